"""Reading raw corpora: jsonl, parquet, plain text, HF datasets on disk, the python-packages corpus.

Inputs are split into *units* (a byte range of a jsonl file, a parquet row group, a few text
files, a row range of a dataset, one package): the work items of ``prepare``'s worker processes,
planned deterministically so that an interrupted run resumes unit by unit. :class:`RawCorpus`
gives random access to single records, for tokenizing on the fly in the data service.

A record is either text or an error (bad UTF-8, not JSON, missing or non-string text field, empty
document) with its origin (``file:line`` or ``file#row``) so callers log one line and skip it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Unit", "Record", "plan_units", "iter_unit", "RawCorpus", "expand_inputs", "PYPKG"]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
PYPKG = "python-packages"


@dataclass(frozen=True)
class Unit:
    """One work item: ``kind`` in jsonl/parquet/text/hf/pypkg."""

    kind: str
    path: str = ""
    start: int = 0  # jsonl: first byte; parquet: row group; hf: first row
    end: int = 0  # jsonl: end byte; hf: end row
    first_line: int = 1  # jsonl: line number of the byte at ``start``
    files: Tuple[str, ...] = ()  # text: the files (one document each)
    package: Optional[tuple] = None  # pypkg: (name, root, files)


@dataclass(frozen=True)
class Record:
    origin: str
    text: Optional[str] = None
    error: Optional[str] = None


def _is_hf_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists())


def expand_inputs(inputs: Sequence[str]) -> List[Tuple[str, Path]]:
    """(kind, path) for every input; a directory is an HF dataset or searched for data files.
    Raises FileNotFoundError naming the first missing input."""
    out: List[Tuple[str, Path]] = []
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"input {raw}: no such file or directory")
        if _is_hf_dataset(p):
            out.append(("hf", p))
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and _kind(f) is not None)
            if not files:
                raise FileNotFoundError(f"input {raw}: directory holds no .jsonl, .parquet or text file")
            out += [(_kind(f), f) for f in files]
        else:
            out.append((_kind(p) or "text", p))
    return out


def _kind(p: Path) -> Optional[str]:
    if p.suffix in JSONL_SUFFIXES:
        return "jsonl"
    if p.suffix == ".parquet":
        return "parquet"
    if p.suffix in TEXT_SUFFIXES:
        return "text"
    return None


def _need(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise RuntimeError(f"{what} needs the '{module.split('.')[0]}' package (pip install {module.split('.')[0]})") from e


def _load_hf(path: Path):
    datasets = _need("datasets", f"input {path} (an HF dataset saved on disk)")
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        raise RuntimeError(f"input {path}: a DatasetDict ({sorted(ds)}); pass one split's directory, e.g. {path}/train")
    return ds


def plan_units(inputs: Sequence[str], text_field: str = "text", unit_bytes: int = 32 << 20,
               packages: Sequence = (), code_layout: bool = False) -> List[Unit]:
    """Split inputs into units, deterministically (file order as given, directories sorted).
    ``code_layout``: packages as files plus repository documents (:func:`.corpora.package_documents`)."""
    units: List[Unit] = []
    text_batch: List[str] = []
    text_size = 0

    def flush_text() -> None:
        nonlocal text_batch, text_size
        if text_batch:
            units.append(Unit("text", files=tuple(text_batch)))
        text_batch, text_size = [], 0

    for kind, p in expand_inputs(inputs):
        if kind != "text":
            flush_text()
        if kind == "jsonl":
            units += _jsonl_units(p, unit_bytes)
        elif kind == "parquet":
            pq = _need("pyarrow.parquet", f"input {p} (parquet)")
            f = pq.ParquetFile(str(p))
            if text_field not in f.schema_arrow.names:
                raise RuntimeError(f"input {p}: no column {text_field!r} (columns: {f.schema_arrow.names}); use --text-field")
            units += [Unit("parquet", str(p), g) for g in range(f.num_row_groups)]
        elif kind == "hf":
            ds = _load_hf(p)
            if text_field not in ds.column_names:
                raise RuntimeError(f"input {p}: no column {text_field!r} (columns: {ds.column_names}); use --text-field")
            step = 4096
            units += [Unit("hf", str(p), a, min(a + step, len(ds))) for a in range(0, len(ds), step)]
        else:
            text_batch.append(str(p))
            text_size += p.stat().st_size
            if text_size >= unit_bytes:
                flush_text()
    flush_text()
    kind = "pycode" if code_layout else "pypkg"
    units += [Unit(kind, package=(pk.name, pk.root, tuple(pk.files))) for pk in packages]
    return units


def _jsonl_units(p: Path, unit_bytes: int) -> List[Unit]:
    """Byte ranges starting at line starts, with the line number of each start."""
    size = p.stat().st_size
    units: List[Unit] = []
    start, line = 0, 1
    with open(p, "rb") as f:
        while start < size:
            target = min(start + unit_bytes, size)
            f.seek(target)
            f.readline()  # move to the next line start
            end = min(f.tell(), size) if target < size else size
            f.seek(start)
            remaining, newlines = end - start, 0
            while remaining > 0:
                block = f.read(min(remaining, 1 << 24))
                newlines += block.count(b"\n")
                remaining -= len(block)
            units.append(Unit("jsonl", str(p), start, end, line))
            start, line = end, line + newlines
    return units


def _json_record(origin: str, raw: bytes, field: str) -> Record:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Record(origin, error=f"bad UTF-8 at byte {e.start}")
    try:
        obj = json.loads(text)
    except ValueError as e:
        return Record(origin, error=f"not JSON ({e})")
    return _field(origin, obj, field)


def _field(origin: str, obj, field: str) -> Record:
    if not isinstance(obj, dict) or field not in obj or obj[field] is None:
        return Record(origin, error=f"missing text field {field!r}")
    text = obj[field]
    if not isinstance(text, str):
        return Record(origin, error=f"text field {field!r} is a {type(text).__name__}, not a string")
    return _text(origin, text)


def _text(origin: str, text: str) -> Record:
    if not text.strip():
        return Record(origin, error="empty document")
    return Record(origin, text=text)


def _text_file(path: str) -> Record:
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        return Record(path, error=f"unreadable ({e.strerror})")
    try:
        return _text(path, raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Record(path, error=f"bad UTF-8 at byte {e.start}")


def iter_unit(unit: Unit, text_field: str = "text", max_doc_bytes: Optional[int] = None) -> Iterator[Record]:
    """The records of one unit, in order (blank jsonl lines are not records)."""
    if unit.kind == "jsonl":
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            line, pos = unit.first_line, unit.start
            while pos < unit.end:
                raw = f.readline()
                if not raw:
                    break
                pos += len(raw)
                if raw.strip():
                    yield _json_record(f"{unit.path}:{line}", raw, text_field)
                line += 1
    elif unit.kind == "text":
        for path in unit.files:
            yield _text_file(path)
    elif unit.kind == "parquet":
        pq = _need("pyarrow.parquet", "parquet input")
        f = pq.ParquetFile(unit.path)
        first = sum(f.metadata.row_group(g).num_rows for g in range(unit.start))
        col = f.read_row_group(unit.start, columns=[text_field]).column(0).to_pylist()
        for i, text in enumerate(col):
            yield _field(f"{unit.path}#{first + i}", {text_field: text}, text_field)
    elif unit.kind == "hf":
        col = _load_hf(Path(unit.path))[unit.start:unit.end][text_field]
        for i, text in enumerate(col):
            yield _field(f"{unit.path}#{unit.start + i}", {text_field: text}, text_field)
    elif unit.kind == "pypkg":
        from .corpora import Package, package_text

        name, root, files = unit.package
        yield _text(f"{PYPKG}:{name}", package_text(Package(name, root, tuple(files), 0), max_doc_bytes))
    elif unit.kind == "pycode":
        from .corpora import Package, package_documents

        name, root, files = unit.package
        for origin, text in package_documents(Package(name, root, tuple(files), 0), max_doc_bytes):
            yield _text(f"{PYPKG}:{origin}", text)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")


class RawCorpus:
    """Random access to the records of raw inputs (for tokenizing on the fly).

    Document ``i`` is the i-th record in input order (blank jsonl lines excluded). Building the
    index reads each jsonl file once (8 + 8 bytes per line); parquet and HF datasets need only
    their row counts; a text file is one document; a python package is one document.
    """

    def __init__(self, inputs: Sequence[str] = (), text_field: str = "text", packages: Sequence = (),
                 max_doc_bytes: Optional[int] = None) -> None:
        self.text_field = text_field
        self.max_doc_bytes = max_doc_bytes
        self._parts: List[Tuple[str, str, object, int]] = []  # kind, path, payload, count
        for kind, p in expand_inputs(inputs):
            if kind == "jsonl":
                offs, lines = _line_index(p)
                self._parts.append((kind, str(p), (offs, lines), len(offs)))
            elif kind == "parquet":
                pq = _need("pyarrow.parquet", f"input {p} (parquet)")
                f = pq.ParquetFile(str(p))
                if text_field not in f.schema_arrow.names:
                    raise RuntimeError(f"input {p}: no column {text_field!r} (columns: {f.schema_arrow.names})")
                self._parts.append((kind, str(p), None, f.metadata.num_rows))
            elif kind == "hf":
                ds = _load_hf(p)
                if text_field not in ds.column_names:
                    raise RuntimeError(f"input {p}: no column {text_field!r} (columns: {ds.column_names})")
                self._parts.append((kind, str(p), None, len(ds)))
            else:
                self._parts.append((kind, str(p), None, 1))
        for pk in packages:
            self._parts.append(("pypkg", pk.name, pk, 1))
        self._bounds = np.cumsum([0] + [c for *_, c in self._parts]).astype(np.int64)
        self._cache: dict = {}

    def __len__(self) -> int:
        return int(self._bounds[-1])

    def record(self, i: int) -> Record:
        if not 0 <= i < len(self):
            raise IndexError(f"RawCorpus: record {i} out of range [0, {len(self)})")
        part = int(np.searchsorted(self._bounds, i, side="right")) - 1
        kind, path, payload, _ = self._parts[part]
        j = i - int(self._bounds[part])
        if kind == "jsonl":
            offs, lines = payload
            with open(path, "rb") as f:
                f.seek(int(offs[j]))
                return _json_record(f"{path}:{int(lines[j])}", f.readline(), self.text_field)
        if kind == "text":
            return _text_file(path)
        if kind == "pypkg":
            from .corpora import package_text

            return _text(f"{PYPKG}:{payload.name}", package_text(payload, self.max_doc_bytes))
        if kind == "parquet":
            if path not in self._cache:
                self._cache[path] = _need("pyarrow.parquet", "parquet input").read_table(path, columns=[self.text_field]).column(0)
            return _field(f"{path}#{j}", {self.text_field: self._cache[path][j].as_py()}, self.text_field)
        if path not in self._cache:
            self._cache[path] = _load_hf(Path(path))
        return _field(f"{path}#{j}", {self.text_field: self._cache[path][j][self.text_field]}, self.text_field)


def _line_index(p: Path) -> Tuple[np.ndarray, np.ndarray]:
    """Start offsets and 1-based line numbers of the non-blank lines of a file."""
    offs: List[np.ndarray] = []
    lines: List[np.ndarray] = []
    size = os.path.getsize(p)
    if size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    mm = np.memmap(p, dtype=np.uint8, mode="r")
    nl = np.flatnonzero(mm == 10).astype(np.int64)
    starts = np.concatenate([[0], nl + 1])
    starts = starts[starts < size]
    ends = np.concatenate([nl, [size]])[:len(starts)]
    numbers = np.arange(1, len(starts) + 1, dtype=np.int64)
    # blank (whitespace only, like bytes.strip()): only lines starting with whitespace can be
    blank = np.zeros(len(starts), dtype=bool)
    first = mm[np.minimum(starts, size - 1)]
    cand = np.isin(first, np.frombuffer(b" \t\n\r\x0b\x0c", np.uint8))
    for k in np.flatnonzero(cand):
        blank[k] = not bytes(mm[starts[k]:ends[k]]).strip()
    offs.append(starts[~blank])
    lines.append(numbers[~blank])
    del mm
    return offs[0], lines[0]
