#!/usr/bin/env bash
# Here (not on the GPU host): cut the default model's GGUF (98 MB) into four ignored
# folders .m1 .. .m4 of ~24 MB, for a runner that brings at most 64 MiB of folders along
# per command. The folders brought along do not outlive their run, but /tmp on the host
# does while it stays warm, so three runs in quick succession get the whole file there
# (the `parts` step stashes each pair in /tmp):
#   with .m1 and .m2 brought along:        bash benchmarks/gpu/run.sh parts
#   with .m3 and .m4 brought along:        bash benchmarks/gpu/run.sh parts
#   with .whl and .ficache brought along:  bash benchmarks/gpu/run.sh model
# The `model` step checks the parts against the SHA256 before it runs anything.
set -euo pipefail
cd "$(dirname "$0")/../.."
gguf=$(.venv/bin/python -c "from sgl.sched.models.default_model import find_gguf; print(find_gguf())")
rm -rf .m1 .m2 .m3 .m4 && mkdir -p .m1 .m2 .m3 .m4
tmp=$(mktemp -d)
split -n 4 -d "$gguf" "$tmp/part."
for i in 0 1 2 3; do mv "$tmp/part.0$i" ".m$((i + 1))/part.0$i"; done
rmdir "$tmp"
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .m1/SHA256
du -sh .m1 .m2 .m3 .m4
