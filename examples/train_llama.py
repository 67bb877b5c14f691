"""Train a small Llama-style model with hybrid data parallelism (HDP) on the bytescale backend.

    torchrun --nproc_per_node 4 examples/train_llama.py [--steps 20] [--baseline] [--device cpu]

Data: synthetic sequences whose lengths follow the ByteScale paper's "byted" corpus, scaled down
(``--scale``, default 1/512: the 2M-token sequences become 4K tokens) so the job runs on CPUs.
Every step the C++ planner assigns the global batch: sequences longer than a rank's capacity are
sharded over a dynamic group of just as many ranks as they need and run ring attention; short
ones are packed locally; ranks may run different numbers of micro-batches. Gradients are summed
once per step (token-level loss), so training equals single-device training on the same batches.

Printed per step (rank 0): loss, tokens/s, micro-batches per rank, ranks per sharded sequence,
predicted and measured imbalance (max/mean of the ranks' compute time), and the plan summary.
``--offload`` lets the planner trade ranks for activation offloading (each long sequence over fewer
ranks, a share of its activations moved to host memory during forward) and logs the ratios.
``--baseline`` then trains the same data from the same initial weights with a static DP x CP
layout (CP degree sized for the longest sequence, every sequence sharded over its CP group) and
prints both side by side.
"""
from __future__ import annotations

import argparse
import os
import time
from statistics import mean

import torch
import torch.distributed as dist

from bytescale import HybridDataParallel, LoaderConfig, PlannerConfig, token_level_loss
from bytescale.data import HDPLoader, SyntheticTokens, sample_lengths, static_cp_degree
from bytescale.models import Llama, LlamaConfig


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capacity", type=int, default=1024, help="tokens per micro-batch per rank")
    p.add_argument("--tokens-per-batch", type=int, default=12288, help="global batch (tokens)")
    p.add_argument("--scale", type=float, default=1 / 512, help="length scale of the byted corpus")
    p.add_argument("--num-sequences", type=int, default=4000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--strategy", default="balanced", choices=["balanced", "naive", "pow2"])
    p.add_argument("--baseline", action="store_true", help="also run the static DP x CP baseline")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--offload", action="store_true",
                   help="let the planner give long sequences fewer ranks and an activation offload "
                        "ratio (paper Eq. 3), applied per micro-batch by HybridDataParallel")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def build_model(args, device):
    cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                      ffn_dim=int(args.dim * 8 / 3) // 8 * 8)
    torch.manual_seed(args.seed)
    return Llama(cfg).to(device)


def train(args, name, planner: PlannerConfig, device):
    world = dist.get_world_size()
    lengths = sample_lengths("byted", args.num_sequences, seed=args.seed, scale=args.scale,
                             max_len=args.capacity * world)
    data = SyntheticTokens(lengths.tolist(), vocab_size=256, seed=args.seed)
    loader = HDPLoader(data, planner, LoaderConfig(args.tokens_per_batch, seed=args.seed, max_steps=args.steps))
    model = HybridDataParallel(build_model(args, device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log(f"\n=== {name}: {world} ranks, capacity {args.capacity} tokens/rank, global batch "
        f"~{args.tokens_per_batch} tokens, device {device}")
    history = []
    for step in loader:
        dist.barrier()
        t0 = time.perf_counter()
        mbs = step.micro_batches
        local_loss = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(mbs):
            # the wrapper applies the plan's offload ratio; the model gets the attention layout
            with model.micro_batch(mb, last=(i == len(mbs) - 1)):
                logits = model(mb.input_ids.to(device), mb.position_ids.to(device), layout=mb.layout)
                loss = token_level_loss(logits, mb.labels.to(device), step.global_loss_tokens)
                loss.backward()
            local_loss += loss.detach().double().cpu()
        compute = time.perf_counter() - t0
        model.finish_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        # gather per-rank facts for the log
        max_ratio = max((mb.offload_ratio for mb in mbs), default=0.0)
        facts = torch.tensor([compute, float(len(mbs)), local_loss.item(), max_ratio], dtype=torch.float64)
        table = [torch.zeros_like(facts) for _ in range(world)]
        dist.all_gather(table, facts)
        times = [float(t[0]) for t in table]
        mb_counts = [int(t[1]) for t in table]
        loss_val = sum(float(t[2]) for t in table)
        ratios = [round(float(t[3]), 2) for t in table]
        meas_imb = max(times) / max(mean(times), 1e-12)
        plan = step.plan
        rings = plan.ring_sizes()
        pred = f"{plan.imbalance:.2f}"
        summary = plan.summary()
        toks = step.global_tokens / elapsed
        history.append((loss_val, toks, meas_imb, elapsed))
        log(f"[{name}] step {step.index:3d} | loss {loss_val:.4f} | {toks:8.0f} tok/s | "
            f"mbs/rank {mb_counts} | ranks per sharded seq {sorted(rings.values(), reverse=True)[:6]} | "
            f"imbalance pred {pred} meas {meas_imb:.2f}" +
            (f" | offload ratio/rank {ratios}" if args.offload and name == "HDP" else ""))
        if step.index in (0, args.steps - 1):
            log(f"           plan: {summary}")
    loader.close()
    return history


def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("bytescale", device_id=torch.device("cuda", local))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("WORLD_SIZE", 1)))))
        dist.init_process_group("bytescale")
    world = dist.get_world_size()
    hdp = train(args, "HDP", PlannerConfig(args.capacity, strategy=args.strategy, offload=args.offload), device)
    if args.baseline:
        # static: ONE CP degree for the whole run, sized for the longest sequence in the data
        longest = int(sample_lengths("byted", args.num_sequences, seed=args.seed, scale=args.scale,
                                     max_len=args.capacity * world).max())
        cp = static_cp_degree(longest, args.capacity, world)
        base = train(args, f"static DPxCP (cp={cp})", PlannerConfig(args.capacity, strategy="static", static_cp=cp),
                     device)
        skip = min(2, args.steps - 1)  # warm-up steps
        h_tok = mean(h[1] for h in hdp[skip:])
        b_tok = mean(h[1] for h in base[skip:])
        log("\n=== side by side (same data, same initial weights; steps after warm-up)")
        log(f"HDP          : {h_tok:8.0f} tok/s, final loss {hdp[-1][0]:.4f}, measured imbalance "
            f"{mean(h[2] for h in hdp[skip:]):.2f}")
        log(f"static DPxCP : {b_tok:8.0f} tok/s, final loss {base[-1][0]:.4f}, measured imbalance "
            f"{mean(h[2] for h in base[skip:]):.2f}")
        log(f"speed-up HDP / static: {h_tok / b_tok:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
