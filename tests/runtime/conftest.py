"""Lets the tests of this folder import the shared helpers in tests/ (dist_utils)."""
import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
