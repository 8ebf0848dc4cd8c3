#!/usr/bin/env bash
# Fill .whl/ with what the offline GPU host lacks for this engine, on a machine with
# package access (run from the repository root; .whl/ is ignored): FlashInfer's two wheels
# through ../shared/gpu/fetch-wheels.sh, its install script, and the pure dependencies the
# GPU host does not have (msgspec, structlog, pyzmq, gguf, prometheus_client: without them
# `import sgl` fails there; xgrammar and pydantic's wheels: without them every grammar
# request is refused there; uvicorn, starlette, h11, httptools and uvloop for `sgl serve`
# (step w8); py-spy for the *spy steps; watchfiles, model-hosting-container-standards and
# jmespath, which vLLM's OpenAI server imports at start and the vLLM peer's bundle lacks
# (steps vllmw8, vllmspec; its uvicorn, httptools included, is ours too).
# benchmarks/gpu/run.sh installs them all into /tmp/site.
set -euo pipefail
bash ../shared/gpu/fetch-wheels.sh .whl
cp ../shared/gpu/install-wheels.sh .whl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl msgspec structlog pyzmq gguf prometheus_client \
  xgrammar==0.2.9 pydantic pydantic-core annotated-types typing-inspection py-spy uvicorn starlette h11 \
  httptools uvloop watchfiles model-hosting-container-standards jmespath
ls .whl
