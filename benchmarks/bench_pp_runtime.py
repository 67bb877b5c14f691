"""PP 2 x HDP 2 measured on CPU through the real entry point (``torchrun --nproc_per_node 4 -m
bytescale.train --pp 2``): the same data, model, seed and steps under four plans of the same
pipelines, run ``--rounds`` times alternately so that load on the machine hits them alike:

* ``static``: the static DP x CP x PP baseline (``--strategy static --pp 2``: one CP degree sized for
  the longest document, every document sharded over its replica's CP group, packed micro-batches
  through the same 1F1B executor; issue 34);
* ``pp-balance``: the paper's PP-Balance (with its safety nets, csrc/planner/pp_balance.cpp);
* ``pp-lockstep``: Megatron's lockstep slots (every pipeline the same count, rings aligned);
* ``naive``: the paper's Alg. 1 token-balanced order, slotted as it comes.

    python benchmarks/bench_pp_runtime.py --steps 8 --rounds 2 --json pp_runtime.json

``--calibrate`` runs them again with a cost model of this machine's trainer instead of the default
(GPU-shaped) one: a1, b1 and the fixed cost g per micro-batch fitted on packed micro-batches of the
run's documents through the trainer's code path (``benchmarks/sim_trainer_profile.local_profile``,
the whole model as one layer), halved for one of the two stages except g (each stage pays it).

Reported per plan: the median step time over the measured steps (the first two are warm-up),
tokens/s, the MEASURED bubble (1 - the ranks' mean time inside their forward / backward operations
over the step; receives and waits for transfers excluded, StepExecutor's ``compute_s``), the
PLANNED bubble (the plan's 1F1B replay, ``Plan.bubble``), the last step's loss (the same batches
from the same weights: equal to float tolerance) and the load average during the runs.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the tree's bytescale (calibration)
from bench_tp import _run, run_arguments  # noqa: E402  (one launcher for the measured CPU benchmarks)

PLANS = ("static", "pp-balance", "pp-lockstep", "naive")


def main(argv=None) -> None:
    ap = run_arguments(__doc__, "tokens per micro-batch per unit of a stage")
    ap.add_argument("--png", help="bar chart of step time and bubbles per plan")
    ap.add_argument("--calibrate", action="store_true", help="also plan with this machine's trainer cost model")
    args = ap.parse_args(argv)
    variants = {name: ["--pp", "2", "--strategy", name] for name in PLANS}
    with tempfile.TemporaryDirectory() as d:
        if args.calibrate:
            cost = _trainer_cost(args, Path(d))
            print(f"trainer cost model (one stage): {cost}")
            variants.update({f"{name}+cal": v + ["--cost-profile", str(Path(d) / "cost.json")]
                             for name, v in list(variants.items())})
        runs = {k: [] for k in variants}
        for r in range(args.rounds):
            for name, extra in variants.items():
                runs[name].append(_run(Path(d), f"{name}-{r}", args, extra))
    out = {}
    for name, rs in runs.items():
        rows = [row for run in rs for row in run["rows"][2:]]
        times = [row["step_time_s"] for row in rows]
        measured = [1 - (row["compute_s"] / row["imbalance"]) / row["step_time_s"] for row in rows]
        planned = [float(m.group(1)) for row in rows for m in [re.search(r"bubble ([0-9.]+)", row["plan"])] if m]
        out[name] = {"median_step_s": statistics.median(times),
                     "tokens_per_s": sum(row["tokens"] for row in rows) / sum(times),
                     "measured_bubble": statistics.mean(measured),
                     "planned_bubble": statistics.mean(planned) if planned else float("nan"),
                     "last_loss": rs[0]["rows"][-1]["loss"], "load": statistics.mean(run["load"] for run in rs),
                     "steps_measured": len(times), "plans": sorted({row["plan"].split()[0] for row in rows}),
                     "round_medians": [statistics.median(row["step_time_s"] for row in run["rows"][2:]) for run in rs],
                     "micro_batches": [int(statistics.median(c)) for c in zip(*(row["micro_batches"] for row in rows))]}
    for name, o in out.items():  # +cal variants against the +cal baselines
        suffix = name[len(name.split("+")[0]):]
        o["vs_static"] = out["static" + suffix]["median_step_s"] / o["median_step_s"]
        o["vs_lockstep"] = out["pp-lockstep" + suffix]["median_step_s"] / o["median_step_s"]
    print(f"{'plan':<16} {'median step (s)':>16} {'tokens/s':>9} {'vs static':>10} {'vs lockstep':>12} "
          f"{'bubble measured':>16} {'bubble planned':>15} {'last loss':>10} {'load':>5}")
    for name, o in out.items():
        print(f"{name:<16} {o['median_step_s']:>16.3f} {o['tokens_per_s']:>9.0f} {o['vs_static']:>9.2f}x "
              f"{o['vs_lockstep']:>11.2f}x {o['measured_bubble']:>16.3f} {o['planned_bubble']:>15.3f} "
              f"{o['last_loss']:>10.4f} {o['load']:>5.1f}")
        print(f"{'':<16} plans: {', '.join(o['plans'])}; micro-batches per rank (median over steps) "
              f"{o['micro_batches']}; median step per round (s) {', '.join(f'{x:.2f}' for x in o['round_medians'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.png:
        _plot(out, args.png)


def _trainer_cost(args, d: Path) -> dict:
    """One stage's cost model fitted through the trainer's code path (module docstring)."""
    import numpy as np
    from sim_trainer_profile import local_profile

    from bytescale.train.build import build_dataset
    from bytescale.train.config import parse_args

    cfg = parse_args(["--data", args.data, "--model", args.model, "--capacity", str(args.capacity),
                      "--tokens-per-batch", str(args.tokens_per_batch), "--synthetic-docs", "2000",
                      "--synthetic-scale", str(args.scale), "--max-length", str(args.capacity * 2)])
    ds, vocab, _ = build_dataset(cfg, args.capacity * 2)
    prof = local_profile(cfg, vocab, np.asarray(ds.lengths, dtype=np.int64), args.capacity,
                         max_len=args.capacity * 2)
    cost = {"a1": prof["a1"] / 2, "b1": prof["b1"] / 2, "g": prof["g"], "layers": 1}
    (d / "cost.json").write_text(json.dumps(cost))
    return cost


def _plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out)
    fig, (a, b) = plt.subplots(1, 2, figsize=(4 + 1.6 * len(names), 3.6))
    a.tick_params(axis="x", labelrotation=30)
    a.bar(names, [out[n]["median_step_s"] for n in names])
    a.set_ylabel("median step (s)")
    a.set_title("PP 2 x HDP 2 on CPU: step time")
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [out[n]["measured_bubble"] for n in names], width=0.4, label="measured")
    b.bar([i + 0.2 for i in x], [out[n]["planned_bubble"] for n in names], width=0.4, label="planned (replay)")
    b.set_xticks(list(x), names, rotation=30)
    b.set_ylabel("bubble (idle share)")
    b.set_title("bubble")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
