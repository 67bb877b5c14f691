"""Several processes on ONE GPU through the staged transport (BYTESCALE_CUDA_TRANSPORT=staged,
csrc/comm/staged_transport.h: every message through pinned host memory over Gloo): what NCCL
cannot run on a single GPU (it refuses two ranks on one device) runs multi-process here with the
real CUDA compute path: ring attention with the flash / cuDNN steps, CUDA dynamic-group and world
collectives, HDP training with activation offloading, PP 2 x HDP 2 pipelines (StepExecutor), and
TP 3 with the local plan (bytescale's TP collectives, the vocabulary-parallel loss), against
single-process references.
Skipped without a GPU (the staging code itself is tested on CPU tensors in
tests/comm/test_staged_transport.py). Run by scripts/gpu_check.sh.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def staged(monkeypatch):
    monkeypatch.setenv("BYTESCALE_CUDA_TRANSPORT", "staged")  # read by the worker processes


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _ring(rank, world, lens, dtype_name, kernel):
    import bytescale._C as C
    from bytescale.attention import reference_varlen_attention, ring_attention, shard

    C.attention.set_kernel_choice(kernel)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(7)
    t = sum(lens)
    q64, k64, v64, do64 = (torch.randn(t, h, 128, device="cuda", dtype=torch.float64, generator=g)
                           for h in (8, 2, 2, 8))
    ring = list(range(world))
    q, k, v = (shard(x, lens, world, rank).to(dtype).requires_grad_() for x in (q64, k64, v64))
    out = ring_attention(q, k, v, lens, ring)
    grads = torch.autograd.grad(out, (q, k, v), shard(do64, lens, world, rank).to(dtype))
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q64, k64, v64))
    ref = reference_varlen_attention(qr, kr, vr, lens)
    rgrads = torch.autograd.grad(ref, (qr, kr, vr), do64)
    errs = [_rel(a, shard(b, lens, world, rank)) for a, b in zip((out, *grads), (ref, *rgrads))]
    return errs, bool(C.attention.cudnn_failed())


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_ring_attention_with_real_kernels_across_processes(world, kernel):
    lens = [9000, 1500, 37] if kernel == "cudnn" else [3000, 777, 5]
    for errs, cudnn_failed in run_distributed(_ring, world, lens, "bfloat16", kernel, timeout=300):
        assert max(errs) < 2e-2, errs
        assert not cudnn_failed


def _collectives(rank, world):
    import torch.distributed as dist

    import bytescale

    out = {}
    x = torch.full((1000,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    out["world_all_reduce"] = x.cpu()
    g = bytescale.dynamic_group(list(range(world))[::-1])
    y = torch.arange(12, dtype=torch.float32, device="cuda") * (rank + 1)
    dist.all_reduce(y, group=g)
    out["group_all_reduce"] = y.cpu()
    gathered = torch.empty(world * 5, device="cuda")
    dist.all_gather_into_tensor(gathered, torch.full((5,), float(rank), device="cuda"), group=g)
    out["group_all_gather"] = gathered.cpu()
    rs = torch.empty(4, device="cuda")
    dist.reduce_scatter_tensor(rs, torch.ones(4 * world, device="cuda"), group=g)
    out["group_reduce_scatter"] = rs.cpu()
    # a static group (its own Gloo context; the staged transport over it, as NCCL would split)
    s = dist.new_group([0, world - 1])
    z = torch.full((7,), float(rank + 1), device="cuda")
    if rank in (0, world - 1):
        dist.all_reduce(z, group=s)
    out["static_all_reduce"] = z.cpu()
    return out


def test_cuda_collectives_across_processes():
    world = 3
    for rank, out in enumerate(run_distributed(_collectives, world, timeout=180)):
        assert torch.equal(out["world_all_reduce"], torch.full((1000,), 6.0))
        assert torch.equal(out["group_all_reduce"], torch.arange(12, dtype=torch.float32) * 6)
        # group order is reversed: group rank j is global rank world-1-j
        want = torch.cat([torch.full((5,), float(world - 1 - j)) for j in range(world)])
        assert torch.equal(out["group_all_gather"], want)
        assert torch.equal(out["group_reduce_scatter"], torch.full((4,), float(world)))
        want = float(1 + world) if rank in (0, world - 1) else float(rank + 1)
        assert torch.equal(out["static_all_reduce"], torch.full((7,), want))


def _hdp_offload(rank, world):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from test_hdp_training import CAPACITY, STEPS, TOKENS_PER_BATCH, _dataset, _model  # noqa: E402

    from bytescale import HybridDataParallel
    from bytescale.config import LoaderConfig, PlannerConfig, RuntimeConfig
    from bytescale.data import HDPLoader
    from bytescale.runtime import token_level_loss

    loader = HDPLoader(_dataset(), PlannerConfig(CAPACITY, offload=True),
                       LoaderConfig(TOKENS_PER_BATCH, seed=5, max_steps=STEPS))
    model = HybridDataParallel(_model(torch.float32).cuda(),
                               config=RuntimeConfig(bucket_cap_mb=0.01, offload_min_bytes=256))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in loader:
        mbs = step.micro_batches
        for i, mb in enumerate(mbs):
            with model.micro_batch(mb, last=i == len(mbs) - 1, offload_ratio=0.5):
                logits = model(mb.input_ids.cuda(), mb.position_ids.cuda(), layout=mb.layout)
                token_level_loss(logits, mb.labels.cuda(), step.global_loss_tokens).backward()
        model.finish_step()
        opt.step()
        opt.zero_grad()
    loader.close()
    return [p.detach().cpu() for p in model.module.parameters()]


def test_hdp_with_offload_on_one_gpu_matches_single_process():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from test_hdp_training import _reference  # noqa: E402

    world = 3
    ref, _ = _reference(torch.float64, world)
    for params in run_distributed(_hdp_offload, world, timeout=300):
        for p, r in zip(params, ref):
            # fp32 on CUDA against the float64 CPU reference
            torch.testing.assert_close(p.double(), r, rtol=1e-4, atol=1e-5)


def _pipeline_on_cuda(rank, world):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from test_pipeline_executor import Case, _cfg, _dataset, _loader_config, _model  # noqa: E402

    import bytescale
    from bytescale import HybridDataParallel, StepExecutor
    from bytescale.config import PlannerConfig, RuntimeConfig
    from bytescale.data import HDPLoader

    case = Case(pp=2, hdp=2, steps=2)
    mesh = bytescale.init_mesh(pp=2)
    net = _model(_cfg(case)).pipeline_stage(mesh.stage, mesh.pp).to(torch.float32).cuda()
    model = HybridDataParallel(net, process_group=mesh.group("hdp"), config=RuntimeConfig(bucket_cap_mb=0.01))
    loader = HDPLoader(_dataset(case), PlannerConfig(case.capacity, case.strategy, pp=2), _loader_config(case),
                       units=mesh)
    executor = StepExecutor(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in loader:
        executor.run(step)
        opt.step()
        opt.zero_grad()
    loader.close()
    return {n: p.detach().cpu() for n, p in net.named_parameters()}


def test_pipeline_pp2_hdp2_on_one_gpu_matches_single_process():
    """PP 2 x HDP 2 (bytescale.StepExecutor: 1F1B over the plan's slots, activations and
    gradients on the per-direction channels) with the CUDA compute path, against the float64
    single-process reference of tests/runtime/test_pipeline_executor.py."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from test_pipeline_executor import Case, _reference  # noqa: E402

    ref, _, _ = _reference(Case(pp=2, hdp=2, steps=2))
    for params in run_distributed(_pipeline_on_cuda, 4, timeout=300):
        for n, p in params.items():
            torch.testing.assert_close(p.double(), ref[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


def _tp_on_device(rank, world, device):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from test_tp_local import DENSE, LENGTHS, MOE, SHARED_KV  # noqa: E402

    import bytescale
    from bytescale.attention.layout import Layout
    from bytescale.models.parallel import tensor_parallel
    from bytescale.runtime.loss import token_level_loss
    from fixtures import tiny_llama

    mesh = bytescale.init_mesh(tp=world)
    loss_tokens = sum(map(sum, LENGTHS))

    def run(model, cfg, lens):
        g = torch.Generator().manual_seed(sum(lens))
        ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g).to(device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(device)
        logits, aux = model(ids, pos, layout=Layout.local(list(lens)), global_tokens=loss_tokens, return_aux=True)
        loss = token_level_loss(logits, torch.roll(ids, -1), loss_tokens) + aux
        loss.backward()
        return loss.detach().double().cpu()

    out = {}
    for name, cfg, sp in (("dense", DENSE, False), ("shared-kv-sp", SHARED_KV, True), ("moe-sp", MOE, True)):
        ref = tiny_llama(cfg, torch.float32).to(device)
        tp_model = tensor_parallel(tiny_llama(cfg, torch.float32).to(device), mesh["tp"], sequence_parallel=sp)
        errs = [_rel(run(tp_model, cfg, lens), run(ref, cfg, lens)) for lens in LENGTHS]
        want = {n: p.grad for n, p in ref.named_parameters()}
        for n, p in tp_model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            errs.append(_rel(g, want[n]))
        out[name] = max(errs)
    return out


def test_tensor_parallel_local_plan_on_one_gpu_matches_the_unsharded_model():
    """TP 3 (the local plan: bytescale's TP collectives over the staged transport, the
    vocabulary-parallel loss) with the CUDA compute path: dense, shared KV heads with sequence
    parallelism, MoE with sequence parallelism; losses and every gradient against the unsharded
    model on the same GPU (fp32)."""
    for errs in run_distributed(_tp_on_device, 3, "cuda", timeout=300):
        assert max(errs.values()) < 1e-4, errs
