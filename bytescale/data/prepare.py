"""Turn raw corpora into a token store: ``python -m bytescale.data.prepare INPUTS... --output DIR``.

Inputs: jsonl files (one JSON object per line, text in ``--text-field``), parquet files (pyarrow),
plain text files (one document per file), directories of those, an HF ``datasets`` dataset saved
with ``save_to_disk`` (needs ``datasets``), or ``--python-packages`` (the installed Python packages
and standard library, one document per package; see :mod:`bytescale.data.corpora`) or
``--python-code`` (the same packages as a code corpus: one document per source file plus one
repository-level document per package, its files concatenated; the main command's default).

Output: ``DIR/data.bin`` + ``DIR/data.idx`` (Megatron's indexed layout, :mod:`.token_store`),
``DIR/summary.json`` (counts, skipped records by reason, length distribution) and
``DIR/lengths.png`` (histograms of document lengths and of tokens by document length).

Work is split into units (:func:`bytescale.data.records.plan_units`) tokenized by ``--workers``
processes into ``DIR/parts/``; each finished unit is renamed into place atomically, so a run that
was interrupted (killed, out of disk, ...) resumes where it stopped when run again with the same
arguments, and produces byte-identical output. Malformed records are counted and skipped with one
log line naming file and line; a missing input or an unreadable tokenizer fails at start.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .records import Unit, iter_unit, plan_units
from .token_store import TokenStore, TokenStoreWriter, dtype_for_vocab
from .tokenizer import load_tokenizer

__all__ = ["prepare", "length_summary", "histogram_text", "plot_lengths", "main"]

log = logging.getLogger("bytescale.data.prepare")
MAX_LOGGED_SKIPS = 1000  # per run; later skips are counted only
_worker_state: Dict[str, Any] = {}


def _init_worker(tokenizer: str) -> None:
    _worker_state["tok"] = load_tokenizer(tokenizer)


def _run_unit(args) -> Dict[str, Any]:
    """Tokenize one unit into ``parts/part-NNNNNN.{bin,idx,json}``; the .json marks it done."""
    index, unit, parts, text_field, max_length, max_doc_bytes, dtype = args
    tok = _worker_state["tok"]
    prefix = Path(parts) / f"part-{index:06d}"
    skipped: Counter = Counter()
    skips: List[List[str]] = []
    with TokenStoreWriter(prefix, dtype) as w:
        for rec in iter_unit(unit, text_field, max_doc_bytes):
            if rec.error is None:
                ids = tok.encode(rec.text)
                if max_length is not None and len(ids) > max_length:
                    rec = rec.__class__(rec.origin, error=f"{len(ids)} tokens, longer than --max-length {max_length}")
                else:
                    w.add(ids)
                    continue
            reason = rec.error.split(" (")[0] if rec.error.startswith("not JSON") else rec.error.split(" at byte")[0]
            reason = "longer than --max-length" if "--max-length" in reason else reason
            skipped[reason] += 1
            if len(skips) < MAX_LOGGED_SKIPS:
                skips.append([rec.origin, rec.error])
        docs = w.num_documents
    info = {"unit": index, "documents": docs, "skipped": dict(skipped), "skips": skips}
    tmp = prefix.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, prefix.with_suffix(".json"))
    return info


def _fingerprint(units: List[Unit], options: Dict[str, Any]) -> str:
    stats = []
    for u in units:
        for f in ([u.path] if u.path else []) + list(u.files):
            st = os.stat(f)
            stats.append((f, st.st_size, st.st_mtime_ns))
    blob = json.dumps({"units": [asdict(u) for u in units], "files": sorted(set(stats)), **options},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def length_summary(lengths: np.ndarray) -> Dict[str, Any]:
    """Count, total, mean, percentiles and token shares above 4K/32K/128K/1M of document lengths."""
    x = np.asarray(lengths, dtype=np.int64)
    if x.size == 0:
        return {"documents": 0, "tokens": 0}
    tot = int(x.sum())
    pct = {f"p{p}": int(np.percentile(x, p, method="lower")) for p in (10, 50, 90, 99)}
    shares = {f"token_share_gt_{k}K": float(x[x > k * 1024].sum() / tot) for k in (4, 32, 128, 1024)}
    return {"documents": int(x.size), "tokens": tot, "mean": float(x.mean()), "min": int(x.min()),
            **pct, "max": int(x.max()), **shares}


def histogram_text(lengths: np.ndarray) -> str:
    """A printable histogram: documents and tokens per length band (powers of four)."""
    x = np.asarray(lengths, dtype=np.int64)
    x = x[x > 0]
    tot = max(int(x.sum()), 1)
    edges = [0, 256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 1 << 62]

    def fmt(n: int) -> str:
        return "inf" if n >= 1 << 62 else f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1024 else str(n)

    lines = [f"{'length (tokens)':>16} {'documents':>10} {'share':>6} {'tokens':>7}"]
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (x > lo) & (x <= hi)
        if not sel.any():
            continue
        share = x[sel].sum() / tot
        lines.append(f"{fmt(lo) + ' - ' + fmt(hi):>16} {int(sel.sum()):>10} {sel.mean():>6.1%} {share:>7.1%}  "
                     + "#" * int(round(40 * share)))
    return "\n".join(lines)


def plot_lengths(lengths: np.ndarray, path: Path, title: str) -> None:
    """Histogram PNG: documents and tokens per log2 length bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.asarray(lengths, dtype=np.int64)
    x = x[x > 0]
    hi = max(1, int(np.ceil(np.log2(max(2, x.max() + 1))))) if x.size else 1
    bins = 2.0 ** np.arange(0, hi + 1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].hist(x, bins=bins, color="tab:blue")
    axes[0].set(xscale="log", xlabel="document length (tokens)", ylabel="documents", title="documents by length")
    axes[1].hist(x, bins=bins, weights=x, color="tab:orange")
    axes[1].set(xscale="log", xlabel="document length (tokens)", ylabel="tokens", title="tokens by document length")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def prepare(inputs: Sequence[str], output: str, tokenizer: str = "bytes", workers: int = 1,
            text_field: str = "text", max_length: Optional[int] = None, python_packages: bool = False,
            max_packages: Optional[int] = None, max_bytes: Optional[int] = None,
            max_doc_bytes: Optional[int] = None, unit_bytes: int = 32 << 20, overwrite: bool = False,
            progress: bool = True, plot: bool = True, python_code: bool = False) -> Dict[str, Any]:
    """Tokenize ``inputs`` into a token store in ``output``; returns the summary (also in
    ``output/summary.json``). Resumes an interrupted run with the same arguments."""
    tok = load_tokenizer(tokenizer)  # fails now, with the path, if unreadable
    if python_packages and python_code:
        raise ValueError("prepare: --python-packages and --python-code are two layouts of one corpus; give one")
    if not inputs and not (python_packages or python_code):
        raise ValueError("prepare: no input (give files/directories, --python-packages or --python-code)")
    packages = []
    if python_packages or python_code:
        from .corpora import python_packages as find

        packages = find(max_packages=max_packages, max_bytes=max_bytes)
    units = plan_units(inputs, text_field, unit_bytes, packages, code_layout=python_code)
    dtype = dtype_for_vocab(tok.vocab_size)
    options = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "text_field": text_field,
               "max_length": max_length, "max_doc_bytes": max_doc_bytes, "dtype": dtype.name}
    fp = _fingerprint(units, options)
    out = Path(output)
    parts = out / "parts"
    summary_path = out / "summary.json"
    if summary_path.exists() and not overwrite:
        done = json.loads(summary_path.read_text())
        if done.get("fingerprint") == fp:
            log.info("prepare: %s is already prepared from these inputs", out)
            return done
        raise RuntimeError(f"prepare: {out} holds a store prepared from other inputs or options; "
                           "use another --output or --overwrite")
    if overwrite:
        for p in (parts, summary_path, out / "data.bin", out / "data.idx", out / "lengths.png"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    parts.mkdir(parents=True, exist_ok=True)
    plan_file = parts / "plan.json"
    if plan_file.exists() and json.loads(plan_file.read_text()).get("fingerprint") != fp:
        raise RuntimeError(f"prepare: {parts} holds an interrupted run with other inputs or options; "
                           "rerun it with the same arguments, or use --overwrite")
    plan_file.write_text(json.dumps({"fingerprint": fp, "units": len(units)}))
    for stale in parts.glob("*.tmp"):
        stale.unlink()
    todo = [i for i in range(len(units)) if not (parts / f"part-{i:06d}.json").exists()]
    if len(todo) < len(units):
        log.info("prepare: resuming, %d of %d units already done", len(units) - len(todo), len(units))
    jobs = [(i, units[i], str(parts), text_field, max_length, max_doc_bytes, dtype) for i in todo]
    t0 = time.perf_counter()
    logged = 0
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=len(units), initial=len(units) - len(todo), unit="unit",
                                        desc="prepare", disable=not progress) as bar:
        def report(info: Dict[str, Any]) -> None:
            nonlocal logged
            for origin, why in info["skips"]:
                if logged < MAX_LOGGED_SKIPS:
                    log.warning("prepare: skipped %s: %s", origin, why)
                    logged += 1
            bar.update(1)

        if workers <= 1:
            _init_worker(tokenizer)
            for job in jobs:
                report(_run_unit(job))
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
                for info in pool.imap_unordered(_run_unit, jobs):
                    report(info)
    # Merge the parts in unit order.
    skipped: Counter = Counter()
    with TokenStoreWriter(out / "data", dtype) as w:
        for i in range(len(units)):
            info = json.loads((parts / f"part-{i:06d}.json").read_text())
            skipped.update(info["skipped"])
            if info["documents"]:
                w.add_file(TokenStore(parts / f"part-{i:06d}"))
    store = TokenStore(out)
    summary = {"fingerprint": fp, **options, "inputs": [str(i) for i in inputs],
               "python_packages": [p.name for p in packages], **length_summary(store.lengths),
               "skipped": dict(sorted(skipped.items())), "skipped_total": int(sum(skipped.values()))}
    if plot and len(store):
        plot_lengths(store.lengths, out / "lengths.png", f"{out.name}: {len(store)} documents, "
                     f"{summary['tokens']} tokens ({tok.name})")
    tmp = summary_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, summary_path)
    shutil.rmtree(parts)
    elapsed = time.perf_counter() - t0
    log.info("prepare: %s: %d documents, %d tokens, %d skipped %s, in %.1f s", out, summary["documents"],
             summary["tokens"], summary["skipped_total"], summary["skipped"] or "", elapsed)
    if len(store):
        log.info("prepare: lengths min %d p50 %d p90 %d p99 %d max %d; tokens in documents > 32K: %.1f%%",
                 summary["min"], summary["p50"], summary["p90"], summary["p99"], summary["max"],
                 100 * summary["token_share_gt_32K"])
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bytescale.data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", help="jsonl / parquet / text files, directories, HF datasets on disk")
    ap.add_argument("--output", required=True, help="output directory (data.bin, data.idx, summary.json, lengths.png)")
    ap.add_argument("--tokenizer", default="bytes", help="'bytes' (built-in byte level) or a local HF tokenizer path")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    ap.add_argument("--text-field", default="text", help="the text column / JSON key")
    ap.add_argument("--max-length", type=int, default=None, help="skip documents longer than this (tokens)")
    ap.add_argument("--python-packages", action="store_true", help="add the installed Python packages corpus")
    ap.add_argument("--python-code", action="store_true", help="add the installed Python packages as a code "
                    "corpus: a document per source file plus a repository-level document per package")
    ap.add_argument("--max-packages", type=int, default=None, help="python packages: at most this many packages")
    ap.add_argument("--max-bytes", type=int, default=None, help="python packages: stop adding packages past this size")
    ap.add_argument("--max-doc-bytes", type=int, default=None, help="python packages / code: cut a document here")
    ap.add_argument("--unit-bytes", type=int, default=32 << 20, help="bytes of jsonl/text per work unit")
    ap.add_argument("--overwrite", action="store_true", help="discard an existing store or interrupted run in --output")
    ap.add_argument("--describe", action="store_true", help="print the length histogram of the store in --output "
                    "and exit")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if a.describe:
        try:
            store = TokenStore(a.output)
        except (OSError, ValueError) as e:
            log.error("error: %s: %s", a.output, e)
            return 2
        print(f"{a.output}: {len(store)} documents, {int(store.lengths.sum()):,} tokens; lengths.png draws it")
        print(histogram_text(store.lengths))
        return 0
    try:
        prepare(a.inputs, a.output, a.tokenizer, a.workers, a.text_field, a.max_length, a.python_packages,
                a.max_packages, a.max_bytes, a.max_doc_bytes, a.unit_bytes, a.overwrite,
                progress=not a.no_progress, plot=not a.no_plot, python_code=a.python_code)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        log.error("error: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
