"""``python -m bytescale.sim`` end to end (JSON + PNG) and its errors on bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bytescale.sim.__main__ import main, parse_tokens, read_lengths

KEYS = ("step_time_s", "tokens_per_s", "mfu", "breakdown")


def test_cli_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(["--corpus", "github", "--model", "llama-7b", "--gpus", "64", "--gpus-per-node", "8",
               "--context", "256K", "--global-batch-tokens", "2M", "--strategy", "all",
               "--json", str(out), "--png", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert set(doc["strategies"]) == {"static", "pow2", "hdp", "hdp-offload", "hdp-offload-eq3", "hdp-balance",
                                     "hdp-full"}
    for name, r in doc["strategies"].items():
        for k in KEYS:
            assert k in r, (name, k)
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert sum(r["breakdown"].values()) == pytest.approx(r["step_time_s"], rel=1e-9)
    assert doc["config"]["context"] == 256 * 1024 and doc["config"]["tokens"] <= 2 << 20
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "hdp-full" in text and "speed-up" in text


def test_cli_lengths_file_one_strategy(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("# one batch\n1000 2000\n300000\n\n4096  # trailing comment\n")
    out = tmp_path / "o.json"
    assert main(["--lengths", str(f), "--gpus", "16", "--gpus-per-node", "4", "--strategy", "hdp-balance",
                 "--capacity", "32K", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["strategies"]) == ["hdp-balance"] and doc["config"]["tokens"] == 307096
    assert doc["config"]["capacity"] == 32768


@pytest.mark.parametrize("argv,needle", [
    (["--corpus", "byted", "--model", "llama-9b"], "unknown model 'llama-9b'"),
    (["--corpus", "wiki"], "--corpus 'wiki'"),
    (["--corpus", "byted", "--context", "2X"], "--context '2X'"),
    (["--corpus", "byted", "--strategy", "hdp-fast"], "--strategy 'hdp-fast'"),
    (["--corpus", "byted", "--cluster", "tpu"], "unknown cluster 'tpu'"),
    (["--corpus", "byted", "--gpus", "8", "--context", "2M", "--capacity", "8K"], "needs"),
])
def test_cli_bad_input_names_it(argv, needle, capsys):
    assert main(argv + ["--global-batch-tokens", "4M"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_lengths_file_with_non_integers(tmp_path, capsys):
    f = tmp_path / "bad.txt"
    f.write_text("100\n200 1.5\n")
    assert main(["--lengths", str(f)]) == 2
    assert "line 2: '1.5' is not an integer" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no lengths"):
        (tmp_path / "empty.txt").write_text("# nothing\n")
        read_lengths(str(tmp_path / "empty.txt"))
    assert main(["--lengths", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_parse_tokens():
    assert parse_tokens("2M") == 2 << 20 and parse_tokens("256k") == 256 << 10 and parse_tokens("32768") == 32768
    for bad in ("2X", "", "-1", "0", "0.5K1", "1.3"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_module_entry_point(tmp_path):
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, "-m", "bytescale.sim", "--corpus", "byted", "--gpus", "32",
                        "--context", "128K", "--global-batch-tokens", "1M", "--strategy", "static,hdp-full",
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert set(json.loads(out.read_text())["strategies"]) == {"static", "hdp-full"}


def test_lengths_from_a_token_store(tmp_path):
    """--lengths DIR: a token store's documents are the global batch (empty ones left out); what
    the demo (scripts/run_demo.sh) asks of its corpus."""
    import numpy as np

    from bytescale.data.token_store import TokenStoreWriter

    d = tmp_path / "store"
    d.mkdir()
    lens = [300_000, 0, 5, 70_000, 1]
    with TokenStoreWriter(d / "data", np.uint16) as w:
        for n in lens:
            w.add(np.arange(n) % 256)
    assert read_lengths(str(d)).tolist() == [300_000, 5, 70_000, 1]
    assert read_lengths(str(d / "data.idx")).tolist() == [300_000, 5, 70_000, 1]
    out = tmp_path / "o.json"
    assert main(["--lengths", str(d), "--gpus", "16", "--gpus-per-node", "8", "--context", "256K",
                 "--capacity", "32K", "--strategy", "static,hdp", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    # 300,000 tokens at a 256K context: two pieces (262,144 + 37,856)
    assert doc["config"]["sequences"] == 5 and doc["config"]["tokens"] == 370_006
    st, hdp = doc["strategies"]["static"], doc["strategies"]["hdp"]
    # static shards everything over CP 8; HDP (memory-driven) keeps the two that fit 32K local
    assert st["cp"] == 8 and st["local_sequences"] == 0 and st["local_tokens"] == 0
    assert hdp["local_sequences"] == 2 and hdp["local_tokens"] == 6


def test_lengths_from_a_broken_token_store_names_it(tmp_path, capsys):
    d = tmp_path / "store"
    d.mkdir()
    (d / "data.idx").write_bytes(b"not an index")
    (d / "data.bin").write_bytes(b"")
    assert main(["--lengths", str(d)]) == 2
    err = capsys.readouterr().err
    assert str(d) in err and "truncated" in err, err
