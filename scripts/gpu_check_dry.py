"""The dry run's Python checks for scripts/gpu_check.sh, in ONE interpreter (torch is imported once
instead of once per check: the dry run runs in CI on every change).

Input: a file of tab-separated checks, one per line, ``STAGE NAME KIND ARG...``:
  script PATH      the script answers ``--help`` (run as ``__main__``, exit status 0)
  module MODULE    ``python -m MODULE --help`` does
  train ARGS...    the training entry point's own option parser accepts ARGS
Prints one ``dry run: NAME: ...`` line per check (the error's tail when it fails) and one
``failed-stage STAGE`` line per stage with a failed check; exits 1 if any check failed.
"""
from __future__ import annotations

import contextlib
import io
import runpy
import sys
import traceback


def _exit_status(run, argv: list[str]) -> tuple[int, str]:
    """Runs ``run()`` with ``sys.argv = argv``; its exit status and what it wrote to stderr."""
    err = io.StringIO()
    saved = sys.argv[:]
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                run()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - any failure of the checked code is reported
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved
    return code, err.getvalue()


def main(path: str) -> int:
    failed_stages: list[str] = []
    for line in open(path):
        fields = line.rstrip("\n").split("\t")
        if len(fields) < 4:
            continue
        stage, name, kind, args = fields[0], fields[1], fields[2], [a for a in fields[3:] if a != ""]
        if kind == "script":
            code, err = _exit_status(lambda: runpy.run_path(args[0], run_name="__main__"), [args[0], "--help"])
            what = f"{args[0]} --help"
        elif kind == "module":
            code, err = _exit_status(lambda: runpy.run_module(args[0], run_name="__main__", alter_sys=True),
                                     [args[0], "--help"])
            what = f"-m {args[0]} --help"
        elif kind == "train":
            from bytescale.train.config import parse_args

            code, err = _exit_status(lambda: parse_args(args), ["bytescale.train", *args])
            what = "bytescale.train options"
        else:
            code, err, what = 1, f"unknown check kind {kind!r}", kind
        if code == 0:
            print(f"dry run: {name}: {what} ok")
        else:
            print(f"dry run: {name}: {what} failed (exit status {code}):")
            print("\n".join(err.strip().splitlines()[-5:]))
            if stage not in failed_stages:
                failed_stages.append(stage)
    for s in failed_stages:
        print(f"failed-stage {s}")
    return 1 if failed_stages else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
