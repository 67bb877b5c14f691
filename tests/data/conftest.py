"""Shared fixtures of the data tests: small real corpora written to disk (helpers in corpus_utils)."""
from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from corpus_utils import make_texts, write_jsonl


@pytest.fixture
def texts() -> List[str]:
    return make_texts(60, seed=1)


@pytest.fixture
def jsonl(tmp_path: Path, texts: List[str]) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", texts)
