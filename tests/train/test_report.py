"""``python -m bytescale.train.report``: the side by side of the demo's two runs (the layout
columns come from the trainer's per-step records) and, with ``--sim``, what the simulator
predicted for the same corpus at scale, with the measured and the predicted speed-up on one line."""
from __future__ import annotations

import json

from bytescale.sim.__main__ import main as sim_main
from bytescale.train.report import compare, main, sim_summary


def _records(step_time, sharded_seqs, sharded_tokens, steps=4, layout=True):
    out = []
    for s in range(steps):
        r = {"step": s, "loss": 5.0 - 0.5 * s, "tokens": 1000, "step_time_s": step_time, "mfu": 0.01,
             "data_wait_s": 0.002, "imbalance": 1.1}
        if layout:
            r.update(sequences=10, sharded_sequences=sharded_seqs, sharded_tokens=sharded_tokens)
        out.append(r)
    return out


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_compare_prints_the_layout_and_the_speedup():
    text = compare({"HDP": _records(0.5, 3, 400), "static": _records(0.8, 10, 1000),
                    "old": _records(1.0, 0, 0, layout=False)}, skip=1)
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.split() and ln.split()[0] in ("HDP", "static", "old")}
    assert rows["HDP"].endswith("70% /  60%"), rows["HDP"]  # 7 of 10 sequences, 600 of 1000 tokens local
    assert rows["static"].endswith("0% /   0%"), rows["static"]
    assert rows["old"].rstrip().endswith("- /    -"), rows["old"]  # metrics from before the layout fields
    assert "speed-up HDP / static: 1.60x" in text and "speed-up HDP / old: 2.00x" in text


def test_report_with_the_simulators_prediction(tmp_path, capsys):
    sim = tmp_path / "sim.json"
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("300000 70000 9000 5000 200 1\n" * 20)
    assert sim_main(["--lengths", str(lengths), "--gpus", "64", "--gpus-per-node", "8", "--context", "512K",
                     "--capacity", "16K", "--strategy", "static,pow2,hdp-balance", "--json", str(sim)]) == 0
    capsys.readouterr()
    doc = json.loads(sim.read_text())
    st = doc["strategies"]
    text = sim_summary(doc)
    assert "64 GPUs" in text and "512K context" in text and "16,384 tokens per GPU" in text
    for name, label in (("static", "static DP x CP"), ("pow2", "pow2 (Megatron-style CP)"),
                        ("hdp-balance", "HDP + balance")):
        row = next(ln for ln in text.splitlines() if ln.startswith(label))
        assert f"{st['static']['step_time_s'] / st[name]['step_time_s']:.2f}x" in row, row
        assert f"{st[name]['step_time_s']:.2f}" in row and row.split()[-4] == str(st[name]["max_ring"])
    static_row = next(ln for ln in text.splitlines() if ln.startswith("static DP x CP"))
    assert static_row.endswith("0% /   0%")

    a = _write(tmp_path / "hdp.jsonl", _records(0.5, 3, 400))
    b = _write(tmp_path / "static.jsonl", _records(0.6, 10, 1000))
    assert main([f"HDP={a}", f"static DPxCP={b}", "--sim", str(sim)]) == 0
    out = capsys.readouterr().out
    want = st["static"]["step_time_s"] / st["hdp-balance"]["step_time_s"]
    assert (f"measured here: HDP / static DPxCP: 1.20x; predicted at scale: HDP + balance / static DP x CP: "
            f"{want:.2f}x") in out, out
    assert main([f"HDP={a}", "--sim", str(tmp_path / "missing.json")]) == 2


def _with_traffic(recs, ring_mb, wait_s):
    for r in recs:
        r.update(comm_bytes={"ring_kv_fwd": ring_mb * 1e6 / 4, "ring_kv_bwd": ring_mb * 1e6 / 4,
                             "ring_dkv_bwd": ring_mb * 1e6 / 2, "grad_sync": 2e6},
                 ring_steps=[4, 6], ring_wait_s=list(wait_s), local_token_share=1 - r["sharded_tokens"] / r["tokens"])
    return recs


def test_report_prints_the_counted_traffic_and_the_distributions(tmp_path, capsys):
    text = compare({"HDP": _with_traffic(_records(0.5, 3, 400), 2.0, (0.02, 0.05)),
                    "static": _with_traffic(_records(0.8, 10, 1000), 20.0, (0.8, 1.2))}, skip=1)
    lines = text.splitlines()
    hdp = next(ln for ln in lines if ln.startswith("HDP ") and "MB" not in ln and ln.split()[1] == "2.00")
    assert hdp.split()[1:6] == ["2.00", "0.50", "0.50", "1.00", "2.00"] and hdp.split()[6] == "5.0"
    assert "20-50" in hdp and hdp.rstrip().endswith("60%")
    assert "ring attention bytes per step, static / HDP: 10.00x" in text
    comp = tmp_path / "c.json"
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("300000 70000 9000 5000 200 1\n" * 20)
    assert sim_main(["--compare", f"this corpus={lengths},magi-short", "--gpus", "64", "--context", "512K",
                     "--global-batch-tokens", "4M", "--json", str(comp)]) == 0
    capsys.readouterr()
    a = _write(tmp_path / "hdp.jsonl", _with_traffic(_records(0.5, 3, 400), 2.0, (0.02, 0.05)))
    b = _write(tmp_path / "static.jsonl", _with_traffic(_records(0.8, 10, 1000), 20.0, (0.8, 1.2)))
    assert main([f"HDP={a}", f"static={b}", "--compare", str(comp)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(comp.read_text())
    assert "magi-short" in out and "MagiAttention" in out
    assert (f"predicted at scale: HDP + balance / static DP x CP "
            f"{doc['distributions']['this corpus']['speedup']['hdp-balance']:.2f}x") in out
    assert "static / HDP: 10.00x" in out and "HDP / static: 1.60x" in out
