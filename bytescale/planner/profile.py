"""Measure the planner's cost-model coefficients on the current device and model.

    bytescale.profile(lambda: MyLayer(...), make_input, seq_lens=[512, 1024, 2048, 4096],
                      layers=32, out="profile.json")

* a1, b1, g: least-squares fit of one layer's forward+backward time T(s) = a1*s^2 + b1*s + g over
  ``seq_lens`` (median of ``reps`` timed runs after a warm-up);
* a2, b2: fit of Act(s) = a2*s + b2, the bytes one layer saves for backward (counted exactly with
  autograd's saved-tensor hooks, parameters excluded);
* bw_d2h, bw_h2d: device<->host copy bandwidth with pinned memory on CUDA (host memcpy on CPU).

Writes the JSON profile ``bytescale.planner.load_cost_model`` reads, with keys a1, b1, g, a2, b2,
layers, bw_d2h, bw_h2d, device, torch, measured_at. Cost: (len(seq_lens) * (reps + 1)) forward +
backward passes of ONE layer plus two ~256 MiB copies; seconds on a GPU, and on the 2-core CI
machine about 5 s for a small layer at lengths up to 1K.
"""
from __future__ import annotations

import datetime
import json
import time
from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

__all__ = ["profile", "measure_layer"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_layer(layer: nn.Module, make_input: Callable[[int], tuple], s: int, reps: int,
                  device: torch.device) -> tuple[float, int]:
    """(median fwd+bwd seconds, saved activation bytes) of ``layer`` at sequence length ``s``."""
    params = {id(p) for p in layer.parameters()}
    saved = [0]

    def pack(t):
        if id(t) not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    times = []
    for r in range(reps + 1):
        args = make_input(s)
        saved[0] = 0
        _sync(device)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(*args)
        out.float().square().mean().backward()
        _sync(device)
        if r:  # the first run is a warm-up
            times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
    return float(np.median(times)), saved[0]


def _bandwidth(device: torch.device, nbytes: int) -> tuple[float, float]:
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dev.copy_(host, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter(); host.copy_(dev, non_blocking=True); _sync(device)
        d2h = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter(); dev.copy_(host, non_blocking=True); _sync(device)
        h2d = nbytes / (time.perf_counter() - t0)
        return d2h, h2d
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    b.copy_(a)
    t0 = time.perf_counter()
    b.copy_(a)
    bw = nbytes / (time.perf_counter() - t0)
    return bw, bw


def profile(layer_factory: Callable[[], nn.Module], make_input: Callable[[int], tuple],
            seq_lens: Sequence[int], layers: int, out: Optional[str] = None, reps: int = 3,
            device: Optional[torch.device] = None, copy_bytes: int = 256 << 20) -> Dict[str, object]:
    """Measure the coefficients (see module doc); returns the profile dict and writes ``out``."""
    if len(seq_lens) < 3:
        raise ValueError("profile: need at least 3 sequence lengths to fit a1*s^2 + b1*s + g")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    layer = layer_factory().to(device)
    ts, acts = [], []
    for s in seq_lens:
        t, a = measure_layer(layer, make_input, int(s), reps, device)
        ts.append(t)
        acts.append(a)
    s_arr = np.asarray(seq_lens, dtype=np.float64)
    a1, b1, g = np.linalg.lstsq(np.stack([s_arr ** 2, s_arr, np.ones_like(s_arr)], 1), np.asarray(ts), rcond=None)[0]
    a2, b2 = np.linalg.lstsq(np.stack([s_arr, np.ones_like(s_arr)], 1), np.asarray(acts, dtype=np.float64), rcond=None)[0]
    d2h, h2d = _bandwidth(device, copy_bytes)
    prof = {
        "a1": max(float(a1), 0.0), "b1": max(float(b1), 0.0), "g": max(float(g), 0.0),
        "a2": max(float(a2), 1.0), "b2": max(float(b2), 0.0), "layers": int(layers),
        "bw_d2h": float(d2h), "bw_h2d": float(h2d), "device": str(device), "torch": torch.__version__,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "samples": {"seq_lens": [int(s) for s in seq_lens], "seconds": ts, "act_bytes": acts},
    }
    if out:
        flat = {k: v for k, v in prof.items() if k != "samples"}
        with open(out, "w") as f:
            json.dump(flat, f, indent=1)
    return prof
