#!/usr/bin/env bash
# One call on the lent H200 (see ../shared/gpu/README.md): install the carried
# wheels, install FlashInfer kernels built by an earlier call (.ficache), run the
# given steps, and hand the kernel cache back under $OUT when this call built more.
#
# Usage, through the device's `run` with carry [.whl, .ficache]:
#   bash benchmarks/gpu_session.sh STEP...
# Steps: jit tests w1 w12ov w1hf w2 w2hf w3 w3c16k w3rep w3spy w3old w3oldspy w7 grammar06 grammar06old grammarw2 grammarspy grammarthreads grammartimeline cpuinfo startup startupspy tcab tritonab fp8 fp8acc vllmfp8 drawcost decodebal prof1 prof2 prof3 prof8b vllm vllm8b
#        w6 beamtests tp looplag grammar profile profile2 cascadeprof parts model old
# (w3rep: W3's three engines with 5 timed runs each, medians; w3spy: the cascade engine's
# 5 runs under py-spy (its wheel in .whl), folded stacks in $OUT/w3spy.txt; w3old: its 5 runs
# on the checkout in .old/, run by this checkout's benchmark script; w3oldspy: under py-spy)
# (prof1/2/3/8b: benchmarks/profile_run.py, W1/W2/W3 (prof8b: W2 at 8B) kernels by kind and
# batches by size; startup: benchmarks/startup.py; w7: W1 and W2 on the Qwen3-8B architecture;
# decodebal: benchmarks/decode_balance.py, decode attention at W1's, W2's and W3's real batches)
# (vllm, vllm8b: the peer kit's bench.py, once its parts are in /tmp (../shared/peers/vllm:
# carry .peer/vllm/c1 and kit in one call, c2 and kit in the next); vllm8b runs W1,W2 at 8B)
# A later call on a machine still warm may carry neither .whl nor .ficache: what the first
# call installed in /tmp (wheels, kernels) is used again.
# (old: W1, W2 and W3 on an older checkout carried in .old/ (`git archive COMMIT | tar x
# -C .old`), installed apart in /tmp/oldsite, so a change is measured against what it
# changed in the same lease)
# (jit: every kernel module, built in parallel, skipped when carried: benchmarks/build_kernels.py)
# (model: SmolLM2's GGUF, carried in parts by benchmarks/model_parts.sh and stashed in
# /tmp by `parts`, through both attention backends: benchmarks/backend_equality.py).
#
# Before the first call on a new machine: `bash benchmarks/gpu_wheels.sh` fills .whl/.
#
# What earlier calls taught (each lesson cost device time):
# - The GPU host lacks msgspec, structlog, pyzmq, gguf and prometheus_client: without
#   their wheels in .whl (gpu_wheels.sh) the editable install "succeeds" and every
#   step then dies on `import sgl`.
# - Everything streams into $OUT/log.txt as it is printed, so a call cut short still
#   returns what it did. Never pipe a step into `tail`: tail prints nothing until
#   its input ends, and a killed step then shows nothing at all.
# - The whole call stays within GPU_BUDGET_S (default 540 s, under the 600 s limit):
#   each step gets the time left, capped by its own limit; steps that no longer fit
#   are skipped and say so.
# - A fresh machine costs 60-120 s of device time before the command starts; a call sent
#   within 30 s of the last one's return keeps the same machine (and its /tmp).
# - One lease for the table of issue 17 (carry is 64 MiB a call: c1 is 58 MiB, c2 44 MiB,
#   .whl 16 MiB, .ficache 36 MiB), each call sent as soon as the last returns:
#   1. carry c1, kit: `bash .peer/vllm/kit/unpack.sh .peer/vllm` (exits 3: part.01 missing);
#   2. carry c2, kit, .whl: the same with `-- --timeout 330 --json $OUT/vllm.json` (~200 s),
#      then `bash benchmarks/gpu_session.sh` with no step (installs the wheels in /tmp/site);
#   3. carry kit, .ficache: the kit with `-- --config /tmp/qwen3-8b.json --workloads W1,W2
#      --timeout 200 --json $OUT/vllm8b.json` (cp benchmarks/configs/qwen3-8b.json first;
#      ~135 s), then `GPU_BUDGET_S=$((570 - SECONDS)) bash benchmarks/gpu_session.sh tests w1 w2 w7`;
#   4. carry .lt, .old: `W3_REPEAT=3 STARTUP_REPEAT=2 bash benchmarks/gpu_session.sh w3rep
#      startup grammar06 grammar06old drawcost prof8b`. .lt: the default model's files but its
#      weights (`d=$(.venv/bin/python -c "from sgl.sched.models.default_model import
#      default_model_dir as f; print(f())"); mkdir .lt; cp $d/*.json $d/*.jinja .lt/`);
#      .old: the checkout to compare with (`mkdir .old; git archive COMMIT | tar x -C .old`).
# - A call that pipes this script's output (`... | tail`) returns only when every process
#   holding the pipe has ended: session 14 lost ~930 s of device time to the watchdog's
#   sleep (fixed in stacks_after). Send the next call at once: a machine idle for 30 s goes
#   back, and the next call then starts a fresh one with no wheels, no /tmp/site and no
#   kernels (carry .whl and .ficache again).
# - "No device machine could be started" still costs device time (session 15: four refused
#   starts took ~520 s of the 1,800). After one, wait the minutes it names before the next call.
# - An A/B of a change not in the checkout: put `git diff A B -- DIR > ab.patch` in the repo root
#   (untracked files travel), `patch -p1 < ab.patch` in the command, and turn parts off with
#   `sed` between steps; restore the file before the next step (session 15, calls 9-11).
# - The first engine on a fresh machine compiles Triton kernels inside its timed runs: its
#   grammar06 ratio came out 0.1-0.2 under the next run's (session 16, three machines). Run
#   an A/B as base, change, base, change and compare the later pairs.
# - To see what sets a step, time it on a timeline before guessing from sums: `grammartimeline`
#   (session 17) showed in one call the GPU idle behind the next batch's preparation, which five
#   calls of per-phase sums in sessions 15-16 had not placed. Its A/B runs in one process.
# - The *spy steps need py-spy's wheel in .whl (gpu_wheels.sh fetches it since session 16).
# - Built kernels are installed as FlashInfer AOT modules. Restored as a JIT cache
#   they are not enough: FlashInfer runs ninja on every load, and the fresh wheel
#   install makes its headers newer than the cached objects, so ninja rebuilds
#   (decode ~10 s, each prefill module ~90 s, sampling ~100 s).
set -uo pipefail
log=${OUT:-/tmp}/log.txt
exec > >(tee -a "$log") 2>&1
budget=${GPU_BUDGET_S:-540}
if [ -f .whl/install-wheels.sh ]; then
  eval "$(bash .whl/install-wheels.sh)"
else  # a warm machine: the first call's /tmp/site
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
  [ -d /tmp/site/flashinfer ] || echo "no .whl carried and no /tmp/site: nothing of sgl will import"
fi
export PATH=/tmp/site/bin:$PATH
# Bytecode cached across processes: the host's site-packages is not writable, so without
# this every process compiles transformers' modules again (py-spy, session 10: about 8 s
# of each start). A user's install has its .pyc files; so do these runs from the 2nd on.
export PYTHONPYCACHEPREFIX=/tmp/pycache
# Session 12's py-spy of two starts showed every process compiling its sources on both:
# the cache above stayed empty. PYTHONDONTWRITEBYTECODE set by the image is one way that
# happens; the line below says what it was and how full the cache is.
echo "bytecode: PYTHONDONTWRITEBYTECODE='${PYTHONDONTWRITEBYTECODE-<unset>}', $(find /tmp/pycache -name '*.pyc' 2>/dev/null | wc -l) cached"
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
ws=$FLASHINFER_WORKSPACE_BASE
if [ -f .ficache/cache.tar.gz ]; then mkdir -p "$ws" && tar xzf .ficache/cache.tar.gz -C "$ws"; fi
aot=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)")
n=0
for so in "$ws"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
  [ -f "$so" ] || continue
  uri=$(basename "$(dirname "$so")")
  [ "$(basename "$so" .so)" = "$uri" ] || continue
  mkdir -p "$aot/$uri" && cp "$so" "$aot/$uri/" && n=$((n + 1))
done
echo "kernel cache: $n modules installed as AOT in $aot"
built() { find "$ws" -name '*.so' 2>/dev/null | wc -l; }
before=$(built)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

# run LIMIT CMD...: CMD under the smaller of LIMIT and the budget left, output unfiltered but for info logs.
# A step still running 10 s before its limit first has the stacks of every Python process
# printed (py-spy dump, threads included), so a step that hangs says where (session 12's
# grammar06 timed out after 231 s with no output at all, and no clue).
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
stacks_after() {
  # The sleep is a child of its own: `kill` of this subshell alone left it running, holding
  # the call's output open until it ended (session 14: two calls whose steps were done in
  # 19 s and 45 s returned after 407 s and 216 s, each step's whole cap, all of it charged).
  sleep "$1" & local nap=$!
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  wait "$nap" || return 0
  echo "--- still running after ${1}s: every Python process's stacks"
  command -v py-spy >/dev/null || { echo "(no py-spy: carry .whl)"; return; }
  for p in $(pgrep -f "^[^ ]*python[0-9.]* "); do
    echo "--- pid $p: $(tr '\0' ' ' < /proc/"$p"/cmdline 2>/dev/null | cut -c1-120)"
    timeout 10 py-spy dump --pid "$p" 2>&1 | head -80
  done
}
# Carried model parts (benchmarks/model_parts.sh) go to /tmp, which outlives the call
# while the machine stays warm; carried folders do not.
# old_site BENCHMARKS: install the checkout carried in .old/ into /tmp/oldsite and put the
# benchmark folder BENCHMARKS (its own, or this checkout's) alone in /tmp/oldrun: run from
# there, since a checkout's own sgl/ folder on the path (python -m puts the cwd first) would
# shadow the installed package. False (and says so) when .old is missing or fails to install.
old_site() {
  if [ -d .old ] && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite .old \
      >/dev/null 2>&1; then
    rm -rf /tmp/oldrun && mkdir -p /tmp/oldrun && cp -r "$1" /tmp/oldrun/benchmarks
    return 0
  fi
  echo "no .old checkout carried, or it failed to install"
  return 1
}
stash_parts() { mkdir -p /tmp/sgl-parts && cp .m?/* /tmp/sgl-parts/ 2>/dev/null; }
for step in "$@"; do
  echo "=== $step ($(date +%T), ${SECONDS}s into the call)"
  case $step in
    jit) run 420 python3 -m benchmarks.build_kernels ;;
    tests) run 400 python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=120 -m gpu \
             ${GPU_TESTS:-$(grep -l "pytest.mark.gpu" tests/*.py)} ;;  # GPU_TESTS: some files only
    w1) run 300 python3 -m benchmarks.w1_w2_gpu --workloads W1 --no-hf ;;
    w12ov) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --overlap-off ;;
    w1hf) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1 --overlap-off ;;
    w2) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W2 --no-hf ;;
    w2hf) run 500 python3 -m benchmarks.w1_w2_gpu --workloads W2 ;;
    w3) run 400 python3 -m benchmarks.w3_shared_prefix ;;
    w3c16k) run 400 python3 -m benchmarks.w3_shared_prefix --chunked-prefill-size 16384 ;;
    w3rep) run 400 python3 -m benchmarks.w3_shared_prefix --repeat ${W3_REPEAT:-5} ;;
    w3spy) run 200 py-spy record -r 400 --nonblocking --subprocesses --format raw -o "${OUT:-/tmp}/w3spy.txt" -- \
             python3 -m benchmarks.w3_shared_prefix --variants cascade --repeat 5 ;;
    w3old|w3oldspy)
      spy=(); [ "$step" = w3oldspy ] && spy=(py-spy record -r 400 --nonblocking --subprocesses --format raw -o "${OUT:-/tmp}/w3spyold.txt" --)
      if old_site benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 200 "${spy[@]}" python3 -m benchmarks.w3_shared_prefix --variants cascade --repeat 5)
      fi ;;
    w7) run 400 python3 -m benchmarks.w1_w2_gpu --config qwen3-8b --no-hf ;;
    startup) run 200 python3 -m benchmarks.startup --repeat ${STARTUP_REPEAT:-3}
             echo "bytecode cache: $(find /tmp/pycache -name '*.pyc' 2>/dev/null | wc -l) files" ;;
    # Start-up under py-spy (every process, idle included): where the seconds before ready go.
    startupspy) run 200 py-spy record -r 200 --nonblocking --subprocesses --idle --format raw \
                  -o "${OUT:-/tmp}/startupspy.txt" -- python3 -m benchmarks.startup --repeat 2
                gzip -f "${OUT:-/tmp}/startupspy.txt" ;;
    # Tensor-core decode from 48 rows (the default) against the decode kernel at every size,
    # engines in turn: W1 and W2, then W3 without cascade (3 runs each).
    # An FP8 KV cache (kv_cache_dtype): W1 and W2 against the bf16 cache, engines in turn
    # (build its kernels first: step `jit`), then vLLM's FP8 cache on the same inputs (its
    # parts in /tmp, as step vllm).
    fp8) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --variant '{}' \
           --variant '{"kv_cache_dtype": "fp8_e4m3"}' ;;
    vllmfp8) run 540 bash .peer/vllm/kit/unpack.sh .peer/vllm -- --workloads W1,W2 --timeout 520 \
               --llm-kwargs '{"kv_cache_dtype": "fp8"}' --json "${OUT:-/tmp}/vllmfp8.json" ;;
    # Plain decode's kernel (decode_attention_backend): sgl's Triton kernel (the default) against
    # FlashInfer's pick, then the Triton kernel on an FP8 cache; W1 and W2, engines in turn.
    tritonab) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --variant '{}' \
                --variant '{"decode_attention_backend": "flashinfer"}' --variant '{"kv_cache_dtype": "fp8_e4m3"}' ;;
    tcab) run 400 python3 -m benchmarks.w1_w2_gpu --workloads W1,W2 --no-hf --variant '{}' \
            --variant '{"tensor_core_decode_min_batch": 100000}'
          run 200 python3 -m benchmarks.w3_shared_prefix --variants radix --repeat 3
          run 200 python3 -m benchmarks.w3_shared_prefix --variants radix --repeat 3 \
            --engine-kw '{"tensor_core_decode_min_batch": 100000}' ;;
    drawcost) run 120 python3 -m benchmarks.draw_cost ;;  # the sampler's one-pass draw against what it replaced
    decodebal) run 200 python3 -m benchmarks.decode_balance ${DECODEBAL_ARGS:-} ;;  # DECODEBAL_ARGS=--others: the kernels not in the engine too
    prof1) run 200 python3 -m benchmarks.profile_run --workload W1 ;;
    prof2) run 200 python3 -m benchmarks.profile_run --workload W2 ;;
    prof3) run 200 python3 -m benchmarks.profile_run --workload W3 ;;
    prof8b) run 300 python3 -m benchmarks.profile_run --workload W2 --config qwen3-8b ;;
    vllm) run 540 bash .peer/vllm/kit/unpack.sh .peer/vllm -- --timeout 520 --json "${OUT:-/tmp}/vllm.json" ;;
    vllm8b) cp benchmarks/configs/qwen3-8b.json /tmp/qwen3-8b.json
            run 540 bash .peer/vllm/kit/unpack.sh .peer/vllm -- --config /tmp/qwen3-8b.json --workloads W1,W2 \
              --timeout 520 --json "${OUT:-/tmp}/vllm8b.json" ;;
    profile) run 300 python3 -m benchmarks.profile_decode ;;
    # The front end's loop stalls at the issue's size (carry .lt: the default model's config
    # and tokenizer files, ~3.4 MB; null weights, so the host's 16 cores serve the front end).
    looplag) run 300 python3 benchmarks/loop_lag.py --prompts 64 --words 3000 --transport ipc --null --model .lt ;;
    # Issue 16: grammar rows under overlap and graphs (tests/test_gpu_grammar.py), then 256
    # requests generated plain and under a JSON schema (carry .lt, as looplag).
    grammar) run 200 python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=120 -m gpu \
               tests/test_gpu_grammar.py
             run 300 python3 -m benchmarks.grammar_cost --model .lt --load-format dummy --dtype bfloat16 \
               --requests 256 --new-tokens 256 ;;
    # W2-like (issue 16): the Qwen3-0.6B architecture (dummy bf16) with the default model's
    # tokenizer (carry .lt), 256 requests under a JSON schema against plain, same lengths.
    grammar06) run 200 python3 -m benchmarks.grammar_cost --model .lt --config qwen3-0.6b --load-format dummy \
                 --dtype bfloat16 --requests 256 --new-tokens 256 ;;
    # grammar06 on the checkout carried in .old/ (see `old`), for an A/B of a grammar change in one lease.
    grammar06old)
      if old_site benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 200 python3 -m benchmarks.grammar_cost --model "$OLDPWD/.lt" --config qwen3-0.6b --load-format dummy \
            --dtype bfloat16 --requests 256 --new-tokens 256)
      fi ;;
    # The same on W2's prompts, output caps and temperature (the schema closes each output).
    grammarw2) run 300 python3 -m benchmarks.grammar_cost --model .lt --config qwen3-0.6b --load-format dummy \
                 --dtype bfloat16 --requests 256 --w2 ;;
    # One decode step on a timeline (host phases, fill thread, GPU), JSON schema against plain.
    grammartimeline) run 200 python3 -m benchmarks.grammar_timeline --model .lt --config qwen3-0.6b \
                       --requests 256 --new-tokens ${GTL_TOKENS:-128} ;;
    cpuinfo) lscpu | head -30; nproc; cat /proc/loadavg ;;
    # The grammar step's matcher work off the engine, in parts against xgrammar's own pool (carry .lt).
    grammarthreads) run 200 python3 -m benchmarks.grammar_threads --model .lt --threads ${GT_THREADS:-2,4,8,12} \
                      --build-ms 0,2 --steps 60 ;;
    # grammar06 under py-spy (threads apart, idle included): where a grammar step's host time goes.
    grammarspy) run 300 py-spy record -r 250 --nonblocking --subprocesses --threads --idle --format raw \
                  -o "${OUT:-/tmp}/grammarspy.txt" -- python3 -m benchmarks.grammar_cost --model .lt \
                  --config qwen3-0.6b --load-format dummy --dtype bfloat16 --requests 256 --new-tokens 256
                gzip -f "${OUT:-/tmp}/grammarspy.txt" ;;  # 60 MB raw: over what $OUT brings back
    beamtests) run 300 python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=120 -m gpu \
                 tests/test_gpu_beams.py ;;
    # Issue 18, on nvidia-h200-x2: the TP/DP GPU test, then W1 and W2 on the Qwen3-8B
    # architecture at TP=1, TP=2 and DP=2.
    tp) run 300 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gpu_tp.py
        for par in "--tp-size 1" "--tp-size 2" "--dp-size 2"; do
          run 400 python3 -m benchmarks.w1_w2_gpu --config qwen3-8b --no-hf $par
        done ;;
    w6) run 400 python3 -m benchmarks.w6_beam ${W6_ARGS:-} ;;
    cascadeprof) run 300 python3 -m benchmarks.profile_decode --ctx 2164 --shared 2000 --steps 10 ;;
    profile2) run 300 python3 -m benchmarks.profile_decode --temperature 0.6 --steps 10 ;;
    parts) stash_parts; ls /tmp/sgl-parts ;;
    old)
      if old_site .old/benchmarks; then
        (cd /tmp/oldrun && export PYTHONPATH=/tmp/oldsite:$PYTHONPATH \
          && run 300 python3 -m benchmarks.w1_w2_gpu --workloads ${OLD_WORKLOADS:-W1,W2} --no-hf \
          ; run 300 python3 -m benchmarks.w3_shared_prefix)
      fi ;;
    model|fp8acc)  # fp8acc: the FP8 cache's greedy outputs against bf16's, real weights, FlashInfer
      stash_parts
      gguf=/tmp/$(cut -d' ' -f3 /tmp/sgl-parts/SHA256 2>/dev/null)
      cat /tmp/sgl-parts/part.* > "$gguf" 2>/dev/null
      if ! (cd /tmp && sha256sum -c --quiet /tmp/sgl-parts/SHA256); then
        echo "model parts missing or damaged: $(ls /tmp/sgl-parts | tr '\n' ' ')(the device went cold between calls?)"
      elif [ "$step" = model ]; then
        run 400 python3 -m benchmarks.backend_equality --model "$gguf"
      else
        run 300 python3 -m benchmarks.kv_dtype_accuracy --model "$gguf" --dtype bfloat16 --reference-dtype bfloat16
        run 300 python3 -m benchmarks.kv_dtype_accuracy --model "$gguf" --kv auto --dtype bfloat16
      fi ;;
    *) echo "unknown step $step" ;;
  esac
done
# Hand the kernel cache back only when this call built a kernel the carried one lacked.
if [ -d "$ws/.cache" ] && [ "$(built)" != "$before" ]; then
  tar cz -C "$ws" .cache | split -b 15M - "$OUT/ficache.part."
  echo "kernel cache grew: $OUT/ficache.part.* -> cat > .ficache/cache.tar.gz"
fi
echo "=== done (${SECONDS}s)"
