"""Work semantics of the bytescale backends: timeouts, completion without wait(), coalescing.

* ``wait(timeout)`` raises after that timeout (else after the process group's timeout), naming the
  op, the group and the peer that did not answer; the op is not cancelled and still completes.
* A point-to-point Work's ``is_completed()`` turns true once the transfer is done, without wait().
* The Works of sends/recvs inside a coalescing block follow the block's Work (and a wait() inside
  the block raises instead of hanging); a collective issued inside a block completes with it.
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import bytescale
from dist_utils import run_distributed


def test_cuda_plugin_registers_itself_in_cuda_builds():
    # csrc/cuda/comm registers the NCCL backend when the extension loads; csrc/comm knows no CUDA.
    assert bytescale._C.comm.has_device_backend("cuda") == bytescale._C.with_cuda
    assert not bytescale._C.comm.has_device_backend("cpu")


def _store():
    return dist.distributed_c10d._get_default_store()


def _wait_error(work, seconds=None):
    t0 = time.monotonic()
    try:
        if seconds is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
    except Exception as e:  # noqa: BLE001 - the error is the result under test
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "no error", time.monotonic() - t0


def _poll(work, limit_s=60.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# ---- wait(timeout) ------------------------------------------------------------------------------

def _recv_explicit_timeout(rank: int, world: int):
    out = {}
    if rank == 0:
        t = torch.zeros(10)
        w = dist.irecv(t, src=1)
        out["err"] = _wait_error(w, 2)
        out["completed_after_timeout"] = w.is_completed()
        _store().set("timed_out", "1")
        w.wait()  # not cancelled: it completes once rank 1 sends
        out["value"] = t.tolist()
    elif rank == 1:
        _store().wait(["timed_out"])
        dist.send(torch.arange(10.0), dst=0)
    return out


def test_recv_wait_timeout_names_op_group_and_peer():
    out = run_distributed(_recv_explicit_timeout, 3, timeout=120)[0]
    kind, msg, elapsed = out["err"]
    assert kind == "DistBackendError", (kind, msg)
    assert 1.9 <= elapsed < 10, elapsed
    assert "recv from rank 1 on world group [0, 1, 2]" in msg, msg
    assert "2000 ms" in msg and "timeout passed to wait()" in msg, msg
    assert "waiting for receive from rank 1 (40 bytes)" in msg, msg
    assert out["completed_after_timeout"] is False
    assert out["value"] == list(range(10))


def _recv_group_timeout(rank: int, world: int):
    out = {}
    if rank == 0:
        w = dist.irecv(torch.zeros(4), src=1)
        out["err"] = _wait_error(w)  # no timeout given: the process group's (3 s)
        _store().set("done", "1")
    else:
        _store().wait(["done"])
    return out


def test_wait_without_timeout_uses_the_process_group_timeout():
    out = run_distributed(_recv_group_timeout, 2, pg_timeout=3, timeout=120)[0]
    kind, msg, elapsed = out["err"]
    assert kind is not None, "no error after the process group's timeout"
    assert 2.5 <= elapsed < 15, elapsed
    # Our wait's deadline or Gloo's own timeout (the same 3 s) may fire first; both name these.
    assert "recv from rank 1 on world group [0, 1]" in msg, msg
    assert "receive from rank 1" in msg, msg


def _collective_timeouts(rank: int, world: int):
    out = {}
    g = bytescale.dynamic_group([0, 1, 2])
    t = torch.ones(5)
    u = torch.ones(3)
    if rank != 2:
        w = dist.all_reduce(t, group=g, async_op=True)
        out["group"] = _wait_error(w, 2)
        v = dist.all_reduce(u, async_op=True)
        out["world"] = _wait_error(v, 1)
        _store().set(f"late{rank}", "1")
    else:
        _store().wait(["late0", "late1"])
        w = dist.all_reduce(t, group=g, async_op=True)
        v = dist.all_reduce(u, async_op=True)
    w.wait()
    v.wait()
    out["values"] = (t.tolist(), u.tolist())
    return out


def test_collective_wait_timeout_names_the_missing_rank():
    results = run_distributed(_collective_timeouts, 3, timeout=180)
    for rank in (0, 1):
        kind, msg, elapsed = results[rank]["group"]
        assert kind == "DistBackendError" and 1.9 <= elapsed < 10, (kind, msg, elapsed)
        assert "all_reduce on dynamic group [0, 1, 2]" in msg, msg
        waiting = msg.split("waiting for", 1)[1]
        assert "rank 2" in waiting and f"rank {1 - rank} (" not in waiting, msg
        kind, msg, elapsed = results[rank]["world"]
        assert kind == "DistBackendError" and 0.9 <= elapsed < 10, (kind, msg, elapsed)
        assert "all_reduce on world group [0, 1, 2]" in msg and "1000 ms" in msg, msg
    for out in results:
        assert out["values"] == ([3.0] * 5, [3.0] * 3)


# ---- completion without wait() ------------------------------------------------------------------

def _completes_without_wait(rank: int, world: int):
    out = {}
    peer = 1 - rank
    if rank == 0:
        r = torch.zeros(6)
        w = dist.irecv(r, src=1)
        out["before"] = w.is_completed()
        _store().set("posted", "1")
        out["polled"] = _poll(w)
        out["value"] = r.tolist()  # read without wait(): the transfer is done
        out["future"] = w.get_future().wait()[0].tolist()
    else:
        _store().wait(["posted"])
        w = dist.isend(torch.arange(6.0), dst=0)
        out["polled"] = _poll(w)
    g = bytescale.dynamic_group([0, 1])
    r2 = torch.zeros(3)
    w = g.ring_exchange(torch.full((3,), float(rank)), r2, async_op=True)
    out["ring_polled"] = _poll(w)
    out["ring"] = r2.tolist()
    s3, r3 = torch.full((2,), float(rank)), torch.zeros(2)
    ws = dist.batch_isend_irecv([dist.P2POp(dist.isend, s3, peer), dist.P2POp(dist.irecv, r3, peer)])
    out["batch_polled"] = all(_poll(x) for x in ws)
    out["batch"] = r3.tolist()
    t = torch.ones(4)
    w = dist.all_reduce(t, group=g, async_op=True)
    out["group_polled"] = _poll(w)
    out["group"] = t.tolist()
    return out


def test_p2p_work_completes_without_wait():
    results = run_distributed(_completes_without_wait, 2, timeout=120)
    r0, r1 = results
    assert r0["before"] is False
    assert r0["polled"] and r1["polled"]
    assert r0["value"] == list(range(6)) and r0["future"] == list(range(6))
    for rank, out in enumerate(results):
        assert out["ring_polled"] and out["ring"] == [float(1 - rank)] * 3
        assert out["batch_polled"] and out["batch"] == [float(1 - rank)] * 2
        assert out["group_polled"] and out["group"] == [2.0] * 4


# ---- coalescing ---------------------------------------------------------------------------------

def _coalesced(rank: int, world: int):
    out = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    s, r = torch.full((4,), float(rank)), torch.zeros(4)
    cpu = torch.device("cpu")
    with dist._coalescing_manager(device=cpu, async_ops=True) as cm:
        ws = dist.isend(s, dst=nxt)
        wr = dist.irecv(r, src=prv)
        out["inside"] = _wait_error(wr, 1)
    cm.wait()
    out["completed"] = (ws.is_completed(), wr.is_completed())
    out["waits"] = (ws.wait(), wr.wait())
    out["value"] = r.tolist()
    out["future"] = wr.get_future().wait()[0].tolist()
    # a dynamic group's block
    g = bytescale.dynamic_group(list(reversed(range(world))))
    r2 = torch.zeros(2)
    with dist._coalescing_manager(group=g, device=cpu, async_ops=True) as cm:
        w2 = dist.isend(torch.full((2,), float(rank)), dst=g.next_rank, group=g)
        w3 = dist.irecv(r2, src=g.prev_rank, group=g)
    cm.wait()
    out["group_value"] = (r2.tolist(), _poll(w2), _poll(w3))
    # collectives issued inside a block complete with the block's Work
    ts = [torch.full((3,), float(rank + k)) for k in range(3)]
    with dist._coalescing_manager(device=cpu, async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    out["all_reduce"] = [t.tolist() for t in ts]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_placeholders_complete(world):
    results = run_distributed(_coalesced, world, timeout=120)
    for rank, out in enumerate(results):
        kind, msg, elapsed = out["inside"]
        assert kind is not None and "inside its coalescing block" in msg and elapsed < 5, msg
        assert out["completed"] == (True, True)
        assert out["waits"] == (True, True)
        prv = (rank - 1) % world
        assert out["value"] == [float(prv)] * 4 and out["future"] == [float(prv)] * 4
        group_prev = (rank + 1) % world  # the group is in reversed order
        assert out["group_value"] == ([float(group_prev)] * 2, True, True)
        total = sum(range(world))
        assert out["all_reduce"] == [[float(total + world * k)] * 3 for k in range(3)]
