"""TrainConfig: files, overrides, flat names, validation messages (no processes)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from bytescale.train.build import SplitDocuments
from bytescale.train.build import build_optimizer
from bytescale.train.config import ALIASES, ConfigError, TrainConfig, help_text, parse_args
from bytescale.train.metrics import FlopsModel


def test_defaults_are_valid_and_frozen():
    cfg = TrainConfig()
    assert cfg.hdp.strategy == "balanced" and cfg.train.steps == 100
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hdp.capacity = 3


def test_check_names_and_flat_aliases():
    cfg = parse_args(["--data", "/d", "--steps", "7", "--checkpoint-dir", "/c", "--save-every", "3", "--resume",
                      "--samples-log", "s.jsonl", "--metrics", "m.jsonl", "--model", "cfg.json",
                      "--capacity=64", "--fsdp", "--lr", "1e-4", "--hdp.strategy=static"])
    assert (cfg.data.path, cfg.train.steps, cfg.checkpoint.dir, cfg.checkpoint.save_every) == ("/d", 7, "/c", 3)
    assert cfg.checkpoint.resume and cfg.hdp.fsdp and cfg.hdp.strategy == "static"
    assert (cfg.metrics.samples_log, cfg.metrics.path, cfg.model.name) == ("s.jsonl", "m.jsonl", "cfg.json")
    assert cfg.hdp.capacity == 64 and cfg.optim.lr == 1e-4
    assert parse_args(["--data-spec", "mix.toml"]).data.spec == "mix.toml"
    assert parse_args(["--fsdp=false"]).hdp.fsdp is False
    assert parse_args(["--fsdp", "no", "--bf16"]).hdp.fsdp is False
    for flat, full in ALIASES.items():
        assert "." in full and flat


def test_toml_and_yaml_files_with_overrides(tmp_path):
    (tmp_path / "run.toml").write_text('[hdp]\ncapacity = 2048\nstrategy = "pow2"\n[train]\nbf16 = true\n'
                                       '[optim]\nlr = 1e-3\n')
    cfg = parse_args(["--config", str(tmp_path / "run.toml"), "--hdp.capacity=512"])
    assert cfg.hdp.capacity == 512 and cfg.hdp.strategy == "pow2" and cfg.train.bf16 and cfg.optim.lr == 1e-3
    (tmp_path / "run.yaml").write_text("data:\n  tokens_per_batch: 4096\n  path: synthetic:github\nmodel:\n  name: small\n")
    cfg = parse_args([f"--config={tmp_path / 'run.yaml'}", "--steps", "3"])
    assert cfg.data.tokens_per_batch == 4096 and cfg.model.name == "small" and cfg.train.steps == 3


@pytest.mark.parametrize("argv, words", [
    (["--hdp.capacty=3"], ["'hdp.capacty'", "did you mean hdp.capacity"]),
    (["--capasity", "3"], ["'capasity'", "did you mean --capacity"]),
    (["--trian.steps=3"], ["'trian.steps'", "no section 'trian'"]),
    (["--hdp.capacity=abc"], ["hdp.capacity", "'abc'", "int"]),
    (["--hdp.capacity=0"], ["hdp.capacity", ">= 1", "0"]),
    (["--strategy", "fastest"], ["hdp.strategy", "'fastest'", "balanced"]),
    (["--fsdp=maybe"], ["hdp.fsdp", "'maybe'", "boolean"]),
    (["--lr=fast"], ["optim.lr", "'fast'"]),
    (["--resume"], ["checkpoint.resume", "checkpoint.dir"]),
    (["--data", "a", "--data-spec", "b"], ["--data", "--data-spec"]),
    (["--static-cp", "2"], ["hdp.static_cp", "static"]),
    (["positional"], ["'positional'"]),
    (["--steps"], ["--steps needs a value"]),
    (["--name", "x"], ["ambiguous option 'name'", "--model.name or --train.name"]),
])
def test_bad_options_name_themselves(argv, words):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_file_keys_name_file_and_key(tmp_path):
    (tmp_path / "a.toml").write_text("[hdp]\ncapacityy = 3\n")
    with pytest.raises(ConfigError, match=r"a.toml: unknown key hdp.capacityy \(did you mean hdp.capacity\?\)"):
        parse_args(["--config", str(tmp_path / "a.toml")])
    (tmp_path / "b.toml").write_text("[optimizer]\nlr = 3\n")
    with pytest.raises(ConfigError, match="unknown section 'optimizer'.*did you mean optim"):
        parse_args(["--config", str(tmp_path / "b.toml")])
    (tmp_path / "c.toml").write_text('[hdp]\ncapacity = "big"\n')
    with pytest.raises(ConfigError, match="hdp.capacity: expected an int, got 'big'"):
        parse_args(["--config", str(tmp_path / "c.toml")])
    (tmp_path / "d.toml").write_text("[hdp\n")
    with pytest.raises(ConfigError, match="d.toml: cannot parse"):
        parse_args(["--config", str(tmp_path / "d.toml")])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(["--config", str(tmp_path / "none.toml")])


def test_help_lists_every_option(capsys):
    text = help_text()
    for key in ("--hdp.capacity", "--checkpoint.dir (--checkpoint-dir)", "--metrics.samples_log (--samples-log)",
                "--data.spec (--data-spec)", "--model.name (--model)"):
        assert key in text
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--train.steps" in capsys.readouterr().out


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    import torch

    cfg = parse_args(["--steps", "20", "--warmup-steps", "5", "--lr", "1.0", "--min-lr-ratio", "0.1"])
    opt, sched = build_optimizer(torch.nn.Linear(2, 2), cfg)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 14 / 15)))
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.optim.weight_decay, 0.0]  # no decay on the bias


def test_split_documents_keeps_every_token():
    from bytescale.data import InMemoryTokens
    import torch

    base = InMemoryTokens([torch.arange(10), torch.arange(3) + 100, torch.arange(8) + 200])
    ds = SplitDocuments(base, 4)
    assert [ds.length(i) for i in range(len(ds))] == [4, 4, 2, 3, 4, 4]
    assert torch.cat([ds.tokens(i, 0, ds.length(i)) for i in range(len(ds))]).tolist() == \
        list(range(10)) + [100, 101, 102] + list(range(200, 208))
    assert ds.tokens(1, 1, 3).tolist() == [5, 6]


def test_flops_model_counts_causal_attention():
    f = FlopsModel(matmul_params=1000, layers=2, heads=4, head_dim=8)
    assert f.step_flops([10, 20]) == 6 * 1000 * 30 + 6 * 2 * 4 * 8 * (100 + 400)


def test_the_peer_budget_reaches_the_planner_and_is_checked():
    from bytescale.train.config import planner_config

    assert planner_config(parse_args(["--data", "synthetic:byted"])).peer_budget == 4
    assert planner_config(parse_args(["--data", "synthetic:byted", "--peer-budget", "0"])).peer_budget == 0
    with pytest.raises(ConfigError, match="peer_budget must be 0 .unbounded. or an integer >= 4, got 2"):
        parse_args(["--data", "synthetic:byted", "--peer-budget", "2"])
