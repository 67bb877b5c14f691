"""The training loop of ``python -m bytescale.train``, by hand, in 60 lines (no checkpoints, no
metrics): HDP over the bytescale backend on a token store or synthetic data.

    torchrun --nproc_per_node 4 examples/train_llama.py [--data DIR] [--steps 20]

Everything that differs from a plain DDP loop is marked ``# bytescale``.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from bytescale import HybridDataParallel, LoaderConfig, PlannerConfig, token_level_loss
from bytescale.data import HDPLoader, SyntheticTokens, TokenStore, sample_lengths
from bytescale.models import Llama, preset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", help="a token store (python -m bytescale.data.prepare); default: synthetic")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capacity", type=int, default=1024, help="tokens per micro-batch per rank")
    p.add_argument("--tokens-per-batch", type=int, default=12288)
    args = p.parse_args()

    dist.init_process_group("bytescale")            # bytescale: the backend (registered by the import)
    world = dist.get_world_size()
    if args.data:
        data = TokenStore(args.data)  # documents must fit capacity x world (bytescale.train splits them)
    else:
        lengths = sample_lengths("byted", 4000, scale=1 / 512, max_len=args.capacity * world)
        data = SyntheticTokens(lengths.tolist(), vocab_size=256)
    loader = HDPLoader(data, PlannerConfig(args.capacity),                  # bytescale: the plan-driven loader
                       LoaderConfig(args.tokens_per_batch, max_steps=args.steps))
    torch.manual_seed(0)
    model = HybridDataParallel(Llama(preset("tiny")))                       # bytescale: the wrapper
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step in loader:
        mbs = step.micro_batches                                            # this rank's share, any count
        loss_sum = 0.0
        for i, mb in enumerate(mbs):
            with model.micro_batch(mb, last=i == len(mbs) - 1):             # bytescale: layout, offload, sync
                logits = model(mb.input_ids, mb.position_ids, layout=mb.layout)
                loss = token_level_loss(logits, mb.labels, step.global_loss_tokens)  # bytescale: global mean
                loss.backward()
            loss_sum += loss.item()
        model.finish_step()                                                 # bytescale: gradients summed
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total)                                              # the global batch's loss
        if dist.get_rank() == 0:
            print(f"step {step.index:3d} | loss {total.item():.4f} | {step.plan.summary()}", flush=True)
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
