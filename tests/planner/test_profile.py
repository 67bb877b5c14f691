"""The device profiler measures sane coefficients and writes a profile the planner loads."""
from __future__ import annotations

import json

import torch

import bytescale
from bytescale.attention import Layout
from bytescale.models.llama import Block, LlamaConfig
from bytescale.planner import profile

CFG = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)


def test_profile_cpu_layer(tmp_path):
    def make_input(s):
        return (torch.randn(s, CFG.dim, requires_grad=True), torch.arange(s))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block(CFG)

        def forward(self, x, pos):
            return self.block(x, pos, Layout.local([x.shape[0]]))

    out = tmp_path / "profile.json"
    prof = profile(Layer, make_input, seq_lens=[128, 256, 512, 768], layers=8, out=str(out), reps=2,
                   copy_bytes=16 << 20)
    data = json.loads(out.read_text())
    for key in ("a1", "b1", "g", "a2", "b2", "layers", "bw_d2h", "bw_h2d", "device", "torch", "measured_at"):
        assert key in data
    assert data["a2"] > 0 and data["bw_d2h"] > 0 and data["layers"] == 8
    # activations grow linearly in s: the fit reproduces the measurements
    acts = prof["samples"]["act_bytes"]
    assert acts[-1] > acts[0]
    fit = [data["a2"] * s + data["b2"] for s in prof["samples"]["seq_lens"]]
    assert max(abs(f - a) / a for f, a in zip(fit, acts)) < 0.05
    cm = bytescale.planner.load_cost_model(str(out))
    assert cm.layers == 8 and cm.seq_time(512) > 0
