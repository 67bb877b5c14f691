"""The training loop of ``python -m bytescale.train``, by hand, in 60-odd lines (no checkpoints, no
metrics): HDP over the bytescale backend on a token store or synthetic data, optionally with
tensor parallelism inside each HDP unit.

    torchrun --nproc_per_node 4 examples/train_llama.py [--data DIR] [--steps 20] [--tp 2]

Everything that differs from a plain DDP loop is marked ``# bytescale``.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import bytescale
from bytescale import HybridDataParallel, LoaderConfig, PlannerConfig, StepExecutor
from bytescale.data import HDPLoader, SyntheticTokens, TokenStore, sample_lengths
from bytescale.models import Llama, preset
from bytescale.models.parallel import tensor_parallel
from bytescale.runtime import clip_grad_norm_


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", help="a token store (python -m bytescale.data.prepare); default: synthetic")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capacity", type=int, default=1024, help="tokens per micro-batch per rank")
    p.add_argument("--tokens-per-batch", type=int, default=12288)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per HDP unit")
    args = p.parse_args()

    dist.init_process_group("bytescale")            # bytescale: the backend (registered by the import)
    mesh = bytescale.init_mesh(tp=args.tp)          # bytescale: hdp x tp, TP innermost
    units = mesh.hdp                                # the planner plans HDP units of tp ranks
    if args.data:
        # documents longer than any plan of the mesh can hold are cut into pieces that fit (no token
        # dropped): LoaderConfig(oversize="split"), the default; "skip" or "error" to choose otherwise
        data = TokenStore(args.data)
    else:
        lengths = sample_lengths("byted", 4000, scale=1 / 512, max_len=args.capacity * units)
        data = SyntheticTokens(lengths.tolist(), vocab_size=256)
    loader = HDPLoader(data, PlannerConfig(args.capacity),                  # bytescale: the plan-driven loader
                       LoaderConfig(args.tokens_per_batch, max_steps=args.steps))
    torch.manual_seed(0)
    net = tensor_parallel(Llama(preset("tiny")), mesh["tp"]) if args.tp > 1 else Llama(preset("tiny"))
    model = HybridDataParallel(net, process_group=mesh.group("hdp"))       # bytescale: the wrapper
    executor = StepExecutor(model)                                          # bytescale: runs each step
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step in loader:                                                     # this rank's share, any count
        out = executor.run(step)                    # bytescale: every micro-batch in the plan's order
        clip_grad_norm_(model.parameters(), 1.0)    # bytescale: any parameter layout (TP DTensors too)
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = float(mesh.coords()["tp"] == 0)     # every TP rank of a unit has the unit's loss
        total = torch.tensor([out.loss * first], dtype=torch.float64)
        dist.all_reduce(total)                                              # the global batch's loss
        if dist.get_rank() == 0:
            print(f"step {step.index:3d} | loss {total.item():.4f} | {step.plan.summary()}", flush=True)
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
