"""What a person watches: per-step numbers, a progress bar, JSONL, TensorBoard, a PNG at the end.

Per step (rank 0 writes; every rank contributes its share through one all-gather): loss (the
token-level loss of the global batch, summed over ranks), router aux loss (MoE), learning rate,
gradient norm, global tokens, tokens/s, MFU, data-wait time (the longest any rank waited for its
micro-batches), measured imbalance (max/mean of the ranks' compute time), micro-batches per rank
and the plan's one-line summary.

Measured traffic (counted by the transport, bytescale.comm.traffic; exact and independent of the
machine's load), per step: ``comm_bytes`` (bytes all ranks sent for ring attention's K/V in the
forward and again in the backward, its dK/dV accumulators, and the gradient all-reduce payload),
``ring_steps`` and ``ring_wait_s`` per rank (ring exchanges run, time blocked waiting for ring
partners), and ``local_token_share`` (tokens of documents no rank shares: they never leave their
rank).

MFU = model FLOPs of the step / (step time x world size x peak FLOP/s of one device). Model FLOPs
are the usual 6 x (parameters outside the embedding, only the experts a token uses) per token plus
causal attention, 6 x layers x heads x head_dim x L^2 per document of L tokens (forward 2 L^2 h d,
backward twice that); recomputation is not counted. Peak: ``train.peak_tflops``, else 989 TFLOP/s
(H100/H200, bf16 dense), 312 (A100), else 0.1 per CPU process (a rough figure for one core in
fp32; give ``--peak-tflops`` for yours).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

__all__ = ["FlopsModel", "peak_flops", "MetricsLogger", "read_jsonl", "plot_runs", "truncate_jsonl",
           "traffic_row", "traffic_fields"]

# the purposes of bytescale.comm.traffic a step reports (bytes sent), then ring steps and ring wait
_SENT = ("ring_kv_fwd", "ring_kv_bwd", "ring_dkv_bwd", "grad_sync")


@dataclass(frozen=True)
class FlopsModel:
    """FLOPs of training on a batch of documents (see module docstring)."""

    matmul_params: int  # parameters a token multiplies with (embedding excluded, active experts only)
    layers: int
    heads: int
    head_dim: int

    def step_flops(self, doc_lengths: Iterable[int]) -> float:
        lens = [int(n) for n in doc_lengths]
        tokens = sum(lens)
        attn = 6.0 * self.layers * self.heads * self.head_dim * sum(n * n for n in lens)
        return 6.0 * self.matmul_params * tokens + attn


def peak_flops(device: torch.device, given_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device (module docstring)."""
    if given_tflops:
        return given_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if "H100" in name or "H200" in name or "H800" in name or "H20" in name:
            return 989e12
        if "A100" in name or "A800" in name:
            return 312e12
        return 100e12
    return 0.1e12


def traffic_row(moved: Any) -> List[float]:
    """One rank's step traffic (a :class:`bytescale.comm.traffic.Traffic`) as numbers to all-gather."""
    return [float(moved.sent(p)) for p in _SENT] + [float(moved.ring_steps), moved.ring_wait_s,
                                                   float(getattr(moved, "peers", 0))]


def _ring_mb(rec: Dict[str, Any]) -> float:
    return sum(v for k, v in (rec.get("comm_bytes") or {}).items() if k.startswith("ring")) / 1e6


def traffic_fields(table: torch.Tensor) -> Dict[str, Any]:
    """The step record's traffic fields from every rank's :func:`traffic_row` (one row per rank)."""
    k = len(_SENT)
    return {"comm_bytes": {p: int(table[:, i].sum()) for i, p in enumerate(_SENT)},
            "ring_steps": [int(x) for x in table[:, k].tolist()],
            "ring_wait_s": [round(float(x), 6) for x in table[:, k + 1].tolist()],
            # distinct point-to-point peers per rank since it started (bytescale.comm.traffic)
            **({"p2p_peers": [int(x) for x in table[:, k + 2].tolist()]} if table.shape[1] > k + 2 else {})}


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def truncate_jsonl(path: Optional[str], before_step: int) -> None:
    """Keep only lines with ``step < before_step`` (a resumed run rewrites what follows)."""
    if not path or not os.path.exists(path):
        return
    keep = [r for r in read_jsonl(path) if int(r.get("step", -1)) < before_step]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for r in keep:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


class MetricsLogger:
    """Rank 0's sinks: console lines under a tqdm bar, metrics JSONL, samples log, TensorBoard."""

    def __init__(self, *, rank: int, total_steps: int, start_step: int, name: str,
                 metrics_path: Optional[str], samples_path: Optional[str], tensorboard_dir: Optional[str],
                 progress: bool, log_every: int) -> None:
        self.rank = rank
        self.name = name
        self.log_every = log_every
        self.records: List[Dict[str, Any]] = []
        self._bar = None
        self._tb = None
        self._metrics = self._samples = None
        self.tensorboard_dir = None
        if rank != 0:
            return
        for p in (metrics_path, samples_path):
            if p:
                Path(p).parent.mkdir(parents=True, exist_ok=True)
                truncate_jsonl(p, start_step)
        self._metrics = open(metrics_path, "a") if metrics_path else None
        self._samples = open(samples_path, "a") if samples_path else None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(tensorboard_dir, purge_step=start_step)
                self.tensorboard_dir = tensorboard_dir
            except ImportError:
                self._tb = None
        if progress:
            try:
                from tqdm.auto import tqdm

                # disable=None: no bar when stderr is not a terminal (logs stay clean)
                self._bar = tqdm(total=total_steps, initial=start_step, desc=name, unit="step", disable=None,
                                 dynamic_ncols=True, leave=True)
            except ImportError:
                self._bar = None

    def print(self, msg: str) -> None:
        if self.rank != 0:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def samples(self, step: int, sample_ids: Sequence[int]) -> None:
        if self._samples is not None:
            self._samples.write(json.dumps({"step": step, "samples": [int(s) for s in sample_ids]}) + "\n")
            self._samples.flush()

    def log(self, rec: Dict[str, Any], plan_summary: str) -> None:
        if self.rank != 0:
            return
        self.records.append(rec)
        if self._metrics is not None:
            self._metrics.write(json.dumps(dict(rec, plan=plan_summary)) + "\n")
            self._metrics.flush()
        if self._tb is not None:
            for k in ("loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "data_wait_s",
                      "step_time_s", "imbalance"):
                v = rec.get(k)
                if v is not None and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, rec["step"])
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
        if rec["step"] % self.log_every == 0:
            aux = f" aux {rec['aux_loss']:.4f} |" if rec.get("aux_loss") else ""
            self.print(f"[{self.name}] step {rec['step']:4d} | loss {rec['loss']:.4f} |{aux} "
                       f"{rec['tokens_per_s']:8.0f} tok/s | mfu {100 * rec['mfu']:5.2f}% | "
                       f"wait {1e3 * rec['data_wait_s']:6.1f} ms | lr {rec['lr']:.2e} | "
                       f"imb {rec['imbalance']:.2f} | ring {_ring_mb(rec):.1f} MB, wait "
                       f"{1e3 * max(rec.get('ring_wait_s') or [0]):.0f} ms | {plan_summary}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for f in (self._metrics, self._samples):
            if f is not None:
                f.close()
        self._metrics = self._samples = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def plot_runs(runs: Dict[str, List[Dict[str, Any]]], out: str, skip: int = 1) -> Optional[str]:
    """PNG of loss and tokens/s over steps for one or several runs (name -> records)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, recs in runs.items():
        steps = [r["step"] for r in recs]
        a.plot(steps, [r["loss"] for r in recs], label=name)
        b.plot(steps[skip:], [r["tokens_per_s"] for r in recs][skip:], label=name)
    a.set_xlabel("step")
    a.set_ylabel("loss (token-level cross-entropy)")
    a.set_title("loss")
    b.set_xlabel("step")
    b.set_ylabel("tokens / s (global)")
    b.set_title("throughput")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
