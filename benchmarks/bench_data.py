"""Data loading benchmark: the data service vs every rank loading the whole global batch itself.

    python benchmarks/bench_data.py [--steps 30] [--png benchmarks/data.png] [--json out.json]

Corpus: the installed Python packages (:mod:`bytescale.data.corpora`, one document per package,
a heavy tail), tokenized with a BPE tokenizer trained here on the corpus (8K vocabulary, the
``tokenizers`` library; cached with the token store in ``--cache``). Four CPU "ranks" (forked
processes) run ``--steps`` steps each: take the next global batch, read the token ranges an HDP
plan gives the rank (documents longer than a quarter of the budget are split over all four ranks
in zig-zag halves, the others go whole to the least loaded rank), then "train" for
``--step-ms`` (a sleep: the accelerator computes, the CPU is free). Measured per rank: data wait
per step (next_batch + token reads; the first ``--warmup`` steps excluded), peak RSS, and the RSS
the loader added over the rank's start. Configurations:

* ``service/text/wN``: local-engine service, N source workers tokenizing on the fly, prefetch 4;
* ``service/store``: local-engine service over the prepared token store;
* ``.../x4``: four sources (copies of the corpus, equal weights) instead of one;
* ``baseline/text``: every rank reads and tokenizes every document of the global batch itself
  (the sampler needs all lengths), keeps its slices;
* ``baseline/store``: every rank reads every document of the global batch from the store.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

from bytescale.data import DataService, MixingSampler, MixingSpec, TokenStore
from bytescale.data.corpora import package_text, python_packages
from bytescale.data.prepare import prepare
from bytescale.data.records import RawCorpus
from bytescale.data.tokenizer import load_tokenizer

WORLD = 4


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def my_ranges(lengths, rank, budget):
    """(document index, start, end) this rank reads: zig-zag halves of long documents, whole
    short ones on the least loaded rank (a stand-in for the planner, same on every rank)."""
    load = [0] * WORLD
    out = []
    for i, n in enumerate(lengths):
        if n > budget // WORLD:
            c = -(-n // (2 * WORLD))
            for k in (rank, 2 * WORLD - 1 - rank):
                a, b = min(n, k * c), min(n, (k + 1) * c)
                if b > a:
                    out.append((i, a, min(n, b + 1)))  # + the label token
            for r in range(WORLD):
                load[r] += n // WORLD
        else:
            r = min(range(WORLD), key=lambda j: (load[j], j))
            load[r] += n
            if r == rank:
                out.append((i, 0, n))
    return out


def run_rank(cfg, rank, args, address, store_dir, tok_path, conn):
    start = rss_mb()
    waits, tokens = [], 0
    if cfg.startswith("service"):
        from bytescale.data import connect

        src = connect(address)
        fetch = lambda: src.next_batch()  # noqa: E731
        read = lambda sid, a, b: src.tokens(sid, a, b)  # noqa: E731
    else:
        spec = MixingSpec.from_dict(_spec_dict(cfg, args, store_dir, tok_path))
        if cfg.endswith("store"):
            st = TokenStore(store_dir)
            smp = MixingSampler(spec, [len(st)])
            lens = st.lengths
            def fetch():  # noqa: E306
                b = smp.next_batch(lambda s, p, i: int(lens[i]))
                held = {sid: np.array(st.array(sid)) for sid in b.sample_ids}  # the whole batch
                return b, held
        else:
            tok = load_tokenizer(tok_path)
            corpus = RawCorpus(packages=python_packages(max_bytes=args.max_bytes), max_doc_bytes=args.max_doc_bytes)
            smp = MixingSampler(spec, [len(corpus)])
            cache = {}
            def length_of(s, p, lid):  # noqa: E306
                if lid not in cache:
                    rec = corpus.record(lid)
                    cache[lid] = None if rec.error else tok.encode(rec.text)
                return -1 if cache[lid] is None else len(cache[lid])
            def fetch():  # noqa: E306
                b = smp.next_batch(length_of)
                held = {sid: cache[sid] for sid in b.sample_ids}
                for k in [k for k in cache if k not in held]:
                    if k != smp.local_id(0, smp.positions[0]):  # the document opening the next batch
                        del cache[k]
                return b, held
    for step in range(args.steps):
        t0 = time.perf_counter()
        if cfg.startswith("service"):
            batch = fetch()
            for i, a, b in my_ranges(batch.lengths, rank, args.tokens_per_batch):
                tokens += len(read(batch.sample_ids[i], a, b))
        else:
            batch, held = fetch()
            for i, a, b in my_ranges(batch.lengths, rank, args.tokens_per_batch):
                tokens += len(held[batch.sample_ids[i]][a:b])
            del held
        if step >= args.warmup:
            waits.append(time.perf_counter() - t0)
        time.sleep(args.step_ms / 1e3)
    conn.send({"wait_ms": [w * 1e3 for w in waits], "peak_mb": peak_mb(), "start_mb": start, "tokens": tokens})


def _opt(cfg, key, default):
    return next((int(p[1:]) for p in cfg.split("/")[2:] if p.startswith(key)), default)


def _spec_dict(cfg, args, store_dir, tok_path):
    """``mode/kind[/wN][/xK]``: K sources (copies of the corpus, equal weights), N workers each."""
    kind = cfg.split("/")[1]
    src = ({"store": store_dir} if kind == "store" else
           {"python_packages": {"max_bytes": args.max_bytes, "max_doc_bytes": args.max_doc_bytes}, "tokenizer": tok_path})
    srcs = [dict(src, name=f"pypkg{k}") for k in range(_opt(cfg, "x", 1))]
    return {"tokens_per_batch": args.tokens_per_batch, "seed": 0, "sources": srcs}


def proc_uss_mb(pid):
    """Memory private to a process (not shared with the process it was forked from), now."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(l.split()[1]) for l in f if l.startswith(("Private_Clean:", "Private_Dirty:"))) / 1024
    except OSError:
        return 0.0


def run_config(cfg, args, store_dir, tok_path):
    svc, address, service_mb = None, None, 0.0
    if cfg.startswith("service"):
        svc = DataService(_spec_dict(cfg, args, store_dir, tok_path), workers=_opt(cfg, "w", 1), prefetch=4, standby=0)
        address = svc.address
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    t0 = time.perf_counter()
    for r in range(WORLD):
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=run_rank, args=(cfg, r, args, address, store_dir, tok_path, b))
        p.start()
        pipes.append(a)
        procs.append(p)
    res = []
    for a in pipes:
        if not a.poll(args.timeout):
            raise TimeoutError(f"{cfg}: a rank gave no result in {args.timeout} s")
        res.append(a.recv())
        if svc is not None and not service_mb:  # while the service still holds its chunks
            pids = svc.worker_pids()
            service_mb = sum(proc_uss_mb(p) for p in pids["workers"].values()) + proc_uss_mb(svc._proc.pid)
    wall = time.perf_counter() - t0
    if svc is not None:
        svc.close()
    for p in procs:
        p.join()
    waits = np.concatenate([r["wait_ms"] for r in res])
    print(f"  {cfg}: {wall:.0f} s, {np.mean([r['tokens'] for r in res]) * WORLD / args.steps / 1e3:.0f}K tokens read "
          "per step (all ranks)", file=sys.stderr)
    return {"config": cfg, "wait_ms_mean": float(waits.mean()), "wait_ms_p90": float(np.percentile(waits, 90)),
            "wait_pct": float(100 * waits.mean() / (waits.mean() + args.step_ms)),
            "peak_rss_mb": max(r["peak_mb"] for r in res),
            "loader_mb": max(r["peak_mb"] - r["start_mb"] for r in res),
            "service_mb": service_mb, "tokens_per_rank": int(np.mean([r["tokens"] for r in res])), "wall_s": wall}


def build_corpus(args):
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    tok_path = cache / "tokenizer.json"
    if not tok_path.exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        pk = python_packages(max_bytes=args.max_bytes)
        tok.train_from_iterator((package_text(p, args.max_doc_bytes) for p in pk[:40]),
                                trainers.BpeTrainer(vocab_size=8192, show_progress=False,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(str(tok_path))
    store = cache / "store"
    s = prepare([], str(store), tokenizer=str(tok_path), workers=2, python_packages=True, max_bytes=args.max_bytes,
                max_doc_bytes=args.max_doc_bytes, progress=False, plot=False)
    return str(store), str(tok_path), s


def tokenizer_rate(tok_path, args) -> float:
    """Tokens per second of one process tokenizing a few packages (the supply side)."""
    tok = load_tokenizer(tok_path)
    texts = [package_text(p, 256 << 10) for p in python_packages(max_bytes=args.max_bytes)[:8]]
    t0 = time.perf_counter()
    n = sum(len(tok.encode(t)) for t in texts)
    return n / (time.perf_counter() - t0)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    colors = ["tab:blue" if n.startswith("service") else "tab:red" for n in names]
    ax[0].bar(names, [r["wait_pct"] for r in rows], color=colors)
    ax[0].axhline(2.0, ls="--", c="k", lw=0.8)
    ax[0].set(ylabel="data wait, % of step", title="data wait per step (mean over ranks and steps)", yscale="log")
    ax[1].bar(names, [r["loader_mb"] for r in rows], color=colors)
    ax[1].set(ylabel="MiB", title="per-rank loader memory (peak RSS - RSS at start)")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=1000.0)
    ap.add_argument("--tokens-per-batch", type=int, default=64 * 1024)
    ap.add_argument("--max-bytes", type=int, default=30 << 20)
    ap.add_argument("--max-doc-bytes", type=int, default=2 << 20)
    ap.add_argument("--configs", default="service/text/w1,service/text/w2,service/text/w4,service/text/w1/x4,"
                                          "service/store,service/store/x4,baseline/text,baseline/store")
    ap.add_argument("--cache", default="/tmp/bytescale-bench-data")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    store, tok, s = build_corpus(args)
    rate = tokenizer_rate(tok, args)
    print(f"# bench_data ({datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{WORLD} ranks, {args.steps} steps of {args.step_ms:.0f} ms, {args.tokens_per_batch} tokens per batch)\n")
    print(f"corpus: {s['documents']} python packages, {s['tokens']} BPE tokens (8K vocabulary); lengths p50 {s['p50']}, "
          f"p90 {s['p90']}, max {s['max']}; one process tokenizes {rate / 1e3:.0f}K tokens/s on this machine now\n")
    print("| config | data wait ms/step (mean) | p90 | wait % of step | per-rank peak RSS MiB | per-rank loader MiB "
          "| service processes private MiB | tokens read per rank |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for cfg in args.configs.split(","):
        r = run_config(cfg, args, store, tok)
        rows.append(r)
        print(f"| {cfg} | {r['wait_ms_mean']:.2f} | {r['wait_ms_p90']:.2f} | {r['wait_pct']:.2f} | {r['peak_rss_mb']:.0f} "
              f"| {r['loader_mb']:.1f} | {r['service_mb']:.0f} | {r['tokens_per_rank']} |", flush=True)
    if args.png:
        plot(rows, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
