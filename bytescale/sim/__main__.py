"""``python -m bytescale.sim``: simulate one training step per strategy and print a table.

    python -m bytescale.sim --corpus byted --model llama-7b --gpus 1024 --gpus-per-node 8 \\
        --context 2M --strategy all --json sim.json --png sim.png [--tp 4]

Lengths come from a synthetic corpus (``--corpus byted|github``: one global batch of
``--global-batch-tokens`` tokens, seeded), a file (``--lengths FILE``: integers, one or more per
line, ``#`` comments) or a token store (``--lengths DIR``, what ``bytescale.data.prepare`` writes:
every document's length, the whole corpus as one global batch). Documents longer than
``--context`` are cut into pieces of at most that many tokens. ``--tp T`` makes an HDP unit of T
GPUs of one node (tensor parallelism inside it; every strategy, the static DP x CP baseline
included, plans the ``gpus / T`` units). ``--pp P`` cuts the model into P pipeline stages (1F1B;
P must divide its layers): every strategy plans the ``gpus / (T x P)`` pipelines, and "all" adds
the pipeline schedules ``lockstep`` (Megatron's lockstep slots) and ``hdp-pp-balance``
(PP-Balance). The JSON holds, per strategy, ``step_time_s``,
``tokens_per_s``, ``mfu`` and the breakdown.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from .strategies import PP_STRATEGIES, STRATEGIES

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_tokens(text: str, what: str = "context") -> int:
    """``"2M"`` -> 2,097,152, ``"256K"`` -> 262,144, ``"32768"`` -> 32,768 (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KkMmGg]?)\s*", str(text))
    if not m:
        raise ValueError(f"--{what} {text!r}: expected a token count such as 2M, 256K or 32768")
    v = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if v < 1 or v != int(v):
        raise ValueError(f"--{what} {text!r}: must be a whole number of tokens >= 1")
    return int(v)


def read_lengths(path: str) -> np.ndarray:
    """Integers >= 1 from ``path`` (whitespace separated, ``#`` starts a comment), or, for a token
    store (a directory or a Megatron ``.idx``/``.bin`` prefix), its documents' lengths (empty
    documents left out)."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir() or p.suffix == ".idx" or Path(path + ".idx").exists():
        from ..data.token_store import TokenStore

        try:
            lens = TokenStore(path).lengths
        except (OSError, ValueError) as e:
            raise ValueError(f"--lengths {path}: {e}") from None
        lens = lens[lens > 0]
        if not lens.size:
            raise ValueError(f"--lengths {path}: the token store holds no tokens")
        return np.asarray(lens, dtype=np.int64)
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"--lengths {path}: cannot read it ({e.strerror})") from None
    out: List[int] = []
    for no, line in enumerate(lines, 1):
        for tok in line.split("#", 1)[0].split():
            if not re.fullmatch(r"\d+", tok) or int(tok) < 1:
                raise ValueError(f"--lengths {path}: line {no}: {tok!r} is not an integer >= 1")
            out.append(int(tok))
    if not out:
        raise ValueError(f"--lengths {path}: no lengths in the file")
    return np.asarray(out, dtype=np.int64)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bytescale.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--compare", help="distributions side by side (bytescale.sim.compare): a comma-separated "
                     "list of byted, github, magi-short, magi-long and token stores / lengths files (NAME=PATH "
                     "names one); one --global-batch-tokens batch each; --json, --png as usual")
    src.add_argument("--corpus", help="synthetic corpus: byted or github")
    src.add_argument("--lengths", help="file of sequence lengths (one global batch), or a token store "
                     "directory (its documents' lengths)")
    p.add_argument("--model", default="llama-7b", help="llama-7b, llama-13b, llama-30b, llama-70b, "
                   "mistral-8x7b, mistral-8x22b (the paper's Table 1 shapes), a bytescale preset (tiny, "
                   "...) or an HF config.json path")
    p.add_argument("--gpus", type=int, default=1024)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: GPUs per HDP unit, inside a node "
                   "(must divide --gpus-per-node and the model's heads)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B; must divide the model's layers); "
                   "the HDP pool of a stage is its units")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE models): experts sharded over "
                   "blocks of EP HDP units; prices the all-to-alls and the EP lockstep")
    p.add_argument("--context", default="2M", help="longest sequence; longer documents are split (2M, 256K, ...)")
    p.add_argument("--strategy", default="all", help=f"{', '.join(list(STRATEGIES) + list(PP_STRATEGIES))} or all "
                   "(comma-separated list allowed; all = the first six, plus the last two with --pp > 1)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="per-rank timeline PNG")
    p.add_argument("--capacity", default=None, help="tokens per micro-batch per HDP unit (one GPU, or --tp "
                   "GPUs; default: what fits in memory)")
    p.add_argument("--global-batch-tokens", default="32M", help="tokens per global batch (synthetic corpora)")
    p.add_argument("--cluster", default="h100-nvlink-ib400", help="cluster preset")
    p.add_argument("--profile", default=None, help="cost profile JSON from bytescale.profile ('default': the "
                   "planner's built-in one); default: derived from the model's FLOPs")
    p.add_argument("--efficiency", type=float, default=0.4, help="attained / peak FLOP/s of the derived cost model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-ranks-drawn", type=int, default=48, help="ranks drawn in the PNG (sampled)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from . import simulate_batch, table, timeline_png
    from .strategies import split_at_context

    context = parse_tokens(args.context, "context")
    if args.compare:
        return _compare(args, context)
    known = list(STRATEGIES) + list(PP_STRATEGIES)
    names = ((list(STRATEGIES) + (list(PP_STRATEGIES) if args.pp > 1 else [])) if args.strategy == "all"
             else [s.strip() for s in args.strategy.split(",")])
    for n in names:
        if n not in known:
            raise ValueError(f"--strategy {n!r}: unknown; choose from {', '.join(known)} or all")
    if args.pp < 1:
        raise ValueError(f"--pp {args.pp}: must be an integer >= 1")
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise ValueError(f"--gpus {args.gpus} / --gpus-per-node {args.gpus_per_node}: must be >= 1")
    if args.corpus is not None:
        from ..data.synthetic import CORPORA, global_batch_lengths

        if args.corpus not in CORPORA:
            raise ValueError(f"--corpus {args.corpus!r}: unknown; choose from {', '.join(sorted(CORPORA))} "
                             "(or give --lengths FILE)")
        raw = global_batch_lengths(args.corpus, parse_tokens(args.global_batch_tokens, "global-batch-tokens"),
                                   seed=args.seed)
        source = f"corpus {args.corpus} (seed {args.seed})"
    else:
        raw = read_lengths(args.lengths)
        source = f"lengths {args.lengths}"
    lengths = split_at_context(raw, context)
    cap = parse_tokens(args.capacity, "capacity") if args.capacity is not None else None
    t0 = time.perf_counter()
    results = simulate_batch(lengths, args.model, args.gpus, args.gpus_per_node, names, args.cluster,
                             cap, args.efficiency, args.profile, tp=args.tp, pp=args.pp, ep=args.ep)
    took = time.perf_counter() - t0
    cap = results[0].info["capacity"]
    units = (f", TP {args.tp}: {args.gpus // args.tp} HDP units of {args.tp} GPUs" if args.tp > 1 else "")
    if args.pp > 1:
        units += (f", PP {args.pp}: {args.gpus // (args.tp * args.pp)} pipelines of {args.pp} stages "
                  f"({results[0].info.get('stage_layers')} layers each)")
    units += f", EP {args.ep}" if args.ep > 1 else ""
    head = (f"{source}: {len(lengths)} sequences, {int(lengths.sum()):,} tokens, longest {int(lengths.max()):,}; "
            f"model {args.model}, {args.gpus} GPUs ({args.gpus_per_node}/node, {args.cluster}){units}, "
            f"capacity {cap} tokens/{'unit' if args.tp > 1 else 'GPU'}; simulated in {took:.2f} s")
    print(head)
    print(table(results))
    doc = None
    if args.json:
        doc = {"config": {"source": source, "model": args.model, "gpus": args.gpus,
                          "gpus_per_node": args.gpus_per_node, "tp": args.tp, "pp": args.pp, "ep": args.ep, "context": context, "capacity": cap,
                          "cluster": args.cluster, "profile": args.profile, "efficiency": args.efficiency,
                          "sequences": int(len(lengths)), "tokens": int(lengths.sum()), "seed": args.seed,
                          "simulation_s": took},
               "strategies": {r.strategy: r.to_dict() for r in results}}
        base = doc["strategies"].get("static")
        if base:
            for r in doc["strategies"].values():
                r["speedup_vs_static"] = base["step_time_s"] / r["step_time_s"]
    _write_outputs(args, doc,
                   lambda path: timeline_png(results, path, args.max_ranks_drawn, title=head.split(";")[0]))
    return 0


def _write_outputs(args: argparse.Namespace, doc: Optional[dict], draw: Callable[[str], None]) -> None:
    """``--json``: ``doc`` written there; ``--png``: ``draw(path)`` (needs matplotlib)."""
    if args.json and doc is not None:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--png needs matplotlib (pip install matplotlib)")
        draw(args.png)
        print(f"wrote {args.png}")


def _compare(args: argparse.Namespace, context: int) -> int:
    from .compare import compare_distributions, compare_png, compare_table

    items, labels = [], {}
    for it in (x.strip() for x in args.compare.split(",") if x.strip()):
        name, sep, path = it.partition("=")
        items.append(path if sep else it)
        if sep:
            labels[path] = name
    t0 = time.perf_counter()
    doc = compare_distributions(items, model=args.model, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                                context=context, tokens=parse_tokens(args.global_batch_tokens, "global-batch-tokens"),
                                seed=args.seed, cluster=args.cluster, labels=labels)
    doc["config"]["simulation_s"] = time.perf_counter() - t0
    print(compare_table(doc))
    _write_outputs(args, doc, lambda path: compare_png(doc, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
