"""The package's version, in one place for every layer (`sgl.__version__`, `sgl
--version`, the HTTP server's /version). Bottom layer: imports nothing."""

from __future__ import annotations

__version__ = "0.1.0"  # keep equal to pyproject.toml's version
