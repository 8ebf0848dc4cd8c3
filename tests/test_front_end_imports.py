"""The caller's side imports neither torch nor transformers: in a fresh process, every
name `sgl` exports (the engines, the attached engine, the client, the custom logit
processor base), the HTTP server and the CLI. Only the roles that run a model or a
tokenizer import them."""

from __future__ import annotations

import json
import subprocess
import sys

FRONT_END = """
import json, sys
import sgl
for name in sgl.__all__:
    getattr(sgl, name)
import sgl.cli, sgl.server.app, sgl.server.serve
print(json.dumps([m for m in ("torch", "transformers") if m in sys.modules]))
"""


def test_the_front_end_imports_no_torch_and_no_transformers() -> None:
    run = subprocess.run([sys.executable, "-c", FRONT_END], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []
