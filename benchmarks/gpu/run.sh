#!/usr/bin/env bash
# Drive an offline GPU host (no network): install the wheels brought along in .whl/,
# install the FlashInfer kernels built on an earlier run (.ficache/) as AOT modules, run
# the given steps, and leave the kernel cache in the output folder when this run built
# modules the brought-along cache lacked. benchmarks/gpu/README.md describes the set-up.
#
#   bash benchmarks/gpu/run.sh STEP...        # from the repository root, on the GPU host
#
# The output folder is SGL_GPU_OUT, else OUT, else /tmp: log.txt there gets everything
# printed, as it is printed, so a run cut short still shows what it did.
# GPU_BUDGET_S (default 540) bounds the whole run: each step gets what is left, capped by
# its own limit, and a step that no longer fits is skipped and says so.
#
# Steps (each is one case below; the comment beside it says what it measures):
#   set-up      jit tests beamtests cpuinfo parts
#   control     control control8b (memory release and resume, weight updates)
#   workloads   w1 w2 w12ov w12mixed w1hf w2hf w3 w3c16k w3rep w7 w7fp8 w6 w8 tp startup looplag priority
#   A/B         old w3old w7old w7fp8old w8old specold speccostold grammar06old grammarw2old tcab tritonab fp8 (engines in turn, see README.md)
#   structured  grammar grammar06 grammarw2 grammartimeline grammarthreads
#   profiles    fp8gemm prefillcost prefillcostold streamgaps profile profile2 cascadeprof prof1 prof2 prof3 prof8b vllmprof8b vllmprof2
#               decodebal drawcost
#   py-spy      w3spy w3oldspy startupspy grammarspy gapsspy w8spy specspy (py-spy's wheel in .whl/)
#   real model  model fp8acc smolhf spec (SmolLM2's GGUF, brought in parts: benchmarks/gpu/model_parts.sh)
#   vLLM        vllm vllm8b vllm8bfp8 vllmfp8 vllmw8 vllmspec (the vLLM peer's parts unpacked in /tmp: ../shared/peers/vllm)
#   LoRA        lorakernels lora vllmlora (the kernels; multi-LoRA throughput: sgl, then the vLLM peer)
#
# Notes on the host:
# - It lacks msgspec, structlog, pyzmq, gguf and prometheus_client: without their wheels in
#   .whl/ (benchmarks/gpu/wheels.sh) the editable install "succeeds" and every step then dies
#   on `import sgl`.
# - On a host still warm from an earlier run, .whl/ and .ficache/ may be left out: what the
#   first run installed under /tmp (wheels, kernels) is used again. A fresh host has neither.
# - Never pipe a step into `tail`: tail prints nothing until its input ends, so a step killed
#   at its limit shows nothing at all. And a command that pipes this script's output returns
#   only when every process holding the pipe has ended (see stacks_after).
# - Built kernels are installed as FlashInfer AOT modules: those brought along, at the start,
#   and those step `jit` builds, right after it. Restored as a JIT cache they are not enough:
#   FlashInfer runs ninja on every load, and the fresh wheel install makes its headers newer
#   than the cached objects, so ninja rebuilds (decode ~10 s, each prefill module ~90 s,
#   sampling ~100 s).
# - The first engine on a fresh host compiles Triton kernels inside its timed runs: its
#   grammar06 ratio came out 0.1-0.2 under the next run's. Run an A/B as base, change, base,
#   change and compare the later pairs.
# - To see what sets a step's time, put it on a timeline (grammartimeline) before guessing
#   from per-phase sums.
set -uo pipefail
results=${SGL_GPU_OUT:-${OUT:-/tmp}}  # the output folder
log=$results/log.txt
exec > >(tee -a "$log") 2>&1
budget=${GPU_BUDGET_S:-540}
if [ -f .whl/install-wheels.sh ]; then
  eval "$(bash .whl/install-wheels.sh)"
else  # a warm host: the first run's /tmp/site
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
  [ -d /tmp/site/flashinfer ] || echo "no .whl/ brought along and no /tmp/site: nothing of sgl will import"
fi
export PATH=/tmp/site/bin:$PATH
# Bytecode cached across processes: the host's site-packages is not writable, so without
# this every process compiles transformers' modules again (py-spy: about 8 s of each start).
# A user's install has its .pyc files; so do these runs from the second process on.
export PYTHONPYCACHEPREFIX=/tmp/pycache
# The host image sets PYTHONDONTWRITEBYTECODE, which leaves that cache empty (py-spy showed
# every process compiling its sources); the line below says what it was and how full the
# cache is, and the variable is then unset.
echo "bytecode: PYTHONDONTWRITEBYTECODE='${PYTHONDONTWRITEBYTECODE-<unset>}', $(find /tmp/pycache -name '*.pyc' 2>/dev/null | wc -l) cached"
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
ws=$FLASHINFER_WORKSPACE_BASE
# The kernels travel as .so files alone in an xz tar, through Python's tarfile (the host may
# lack an xz binary).
if [ -f .ficache/kernels.tar.xz ]; then
  mkdir -p "$ws" && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    .ficache/kernels.tar.xz "$ws"
fi
aot=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)")
# install_aot: every module built in the workspace installed as AOT, which FlashInfer loads
# without running ninja (a JIT load runs ninja in the module's own build folder, which lacks
# the log of `jit`'s combined build, and a test then spent minutes in it at its first plan).
install_aot() {
  local n=0 so uri
  for so in "$ws"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    [ -f "$so" ] || continue
    uri=$(basename "$(dirname "$so")")
    [ "$(basename "$so" .so)" = "$uri" ] || continue
    mkdir -p "$aot/$uri" && cp "$so" "$aot/$uri/" && n=$((n + 1))
  done
  echo "kernel cache: $n modules installed as AOT in $aot"
}
install_aot
built() { find "$ws" -name '*.so' 2>/dev/null | wc -l; }
before=$(built)
# save_cache: the built modules into the output folder when there are some the brought-along
# ones lacked (after `jit`, and at the end), so that a run cut short still gives them back.
# Only the .so files (install_aot's input): 15 modules come to 14 MB at xz's fastest preset
# (3 s), where the whole cache with its objects took 38 MB gzipped.
save_cache() {
  if [ -d "$ws/.cache" ] && [ "$(built)" != "$before" ]; then
    (cd "$ws" && python3 -c "
import pathlib, sys, tarfile
with tarfile.open(sys.argv[1], 'w:xz', preset=1) as tf:
    for so in sorted(pathlib.Path('.cache').glob('**/*.so')):
        tf.add(so)" "$results/kernels.tar.xz")
    before=$(built)
    echo "kernel cache grew: $results/kernels.tar.xz -> .ficache/kernels.tar.xz"
  fi
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

# run LIMIT CMD...: CMD under the smaller of LIMIT and the budget left, output unfiltered but for info logs.
# A step still running 10 s before its limit first has the stacks of every Python process
# printed (py-spy dump, threads included), so a step that hangs says where it waits.
run() {
  local cap=$1 left=$((budget - SECONDS)); shift
  if [ "$left" -lt 20 ]; then echo "skipped: ${left}s of the budget left"; return; fi
  [ "$cap" -lt "$left" ] || cap=$left
  stacks_after $((cap - 10)) &
  local spy=$!
  timeout -k 5 "$cap" "$@" 2>&1 | grep --line-buffered -v "info \|USDT"
  local rc=${PIPESTATUS[0]}
  kill "$spy" 2>/dev/null
  [ "$rc" = 124 ] && echo "timed out after ${cap}s"
  return "$rc"  # never the status of the test above: `run A && run B` skipped B when A passed
}
python_procs='^[^ ]*python[0-9.]* '  # pgrep -f: the host's Python processes (each step's, none of run.sh's)
stacks_after() {
  # The sleep is a child of its own: `kill` of this subshell alone would leave it running,
  # holding the run's output open until it ended, so a piped run whose steps end early
  # would still return only after each step's whole cap.
  sleep "$1" & local nap=$!
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  wait "$nap" || return 0
  echo "--- still running after ${1}s: every Python process's stacks"
  command -v py-spy >/dev/null || { echo "(no py-spy: bring its wheel in .whl/)"; return; }
  for p in $(pgrep -f "$python_procs"); do
    echo "--- pid $p: $(tr '\0' ' ' < /proc/"$p"/cmdline 2>/dev/null | cut -c1-120)"
    timeout 10 py-spy dump --pid "$p" 2>&1 | head -80
  done
}
# Model parts brought along (benchmarks/gpu/model_parts.sh) go to /tmp, which outlives the
# run while the host stays warm; the brought-along folders do not.
# old_site BENCHMARKS: install the checkout brought along in .old/ into /tmp/oldsite and put the
# benchmark folder BENCHMARKS (its own, or this checkout's) alone in /tmp/oldrun: run from
# there, since a checkout's own sgl/ folder on the path (python -m puts the cwd first) would
# shadow the installed package. False (and says so) when .old is missing or fails to install.
old_site() {
  if [ -d .old ] && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite .old \
      >/dev/null 2>&1; then
    rm -rf /tmp/oldrun && mkdir -p /tmp/oldrun && cp -r "$1" /tmp/oldrun/benchmarks
    return 0
  fi
  echo "no .old/ checkout brought along, or it failed to install"
  return 1
}
stash_parts() { mkdir -p /tmp/sgl-parts && cp .m?/* /tmp/sgl-parts/ 2>/dev/null; }
# smollm2_gguf: the default model's GGUF put together in /tmp from the stashed parts and checked
# against their SHA256; sets $gguf. False (and says so) when parts are missing or damaged.
smollm2_gguf() {
  stash_parts
  gguf=/tmp/$(cut -d' ' -f3 /tmp/sgl-parts/SHA256 2>/dev/null)
  cat /tmp/sgl-parts/part.* > "$gguf" 2>/dev/null
  if ! (cd /tmp && sha256sum -c --quiet /tmp/sgl-parts/SHA256); then
    echo "model parts missing or damaged: $(ls /tmp/sgl-parts | tr '\n' ' ')(the host went cold between runs?)"
    return 1
  fi
}
# w8_model: the model folder of the W8 steps ($dir), the tokenizer flag ($tok) and the
# workloads ($wl): the Qwen3-0.6B architecture (dummy weights) with the default model's
# tokenizer when .lt is brought along, both workloads; else no tokenizer and w2 alone. Also
# sgl's server command ($sgl_server, with W8_SERVER_ARGS) and the sweep ($w8_sweep: W8_ARGS,
# else the full one).
w8_model() {
  dir=$(python3 -c "from benchmarks.common import dummy_model_dir as d; print(d())")
  tok=--skip-tokenizer-init; wl=w2
  if [ -d .lt ]; then
    dir=$(python3 -c "from benchmarks.common import with_architecture as w; print(w('.lt', 'qwen3-0.6b'))")
    tok=; wl=w2,chat
  fi
  sgl_server="python3 -m sgl.launch_server $dir --load-format dummy $tok --host 127.0.0.1 --port 30000 --random-seed 0 ${W8_SERVER_ARGS:-}"
  w8_sweep=${W8_ARGS:---requests 64 --saturation-requests 256 --rates 4,8,16,32,64,inf --concurrency 1,4,16,64}
}
# vllm_env: the vLLM peer unpacked (its parts in /tmp, ../shared/peers/vllm/README.md): unpack.sh's
# exports put its site first on PYTHONPATH, before /tmp/site (the wheels of .whl/), so vLLM's
# own pydantic, starlette, fastapi and xgrammar win, and what its bundle leaves out for the
# OpenAI server (uvicorn, watchfiles, model_hosting_container_standards, jmespath) comes from
# /tmp/site; the line printed says where each comes from. The environment of the vLLM
# benchmarks (benchmarks/vllm_beam.py ENGINE_ENV) is set where unset. Call it in a subshell:
# it changes the environment. False (and says so) when the peer is not ready.
vllm_env() {
  local exports rc kv name
  exports=$(bash .peer/vllm/kit/unpack.sh .peer/vllm); rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then  # 5: an import check failed; the server then shows the real error
    echo "the vLLM peer is not ready (unpack.sh exit $rc): bring its parts first (../shared/peers/vllm/README.md)"
    return 1
  fi
  eval "$exports"
  for kv in $(python3 -c "from benchmarks.vllm_beam import ENGINE_ENV as e; print(*(f'{k}={v}' for k, v in e.items()))"); do
    name=${kv%%=*}
    [ -n "${!name:-}" ] || export "$kv"
  done
  python3 - <<'PY'
import importlib.util

names = ("vllm", "pydantic", "starlette", "fastapi", "uvicorn", "h11", "watchfiles",
         "model_hosting_container_standards", "jmespath", "numba")
found = [(n, importlib.util.find_spec(n)) for n in names]
print("vLLM server imports:", ", ".join(
    f"{n} {(s.origin or '').rsplit('/' + n, 1)[0] if s else 'MISSING'}" for n, s in found))
PY
}
# spec_plots: the speculative-decoding runs there are (steps spec, vllmspec) drawn together in spec/.
spec_plots() {
  local files=() f
  for f in sgl_off sgl_on vllm_off vllm_on; do
    [ -f "$results/w8_spec_$f.json" ] && files+=("$results/w8_spec_$f.json")
  done
  [ ${#files[@]} = 0 ] || python3 -m benchmarks.w8_online --plot "${files[@]}" --out "$results/spec"
}
# leftovers: Python processes alive between steps (a step's engines or servers that outlived
# it), with their CPU use: they take the host's cores from the next step's timings.
leftovers() {
  local pids
  pids=$(pgrep -d, -f "$python_procs") || return 0
  echo "still running before this step:"
  ps -o pid,pcpu,etime,args -p "$pids" | cut -c1-160
}
for step in "$@"; do
  echo "=== $step ($(date +%T), ${SECONDS}s into the run)"
  leftovers
  case $step in
    # Every FlashInfer module, built in parallel, skipped when installed (benchmarks/build_kernels.py).
    jit) run 420 python3 -m benchmarks.build_kernels; install_aot; save_cache ;;
    # The GPU tests (-m gpu) of every file that has some; GPU_TESTS names some files only.
    # ninja's commands are printed (FLASHINFER_JIT_VERBOSE): a module the tests build at first
    # use (one build_kernels lacks) is named in the log.
    tests) FLASHINFER_JIT_VERBOSE=1 run 400 python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=120 -m gpu \
             ${GPU_TESTS:-$(grep -l "pytest.mark.gpu" tests/*.py)} ;;
    # W1/W2 (benchmarks/w1_w2_gpu.py); w12ov adds each without the overlap loop, w1hf and w2hf
    # add Hugging Face's generate in the same run.
    w1) run 300 python3 -m benchmarks.w1_w2_gpu --workloads W1 --no-hf ;;
    # The control plane (benchmarks/control_gpu.py): memory release/resume as another process
    # sees it, W1 before and after, weight updates from a trainer's CUDA tensors (GB/s).
    control) run 300 python3 -m benchmarks.control_gpu ;;
    control8b) run 400 python3 -m benchmarks.control_gpu --config qwen3-8b --requests 64 --mem-fraction 0.6 ;;
    w12ov) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --overlap-off ;;
    # w12mixed: W2 and W1 with and without mixed forwards (enable_mixed_chunk), in turn, twice.
    w12mixed) run 500 python3 -m benchmarks.w1_w2_gpu --workloads W2,W1 --no-hf --variant '{}' \
                --variant '{"enable_mixed_chunk": true}' --variant '{}' --variant '{"enable_mixed_chunk": true}' ;;
    w1hf) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1 --overlap-off ;;
    w2) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W2 --no-hf ;;
    w2hf) run 500 python3 -m benchmarks.w1_w2_gpu --workloads W2 ;;
    # W3 (benchmarks/w3_shared_prefix.py): cascade, radix cache without cascade, no radix cache;
    # w3c16k with 16,384-token prefill chunks; w3rep W3_REPEAT (5) timed runs each, medians;
    # w3spy the cascade engine's 5 runs under py-spy (folded stacks in the output folder);
    # w3old the same 5 runs on the checkout in .old/ (see `old`), w3oldspy under py-spy.
    w3) run 400 python3 -m benchmarks.w3_shared_prefix ;;
    w3c16k) run 400 python3 -m benchmarks.w3_shared_prefix --chunked-prefill-size 16384 ;;
    w3rep) run 400 python3 -m benchmarks.w3_shared_prefix --repeat ${W3_REPEAT:-5} ;;
    w3spy) run 200 py-spy record -r 400 --nonblocking --subprocesses --format raw -o "$results/w3spy.txt" -- \
             python3 -m benchmarks.w3_shared_prefix --variants cascade --repeat 5 ;;
    # gapsspy: stream_gaps at concurrency 4 with long outputs (where a request's first token and
    # its second each came ~20 ms late inside the engine), every process's stacks, idle ones too.
    gapsspy) run 200 py-spy record -r 400 --nonblocking --idle --subprocesses --format raw \
               -o "$results/gapsspy.txt" -- python3 -m benchmarks.stream_gaps $([ -d .lt ] && echo --tokenizer .lt) \
               --concurrency 4 --requests 24 \
               --max-new 400 --json "$results/gapsspy.json" ;;
    w3old|w3oldspy)
      spy=(); [ "$step" = w3oldspy ] && spy=(py-spy record -r 400 --nonblocking --subprocesses --format raw -o "$results/w3spyold.txt" --)
      if old_site benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 200 "${spy[@]}" python3 -m benchmarks.w3_shared_prefix --variants cascade --repeat 5)
      fi ;;
    # W7: W1 and W2 on the Qwen3-8B architecture; w7old on the checkout in .old/ (see `old`);
    # w7fp8 with FP8 weights (quantization="fp8"), vllm8bfp8 vLLM's FP8 weights on the same inputs.
    w7) run 400 python3 -m benchmarks.w1_w2_gpu --config qwen3-8b --no-hf ;;
    w7fp8) run 400 python3 -m benchmarks.w1_w2_gpu --config qwen3-8b --no-hf --variant '{"quantization": "fp8"}' ;;
    # fp8gemm: the 8B projections alone, FP8 against bf16 by token count, with the weight-only
    # product's settings swept (FP8GEMM_ARGS replaces the options).
    fp8gemm) run 400 python3 -m benchmarks.fp8_gemm ${FP8GEMM_ARGS:---sweep --tokens 1,16,64,256,2048} ;;
    # w7old, w7fp8old: w7 and w7fp8 through the checkout in .old/ (see `old`), the A/B's other side.
    w7old|w7fp8old)
      variant=(); [ "$step" = w7fp8old ] && variant=(--variant '{"quantization": "fp8"}')
      if old_site .old/benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 400 python3 -m benchmarks.w1_w2_gpu --config qwen3-8b --no-hf "${variant[@]}")
      fi ;;
    # W8, online serving (benchmarks/w8_online.py): `sgl serve` on the Qwen3-0.6B architecture
    # (dummy bf16), Poisson rates and a concurrency sweep over HTTP with streaming, then stopped.
    # With .lt brought along the server has the default model's tokenizer and both workloads
    # run (w2, chat); without it, --skip-tokenizer-init and w2 alone. W8_SERVER_ARGS adds server
    # options (e.g. --enable-mixed-chunk). W8_ARGS replaces the sweep;
    # the JSON and PNG plots go to the output folder.
    # w8spy: the same under py-spy (every process of the server and the client, idle ones too).
    w8|w8spy) w8_model
        spy=(); [ "$step" = w8spy ] && spy=(py-spy record -r 500 --nonblocking --idle --subprocesses --format raw -o "$results/w8spy.txt" --)
        run 540 "${spy[@]}" python3 -m benchmarks.w8_online --label sgl --url http://127.0.0.1:30000 --procs 4 \
          --launch "$sgl_server" --workloads "$wl" --json "$results/w8_sgl.json" --plots "$results" $w8_sweep ;;
    # w8mixed: the same sweep with --enable-mixed-chunk (label sgl-mixed, w8_sgl_mixed.json): mixed
    # forwards against separate ones on one host.
    w8mixed) w8_model
        run 540 python3 -m benchmarks.w8_online --label sgl-mixed --url http://127.0.0.1:30000 --procs 4 \
          --launch "$sgl_server --enable-mixed-chunk" --workloads "$wl" --json "$results/w8_sgl_mixed.json" $w8_sweep ;;
    # w8old: the same sweep through the checkout in .old/ (see `old`), label sgl-old, into
    # w8_sgl_old.json: an A/B beside w8 on one host (plot them with w8_online --plot).
    w8old)
      w8_model
      if old_site .old/benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 540 python3 -m benchmarks.w8_online --label sgl-old --url http://127.0.0.1:30000 --procs 4 \
            --launch "$sgl_server" --workloads "$wl" --json "$results/w8_sgl_old.json" $w8_sweep)
      fi ;;
    # vllmw8: the same sweep through the vLLM peer's OpenAI server (its parts unpacked in /tmp, as
    # for `vllm`; the wheels of .whl/ for what its bundle lacks), same model folder, tokenizer and
    # W8_ARGS, label vllm; w8_vllm.json, and w8_*.png of vLLM beside those of w8_sgl.json and
    # w8_sgl_mixed.json that are there too, and w8_compare.md: sgl against vLLM by W8's criteria
    # (w8_online --compare). Its first start compiles (1-2 minutes), inside the 540 s.
    # W8_VLLM_ARGS adds vLLM server options, as W8_SERVER_ARGS does sgl's (e.g. an FP8 KV
    # cache on both: W8_SERVER_ARGS="--kv-cache-dtype fp8_e4m3" W8_VLLM_ARGS="--kv-cache-dtype fp8").
    vllmw8)
      w8_model
      (vllm_env && run 540 python3 -m benchmarks.w8_online --label vllm --url http://127.0.0.1:30001 --procs 4 \
         --launch "python3 -m vllm.entrypoints.openai.api_server --model $dir --load-format dummy --dtype bfloat16 \
                   --seed 0 --host 127.0.0.1 --port 30001 --disable-uvicorn-access-log $tok ${W8_VLLM_ARGS:-}" \
         --launch-timeout 300 --workloads "$wl" --json "$results/w8_vllm.json" \
         $w8_sweep)
      if [ -f "$results/w8_vllm.json" ]; then
        files=(); labels=()
        for f in sgl sgl_mixed; do
          [ -f "$results/w8_$f.json" ] && files+=("$results/w8_$f.json") && labels+=("${f/_/-}")
        done
        labels+=(vllm)
        python3 -m benchmarks.w8_online --plot "${files[@]}" "$results/w8_vllm.json" \
          --labels "$(IFS=,; echo "${labels[*]}")" --out "$results"
        if [ -f "$results/w8_sgl.json" ]; then  # exit 1 means not met: the step still succeeds
          python3 -m benchmarks.w8_online --compare "$results/w8_sgl.json" "$results/w8_vllm.json" \
            > "$results/w8_compare.md" || true
          cat "$results/w8_compare.md"
        fi
      fi ;;
    # Start-up to ready (benchmarks/startup.py), STARTUP_REPEAT (3) starts.
    startup) run 200 python3 -m benchmarks.startup --repeat ${STARTUP_REPEAT:-3}
             echo "bytecode cache: $(find /tmp/pycache -name '*.pyc' 2>/dev/null | wc -l) files" ;;
    # Start-up under py-spy (every process, idle included): where the seconds before ready go.
    startupspy) run 200 py-spy record -r 200 --nonblocking --subprocesses --idle --format raw \
                  -o "$results/startupspy.txt" -- python3 -m benchmarks.startup --repeat 2
                gzip -f "$results/startupspy.txt" ;;
    # An FP8 KV cache (kv_cache_dtype): W1 and W2 against the bf16 cache, engines in turn
    # (build its kernels first: step `jit`), then vLLM's FP8 cache on the same inputs (its
    # parts in /tmp, as step vllm).
    fp8) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --variant '{}' \
           --variant '{"kv_cache_dtype": "fp8_e4m3"}' ;;
    vllmfp8) run 540 bash .peer/vllm/kit/unpack.sh .peer/vllm -- --workloads W1,W2 --timeout 520 \
               --llm-kwargs '{"kv_cache_dtype": "fp8"}' --json "$results/vllmfp8.json" ;;
    # Plain decode's kernel (decode_attention_backend): sgl's Triton kernel (the default) against
    # FlashInfer's pick, then the Triton kernel on an FP8 cache; W1 and W2, engines in turn.
    tritonab) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --variant '{}' \
                --variant '{"decode_attention_backend": "flashinfer"}' --variant '{"kv_cache_dtype": "fp8_e4m3"}' ;;
    # FlashInfer's decode: tensor-core decode from 48 rows (the default) against the decode
    # kernel at every size, engines in turn: W1 and W2, then W3 without cascade (3 runs each).
    tcab) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --variant '{}' \
            --variant '{"tensor_core_decode_min_batch": 100000}'
          run 200 python3 -m benchmarks.w3_shared_prefix --variants radix --repeat 3
          run 200 python3 -m benchmarks.w3_shared_prefix --variants radix --repeat 3 \
            --engine-kw '{"tensor_core_decode_min_batch": 100000}' ;;
    drawcost) run 120 python3 -m benchmarks.draw_cost ;;  # the sampler's one-pass draw against what it replaced
    decodebal) run 200 python3 -m benchmarks.decode_balance ${DECODEBAL_ARGS:-} ;;  # DECODEBAL_ARGS=--others: the kernels not in the engine too
    # benchmarks/profile_run.py: W1, W2, W3 (prof8b: W2 at 8B), kernels by kind, batches by size.
    prof1) run 200 python3 -m benchmarks.profile_run --workload W1 ;;
    prof2) run 200 python3 -m benchmarks.profile_run --workload W2 ;;
    prof3) run 200 python3 -m benchmarks.profile_run --workload W3 ;;
    prof8b) run 300 python3 -m benchmarks.profile_run --workload W2 --config qwen3-8b ;;
    # vllmprof8b: the same W2 at 8B through the vLLM peer under the torch profiler
    # (benchmarks/vllm_profile.py: the peer's own inputs and settings), its kernels by the same
    # kinds as prof8b's; the traces stay in /tmp/vllm-profile. vllmprof2: W2 at 0.6B, beside prof2.
    vllmprof8b) (vllm_env && run 540 python3 -m benchmarks.vllm_profile --kit .peer/vllm/kit \
                   --config benchmarks/configs/qwen3-8b.json --workload W2 --out /tmp/vllm-profile) ;;
    vllmprof2) (vllm_env && run 540 python3 -m benchmarks.vllm_profile --kit .peer/vllm/kit \
                  --workload W2 --out /tmp/vllm-profile) ;;
    # The vLLM peer's bench.py on W1-W3 (vllm8b: W1 and W2 at 8B), once its parts are
    # unpacked in /tmp (../shared/peers/vllm/README.md); JSON results in the output folder.
    vllm) run 540 bash .peer/vllm/kit/unpack.sh .peer/vllm -- --timeout 520 --json "$results/vllm.json" ;;
    vllm8b) cp benchmarks/configs/qwen3-8b.json /tmp/qwen3-8b.json
            run 540 bash .peer/vllm/kit/unpack.sh .peer/vllm -- --config /tmp/qwen3-8b.json --workloads W1,W2 \
              --timeout 520 --json "$results/vllm8b.json" ;;
    vllm8bfp8) cp benchmarks/configs/qwen3-8b.json /tmp/qwen3-8b.json
               run 540 bash .peer/vllm/kit/unpack.sh .peer/vllm -- --config /tmp/qwen3-8b.json --workloads W1,W2 \
                 --timeout 520 --llm-kwargs '{"quantization": "fp8"}' --json "$results/vllm8bfp8.json" ;;
    # Multi-LoRA (benchmarks/lora_gpu.py): W1's shape, requests round-robin over 0 (LoRA off), 1, 8
    # and 32 random rank-16 adapters on every projection, an engine per variant in turn. The
    # adapters are written first into /tmp (benchmarks/lora_adapters.py; kept while the host
    # stays warm). LORA_CONFIG (qwen3-0.6b) names the architecture, LORA_ARGS passes options.
    # The LoRA kernels alone (benchmarks/lora_kernels.py): each projection's delta against its
    # base GEMM at decode and prefill sizes, eager and under a CUDA graph, and their errors.
    lorakernels) run 200 python3 -m benchmarks.lora_kernels ;;
    lora) cfg=${LORA_CONFIG:-qwen3-0.6b}
          run 120 python3 -m benchmarks.lora_adapters "/tmp/lora-adapters-$cfg-r16" --config "$cfg" --count 32
          run 400 python3 -m benchmarks.lora_gpu --config "$cfg" --adapter-dir "/tmp/lora-adapters-$cfg-r16" \
            --json "$results/lora.json" ${LORA_ARGS:-} ;;
    # The vLLM peer on the same inputs and adapter files (benchmarks/vllm_lora.py), each variant an
    # engine in its own process (each LoRA configuration compiles at its first start: four starts
    # take most of the time), with the vLLM peer's parts unpacked in /tmp first, as for `vllm`.
    # LORA_CONFIG as for `lora`; VLLMLORA_ARGS passes options.
    vllmlora) cfg=${LORA_CONFIG:-qwen3-0.6b}
              run 120 python3 -m benchmarks.lora_adapters "/tmp/lora-adapters-$cfg-r16" --config "$cfg" --count 32
              exports=$(bash .peer/vllm/kit/unpack.sh .peer/vllm); rc=$?
              if [ "$rc" = 0 ] || [ "$rc" = 5 ]; then  # 5: an import check failed; the script shows the real error
                left=$((budget - SECONDS - 20)); [ "$left" -lt 520 ] || left=520
                (eval "$exports" && run 540 python3 -m benchmarks.vllm_lora --config "$cfg" --timeout "$left" \
                   --adapter-dir "/tmp/lora-adapters-$cfg-r16" --json "$results/vllmlora.json" ${VLLMLORA_ARGS:-})
              else
                echo "the vLLM peer is not ready (unpack.sh exit $rc): bring its parts first (../shared/peers/vllm/README.md)"
              fi ;;
    # One decode step at W1's batch (benchmarks/profile_decode.py); cascadeprof at W3's,
    # profile2 sampled at T=0.6.
    profile) run 300 python3 -m benchmarks.profile_decode ;;
    # The front end's loop stalls with 64 long prompts (.lt: the default model's config
    # and tokenizer files, ~3.4 MB; null weights, so the host's 16 cores serve the front end).
    # TTFT of priority-10 requests under a saturating priority-0 load, fcfs vs priority.
    priority) run 300 python3 -m benchmarks.priority_ttft --device cuda ;;
    looplag) run 300 python3 benchmarks/loop_lag.py --prompts 64 --words 3000 --transport ipc --null --model .lt ;;
    # Grammar rows under overlap and graphs (tests/test_gpu_grammar.py), then 256 requests
    # generated plain and under a JSON schema (.lt, as looplag).
    grammar) run 200 python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=120 -m gpu \
               tests/test_gpu_grammar.py
             run 300 python3 -m benchmarks.grammar_cost --model .lt --load-format dummy --dtype bfloat16 \
               --requests 256 --new-tokens 256 ;;
    # Structured output's cost: the Qwen3-0.6B architecture (dummy bf16) with the default
    # model's tokenizer (.lt), 256 requests under a JSON schema against plain, same lengths.
    grammar06) run 200 python3 -m benchmarks.grammar_cost --model .lt --config qwen3-0.6b --load-format dummy \
                 --dtype bfloat16 --requests 256 --new-tokens 256 ;;
    # grammar06 and grammarw2 on the checkout in .old/ (see `old`), for an A/B of a grammar change on one host.
    grammar06old|grammarw2old)
      shape=(--new-tokens 256); [ "$step" = grammarw2old ] && shape=(--w2)
      if old_site benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 300 python3 -m benchmarks.grammar_cost --model "$OLDPWD/.lt" --config qwen3-0.6b --load-format dummy \
            --dtype bfloat16 --requests 256 "${shape[@]}")
      fi ;;
    # The same on W2's prompts, output caps and temperature (the schema closes each output).
    grammarw2) run 300 python3 -m benchmarks.grammar_cost --model .lt --config qwen3-0.6b --load-format dummy \
                 --dtype bfloat16 --requests 256 --w2 ;;
    # One decode step on a timeline (host phases, fill thread, GPU), JSON schema against plain.
    grammartimeline) run 200 python3 -m benchmarks.grammar_timeline --model .lt --config qwen3-0.6b \
                       --requests 256 --new-tokens ${GTL_TOKENS:-128} ;;
    cpuinfo) lscpu | head -30; nproc; cat /proc/loadavg ;;
    # The grammar step's matcher work off the engine, in parts against xgrammar's own pool (.lt).
    grammarthreads) run 200 python3 -m benchmarks.grammar_threads --model .lt --threads ${GT_THREADS:-2,4,8,12} \
                      --build-ms 0,2 --steps 60 ;;
    # grammar06 under py-spy (threads apart, idle included): where a grammar step's host time goes.
    grammarspy) run 300 py-spy record -r 250 --nonblocking --subprocesses --threads --idle --format raw \
                  -o "$results/grammarspy.txt" -- python3 -m benchmarks.grammar_cost --model .lt \
                  --config qwen3-0.6b --load-format dummy --dtype bfloat16 --requests 256 --new-tokens 256
                gzip -f "$results/grammarspy.txt" ;;  # 60 MB raw: too big to bring back
    beamtests) run 300 python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=120 -m gpu \
                 tests/test_gpu_beams.py ;;
    # On a host with 2 GPUs: the TP/DP GPU test, then W1 and W2 on the Qwen3-8B
    # architecture at TP=1, TP=2 and DP=2.
    tp) run 300 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gpu_tp.py
        for par in "--tp-size 1" "--tp-size 2" "--dp-size 2"; do
          run 400 python3 -m benchmarks.w1_w2_gpu --config qwen3-8b --no-hf $par
        done ;;
    # W6, beam search (benchmarks/w6_beam.py); W6_ARGS passes options.
    w6) run 400 python3 -m benchmarks.w6_beam ${W6_ARGS:-} ;;
    cascadeprof) run 300 python3 -m benchmarks.profile_decode --ctx 2164 --shared 2000 --steps 10 ;;
    profile2) run 300 python3 -m benchmarks.profile_decode --temperature 0.6 --steps 10 ;;
    # Stash the model parts brought along (.m1-.m4) in /tmp, for `model`, `fp8acc`, `smolhf` and `spec`.
    parts) stash_parts; ls /tmp/sgl-parts ;;
    # W1, W2 and W3 on an older checkout brought along in .old/ (`git archive COMMIT | tar x
    # -C .old`), installed apart in /tmp/oldsite: the A/B's other side, on the same host.
    old)
      if old_site .old/benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 300 python3 -m benchmarks.w1_w2_gpu --workloads ${OLD_WORKLOADS:-W1,W2} --no-hf \
          ; run 300 python3 -m benchmarks.w3_shared_prefix)
      fi ;;
    # model: SmolLM2's greedy tokens through both attention backends (benchmarks/backend_equality.py);
    # fp8acc: the FP8 cache's greedy outputs against bf16's on real weights (kv_dtype_accuracy).
    model) smollm2_gguf && run 400 python3 -m benchmarks.backend_equality --model "$gguf" ;;
    fp8acc)
      if smollm2_gguf; then
        run 300 python3 -m benchmarks.kv_dtype_accuracy --model "$gguf" --dtype bfloat16 --reference-dtype bfloat16
        run 300 python3 -m benchmarks.kv_dtype_accuracy --model "$gguf" --kv auto --dtype bfloat16
      fi ;;
    # smolhf: the same GGUF (parts as for `model`) as a Hugging Face folder, /tmp/smollm2-hf (bf16
    # safetensors, its tokenizer and chat template; benchmarks/gguf_to_hf.py), for vLLM, which does
    # not serve that file; kept while the host stays warm, so a second run writes nothing.
    smolhf)
      if [ -d /tmp/smollm2-hf ]; then
        echo "/tmp/smollm2-hf is there already"
      elif smollm2_gguf; then
        run 300 python3 -m benchmarks.gguf_to_hf "$gguf" /tmp/smollm2-hf
      fi ;;
    # spec: speculative decoding by n-gram lookup on real weights, `sgl serve` on SmolLM2's GGUF
    # (parts as for `model`) plain, then with NGRAM drafts (SPEC_K, default 5, tokens verified per
    # step: up to SPEC_K - 1 proposed; match windows of 1-12 tokens), each through W8's copy-heavy
    # edit workload at temperature 0 (SPEC_ARGS replaces the sweep: concurrency 1 and 8, 32
    # requests each); w8_spec_sgl_off.json, w8_spec_sgl_on.json, plots in spec/ (with vllmspec's).
    # speccost: where a decode step's time goes, plain, NGRAM and STANDALONE (the draft: the same
    # model, so its proposals are all taken) (benchmarks/spec_step_cost.py), on the default
    # model's config with dummy weights (.lt), at concurrency 1 and 8 (SPECCOST_C); SPECCOST_ARGS
    # adds options (e.g. --closed-loop 32: requests joining out of step).
    speccost) run 300 python3 -m benchmarks.spec_step_cost .lt --concurrency ${SPECCOST_C:-1,8} --draft .lt \
                ${SPECCOST_ARGS:-} ;;
    # specspy: NGRAM's steps (SPECSPY_ALGORITHMS: others; STANDALONE's draft is the same model) at
    # concurrency 1 (speccost's set-up, 2,048 tokens) under py-spy, every thread apart (the
    # scheduler's is the one whose host time a step waits for); specspy.txt.
    specspy) run 200 py-spy record -r 1000 --nonblocking --threads --format raw -o "$results/specspy.txt" -- \
               python3 -m benchmarks.spec_step_cost .lt --concurrency 1 --algorithms ${SPECSPY_ALGORITHMS:-NGRAM} \
               --draft .lt --new-tokens 2048 ;;
    # speccostold: the same benchmark (this checkout's) through the engine of .old/ (see `old`).
    speccostold)
      if old_site benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 300 python3 -m benchmarks.spec_step_cost "$OLDPWD/.lt" --concurrency ${SPECCOST_C:-1,8} \
               --draft "$OLDPWD/.lt" ${SPECCOST_ARGS:-})
      fi ;;
    # tablesync: the request table's host cost per decode and speculative step, its mirror on
    # the GPU (benchmarks/table_sync.py; seconds).
    tablesync) run 60 python3 -m benchmarks.table_sync --device cuda ;;
    # prefillcost: one request's prefill alone (benchmarks/prefill_cost.py): host, wall and GPU
    # time per prompt length, and the kernels of one prefill (what a lone request's TTFT costs);
    # PREFILL_ARGS="--decode-rows N" puts N running requests in each prefill's forward.
    prefillcost) run 200 python3 -m benchmarks.prefill_cost ${PREFILL_ARGS:-} ;;
    # prefillcostold: the same benchmark (this checkout's) through the engine of .old/ (see `old`).
    prefillcostold)
      if old_site benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH && run 200 python3 -m benchmarks.prefill_cost ${PREFILL_ARGS:-})
      fi ;;
    # Stream gaps inside the engine, no HTTP (benchmarks/stream_gaps.py): TTFT, each request's
    # first gap and its later ones at concurrency 1, 4 and 16, for the default engine and with
    # mixed batches (GAPS_VARIANTS: other engine options, a JSON list; GAPS_ARGS: more options);
    # with .lt, W8's tokenizer set-up.
    streamgaps) gaps_default='[{}, {"enable_mixed_chunk": true}]'
                run 300 python3 -m benchmarks.stream_gaps $([ -d .lt ] && echo --tokenizer .lt --text) \
                  --variants "${GAPS_VARIANTS:-$gaps_default}" \
                  --json "$results/stream_gaps.json" ${GAPS_ARGS:-} ;;
    spec)
      if smollm2_gguf; then
        for mode in off on; do
          drafts=
          [ "$mode" = on ] && drafts="--speculative-algorithm NGRAM --speculative-num-draft-tokens ${SPEC_K:-5} \
            --speculative-ngram-min-match-window-size 1 --speculative-ngram-max-match-window-size 12"
          run 265 python3 -m benchmarks.w8_online --label "sgl-spec-$mode" --url http://127.0.0.1:30000 \
            --launch "python3 -m sgl.launch_server $gguf --host 127.0.0.1 --port 30000 --random-seed 0 $drafts" \
            --launch-timeout 200 --workloads edit --temperature 0 --json "$results/w8_spec_sgl_$mode.json" \
            ${SPEC_ARGS:---rates none --concurrency 1,8 --requests 32}
        done
        spec_plots
      fi ;;
    # specold: spec's run with drafts through the checkout in .old/ (see `old`), the A/B's other
    # side, with this checkout's client and docs/ (the edit prompts are passages of docs/):
    # w8_spec_sgl_old.json.
    specold)
      if smollm2_gguf && old_site benchmarks; then
        cp -r docs /tmp/oldrun/docs
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 265 python3 -m benchmarks.w8_online --label sgl-spec-old --url http://127.0.0.1:30000 \
            --launch "python3 -m sgl.launch_server $gguf --host 127.0.0.1 --port 30000 --random-seed 0 \
              --speculative-algorithm NGRAM --speculative-num-draft-tokens ${SPEC_K:-5} \
              --speculative-ngram-min-match-window-size 1 --speculative-ngram-max-match-window-size 12" \
            --launch-timeout 200 --workloads edit --temperature 0 --json "$results/w8_spec_sgl_old.json" \
            ${SPEC_ARGS:---rates none --concurrency 1,8 --requests 32})
      fi ;;
    # vllmspec: the same on the vLLM peer (unpacked as for `vllm`), serving /tmp/smollm2-hf (step
    # smolhf), plain and with its n-gram drafts (method ngram, num_speculative_tokens SPEC_K - 1,
    # the same windows). vLLM drafts n-grams only on its V1 model runner, so the plain run is
    # pinned to it too and the two differ by speculation alone. Each start compiles (about a
    # minute); w8_spec_vllm_off.json and w8_spec_vllm_on.json, plots in spec/.
    vllmspec)
      if [ ! -f /tmp/smollm2-hf/config.json ]; then
        echo "no /tmp/smollm2-hf: run step smolhf first (with the model parts, as for model)"
      else
        cfg="{\"method\": \"ngram\", \"num_speculative_tokens\": $((${SPEC_K:-5} - 1)),"
        cfg="$cfg \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 12}"
        (vllm_env && export VLLM_USE_V2_MODEL_RUNNER=0 && for mode in off on; do
           drafts=
           [ "$mode" = on ] && drafts="--speculative-config '$cfg'"
           run 265 python3 -m benchmarks.w8_online --label "vllm-spec-$mode" --url http://127.0.0.1:30001 \
             --launch "python3 -m vllm.entrypoints.openai.api_server --model /tmp/smollm2-hf --dtype bfloat16 \
                       --seed 0 --host 127.0.0.1 --port 30001 --disable-uvicorn-access-log $drafts" \
             --launch-timeout 200 --workloads edit --temperature 0 --json "$results/w8_spec_vllm_$mode.json" \
             ${SPEC_ARGS:---rates none --concurrency 1,8 --requests 32}
         done)
        spec_plots
      fi ;;
    *) echo "unknown step $step" ;;
  esac
done
save_cache
echo "=== done (${SECONDS}s)"
