"""bytescale: hybrid data parallelism for long-context training on PyTorch."""
from __future__ import annotations

__version__ = "0.1.0"
