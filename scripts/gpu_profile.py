"""A cost profile for the planner and the simulator, measured on this machine's device: one
Llama block (a preset's shapes, bf16 on CUDA) timed with ``bytescale.profile`` over a range of
sequence lengths, written as the JSON profile ``python -m bytescale.sim --profile`` and
``PlannerConfig(cost=...)`` read. Each length's measurement is appended to ``--jsonl`` as soon as
it is taken (a timeout loses nothing). Run by scripts/gpu_check.sh.

    python scripts/gpu_profile.py --out profile.json [--preset llama3-8b] [--lengths 1024 4096 16384]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON profile to write")
    ap.add_argument("--preset", default="llama3-8b", help="model preset whose block is timed")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jsonl", default=None, help="append each length's measurement here as it comes")
    ap.add_argument("--cpu", action="store_true", help="profile on the CPU (fp32; small lengths advised)")
    a = ap.parse_args(argv)

    import bytescale
    from bytescale.attention import Layout
    from bytescale.models import presets
    from bytescale.models.llama import Block
    from bytescale.planner.profile import measure_layer

    device = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = presets.preset(a.preset)

    def layer():
        return Block(cfg).to(device, dtype)

    def make_input(s):
        x = torch.randn(s, cfg.dim, device=device, dtype=dtype, requires_grad=True)
        return x, torch.arange(s, device=device), Layout.local([s])

    if a.jsonl:  # one row per length as it is measured; bytescale.profile then fits all of them
        blk = layer()
        for s in a.lengths:
            t, act = measure_layer(blk, make_input, s, a.reps, device)
            with open(a.jsonl, "a") as f:
                f.write(json.dumps(dict(preset=a.preset, seq=s, seconds=t, act_bytes=act, device=str(device))) + "\n")
    prof = bytescale.profile(layer, make_input, seq_lens=a.lengths, layers=cfg.n_layers, out=a.out,
                             reps=a.reps, device=device)
    print(json.dumps({k: v for k, v in prof.items() if k != "samples"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
