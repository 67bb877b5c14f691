"""setup.py's build command (``build_ext_class``: torch's BuildExtension and ninja) builds once:
an unchanged tree compiles and links nothing and leaves the library alone, a changed source
recompiles that source only, a changed header recompiles the sources that include it, and a
temporary build directory (what ``pip install -e .`` passes on every run) is replaced by the
tree's own, so ninja finds the earlier objects. A small plain C++ extension in a temporary project
is built with setup.py's own class, so each build takes seconds."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SETUP = """
import importlib.util
from pathlib import Path
from setuptools import Extension, setup

spec = importlib.util.spec_from_file_location("bytescale_setup", {setup!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
setup(name="demo", version="0", packages=["demo"],
      ext_modules=[Extension("demo._x", ["src/a.cpp", "src/b.cpp"], include_dirs=["src"],
                             extra_compile_args=["-O1"])],
      cmdclass={{"build_ext": mod.build_ext_class(Path(__file__).resolve().parent)}})
"""


def _project(d: Path) -> Path:
    (d / "demo").mkdir(parents=True)
    (d / "demo" / "__init__.py").write_text("")
    (d / "src").mkdir()
    (d / "src" / "a.h").write_text("#pragma once\nconstexpr int kA = 1;\n")
    (d / "src" / "a.cpp").write_text('#include "a.h"\nint a_value() { return kA; }\n')
    (d / "src" / "b.cpp").write_text("int b_value() { return 2; }\n")
    (d / "setup.py").write_text(SETUP.format(setup=str(ROOT / "setup.py")))
    return d


def _build(d: Path, *extra: str) -> str:
    env = dict(os.environ, MAX_JOBS="2")
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", *extra], cwd=d, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def _compiled(log: str) -> list:
    """The sources ninja compiled, from its ``[i/n] ... -c SRC`` lines."""
    return sorted(Path(m).name for m in re.findall(r"^\[\d+/\d+\] .* -c (\S+\.cpp)", log, flags=re.M))


def _touch_later(path: Path, text: str) -> None:
    """Rewrites ``path`` with a modification time strictly after everything built so far."""
    time.sleep(1.1)  # ninja and distutils compare mtimes; some filesystems keep whole seconds
    path.write_text(text)


def test_builds_once_and_recompiles_only_what_changed(tmp_path):
    d = _project(tmp_path)
    log = _build(d)
    assert _compiled(log) == ["a.cpp", "b.cpp"], log[-2000:]
    lib = next((d / "demo").glob("_x*.so"))
    first = lib.stat().st_mtime_ns

    log = _build(d)  # nothing changed: no compile, no link, the library is not rewritten
    assert _compiled(log) == [] and "ninja: no work to do" in log, log[-2000:]
    assert lib.stat().st_mtime_ns == first
    assert "-shared" not in log and "copying" not in log, log[-2000:]

    _touch_later(d / "src" / "b.cpp", "int b_value() { return 3; }\n")
    log = _build(d)
    assert _compiled(log) == ["b.cpp"], log[-2000:]
    assert lib.stat().st_mtime_ns > first  # relinked and copied into the package
    second = lib.stat().st_mtime_ns

    _touch_later(d / "src" / "a.h", "#pragma once\nconstexpr int kA = 5;\n")
    log = _build(d)
    assert _compiled(log) == ["a.cpp"], log[-2000:]
    assert lib.stat().st_mtime_ns > second


def test_a_temporary_build_directory_is_replaced_by_the_trees(tmp_path):
    """pip install -e (setuptools' editable_wheel) passes a new temporary build_temp every run; the
    build goes to the tree's build/temp.* instead, where the earlier objects are."""
    d = _project(tmp_path / "proj")
    assert _compiled(_build(d)) == ["a.cpp", "b.cpp"]
    temp = tmp_path / "pip-tmp.build-temp"
    log = _build(d, "--build-temp", str(temp))
    assert _compiled(log) == [] and "ninja: no work to do" in log, log[-2000:]
    assert not (temp / "build.ninja").exists()
    assert list((d / "build").glob("temp.*/build.ninja"))


def test_changed_link_inputs_relink(tmp_path):
    """A source dropped from the extension changes no object, yet the library must be relinked."""
    d = _project(tmp_path)
    _build(d)
    lib = next((d / "demo").glob("_x*.so"))
    before = lib.stat().st_mtime_ns
    time.sleep(1.1)
    (d / "setup.py").write_text((d / "setup.py").read_text().replace('["src/a.cpp", "src/b.cpp"]', '["src/a.cpp"]'))
    log = _build(d)
    assert _compiled(log) == [] and lib.stat().st_mtime_ns > before, log[-2000:]
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    if nm.returncode == 0:  # binutils present: the dropped source's symbol is gone
        assert "b_value" not in nm.stdout and "a_value" in nm.stdout


def test_release_flags_leave_out_debug_info():
    """Python's CFLAGS carry -g (objects ~16x larger, compiles ~30% slower with torch's headers);
    release builds append -g0 after them, BYTESCALE_DEBUG=1 builds keep -g."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('s', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "e = m.build_extension(); print(repr(e.extra_compile_args))")
    for debug, want in (("0", True), ("1", False)):
        env = dict(os.environ, BYTESCALE_DEBUG=debug, BYTESCALE_NO_CUDA="1")
        p = subprocess.run([sys.executable, "-c", code, str(ROOT / "setup.py")], env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert ("-g0" in p.stdout) == want, (debug, p.stdout)
