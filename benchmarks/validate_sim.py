"""Validates bytescale.sim against measured runs of the main training command on CPU (issue 14).

    PYTHONPATH=. python benchmarks/validate_sim.py [--ranks 2 3 4] [--steps 8] [--out runs/validate]

1. Measures a CPU cost profile with ``bytescale.profile`` of the model the main command trains
   (scripts/run_demo.sh: ``tiny`` Llama, byte tokens), the WHOLE model (embedding, 2 blocks, head,
   token-level loss) as one "layer" (``layers=1``), single documents of 32-1024 tokens; the Gloo
   point-to-point latency and bandwidth (2 processes, the bytescale backend, ping-pong); and the
   optimizer step + gradient clipping time of the model (one process).
2. Runs ``python -m bytescale.train`` (torchrun, the bytescale backend over Gloo) for ``--steps``
   steps at each rank count, HDP (``balanced``, planned with the measured profile) and the static
   DP x CP baseline (CP sized for the longest document; CP=3 at 3 ranks, the power of two does not
   divide 3), with the run_demo.sh options (capacity 256, 4096-token batches, length scale 1/512).
3. Simulates each logged step: the same lengths (samples log -> the dataset's pieces), the same plan
   (``bytescale.plan`` with the cost profile the run was given, strategy ``balanced`` or ``static``), priced by
   the "cpu-gloo" cluster made of the measured numbers: by default the TRAINER-PATH profile
   (benchmarks/sim_trainer_profile.py): a1, b1 and the per-micro-batch overhead g fitted on packed
   micro-batches of real documents and on single documents longer than the capacity, timed
   through ``HybridDataParallel.micro_batch`` exactly as the trainer runs them (local attention,
   loss, backward, ``.cpu()``); and ring micro-batches through the same path timed in place with
   N processes (rings of every size d <= N running at once, each case 24 times back to back),
   which price the ring micro-batches (model, ring kernel, agreement check, exchanges, waits for
   the peers). Oversubscription is modelled explicitly for the one-process terms: N busy ranks on C cores with B other runnable tasks (sampled from
   /proc/loadavg while profiling) compute ``max(1, (N + B) / C) / max(1, (1 + B) / C)`` times
   slower than the one-process profile (on a quiet machine ``max(1, N / C)``); the ring terms are
   measured with N processes already. ``--concurrent-profile``: the earlier model (a
   ``bytescale.profile`` measured by N processes at once, no trainer-path terms). Steps 0-1
   (warm-up) are left out. ``--reuse`` keeps the measured inputs, ``--reuse-runs`` the training
   logs (no training: iterate on the model).
Prints a table (measured vs predicted mean step time, error) and writes OUT/validate.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COMMON = ["--data", "data/python-packages", "--length-scale", "0.001953125", "--model", "tiny",
          "--capacity", "256", "--tokens-per-batch", "4096", "--lr", "1e-2", "--warmup-steps", "3"]
CAPACITY = 256


def _p2p_worker(rank: int, port: int, q: Any) -> None:
    import torch.distributed as dist

    import bytescale  # noqa: F401  (registers the backend)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("bytescale", rank=rank, world_size=2)
    res = {}
    for nbytes in (8, 16 << 20):
        t = torch.zeros(nbytes // 4)
        reps = 200 if nbytes == 8 else 20
        for it in range(reps + 5):
            if it == 5:
                dist.barrier()
                t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        res[nbytes] = (time.perf_counter() - t0) / reps / 2  # one way
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def measure_p2p() -> Dict[str, float]:
    """One-way latency (8 B) and bandwidth (16 MiB) of a send/recv between two processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_p2p_worker, args=(r, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    res = q.get(timeout=180)
    for p in ps:
        p.join(60)
    lat, big = res[8], res[16 << 20]
    # under load the difference can vanish in noise: then the whole transfer time bounds it
    bw = (16 << 20) / (big - lat if big > 2 * lat else big)
    return {"latency_s": lat, "bandwidth_Bps": bw}


def _cfg(extra: List[str]):
    from bytescale.train.config import parse_args

    return parse_args(COMMON + extra)


def measure_profile(out: str) -> Dict[str, Any]:
    """bytescale.profile of the whole tiny model (one 'layer'), plus its optimizer step time."""
    import bytescale
    from bytescale.attention import Layout
    from bytescale.runtime import token_level_loss
    from bytescale.train.build import build_dataset, build_model, build_optimizer

    torch.manual_seed(0)
    cfg = _cfg([])
    _, vocab, _ = build_dataset(cfg, 1024)
    model, info = build_model(cfg, vocab, torch.device("cpu"))

    class Whole(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, ids, pos, labels, s):
            logits = self.m(ids, pos, layout=Layout.local([s]))
            return token_level_loss(logits, labels, s)

    def make_input(s: int):
        ids = torch.randint(0, vocab, (s,))
        return ids, torch.arange(s), torch.randint(0, vocab, (s,)), s

    prof = bytescale.profile(lambda: Whole(), make_input, seq_lens=[32, 64, 128, 256, 384, 512, 768, 1024],
                             layers=1, reps=7, device=torch.device("cpu"), copy_bytes=64 << 20)
    # optimizer + clipping, as the trainer does them after the micro-batches
    opt, _ = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    ts = []
    for _ in range(25):
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ts.append(time.perf_counter() - t0)
    prof["optimizer_s"] = float(np.median(ts[5:]))
    prof["params"] = int(info.params)
    prof["kv_bytes_per_layer_token"] = float(2 * model.cfg.n_kv_heads * (model.cfg.dim // model.cfg.n_heads) * 4)
    prof["model_layers"] = int(model.cfg.n_layers)
    return prof


def _profile_worker(q: Any) -> None:
    torch.set_num_threads(1)
    q.put(measure_profile(""))


def measure_profile_concurrent(n: int) -> Dict[str, Any]:
    """The profile measured by ``n`` processes at once (as ``n`` training ranks share the cores):
    the median of their coefficients."""
    if n <= 1:
        return measure_profile("")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_profile_worker, args=(q,)) for _ in range(n)]
    for p in ps:
        p.start()
    profs = [q.get(timeout=600) for _ in range(n)]
    for p in ps:
        p.join(60)
    out = dict(profs[0])
    for k in ("a1", "b1", "g", "a2", "b2", "bw_d2h", "bw_h2d", "optimizer_s"):
        out[k] = float(np.median([p[k] for p in profs]))
    out["concurrent_processes"] = n
    return out


def _write_profile(prof: Dict[str, Any], p2p: Dict[str, float], path: str) -> None:
    flat = {k: prof[k] for k in ("a1", "b1", "g", "a2", "b2", "layers", "bw_d2h", "bw_h2d")}
    flat.update(ring_bw=p2p["bandwidth_Bps"], ring_latency=p2p["latency_s"] * prof["model_layers"],
                kv_bytes_per_token=prof["kv_bytes_per_layer_token"] * prof["model_layers"])
    with open(path, "w") as f:
        json.dump(flat, f, indent=1)


def run_training(nproc: int, strategy: str, steps: int, outdir: str, profile_path: str) -> Dict[str, str]:
    name = f"{strategy}{nproc}"
    metrics, samples = os.path.join(outdir, f"{name}.jsonl"), os.path.join(outdir, f"{name}.samples.jsonl")
    for f in (metrics, samples):
        if os.path.exists(f):
            os.remove(f)
    extra = ["--steps", str(steps), "--metrics", metrics, "--samples-log", samples, "--progress=false",
             "--plot", os.path.join(outdir, f"{name}.png")]
    if strategy == "static":
        extra += ["--strategy", "static"] + (["--static-cp", "3"] if nproc == 3 else [])
    else:
        extra += ["--cost-profile", profile_path]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "bytescale.train"] + COMMON + extra
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from sim_trainer_profile import RunnableSampler

    t0 = time.perf_counter()
    with RunnableSampler() as sampler:  # the cores' load while the run trains (ours + others')
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"training {name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(os.path.join(outdir, f"{name}.runnable.json"), "w") as f:
        json.dump({"runnable": sampler.runnable(1), "samples": sampler.samples}, f)
    return {"metrics": metrics, "samples": samples, "wall_s": f"{time.perf_counter() - t0:.1f}",
            "extra": " ".join(extra), "runnable": sampler.runnable(1)}


def simulate_run(nproc: int, strategy: str, files: Dict[str, str], prof: Dict[str, Any], p2p: Dict[str, float],
                 skip: int, slow: float, tp: Optional[Dict[str, Any]] = None,
                 plan_profile: Optional[str] = None) -> Dict[str, Any]:
    """Simulates every logged step of one run. ``tp`` (:func:`measure_trainer_profile`): price
    with the trainer-path profile (a1, b1, g of real micro-batches, slowed by ``slow``; ring
    micro-batches measured in place with ``nproc`` processes); without it the ``bytescale.profile``
    numbers. ``plan_profile``: the cost-profile JSON the run was planned
    with (default: ``prof``'s)."""
    from bytescale.planner import CostModel, load_cost_model, plan, static_cp_degree
    from bytescale.sim import ClusterSpec, model_shape, simulate
    from bytescale.sim.strategies import schedule_from_plan, static_schedule
    from bytescale.train.build import build_dataset
    from bytescale.train.metrics import read_jsonl

    cfg = _cfg([])
    ds, _, _ = build_dataset(cfg, CAPACITY * nproc)  # the trainer's default max_length: capacity x world
    all_lengths = np.asarray(ds.lengths, dtype=np.int64)
    measured = {r["step"]: r["step_time_s"] for r in read_jsonl(files["metrics"])}
    batches = {r["step"]: r["samples"] for r in read_jsonl(files["samples"])}
    flat = {k: prof[k] for k in ("a1", "b1", "g", "a2", "b2", "layers", "bw_d2h", "bw_h2d")}
    flat_cost = load_cost_model(dict(flat, ring_bw=p2p["bandwidth_Bps"],
                                     ring_latency=p2p["latency_s"] * prof["model_layers"],
                                     kv_bytes_per_token=prof["kv_bytes_per_layer_token"] * prof["model_layers"]))
    if plan_profile and os.path.isfile(plan_profile):
        with open(plan_profile) as f:
            plan_cost = load_cost_model(json.load(f))
    else:
        plan_cost = flat_cost
    price = CostModel.from_json(flat_cost.to_json())
    lat = p2p["latency_s"]
    ring: Dict[str, float] = {}
    if tp is not None:
        price.a1, price.b1, price.g = tp["local"]["a1"], tp["local"]["b1"], tp["local"]["g"]
        ri = tp["ring"].get(str(nproc))
        if ri is not None:
            # ring micro-batches at their price measured in place with nproc processes (the
            # model's forward + backward, the ring kernel, agreement check, exchanges, waits;
            # already under nproc processes' contention: not slowed again)
            ring = dict(ring_a1=ri["ar"], ring_b1=ri["br"], ring_step_s=ri["cs"], ring_doc_step_s=ri["cn"],
                        ring_call_s=ri["c0"])
    price.a1, price.b1, price.g = price.a1 * slow, price.b1 * slow, price.g * slow
    # the profile's one "layer" is the whole model: a ring step moves every layer's K/V and pays a
    # latency per layer (with the in-place ring price above, which holds the measured exchanges,
    # this transfer term is hidden under the attention blocks)
    cl = ClusterSpec("cpu-gloo", gpus=nproc, gpus_per_node=nproc, intra_bw=p2p["bandwidth_Bps"],
                     intra_latency=lat * prof["model_layers"], inter_bw=p2p["bandwidth_Bps"],
                     inter_latency=lat * prof["model_layers"], host_bw=prof["bw_d2h"],
                     gpu_memory=8e9, peak_flops=0.1e12, compute_slowdown=max(1.0, slow), source="measured", **ring)
    # the gradient all-reduce (fp32, ring algorithm): 2(n-1) hops, each one point-to-point latency
    # (the per-layer scaling of the ring's latency above does not apply to it)
    grad = 4.0 * prof["params"]
    sync = 2.0 * (nproc - 1) / nproc * grad / p2p["bandwidth_Bps"] + 2.0 * (nproc - 1) * lat if nproc > 1 else 0.0
    shape = model_shape("tiny")
    rows = []
    for step in sorted(measured):
        if step < skip or step not in batches:
            continue
        lens = all_lengths[np.asarray(batches[step], dtype=np.int64)]
        if strategy == "static":
            cp = 3 if nproc == 3 else static_cp_degree(int(all_lengths.max()), CAPACITY, nproc)
            sched = static_schedule(lens, nproc, CAPACITY, cp, cost=plan_cost)
        else:
            sched = schedule_from_plan("hdp", plan(lens, nproc, CAPACITY, strategy="balanced", cost=plan_cost),
                                       lens, "remote")
        r = simulate(sched, cl, shape, price, int(lens.sum()), float((lens.astype(float) ** 2).sum()),
                     grad_bytes=grad, step_overhead_s=prof["optimizer_s"] * slow)
        bd = dict(r.breakdown(), grad_sync_s=sync)  # the engine's sync scales the latency per layer
        rows.append((step, measured[step], r.step_time_s - r.grad_sync_s + sync, bd))
    m = np.array([x[1] for x in rows])
    pr = np.array([x[2] for x in rows])
    bd = {k: float(np.mean([x[3][k] for x in rows])) for k in rows[0][3]} if rows else {}
    return {"ranks": nproc, "strategy": strategy, "steps": len(rows), "measured_s": float(m.mean()),
            "predicted_s": float(pr.mean()), "error": float(pr.mean() / m.mean() - 1),
            "per_step_abs_error": float(np.mean(np.abs(pr / m - 1))), "compute_slowdown": slow,
            "predicted_breakdown_s": bd, "per_step": [(int(a), float(b), float(c)) for a, b, c, _ in rows]}


def print_table(results: List[Dict[str, Any]]) -> None:
    """The markdown table: per case measured vs predicted mean step, and, per rank count, the
    static / HDP ratio measured vs predicted (a uniform slowdown of the machine cancels in it)."""
    by = {(r["ranks"], r["strategy"]): r for r in results}
    print("| ranks | strategy | steps | measured step (ms) | predicted (ms) | error | mean per-step abs error | "
          "static / HDP measured | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = ["", "", ""]
        h, st = by.get((r["ranks"], "hdp")), by.get((r["ranks"], "static"))
        if r["strategy"] == "static" and h and st:
            m, p = st["measured_s"] / h["measured_s"], st["predicted_s"] / h["predicted_s"]
            ratio = [f"{m:.2f}", f"{p:.2f}", f"{p / m - 1:+.1%}"]
        print(f"| {r['ranks']} | {'HDP (balanced)' if r['strategy'] == 'hdp' else 'static DP x CP'} | {r['steps']} | "
              f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['error']:+.1%} | "
              f"{r['per_step_abs_error']:.1%} | " + " | ".join(ratio) + " |")


def measure_trainer_profile(ranks: List[int]) -> Dict[str, Any]:
    """The trainer-path profile (benchmarks/sim_trainer_profile.py): real packed micro-batches and
    long single documents through ``HybridDataParallel.micro_batch`` (a1, b1, g), and ring
    micro-batches through the same path timed in place with n processes for each n in ``ranks``."""
    from sim_trainer_profile import local_profile, ring_profile

    from bytescale.train.build import build_dataset

    cfg = _cfg([])
    ds, vocab, _ = build_dataset(cfg, CAPACITY * max(ranks))
    lengths = np.asarray(ds.lengths, dtype=np.int64)
    local = local_profile(cfg, vocab, lengths, CAPACITY, max_len=CAPACITY * max(ranks))
    ring = {str(n): ring_profile(n, cfg, vocab, lengths, CAPACITY) for n in sorted(set(ranks)) if n > 1}
    return {"local": local, "ring": ring}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "validate"))
    ap.add_argument("--reuse", action="store_true",
                    help="reuse OUT/inputs.json (profiles, p2p, ring-step waits) of an earlier run")
    ap.add_argument("--reuse-runs", action="store_true",
                    help="do not train: simulate the runs already logged in OUT (each planned with "
                         "OUT/cpu_profile_N.json when present); with --reuse nothing is measured")
    ap.add_argument("--concurrent-profile", action="store_true",
                    help="the earlier model: bytescale.profile measured by N processes at once right "
                         "before the N-rank runs, no trainer-path profile")
    ap.add_argument("--report", action="store_true", help="only print the table of OUT/validate.json")
    args = ap.parse_args()
    if args.report:
        with open(os.path.join(args.out, "validate.json")) as f:
            print_table(json.load(f)["results"])
        return
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(ROOT, "data", "python-packages", "data.idx")):
        subprocess.run([sys.executable, "-m", "bytescale.data.prepare", "--python-packages", "--max-doc-bytes",
                        "524288", "--workers", "2", "--output", "data/python-packages"], cwd=ROOT, check=True)
    torch.set_num_threads(1)
    inputs = os.path.join(args.out, "inputs.json")
    saved: Dict[str, Any] = {}
    if args.reuse and os.path.isfile(inputs):
        with open(inputs) as f:
            saved = json.load(f)
    if "profile" in saved:
        prof, p2p = saved["profile"], saved["p2p"]
    else:
        prof = measure_profile(os.path.join(args.out, "cpu_profile.json"))
        p2p = measure_p2p()
    tp = saved.get("trainer_profile")
    if tp is None and not args.concurrent_profile:
        tp = measure_trainer_profile(args.ranks)
    with open(inputs, "w") as f:
        json.dump({"profile": prof, "p2p": p2p, "trainer_profile": tp}, f, indent=1)
    cores = os.cpu_count() or 1
    print(f"profile (whole tiny model, 1 process, single documents): a1={prof['a1']:.3e} b1={prof['b1']:.3e} "
          f"g={prof['g']:.3e} optimizer={prof['optimizer_s'] * 1e3:.2f} ms")
    print(f"gloo p2p: latency {p2p['latency_s'] * 1e6:.0f} us, bandwidth {p2p['bandwidth_Bps'] / 1e9:.2f} GB/s")
    if tp is not None:
        lo = tp["local"]
        print(f"trainer-path profile (packed micro-batches and long documents via HybridDataParallel.micro_batch): "
              f"a1={lo['a1']:.3e} b1={lo['b1']:.3e} g={lo['g']:.3e} (fit error {lo['fit_rel_err']:.1%})")
        for n, ri in tp["ring"].items():
            print(f"  ring micro-batches in place, {n} processes on {cores} cores: {ri['ar']:.3e} s per s^2/d + "
                  f"{ri['br']:.3e} s per token + ({ri['cs'] * 1e3:.2f} ms + {ri['cn'] * 1e3:.2f} ms x documents) x d "
                  f"+ {ri['c0'] * 1e3:.2f} ms (fit error {ri['fit_rel_err']:.1%})")
    results = []
    profiles = {}
    from sim_trainer_profile import oversubscription

    bg = (tp["local"].get("background_runnable") or 0.0) if tp else 0.0
    print(f"oversubscription: the profile shared {cores} cores with B = {bg:.1f} other runnable tasks; a run "
          f"with R runnable tasks (sampled while it trains; N + B when not sampled) computes "
          f"max(1, R / C) / max(1, (1 + B) / C) times slower")
    for n in args.ranks:
        prof_n = prof
        if args.concurrent_profile and n > 1:
            prof_n = measure_profile_concurrent(n)
            print(f"profile measured by {n} processes at once: a1={prof_n['a1']:.3e} b1={prof_n['b1']:.3e} "
                  f"g={prof_n['g']:.3e} optimizer={prof_n['optimizer_s'] * 1e3:.2f} ms", flush=True)
        profiles[n] = prof_n
        profile_path = os.path.join(args.out, f"cpu_profile_{n}.json")
        if not args.reuse_runs:
            plan_prof = dict(prof_n, **{k: tp["local"][k] for k in ("a1", "b1", "g")}) if tp else prof_n
            _write_profile(plan_prof, p2p, profile_path)
        for strategy in ("hdp", "static"):
            name = f"{strategy}{n}"
            if args.reuse_runs:
                files = {"metrics": os.path.join(args.out, f"{name}.jsonl"),
                         "samples": os.path.join(args.out, f"{name}.samples.jsonl"), "wall_s": "nan",
                         "runnable": None}
                rpath = os.path.join(args.out, f"{name}.runnable.json")
                if os.path.isfile(rpath):
                    with open(rpath) as f:
                        files["runnable"] = json.load(f)["runnable"]
            else:
                files = run_training(n, strategy, args.steps, args.out, profile_path)
            slow = 1.0 if args.concurrent_profile and n > 1 else oversubscription(n, cores, bg, files["runnable"])
            res = simulate_run(n, strategy, files, prof_n, p2p, args.skip, slow, tp, profile_path)
            res["background_runnable"], res["run_runnable"] = bg, files["runnable"]
            res["train_wall_s"] = float(files["wall_s"])
            results.append(res)
            print(f"  {strategy} x{n}: measured {res['measured_s'] * 1e3:.1f} ms, predicted "
                  f"{res['predicted_s'] * 1e3:.1f} ms ({res['error']:+.1%}); per step "
                  + " ".join(f"{m * 1e3:.0f}/{p * 1e3:.0f}" for _, m, p in res["per_step"]), flush=True)
    load = os.getloadavg()
    print(f"\nmachine: {cores} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"total {time.perf_counter() - t0:.0f} s\n")
    print_table(results)
    with open(os.path.join(args.out, "validate.json"), "w") as f:
        json.dump({"profile": prof, "profiles_by_ranks": profiles, "p2p": p2p, "trainer_profile": tp,
                   "results": results, "loadavg": load}, f, indent=1, default=str)
    print(f"wrote {os.path.join(args.out, 'validate.json')}")


if __name__ == "__main__":
    main()
