"""prepare: every input format round-trips through the token store; malformed records; resume."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bytescale.data import TokenStore
from bytescale.data.corpora import package_text, python_packages
from bytescale.data.prepare import main, prepare
from bytescale.data.token_store import dtype_for_vocab
from bytescale.data.tokenizer import ByteTokenizer

from corpus_utils import make_texts, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def _decoded(out: Path) -> list:
    st = TokenStore(out)
    return [ByteTokenizer.decode(st.array(i)) for i in range(len(st))]


def test_jsonl_round_trip(tmp_path, texts, jsonl):
    s = prepare([str(jsonl)], str(tmp_path / "out"), progress=False, unit_bytes=2000)
    assert _decoded(tmp_path / "out") == texts
    assert s["documents"] == len(texts) and s["tokens"] == sum(len(t.encode()) for t in texts)
    assert s["skipped_total"] == 0 and (tmp_path / "out" / "lengths.png").stat().st_size > 1000
    assert s["p50"] <= s["p90"] <= s["max"]


def test_text_files_and_directories(tmp_path, texts):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    for i, t in enumerate(texts[:7]):
        (d / ("sub" if i % 2 else "") / f"f{i:02d}.txt").write_text(t, encoding="utf-8")
    prepare([str(d)], str(tmp_path / "out"), progress=False, plot=False, unit_bytes=500)
    files = sorted(p for p in d.rglob("*.txt"))
    assert _decoded(tmp_path / "out") == [p.read_text(encoding="utf-8") for p in files]


def test_parquet_round_trip(tmp_path, texts):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": texts, "n": list(range(len(texts)))}), tmp_path / "c.parquet", row_group_size=16)
    s = prepare([str(tmp_path / "c.parquet")], str(tmp_path / "out"), text_field="content", progress=False, plot=False)
    assert _decoded(tmp_path / "out") == texts and s["documents"] == len(texts)
    with pytest.raises(RuntimeError, match="no column 'text'"):
        prepare([str(tmp_path / "c.parquet")], str(tmp_path / "out2"), progress=False)


def test_hf_dataset_on_disk(tmp_path, texts):
    datasets = pytest.importorskip("datasets", reason="the HF 'datasets' package is not installed")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    prepare([str(tmp_path / "ds")], str(tmp_path / "out"), progress=False, plot=False)
    assert _decoded(tmp_path / "out") == texts


def test_hf_tokenizer_from_local_file(tmp_path, texts, jsonl):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts[:30], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    s = prepare([str(jsonl)], str(tmp_path / "out"), tokenizer=str(tmp_path), progress=False, plot=False)
    st = TokenStore(tmp_path / "out")
    assert s["vocab_size"] == tok.get_vocab_size() and st.dtype == dtype_for_vocab(tok.get_vocab_size())
    for i in (0, 5, len(texts) - 1):
        assert st.array(i).tolist() == tok.encode(texts[i]).ids


def test_malformed_records_are_counted_and_logged(tmp_path, caplog):
    p = tmp_path / "bad.jsonl"
    good = make_texts(5, seed=3)
    lines = [json.dumps({"text": good[0]}).encode(), b"{not json", json.dumps({"body": "x"}).encode(),
             json.dumps({"text": "   "}).encode(), b'{"text": "caf\xe9"}', b"", json.dumps({"text": 42}).encode(),
             json.dumps({"text": "y" * 500}).encode(), json.dumps({"text": good[1]}).encode()]
    p.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="bytescale.data.prepare"):
        s = prepare([str(p)], str(tmp_path / "out"), max_length=400, progress=False, plot=False)
    assert _decoded(tmp_path / "out") == good[:2]
    assert s["skipped"] == {"not JSON": 1, "missing text field 'text'": 1, "empty document": 1, "bad UTF-8": 1,
                            "text field 'text' is a int, not a string": 1, "longer than --max-length": 1}
    msgs = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(msgs) == 6
    for line, why in [(2, "not JSON"), (3, "missing text field"), (4, "empty document"), (5, "bad UTF-8"),
                      (7, "is a int"), (8, "longer than --max-length 400")]:
        assert any(f"{p}:{line}: " in m and why in m for m in msgs), (line, msgs)


def test_missing_input_and_unreadable_tokenizer_fail_at_start(tmp_path, jsonl, caplog):
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file"):
        prepare([str(jsonl), str(tmp_path / "nope.jsonl")], str(tmp_path / "out"), progress=False)
    (tmp_path / "tok.json").write_text("{ this is not a tokenizer")
    with pytest.raises(RuntimeError, match="tok.json: cannot be loaded"):
        prepare([str(jsonl)], str(tmp_path / "out"), tokenizer=str(tmp_path / "tok.json"), progress=False)
    with pytest.raises(RuntimeError, match="no such file or directory"):
        prepare([str(jsonl)], str(tmp_path / "out"), tokenizer=str(tmp_path / "missing"), progress=False)
    with caplog.at_level(logging.ERROR):
        assert main([str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "nope.jsonl: no such file" in caplog.text and not (tmp_path / "out").exists()


def test_workers_and_resume_after_kill_give_identical_output(tmp_path):
    texts = make_texts(3000, seed=5, scale=12)
    src = write_jsonl(tmp_path / "big.jsonl", texts)
    ref = tmp_path / "ref"
    prepare([str(src)], str(ref), progress=False, plot=False, unit_bytes=4096)
    par = tmp_path / "par"
    prepare([str(src)], str(par), workers=3, progress=False, plot=False, unit_bytes=4096)
    for f in ("data.bin", "data.idx"):
        assert (ref / f).read_bytes() == (par / f).read_bytes()
    assert _decoded(ref) == texts
    # Interrupt a run (SIGKILL, mid-way), then run again: identical output.
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "bytescale.data.prepare", str(src), "--output", str(out),
                             "--unit-bytes", "4096", "--workers", "2", "--no-progress", "--no-plot"],
                            env=env, stderr=subprocess.PIPE, start_new_session=True)
    parts = out / "parts"
    deadline = time.time() + 120
    n_done = 0
    while time.time() < deadline and proc.poll() is None:
        n_done = len(list(parts.glob("part-*.json"))) if parts.exists() else 0
        if n_done >= 3:
            break
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    total = json.loads((parts / "plan.json").read_text())["units"]
    assert 3 <= n_done < total and not (out / "data.idx").exists(), "the kill did not land mid-way"
    s = prepare([str(src)], str(out), workers=2, progress=False, plot=False, unit_bytes=4096)
    for f in ("data.bin", "data.idx"):
        assert (ref / f).read_bytes() == (out / f).read_bytes()
    assert s["documents"] == len(texts) and not parts.exists()
    with pytest.raises(RuntimeError, match="prepared from other inputs"):
        prepare([str(src)], str(out), max_length=10, progress=False)


def test_python_packages_corpus(tmp_path):
    pk = python_packages(max_bytes=400_000)
    s = prepare([], str(tmp_path / "out"), python_packages=True, max_bytes=400_000, max_doc_bytes=100_000,
                progress=False)
    assert s["python_packages"] == [p.name for p in pk] and s["documents"] == len(pk) >= 2
    got = _decoded(tmp_path / "out")
    assert got == [package_text(p, 100_000) for p in pk]
    assert all(t.startswith("# file: ") for t in got) and (tmp_path / "out" / "lengths.png").exists()


def test_python_code_corpus_files_plus_repositories(tmp_path, capsys):
    from bytescale.data.corpora import package_documents
    from bytescale.data.prepare import main

    pk = python_packages(max_bytes=400_000)
    s = prepare([], str(tmp_path / "out"), python_code=True, max_bytes=400_000, max_doc_bytes=30_000,
                progress=False, plot=False)
    got = _decoded(tmp_path / "out")
    want = [text for p in pk for _, text in package_documents(p, 30_000)]
    assert got == want and s["documents"] == len(want)
    # every UTF-8 file is a document of its own, and a package of several files adds its repository
    def readable(p, rel):
        try:
            (Path(p.root) / rel).read_bytes().decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    files = sum(readable(p, rel) for p in pk for rel in p.files)
    repos = [package_text(p, 30_000) for p in pk if len(p.files) > 1]
    assert len(got) == files + len(repos) and all(r in got for r in repos) and repos
    assert max(len(t.encode()) for t in got) <= 30_000 * 4  # cut at the cap (characters, UTF-8 at most 4 bytes)
    with pytest.raises(ValueError, match="two layouts"):
        prepare([], str(tmp_path / "x"), python_code=True, python_packages=True)
    assert main(["--output", str(tmp_path / "out"), "--describe"]) == 0
    out = capsys.readouterr().out
    assert f"{len(want)} documents" in out and "length (tokens)" in out
