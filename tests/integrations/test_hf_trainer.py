"""HDP inside transformers' Trainer and TRL's SFTTrainer (bytescale.integrations).

Against an independent single-process float64 reference: the same global batches (the sampler's
document ids over the trainer's dataset, split and masked by code of its own here), every
document whole under a local layout, the token-level loss over the batch's targets, AdamW and
gradient clipping as the Trainer configures them. The trainers run on 4 processes with plans
that shard documents over rings of 2, 3 and 4 ranks; their logged per-step losses and final
parameters must match the reference. HF's RMSNorm computes in float32 even for a float64 model
and the trainer logs float32 losses, so agreement is to ~1e-6, not float64 precision.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import bytescale.models.hf  # noqa: E402,F401  (registers attn_implementation="bytescale")
from bytescale.config import LoaderConfig, PlannerConfig  # noqa: E402
from bytescale.data import IGNORE_INDEX, GlobalBatchSampler, SyntheticTokens  # noqa: E402
from dist_utils import capture_error, run_distributed  # noqa: E402

V = 64
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
LENGTHS = [400, 13, 211, 97, 45, 7, 150, 31, 64, 9, 120, 5, 77, 330]  # plans with rings of 2, 3 and 4 at 110
TOKENS_PER_BATCH, SEED, LR = 1000, 1, 3e-3
EVAL_LENGTHS = [23, 41, 17, 30]


def _torchrun_env(rank: int, world: int) -> None:
    """What torchrun sets, which the TrainingArguments read (the process group already exists)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    transformers.logging.set_verbosity_error()


def _model(family: str):
    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    return transformers.AutoModelForCausalLM.from_config(cls(**SIZES), dtype=torch.float64)


def _docs(lengths=LENGTHS, seed=2):
    ds = SyntheticTokens(lengths, vocab_size=V - 2, seed=seed)  # ids V-2, V-1: the tokenizer's pad and eos
    return [ds.tokens(i, 0, n).tolist() for i, n in enumerate(lengths)]


def _sft_rows(lengths=LENGTHS, seed=2):
    """Prompt-completion rows, tokenized: the first third of each document is the prompt (no loss)."""
    docs = _docs(lengths, seed)
    return {"input_ids": docs, "completion_mask": [[0] * (len(d) // 3) + [1] * (len(d) - len(d) // 3) for d in docs]}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(V - 2)}
    vocab.update({"<pad>": V - 2, "</s>": V - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def _args(kind: str, out: str, steps: int, **kw):
    common = dict(output_dir=out, max_steps=steps, logging_steps=1, learning_rate=LR, lr_scheduler_type="constant",
                  use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no", bf16=False)
    common.update(kw)
    if kind == "sft":
        from trl import SFTConfig

        # TRL's defaults otherwise: gradient checkpointing on (kept: recomputation under the layout)
        return SFTConfig(completion_only_loss=True, packing=True, max_length=512, eval_packing=False, **common)
    return transformers.TrainingArguments(**common)


def _trainer(kind: str, family: str, args, capacity: int, **kw):
    from bytescale.integrations import HDPTrainer, hdp_trainer

    hdp = dict(planner=PlannerConfig(capacity), loader=LoaderConfig(TOKENS_PER_BATCH, seed=SEED))
    if kind == "sft":
        from trl import SFTTrainer

        return hdp_trainer(SFTTrainer)(model=_model(family), args=args, processing_class=_tokenizer(),
                                       train_dataset=datasets.Dataset.from_dict(_sft_rows()), **hdp, **kw)
    return HDPTrainer(model=_model(family), args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": _docs()}),
                      **hdp, **kw)


def _result(trainer, rank: int) -> dict:
    hist = trainer.state.log_history
    out = {"loss": [h["loss"] for h in hist if "loss" in h], "eval": [h["eval_loss"] for h in hist if "eval_loss" in h],
           "attn": trainer.model.config._attn_implementation}
    if rank == 0:
        out["params"] = [p.detach().clone() for p in trainer.model.parameters()]
        ds = trainer.train_dataset  # as the trainer prepared it (TRL: labels built, rows packed)
        out["rows"] = {c: ds[c] for c in ("input_ids", "labels", "seq_lengths") if c in ds.column_names}
    return out


def _train_all(rank, world, runs, out_dir):
    _torchrun_env(rank, world)
    results = []
    for kind, family in runs:
        trainer = _trainer(kind, family, _args(kind, os.path.join(out_dir, f"{kind}-{family}"), 3), capacity=110)
        trainer.train()
        results.append(_result(trainer, rank))
    return results


# -- the independent reference --------------------------------------------------------------------
def _reference_docs(rows):
    """(tokens, HF labels) of every document, in row order: a packed row's seq_lengths split it."""
    docs = []
    for i, ids in enumerate(rows["input_ids"]):
        labels = rows["labels"][i] if "labels" in rows else ids
        off = 0
        for n in (rows["seq_lengths"][i] if "seq_lengths" in rows else [len(ids)]):
            docs.append((torch.tensor(ids[off:off + n]), torch.tensor(labels[off:off + n])))
            off += n
    return docs


def _reference(family, rows, steps, eval_after=None):
    """Single-process float64 training on the sampler's global batches: per-step losses, final
    parameters and (``eval_after`` = k) the mean per-document eval loss after step k."""
    from bytescale.attention import Layout, micro_batch_context
    from bytescale.runtime import token_level_loss

    docs = _reference_docs(rows)
    model = _model(family)
    model.set_attn_implementation("bytescale")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sampler = GlobalBatchSampler([len(d[0]) for d in docs], TOKENS_PER_BATCH, SEED)
    losses, batches, evals = [], [], []
    for s in range(steps):
        ids = sampler.next_batch()
        batches.append([len(docs[i][0]) for i in ids])
        toks = [docs[i][0] for i in ids]
        targets = torch.cat([torch.cat([docs[i][1][1:], torch.tensor([IGNORE_INDEX])]) for i in ids])
        pos = torch.cat([torch.arange(len(t)) for t in toks])
        with micro_batch_context(Layout.local([len(t) for t in toks])):
            logits = model(input_ids=torch.cat(toks)[None], position_ids=pos[None]).logits[0]
        loss = token_level_loss(logits, targets, max(1, int((targets != IGNORE_INDEX).sum())))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if eval_after == s + 1:
            evals.append(_eval_reference(model))
    return losses, [p.detach() for p in model.parameters()], batches, evals


def _eval_reference(model):
    """The mean over eval documents of each one's mean completion-token loss (what Trainer's eval
    loop reports with one document per rank and batch)."""
    per_doc = []
    with torch.no_grad():
        for ids, mask in zip(*_sft_rows(EVAL_LENGTHS, seed=5).values()):
            logits = model(input_ids=torch.tensor(ids)[None]).logits[0]
            tgt = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(ids, mask)])[1:]
            per_doc.append(float(torch.nn.functional.cross_entropy(logits[:-1], tgt, ignore_index=IGNORE_INDEX)))
    return sum(per_doc) / len(per_doc)


def _rings(batches, world, capacity):
    """Ring sizes of the plans of these global batches (to show the test covers sharding)."""
    plans = [PlannerConfig(capacity).plan(lengths, world) for lengths in batches]
    return {len(mb.ring) for p in plans for r in range(world) for mb in p.micro_batches(r) if mb.is_ring}


def _check(got, want_losses, want_params, what):
    assert len(got["loss"]) == len(want_losses), f"{what}: logged {got['loss']}"
    torch.testing.assert_close(torch.tensor(got["loss"], dtype=torch.float64),
                               torch.tensor(want_losses, dtype=torch.float64),
                               rtol=2e-6, atol=0, msg=lambda m: f"{what} per-step losses: {m}")
    for g, w in zip(got["params"], want_params):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what} final parameters: {m}")


@pytest.mark.timeout(900)
def test_trainer_and_sft_trainer_match_single_process_with_rings_of_2_3_4(tmp_path):
    runs = [("trainer", "llama"), ("trainer", "qwen2"), ("sft", "llama")]
    per_rank = run_distributed(_train_all, 4, runs, str(tmp_path), timeout=800)
    rings = set()
    for k, (kind, family) in enumerate(runs):
        got = per_rank[0][k]
        losses, params, batches, _ = _reference(family, got["rows"], 3)
        _check(got, losses, params, f"{kind}/{family}")
        for r in per_rank[1:]:
            assert r[k]["loss"] == got["loss"], f"{kind}/{family}: ranks logged different losses"
        assert {r[k]["attn"] for r in per_rank} == {"bytescale"}
        rings |= _rings(batches, 4, 110)
        if kind == "sft":  # TRL packed the rows; HDP trained their documents, each one whole
            assert "seq_lengths" in got["rows"] and len(got["rows"]["input_ids"]) < len(LENGTHS)
            assert any(IGNORE_INDEX in lab for lab in got["rows"]["labels"])
    assert {2, 3, 4} <= rings, rings


# -- resume on another number of ranks ------------------------------------------------------------
CAP = 140  # the longest document (400) fits 3 ranks too


def _sft_run(rank, world, out_dir, steps, resume, broken=None):
    _torchrun_env(rank, world)
    evaluate = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=1) if resume is None else {}
    args = _args("sft", out_dir, steps, save_strategy="steps", save_steps=2, **evaluate)
    eval_ds = datasets.Dataset.from_dict(_sft_rows(EVAL_LENGTHS, seed=5)) if resume is None else None
    error = None
    if broken is not None:  # a checkpoint without its data position: every rank refuses it
        error = capture_error(lambda: _trainer("sft", "llama", args, capacity=CAP).train(resume_from_checkpoint=broken))
    trainer = _trainer("sft", "llama", args, capacity=CAP, eval_dataset=eval_ds)
    trainer.train(resume_from_checkpoint=resume)
    return dict(_result(trainer, rank), error=error and error[:2])


@pytest.mark.timeout(900)
def test_sft_trainer_resumes_from_4_on_3_ranks_with_the_same_batches_and_losses(tmp_path):
    from bytescale.integrations import LOADER_STATE

    a_dir, b_dir = str(tmp_path / "A"), str(tmp_path / "B")
    a = run_distributed(_sft_run, 4, a_dir, 4, None, timeout=400)
    ck = os.path.join(a_dir, "checkpoint-2")
    assert os.path.isfile(os.path.join(ck, LOADER_STATE))
    broken = tmp_path / "C" / "checkpoint-2"
    shutil.copytree(ck, broken)
    os.remove(broken / LOADER_STATE)
    b = run_distributed(_sft_run, 3, b_dir, 4, ck, str(broken), timeout=400)
    losses, params, _, evals = _reference("llama", a[0]["rows"], 4, eval_after=2)
    _check(a[0], losses, params, "uninterrupted 4 ranks")
    # the resumed run's history: steps 1-2 as the checkpoint recorded them, then its own 3-4
    _check(dict(b[0], loss=b[0]["loss"][2:]), losses[2:], params, "resumed on 3 ranks")
    assert b[0]["loss"][:2] == a[0]["loss"][:2]
    # evaluation during training ran the trainer's padded eval loop under the original attention
    assert len(a[0]["eval"]) == 2 and {r["attn"] for r in a} == {"bytescale"}
    assert a[0]["eval"][0] == pytest.approx(evals[0], rel=1e-5)
    for r in b:  # the checkpoint without its data position was refused, by name
        kind, msg = r["error"]
        assert kind == "FileNotFoundError" and LOADER_STATE in msg and "ignore_data_skip" in msg, r["error"]


# -- what cannot apply ----------------------------------------------------------------------------
class _OwnSampler(transformers.Trainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


class _OwnLoss(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 2


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"input_ids": [1, 2, 3]}


def _refusals(rank, world, out_dir):
    from bytescale.integrations import HDPTrainer, hdp_trainer

    _torchrun_env(rank, world)
    ds = datasets.Dataset.from_dict({"input_ids": _docs()[:4]})
    hdp = dict(planner=PlannerConfig(110), loader=LoaderConfig(TOKENS_PER_BATCH))

    def build(cls=HDPTrainer, dataset=ds, **kw):
        return lambda: cls(model=_model("llama"), args=_args("trainer", out_dir, 2, **kw), train_dataset=dataset, **hdp)

    cases = {
        "gradient_accumulation_steps=2": build(gradient_accumulation_steps=2),
        "train_sampling_strategy='group_by_length'": build(train_sampling_strategy="group_by_length"),
        "train_sampling_strategy='sequential'": build(train_sampling_strategy="sequential"),
        "fp16=True": build(fp16=True),
        "label_smoothing_factor=0.1": build(label_smoothing_factor=0.1),
        "_OwnSampler._get_train_sampler": build(hdp_trainer(_OwnSampler)),
        "_OwnLoss.compute_loss": build(hdp_trainer(_OwnLoss)),
        "must be a map-style dataset": build(dataset=_Stream()),
        "must be tokenized": build(dataset=datasets.Dataset.from_dict({"text": ["a b", "c"]})),
        "see 1 process(es) but torch.distributed has 2": build(use_cpu=False),
    }
    out = {want: capture_error(fn)[:2] for want, fn in cases.items()}
    out["too long"] = capture_error(lambda: HDPTrainer(model=_model("llama"), args=_args("trainer", out_dir, 2),
                                                       train_dataset=ds, planner=PlannerConfig(50),
                                                       loader=hdp["loader"]).train())[:2]
    out["planner"] = capture_error(lambda: HDPTrainer(model=_model("llama"), args=_args("trainer", out_dir, 2),
                                                      train_dataset=ds, planner=110, loader=hdp["loader"]))[:2]
    return out


def _refusal_of_backend(rank, world, out_dir):
    from bytescale.integrations import HDPTrainer

    _torchrun_env(rank, world)
    return capture_error(lambda: HDPTrainer(model=_model("llama"), args=_args("trainer", out_dir, 2),
                                            train_dataset=datasets.Dataset.from_dict({"input_ids": _docs()[:4]}),
                                            planner=PlannerConfig(110), loader=LoaderConfig(1000)))[:2]


@pytest.mark.timeout(600)
def test_options_that_cannot_apply_are_refused_by_name(tmp_path):
    got = run_distributed(_refusals, 2, str(tmp_path), timeout=300)[0]
    planner = got.pop("planner")
    kind, msg = got.pop("too long")  # found before the first step, not by the planner mid-run
    assert kind == "ValueError" and "document 0 of the train_dataset (row 0) has 400 tokens" in msg \
        and "capacity 50 x 2 ranks" in msg, msg
    assert planner[0] == "TypeError" and "bytescale.PlannerConfig" in planner[1], planner
    for want, (kind, msg) in got.items():
        assert kind == "ValueError" and want in msg, (want, kind, msg)
        assert msg.count("\n  - ") == 1, f"{want}: more than the one problem reported:\n{msg}"
    kind, msg = run_distributed(_refusal_of_backend, 2, str(tmp_path), backend="gloo", timeout=300)[0]
    assert kind == "ValueError" and "backend is 'gloo'" in msg and "init_process_group('bytescale')" in msg, msg


# -- the example: TRL's documented script, after the few changed lines ------------------------------
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def _code_lines(path):
    with open(path) as f:
        return [line.rstrip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def test_the_sft_example_differs_from_trls_in_seven_lines():
    import difflib

    plain = _code_lines(os.path.join(EXAMPLES, "sft_trl.py"))
    hdp = _code_lines(os.path.join(EXAMPLES, "sft_trl_bytescale.py"))
    changed = [d for d in difflib.ndiff(plain, hdp) if d[:2] in ("+ ", "- ")]
    added = sum(d.startswith("+ ") for d in changed)
    removed = sum(d.startswith("- ") for d in changed)
    assert (added, removed) == (7, 1), changed  # 6 new lines, 1 changed (README: "7 lines")


@pytest.mark.timeout(600)
def test_the_sft_example_trains_under_torchrun(tmp_path):
    """examples/sft_trl_bytescale.py as written, on 2 CPU processes under torchrun; only the hub
    model and dataset are swapped for local ones, and the TrainingArguments a CPU run needs in any
    case (TRL's default bf16 refuses a CPU without use_cpu) are added."""
    import json
    import subprocess
    import sys

    model_dir = tmp_path / "model"
    _tokenizer().save_pretrained(model_dir)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SIZES)).save_pretrained(model_dir)
    with open(tmp_path / "data.jsonl", "w") as f:
        for doc in _docs():
            f.write(json.dumps({"text": " ".join(f"t{t}" for t in doc)}) + "\n")
    src = open(os.path.join(EXAMPLES, "sft_trl_bytescale.py")).read()
    swaps = {'"Qwen/Qwen2.5-0.5B-Instruct"': repr(str(model_dir)),
             'load_dataset("roneneldan/TinyStories", split="train[:1%]")':
                 f'load_dataset("json", data_files={str(tmp_path / "data.jsonl")!r}, split="train")',
             "capacity=16384": "capacity=256", "1 << 20": "600",
             "    train_dataset=dataset,\n": "    train_dataset=dataset,\n    args=__import__('trl').SFTConfig("
                                            "'out', use_cpu=True, bf16=False, max_steps=3, logging_steps=1, "
                                            "report_to='none', disable_tqdm=True),\n"}
    for old, new in swaps.items():
        assert old in src, old
        src = src.replace(old, new)
    (tmp_path / "run.py").write_text(src)
    repo = os.path.abspath(os.path.join(EXAMPLES, ".."))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "run.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    losses = [float(x) for x in __import__("re").findall(r"\{'loss': '([0-9.]+)'", res.stdout)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), res.stdout[-3000:]


# -- the dataset as documents (one process, no training) --------------------------------------------
def test_rows_become_documents_padding_cut_packed_rows_split_labels_kept():
    from bytescale.integrations import HFDocuments

    rows = {"input_ids": [[0, 0, 5, 6, 7], [8, 9, 10, 0], [1, 2, 3, 4, 5, 6], [0, 0]],
            "attention_mask": [[0, 0, 1, 1, 1], [1, 1, 1, 0], [1] * 6, [0, 0]],
            "labels": [[-100, -100, -100, 6, 7], [8, -100, 10, -100], [1, 2, -100, 4, 5, 6], [-100, -100]],
            "seq_lengths": [[3], [3], [2, 4], [0]]}
    docs = HFDocuments(datasets.Dataset.from_dict(rows))
    assert docs.lengths.tolist() == [3, 3, 2, 4]  # row 3 is all padding: no document
    assert [docs.tokens(i, 0, docs.length(i)).tolist() for i in range(4)] == [[5, 6, 7], [8, 9, 10], [1, 2],
                                                                             [3, 4, 5, 6]]
    assert docs.tokens(3, 1, 3).tolist() == [4, 5]
    # targets of positions 1..n-1 of each document: (6, 7), (-100, 10), (2), (4, 5, 6)
    assert docs.loss_tokens.tolist() == [2, 1, 1, 3]
    plain = HFDocuments([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])  # any sized sequence of dicts
    assert plain.lengths.tolist() == [3, 1] and plain.loss_tokens.tolist() == [2, 0] and plain.labels() is None
    with pytest.raises(ValueError, match="row 0: attention_mask has holes"):
        HFDocuments([{"input_ids": [1, 2, 3], "attention_mask": [1, 0, 1]}])
    with pytest.raises(ValueError, match="row 0: seq_lengths sum to 4, the row has 3 tokens"):
        HFDocuments([{"input_ids": [1, 2, 3], "seq_lengths": [1, 3]}])
    with pytest.raises(IndexError, match="outside document 0 of length 3"):
        plain.tokens(0, 2, 4)
