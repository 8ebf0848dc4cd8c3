#!/usr/bin/env bash
# One call on the lent H200 (see ../shared/gpu/README.md): install the carried
# wheels, restore FlashInfer kernels built by an earlier call (.ficache), run the
# given steps, and hand the kernel cache back under $OUT for the next call.
# Usage: bash benchmarks/gpu_session.sh STEP... (jitbg tests topk w1 w12ov w1hf w2 w2hf w3 profile profile2 cascadeprof)
set -uo pipefail
eval "$(bash .whl/install-wheels.sh)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
ws=$FLASHINFER_WORKSPACE_BASE
if [ -f .ficache/cache.tar.gz ]; then mkdir -p "$ws" && tar xzf .ficache/cache.tar.gz -C "$ws" && echo "kernel cache restored"; fi
built() { find "$ws" -name '*.so' 2>/dev/null | wc -l; }
before=$(built)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    jitbg) (python3 -c "import flashinfer.sampling as s; s.get_sampling_module()" >/tmp/jit.log 2>&1; echo "sampling JIT done rc=$?" >>/tmp/jit.log) & ;;
    topk) timeout 90 python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=40 tests/test_gpu.py -k top_k 2>&1 | tail -60 ;;
    tests) timeout 420 python3 -m pytest -q -x -p no:cacheprovider -m gpu $(grep -l "pytest.mark.gpu" tests/*.py) 2>&1 | tail -30 ;;
    w1) timeout 300 python3 -m benchmarks.w1_w2_gpu --workloads W1 --no-hf 2>&1 | tail -8 ;;
    w12ov) timeout 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --overlap-off 2>&1 | grep -v "info " ;;
    w1hf) timeout 400 python3 -m benchmarks.w1_w2_gpu --workloads W1 --overlap-off 2>&1 | tail -8 ;;
    w2) timeout 400 python3 -m benchmarks.w1_w2_gpu --workloads W2 --no-hf 2>&1 | tail -8 ;;
    w2hf) timeout 500 python3 -m benchmarks.w1_w2_gpu --workloads W2 2>&1 | tail -8 ;;
    w3) timeout 300 python3 -m benchmarks.w3_shared_prefix 2>&1 | tail -8 ;;
    profile) timeout 300 python3 -m benchmarks.profile_decode 2>&1 | grep -v "info \|USDT" ;;
    cascadeprof) timeout 300 python3 -m benchmarks.profile_decode --ctx 2164 --shared 2000 --steps 10 2>&1 | grep -v "info \|USDT" ;;
    profile2) timeout 300 python3 -m benchmarks.profile_decode --temperature 0.6 --steps 10 2>&1 | grep -v "info \|USDT" | head -30 ;;
  esac
done
wait; [ -f /tmp/jit.log ] && tail -2 /tmp/jit.log
# Hand the kernel cache back only when this call built a kernel the carried one lacked.
if [ -d "$ws/.cache" ] && [ "$(built)" != "$before" ]; then tar cz -C "$ws" .cache | split -b 15M - "$OUT/ficache.part."; ls -la "$OUT"; fi
