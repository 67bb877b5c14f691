"""The attention kernel registry and the one function that chooses a step's kernel
(csrc/attention/kernel.h), on any build: CPU tensors run on the "sdpa" kernel (ATen's fused CPU
flash attention) for fp32/fp64/bf16 and on the built-in tiled kernel otherwise or when chosen, the
CUDA plug-in registers its kernels exactly in a CUDA build, BYTESCALE_ATTENTION_KERNEL is read
once (a bad value is a clear error at the first op, not a crash at import), and the programmatic
choice validates its argument."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import bytescale._C as C
from bytescale.attention import varlen_attention


@pytest.fixture
def restore_choice():
    before = C.attention.kernel_choice()
    yield
    C.attention.set_kernel_choice(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("choice", ["auto", "sdpa", "flash", "cudnn", "tiled"])
def test_cpu_tensors_run_on_sdpa_or_the_tiled_kernel(dtype, choice, restore_choice):
    C.attention.set_kernel_choice(choice)
    q = torch.randn(2048, 4, 64).to(dtype)
    # a CUDA kernel's name on CPU tensors means "that one or below": no CPU kernel ranks there
    want = "sdpa" if choice in ("auto", "sdpa") and dtype != torch.float16 else "tiled"
    assert C.attention.kernel_for(q, [1500, 548]) == want
    assert C.attention.flash_usable(q) == (want != "tiled")


def test_plugins_register_exactly_in_a_cuda_build():
    want = ["cudnn", "flash"] if C.with_cuda else []
    assert C.attention.kernels("cuda") == want
    assert C.attention.has_cuda_kernels() == bool(C.with_cuda)
    assert C.attention.kernels("cpu") == ["sdpa"]
    assert not C.attention.cudnn_failed()


def test_kernel_choice_validates_and_round_trips(restore_choice):
    for choice in ("tiled", "sdpa", "flash", "cudnn", "auto"):
        C.attention.set_kernel_choice(choice)
        assert C.attention.kernel_choice() == choice
    with pytest.raises(ValueError, match="expected auto, flash, cudnn, sdpa or tiled"):
        C.attention.set_kernel_choice("fast")
    assert C.attention.kernel_choice() == "auto"


def test_results_do_not_depend_on_the_choice_on_cpu(restore_choice):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    outs = []
    for choice in ("auto", "sdpa", "tiled", "cudnn"):
        C.attention.set_kernel_choice(choice)
        outs.append(varlen_attention(q, k, v, [31, 9]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])  # same kernel, same bits
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-12, atol=1e-12)  # sdpa vs tiled


def _python(code: str, env_value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, BYTESCALE_ATTENTION_KERNEL=env_value, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_env_knob_sets_the_initial_choice():
    r = _python("import bytescale._C as C; print(C.attention.kernel_choice())", "tiled")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "tiled"


def test_bad_env_knob_is_a_clear_error_at_first_use():
    code = (
        "import torch, bytescale\n"
        "from bytescale.attention import varlen_attention\n"
        "q = torch.randn(4, 2, 8)\n"
        "try:\n"
        "    varlen_attention(q, q, q, [4])\n"
        "except Exception as e:\n"
        "    print('ERROR', e)\n"
    )
    r = _python(code, "fastest")
    assert r.returncode == 0, r.stderr  # importing and failing cleanly, no abort
    assert "ERROR" in r.stdout and "BYTESCALE_ATTENTION_KERNEL='fastest'" in r.stdout, r.stdout
