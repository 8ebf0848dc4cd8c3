#!/usr/bin/env bash
# Here (not on the device): cut the default model's GGUF (98 MB) into four ignored
# folders .m1 .. .m4 of ~24 MB. A carried folder does not outlive its call, but /tmp
# on the device does while the machine stays warm (~30 s idle), so three calls in
# quick succession get the whole file there (the `parts` step stashes them in /tmp):
#   run(carry=[".m1", ".m2"], command="bash benchmarks/gpu_session.sh parts")
#   run(carry=[".m3", ".m4"], command="bash benchmarks/gpu_session.sh parts")
#   run(carry=[".whl", ".ficache"], command="bash benchmarks/gpu_session.sh model")
# The `model` step checks the parts against the SHA256 before it runs anything.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(.venv/bin/python -c "from sgl.sched.models.default_model import find_gguf; print(find_gguf())")
grep -qx '/.m\*/' .git/info/exclude || echo '/.m*/' >> .git/info/exclude
rm -rf .m1 .m2 .m3 .m4 && mkdir -p .m1 .m2 .m3 .m4
tmp=$(mktemp -d)
split -n 4 -d "$gguf" "$tmp/part."
for i in 0 1 2 3; do mv "$tmp/part.0$i" ".m$((i + 1))/part.0$i"; done
rmdir "$tmp"
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .m1/SHA256
du -sh .m1 .m2 .m3 .m4
