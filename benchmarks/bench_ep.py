"""Expert parallelism on CPU: replicated experts (EP 1) against EP 2 and EP 4 over HDP 4, through the
real entry point (``torchrun --nproc_per_node 4 -m bytescale.train --model mixtral-tiny --ep E``): the
same data, model, seed and steps, run ``--rounds`` times alternately so load on the machine hits all
configurations alike.

    python benchmarks/bench_ep.py --steps 8 --rounds 2 --experts 8 --json ep.json

Reported per configuration: expert parameters per rank and their bytes with gradients and AdamW
state (fp32: 16 bytes a parameter; counted on the model the trainer builds, sharded as
``expert_parallel`` shards it), the median step time over the measured steps (the first two are
warm-up), tokens/s, the last step's loss (the runs see the same batches from the same weights, so
the losses agree to float tolerance) and the machine's load average during the run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _expert_params(model: str, experts: int, ep: int) -> int:
    sys.path.insert(0, str(REPO))
    from bytescale.models import Llama, preset

    cfg = preset(model, n_experts=experts) if experts else preset(model)
    net = Llama(cfg)
    total = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    return total // ep


def _run(tmp: Path, name: str, args, ep: int) -> dict:
    metrics = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "-m", "bytescale.train", "--data", args.data, "--model", args.model, "--steps", str(args.steps),
           "--capacity", str(args.capacity), "--tokens-per-batch", str(args.tokens_per_batch),
           "--synthetic-docs", "2000", "--synthetic-scale", str(args.scale), "--progress=false",
           "--metrics", str(metrics), "--ep", str(ep)]
    if args.experts:
        cmd += ["--experts", str(args.experts)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    load0 = os.getloadavg()[0]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=3600)
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"rows": rows, "load": (load0 + os.getloadavg()[0]) / 2}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="synthetic:byted")
    ap.add_argument("--model", default="mixtral-tiny")
    ap.add_argument("--experts", type=int, default=8, help="experts per MoE layer (0: the preset's)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--scale", type=float, default=1 / 256)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    configs = {"replicated (EP 1)": 1, "EP 2": 2, "EP 4": 4}
    runs = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for name, ep in configs.items():
                runs[name].append(_run(Path(d), f"ep{ep}-{r}", args, ep))
    out = {}
    for name, rs in runs.items():
        times = [row["step_time_s"] for run in rs for row in run["rows"][2:]]
        tokens = [row["tokens"] for run in rs for row in run["rows"][2:]]
        n = _expert_params(args.model, args.experts, configs[name])
        out[name] = {"expert_params_per_rank": n, "expert_mib_per_rank": n * 16 / 2**20,
                     "median_step_s": statistics.median(times), "tokens_per_s": sum(tokens) / sum(times),
                     "last_loss": rs[0]["rows"][-1]["loss"], "load": statistics.mean(run["load"] for run in rs),
                     "steps_measured": len(times)}
    base = out["replicated (EP 1)"]["median_step_s"]
    print("| config | expert params / rank | expert MiB / rank (param+grad+AdamW) | median step (s) | tokens/s | "
          "vs EP 1 | last loss | load |")
    print("|---|---|---|---|---|---|---|---|")
    for name, o in out.items():
        print(f"| {name} | {o['expert_params_per_rank']} | {o['expert_mib_per_rank']:.2f} | {o['median_step_s']:.3f} | "
              f"{o['tokens_per_s']:.0f} | {base / o['median_step_s']:.2f}x | {o['last_loss']:.4f} | {o['load']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
