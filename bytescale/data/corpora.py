"""A real text corpus present on every machine: the installed Python packages and standard library.

Each top-level package (or single-module distribution) of site-packages, and each top-level
package or module of the standard library, becomes ONE document: its source and documentation
files concatenated in sorted path order, each preceded by a ``# file: <path>`` line. Package sizes
span five orders of magnitude (a 1 KB module to torch's tens of MB), a heavy tail like the ByteScale
paper's GitHub corpus. :func:`package_documents` gives the code-corpus layout instead: one document
per source file plus one repository-level document per package (``prepare --python-code``). Everything is deterministic for a given installation (sorted paths; package
selection in a fixed hashed order) and bounded by ``max_packages``, ``max_bytes`` and
``max_doc_bytes`` so tests stay fast.
"""
from __future__ import annotations

import hashlib
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

__all__ = ["Package", "python_packages", "package_text", "package_documents"]

SOURCE_SUFFIXES = frozenset({".py", ".pyi", ".pyx", ".pxd", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh",
                             ".md", ".rst", ".txt", ".toml", ".cfg"})
_SKIP_DIRS = frozenset({"__pycache__", ".git", "site-packages", "dist-packages", "lib-dynload", "idlelib"})
_MAX_FILE_BYTES = 1 << 20  # generated tables and vendored blobs beyond 1 MiB are skipped


@dataclass(frozen=True)
class Package:
    """One document of the corpus: a name, a root and its files (relative, sorted)."""

    name: str
    root: str
    files: Tuple[str, ...]
    size: int  # bytes on disk of its files


def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".dist-info", ".egg-info")))
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if p.suffix in SOURCE_SUFFIXES and not p.is_symlink():
                yield p


def _candidates(base: Path, prefix: str) -> List[Tuple[str, Path]]:
    """Top-level packages and modules under ``base`` (a directory listing only, no walk)."""
    out: List[Tuple[str, Path]] = []
    if not base.is_dir():
        return out
    for entry in sorted(base.iterdir()):
        name = entry.name
        if name in _SKIP_DIRS or name.startswith(".") or name.endswith((".dist-info", ".egg-info", ".pth")):
            continue
        if entry.is_dir():
            out.append((f"{prefix}:{name}", entry))
        elif entry.suffix == ".py" and entry.is_file():
            out.append((f"{prefix}:{entry.stem}", entry))
    return out


def _package(name: str, entry: Path) -> Optional[Package]:
    base = entry.parent
    if entry.is_dir():
        files = [p for p in _walk(entry) if p.stat().st_size <= _MAX_FILE_BYTES]
        if not any(p.suffix in (".py", ".pyi", ".pyx") for p in files):
            return None
    else:
        files = [entry]
    rel = tuple(str(p.relative_to(base)) for p in files)
    return Package(name, str(base), rel, sum(p.stat().st_size for p in files))


def python_packages(max_packages: Optional[int] = None, max_bytes: Optional[int] = None,
                    stdlib: bool = True, site_packages: bool = True) -> List[Package]:
    """The installed packages as documents, sorted by name.

    Args:
        max_packages: keep at most this many packages.
        max_bytes: stop adding packages once their files total this many bytes.
        stdlib, site_packages: which roots to include.

    Packages are selected in a fixed hashed order of their names (so a small selection still mixes
    small and large packages), then returned sorted by name. Only selected packages are walked.
    """
    paths = sysconfig.get_paths()
    found: List[Tuple[str, Path]] = []
    if stdlib:
        found += _candidates(Path(paths["stdlib"]), "stdlib")
    if site_packages:
        seen = set()
        # a venv made with --system-site-packages also imports the system's packages
        for r in sorted({paths["purelib"], paths["platlib"], *site.getsitepackages()}):
            for name, entry in _candidates(Path(r), "site"):
                if name not in seen:
                    seen.add(name)
                    found.append((name, entry))
    chosen: List[Package] = []
    total = 0
    for name, entry in sorted(found, key=lambda c: hashlib.blake2b(c[0].encode(), digest_size=8).digest()):
        if max_packages is not None and len(chosen) >= max_packages:
            break
        if max_bytes is not None and total >= max_bytes:
            break
        pkg = _package(name, entry)
        if pkg is not None and pkg.files:
            chosen.append(pkg)
            total += pkg.size
    if not chosen:
        raise RuntimeError(f"python_packages: no package found under {paths['stdlib']} or {paths['purelib']}")
    return sorted(chosen, key=lambda p: p.name)


def package_text(pkg: Package, max_doc_bytes: Optional[int] = None) -> str:
    """The document of a package: its files in order, each after a ``# file:`` line; files that
    are not valid UTF-8 are left out; the text is cut at a file boundary past ``max_doc_bytes``."""
    parts, size = [], 0
    for rel in pkg.files:
        try:
            raw = (Path(pkg.root) / rel).read_bytes()
            body = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        n = len(raw) + len(rel.encode()) + 10
        if max_doc_bytes is not None and parts and size + n > max_doc_bytes:
            break
        parts.append(f"# file: {rel}\n{body}\n")
        size += n
    text = "".join(parts)
    if max_doc_bytes is not None and len(text) > max_doc_bytes:  # one file larger than the cap
        text = text[:max_doc_bytes]
    return text


def package_documents(pkg: Package, max_doc_bytes: Optional[int] = None) -> Iterator[Tuple[str, str]]:
    """The code-corpus layout of a package: ``(origin, text)`` for each source file as its own
    document (after its ``# file:`` line; files that are not UTF-8 left out), then, for a package
    of more than one file, its repository-level document (:func:`package_text`, cut at
    ``max_doc_bytes``), as long-context code corpora add repository-level documents to file-level
    ones."""
    for rel in pkg.files:
        try:
            body = (Path(pkg.root) / rel).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = f"# file: {rel}\n{body}\n"
        yield f"{pkg.name}/{rel}", text[:max_doc_bytes] if max_doc_bytes is not None else text
    if len(pkg.files) > 1:
        yield f"{pkg.name} (repository)", package_text(pkg, max_doc_bytes)


if __name__ == "__main__":  # a quick look: python -m bytescale.data.corpora
    pk = python_packages()
    print(f"{len(pk)} packages, {sum(p.size for p in pk) / 1e6:.1f} MB; python {sys.version.split()[0]}")
