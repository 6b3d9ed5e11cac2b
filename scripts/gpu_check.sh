#!/usr/bin/env bash
# All GPU tests and benchmarks in one call (for the lent H200). Results go under $OUT.
#   scripts/gpu_check.sh [tests] [ops] [host] [host_step] [step] [sort_ab] [select_ab] [gemv_ab] [gemv_limit_ab] [moe_tiles_ab] [sm90_ab] [sm90_prev_ab] [linear_ab] [linear_sm90_ab] [chain_ab] [switch_ab] [base_ab] [kv_ab] [trace] [probe] [kernels] [sweep] [dump] [serve] [serve_ab] [tp] [tp_step] [spec_step] [rows_ab] [prefill_ab] [wide_ab] [prefill_profile] [cut_ab] [chunk_ab] [ws_ab] [prefill_ctx] [attn_prefill_ab]
#   (default: tests ops step)
#   TESTS="tests/ops/test_mhc.py ..." narrows the GPU tests, OPS="mhc indexer" the kernel
#   bench, KV_BATCH / KV_CONTEXT / KV_PREFILL the kv_ab step, PROBE=floors,select the probe (bench/probe_pieces.py lists the parts), SWEEP=indexer
#   the sweep, NCU=0 skips Nsight in kernels
set -uo pipefail
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD  # the device has no network: run from the tree
# the server's dependencies where the image lacks them (scripts/gpu_deps.sh; carry .gpu_deps)
if [ -d .gpu_deps ] && ! python3 -c "import fastapi" 2>/dev/null; then
  export PYTHONPATH=$PYTHONPATH:$PWD/.gpu_deps
fi
PARTS=${*:-tests ops step}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1 2>/dev/null
} 2>&1 | tee "$OUT/env.txt"

# one decode step at Flash width after a python setup statement (a kernel switch A/B in one call)
#   step_run "SETUP" BATCHES CONTEXT NAME  ->  $OUT/step_NAME.{json,txt}
# (-P: no working directory on sys.path, so PYTHONPATH picks the package: base_ab's ab_base/;
# without it `python -c` imported ./dsv4 for both sides of base_ab until the seventeenth session)
step_run() {
  python3 -P -c "import sys; $1; import dsv4; print('dsv4:', dsv4.__file__); from dsv4.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench step --preset flash --ops triton --layers sliding,csa,hca --batch "$2" \
    --context "$3" --prefill 0 --repeat 3 --graph ${STEP_ARGS:-} --json "$OUT/step_$4.json" 2>&1 \
    | tee "$OUT/step_$4.txt"
}
# one step per value of a module constant: step_ab MODULE CONSTANT "VALUES" BATCHES CONTEXT TAG
step_ab() {
  local v
  for v in $3; do step_run "import $1 as m; m.$2 = $v" "$4" "$5" "$6$v"; done
}

# the serve bench against `dsv4 serve` of /tmp/serve_tiny in one mode: serve_mode MODE TAG
# (SERVE_PATH: the package to serve from, a `git archive` dir as base_ab's; default this tree)
serve_mode() {
  local mode=$1 tag=$2 flags shared pid c
  case $mode in eager) flags=--enforce-eager ;; prefix) flags=--enable-prefix-caching ;;
    nocache) flags=--no-enable-prefix-caching ;; *) flags= ;; esac
  shared=$([ $mode = prefix ] && echo --prefix-len ${PREFIX_LEN:-1024})
  PYTHONPATH=${SERVE_PATH:-$PWD}${PYTHONPATH#$PWD} python3 -P -m dsv4.cli serve \
    --model /tmp/serve_tiny --port 8123 --max-seqs 64 $flags > "$OUT/serve_$tag.log" 2>&1 &
  pid=$!
  if ! python3 -c "import os, sys, time, urllib.request as u
for _ in range(600):
    try: u.urlopen('http://127.0.0.1:8123/health'); sys.exit(0)
    except OSError: time.sleep(0.5)
    os.kill($pid, 0)  # the server died: stop waiting
sys.exit(1)" 2>/dev/null; then
    echo "== $tag: the server did not start" | tee -a "$OUT/serve_bench.txt"
    tail -5 "$OUT/serve_$tag.log" | tee -a "$OUT/serve_bench.txt"; kill $pid; return
  fi
  for c in ${SERVE_CONCURRENCY:-1 16 64}; do
    echo "== $tag, concurrency $c" | tee -a "$OUT/serve_bench.txt"
    python3 -m dsv4.cli bench serve --base-url http://127.0.0.1:8123 --concurrency $c \
      --num-prompts $((c * 4)) --input-len 256 --output-len 64 $shared 2>&1 | tee -a "$OUT/serve_bench.txt"
  done
  kill $pid; wait $pid
}

for part in $PARTS; do
  case $part in
    tests)
      python3 -m pytest -q -m gpu ${TESTS:-tests/} -p no:cacheprovider --ignore=tests/test_server.py 2>&1 | tee "$OUT/gpu_tests.txt"
      echo "gpu tests rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.txt" ;;
    tp)  # two GPUs (kind nvidia-h200-x2): the tensor-parallel tests
      # (bounded: ranks that disagree wait on each other until NCCL's 10-minute watchdog). A hang
      # leaves its stacks: every rank's Python dumps its threads on the SIGABRT that timeout sends
      # to the whole process group, and pytest dumps the main process's after 150 s in one test
      PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN} \
        timeout -s ABRT -k 20 ${TP_TIMEOUT:-300} python3 -m pytest -v -s -m gpu tests/test_parallel.py \
        tests/ops/test_moe.py tests/test_piecewise.py -k "${TP_TESTS:-two_ranks or expert_parallel}" -p no:cacheprovider \
        -o faulthandler_timeout=150 -o log_cli=true --log-cli-level=INFO 2>&1 | tee "$OUT/tp_tests.txt"
      echo "tp tests rc=${PIPESTATUS[0]}" | tee -a "$OUT/tp_tests.txt" ;;
    tp_step)  # the Flash-width decode step on one rank and on two (rank 0's times), side by
      # side; TP_LAYERS=all builds Flash's whole 43-layer schedule (too big for one H200: TP_SIZES=2)
      for n in ${TP_SIZES:-1 2}; do
        python3 -m dsv4.cli bench step --preset flash --ops triton --layers ${TP_LAYERS:-sliding,csa,hca} \
          --batch ${TP_BATCH:-1,16,64} --context ${TP_CONTEXT:-4096} --prefill 0 --repeat 3 --graph \
          -tp "$n" --json "$OUT/step_tp$n.json" 2>&1 | tee "$OUT/step_tp$n.txt"
      done ;;
    host)  # host microseconds per launcher call (the eager steps' cost) and a cProfile
      python3 bench/host_overhead.py 2>&1 | tee "$OUT/host_overhead.txt" ;;
    host_step)  # an eager Flash-width step's host time by where it is spent (cProfile grouped)
      python3 bench/host_step.py ${HOST_STEP_ARGS:-} --json "$OUT/host_step.json" 2>&1 | tee "$OUT/host_step.txt" ;;
    ops)  # every kernel vs its torch reference and the copy bandwidth of this run
      python3 -m dsv4.cli bench ops --repeat 3 $(for o in ${OPS:-}; do echo --only $o; done) \
        --json "$OUT/bench_ops.json" 2>&1 | tee "$OUT/bench_ops.txt" ;;
    step)  # one decode step at Flash width: sliding, CSA, HCA layers
      python3 -m dsv4.cli bench step --preset flash --ops triton --layers sliding,csa,hca \
        --batch 1,16,64 --context 4096,131072 --prefill 4096 --repeat 5 --profile --hf --graph \
        --json "$OUT/bench_step.json" 2>&1 | tee "$OUT/bench_step.txt"
      python3 -m dsv4.cli roofline --preset flash --batch 16 --context 131072 --gpu H200 \
        --bench "$OUT/bench_step.json" 2>&1 | tee "$OUT/roofline.txt" ;;
    spec_step)  # speculative decoding: the verify step of K drafts beside the decode step
      # (K = 0), graphs at Flash width, 4K; ratio = the accepted tokens a step must average
      # (SPEC_PROFILE=1: the per-category breakdown too, e.g. of batch 1's 2-token step)
      for k in ${DRAFTS:-0 1 2}; do
        python3 -m dsv4.cli bench step --preset flash --ops triton --layers sliding,csa,hca \
          --batch ${SPEC_BATCH:-1,16,64} --context 4096 --prefill 0 --repeat 3 --graph \
          --draft-tokens "$k" ${SPEC_PROFILE:+--profile} --json "$OUT/spec_step$k.json" 2>&1 \
          | tee "$OUT/spec_step$k.txt"
      done ;;
    rows_ab)  # verify steps (K drafts) with the row limits of the FP8 and expert kernels as
      # before (64 rows, 512 pairs: the reference and tl.dot_scaled above) and as now
      for k in ${DRAFTS:-1 2}; do
        STEP_ARGS="--draft-tokens $k" step_run "import dsv4.ops.linear as l, dsv4.ops.linear_sm90 as s, dsv4.ops.moe_sm90 as m; l.MAX_ROWS = s.MAX_ROWS = 64; m.MAX_PAIRS = 512; l._dequantized = lambda x, fmt: False" \
          ${ROWS_BATCH:-32,64} 4096 rows_before_k$k
        STEP_ARGS="--draft-tokens $k" step_run "pass" ${ROWS_BATCH:-32,64} 4096 rows_now_k$k
      done ;;
    prefill_ab)  # prefill of 4096 tokens in chunks of 512 / 2048 with the FP8 projections and
      # experts as at the twenty-seventh session's start (the reference past 64 rows, experts
      # past 512 pairs on tl.dot_scaled) and as now
      for c in ${PREFILL_CHUNKS:-512 2048}; do
        STEP_ARGS="--prefill 4096 --chunk $c" step_run "import dsv4.ops.linear as l, dsv4.ops.linear_sm90 as s, dsv4.ops.moe_sm90 as m; l.MAX_ROWS = s.MAX_ROWS = 64; m.MAX_PAIRS = 512; l._dequantized = lambda x, fmt: False" \
          1 4096 prefill_before_c$c
        STEP_ARGS="--prefill 4096 --chunk $c" step_run "pass" 1 4096 prefill_now_c$c
      done ;;
    chunk_ab)  # prefill of 4096 tokens in chunks of 512 (the default until the thirtieth
      # session) and 2048 (the step budget, the default since), this tree
      for c in ${PREFILL_CHUNKS:-512 2048}; do
        STEP_ARGS="--prefill 4096 --chunk $c" step_run "pass" 1 4096 chunk_c$c
      done ;;
    prefill_ctx)  # one 2048-token prefill chunk at long context (PREFILL_CONTEXTS): the indexer in
      # slices given its sequence's rows and counts (the default), in 4x smaller slices, and with
      # the step's tables whole (state.ENTRY_TABLE_ELEMENTS lifted)
      for v in "pass" "m.INDEX_SLICE_ELEMENTS = 1 << 24" "m.ENTRY_TABLE_ELEMENTS = 1 << 40"; do
        STEP_ARGS="--prefill-context ${PREFILL_CONTEXTS:-4096,131072,1048576} --chunk 2048 --repeat 5" \
          step_run "import dsv4.state as m; $v" 1 4096 "ctx_$(echo "$v" | tr -dc 'a-zA-Z0-9')"
      done ;;
    attn_prefill_ab)  # prefill with every chunk's attention on the Triton kernel (as until the
      # forty-fifth session: three kv sources kept prefill off the Gluon kernel) and now, in
      # pairs: 4096 tokens in chunks of 2048 (bf16, then FP8 state), a 2048-token chunk at 128K
      forms=("--prefill 4096 --chunk 2048" "--prefill 4096 --chunk 2048 --kv-cache-dtype fp8"
        "--prefill-context ${PREFILL_CONTEXTS:-131072} --chunk 2048 --repeat 5")
      for i in ${ATTN_AB_FORMS:-0 1 2}; do
        for v in "m.SM90_MIN_TOKENS = m.SM90_MIN_TOKENS_FP8 = 1 << 30" "pass"; do
          STEP_ARGS="${forms[$i]}" step_run "import dsv4.ops.sparse_attn as m; $v" 1 4096 \
            "attn_prefill${i}_$([ "$v" = pass ] && echo now || echo before)"
        done
      done ;;
    wide_ab)  # prefill of 4096 tokens in chunks of 2048 / 4096: the sm90 experts up to 6144 pairs
      # (the twenty-seventh session's limit, tl.dot_scaled past it) and now (WIDE tiles to 65536)
      for c in ${PREFILL_CHUNKS:-2048 4096}; do
        STEP_ARGS="--prefill 4096 --chunk $c" step_run "import dsv4.ops.moe_sm90 as m; m.MAX_PAIRS = 6144; m.ROW_BLOCKS = m.ROW_BLOCKS[:3]" \
          1 4096 wide_before_c$c
        STEP_ARGS="--prefill 4096 --chunk $c" step_run "pass" 1 4096 wide_now_c$c
        rm -f "$OUT"/step_wide_*_c$c.json
      done ;;
    ws_ab)  # prefill of 4096 tokens in chunks of 4096 (2048: PREFILL_CHUNKS): the routed experts'
      # WIDE row-blocks on the one-partition kernel (as until the thirty-first session) and on
      # the warp-specialised one
      for c in ${PREFILL_CHUNKS:-4096}; do
        STEP_ARGS="--prefill 4096 --chunk $c" step_run "import dsv4.ops.moe_sm90 as m; m.WARP_SPECIALIZED = False" \
          1 4096 ws_before_c$c
        STEP_ARGS="--prefill 4096 --chunk $c" step_run "pass" 1 4096 ws_now_c$c
      done ;;
    cut_ab)  # what prefix caching's cut cost a prompt until the thirtieth session (since then
      # the snapshot is written inside the chunk): 300 tokens in one step, and cut at its last
      # block boundary (256 + 44), eager at Flash width
      for c in 300 256; do
        STEP_ARGS="--prefill 300 --chunk $c" step_run "pass" 1 4096 cut_c$c
        rm -f "$OUT/step_cut_c$c.json"
      done ;;
    prefill_profile)  # where a prefill's time goes: 4096 tokens in chunks of 512 / 2048, by category
      for c in ${PREFILL_CHUNKS:-512 2048}; do
        python3 -m dsv4.cli bench step --preset flash --ops triton --layers sliding,csa,hca --batch 1 \
          --context 4096 --prefill 4096 --chunk "$c" --repeat 3 --profile 2>&1 | tee "$OUT/prefill_profile_c$c.txt"
      done ;;
    sort_ab)  # decode step at 4K and 128K: the model's unsorted top-k against SORT_ALWAYS
      step_ab dsv4.ops.indexer SORT_ALWAYS "True False" ${SORT_BATCH:-1,16} 4096 sort4k_
      step_ab dsv4.ops.indexer SORT_ALWAYS "True False" ${SORT_BATCH:-1,16} 131072 sort128k_ ;;
    select_ab)  # decode step at 128K context: the indexer's levels select (hist off) vs the default
      step_ab dsv4.ops.indexer HIST_MAX_TOKENS "0 16" 1,16 131072 hist ;;
    gemv_ab)  # decode step at batch 1-8: the experts' dot form (GEMV off) vs the default
      step_ab dsv4.ops.moe GEMV_MAX_PAIRS "0 48" 1,2,4,8 4096 gemv ;;
    gemv_limit_ab)  # decode step at batch 16 (96 pairs): the experts' dot_scaled form vs GEMV
      step_ab dsv4.ops.moe GEMV_MAX_PAIRS "48 128" 16 4096 gemv_limit ;;
    sm90_ab)  # decode step: the experts' Triton kernels (sm90 off) vs the Gluon sm_90 kernels
      step_ab dsv4.ops.moe_sm90 MAX_PAIRS "0 512" ${SM90_BATCH:-1,2,4,8,16,32,64} 4096 sm90 ;;
    sm90_prev_ab)  # decode step: the previous sm90 expert kernels vs the current ones; the previous
      # file must be in the tree, untracked: git show eb4e697:dsv4/ops/moe_sm90.py > bench/moe_sm90_prev.py
      step_run "import sys; sys.path.insert(0, 'bench'); import moe_sm90_prev as p, dsv4.ops.moe_sm90 as m; m._experts_kernel = p._experts_kernel; m.CONFIG = dict(m.CONFIG, maxnreg=(None, None))" ${SM90_BATCH:-16,64} 4096 sm90_prev
      step_run "pass" ${SM90_BATCH:-16,64} 4096 sm90_cur ;;
    linear_sm90_ab)  # decode step: the FP8 projections' Triton form (the sm90 kernel off) vs the
      # Gluon sm_90 kernel
      step_ab dsv4.ops.linear_sm90 MAX_ROWS "0 64" ${LINEAR_BATCH:-2,16,64} 4096 linear_sm90 ;;
    chain_ab)  # decode step: only the ops' second kernels launched early (PDL) vs every kernel
      # chained behind its predecessor (device.CHAIN)
      step_ab dsv4.ops.device CHAIN "False True" ${AB_BATCH:-1,16,64} 4096 chain ;;
    switch_ab)  # decode step: the per-step lists in one launch (decode_lists.FUSED), then also the
      # attention's hc_post with the FFN's hc_pre (mhc.POST_PRE_MAX_T); AB_BATCH, AB_CONTEXT
      for c in ${AB_CONTEXT:-4096}; do
        step_run "import dsv4.ops.decode_lists as d, dsv4.ops.mhc as m; d.FUSED = False; m.POST_PRE_MAX_T = 0" \
          ${AB_BATCH:-1,16,64} $c "sw0_$c"
        step_run "import dsv4.ops.decode_lists as d, dsv4.ops.mhc as m; d.FUSED = True; m.POST_PRE_MAX_T = 0" \
          ${AB_BATCH:-1,16,64} $c "sw1_$c"
        step_run "pass" ${AB_BATCH:-1,16,64} $c "sw2_$c"  # both (the defaults)
      done ;;
    base_ab)  # decode step: each package in AB_BASES (default ab_base; a dir made by `git archive
      # <commit> dsv4 | tar -x -C DIR`, ab_* is ignored, so pass the dirs in carry) against this tree
      for b in ${AB_BASES:-ab_base}; do
        PYTHONPATH=$PWD/$b step_run "pass" ${AB_BATCH:-1,16,64} ${AB_CONTEXT:-4096} "$b"
      done
      step_run "pass" ${AB_BATCH:-1,16,64} ${AB_CONTEXT:-4096} cur ;;
    moe_tiles_ab)  # decode step at batch 1-8: the experts' GEMV form on the twelfth session's
      # 256-wide tiles (0) vs the default (1)
      step_run "import dsv4.ops.moe as m; m.GEMV_CONFIG_ONE = dict(m.GEMV_CONFIG_ONE, BLOCK_K=256, PREFETCH=False); m.GEMV_CONFIG = dict(m.GEMV_CONFIG, BLOCK_N=32, BLOCK_K=256)" 1,2,4,8 4096 moe_tiles0
      step_run "pass" 1,2,4,8 4096 moe_tiles1 ;;
    linear_ab)  # decode step at batch 1-2: the FP8 projections' tensor-core form vs the GEMV form
      step_ab dsv4.ops.linear GEMV_MAX_ROWS "0 1" 1,2 4096 linear ;;
    kv_ab)  # decode step: bf16 attention state vs FP8 entries (--kv-cache-dtype fp8)
      for kv in auto fp8; do
        python3 -m dsv4.cli bench step --preset flash --ops triton --layers sliding,csa,hca \
          --batch ${KV_BATCH:-1,16,64} --context ${KV_CONTEXT:-4096} --prefill ${KV_PREFILL:-0} --repeat 3 --graph --kv-cache-dtype $kv \
          --json "$OUT/step_kv_$kv.json" 2>&1 | tee "$OUT/step_kv_$kv.txt"
      done ;;
    trace)  # every kernel of one decode step (3 layers + head) by device time: what to fuse next
      python3 -m dsv4.cli bench step --preset flash --ops triton --layers sliding,csa,hca \
        --batch ${TRACE_BATCH:-1,64} --context 4096 --prefill 0 --repeat 2 --trace "$OUT/trace" \
        2>&1 | tail -4
      python3 bench/trace_kernels.py "$OUT"/trace.b*.json --json "$OUT/trace_kernels.json" 2>&1 \
        | tee "$OUT/trace_kernels.txt"
      gzip -f "$OUT"/trace.b*.json ;;
    probe)  # device time of kernel pieces and of an empty launch
      python3 bench/probe_pieces.py ${PROBE:+--only $PROBE} --json "$OUT/probe.json" 2>&1 | tee "$OUT/probe.txt" ;;
    kernels)  # per-kernel device time inside the multi-kernel ops (torch profiler), then Nsight
      python3 bench/kernel_times.py --json "$OUT/kernel_times.json" 2>&1 | tee "$OUT/kernel_times.txt"
      if [ "${NCU:-1}" != 0 ] && command -v ncu >/dev/null; then
        # NCU_KERNELS: space-separated "kernel regex:launches:case name substring"
        for k in ${NCU_KERNELS:-"index_select|hc_pre_finish|hc_mixes:6:" "_sparse_attn_kernel:1:T=64"}; do
          IFS=: read -r rx n only <<< "$k"
          timeout 200 ncu --section SpeedOfLight --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats \
            --section MemoryWorkloadAnalysis --section SchedulerStats --section Occupancy \
            -k regex:"$rx" -c "$n" python3 bench/kernel_times.py --plain --only "$only" 2>&1 \
            | grep -vE "^\s*$" >> "$OUT/ncu.txt"
        done
        grep -E "^  _|Duration|Warp Cycles Per Issued|Registers Per|Block Size|Grid Size|Stall|Memory Throughput|Compute \(SM\)" "$OUT/ncu.txt" | head -90
      else echo "no ncu here"; fi ;;
    dump)  # every compiled Triton kernel (TTIR + options + resources) for bench/kernel_targets.py
      python3 bench/kernel_dump.py "$OUT/kernels.json.gz" 2>&1 | tee "$OUT/kernel_dump.txt" | tail -16 ;;
    serve)  # `dsv4 bench serve` on a tiny model served on the GPU defaults and eagerly: the
      # serving stack's own ceiling (host, engine, HTTP), its model time negligible
      python3 -m dsv4.cli make-tiny /tmp/serve_tiny --tokenizer bytes --vocab-size 300 > /dev/null
      # (SERVE_MODES="prefix": graphs and prefix caching, every prompt after one shared
      # PREFIX_LEN-token prefix; "nocache": graphs without prefix caching, which is on by default)
      for mode in ${SERVE_MODES:-graphs eager}; do serve_mode $mode $mode; done ;;
    serve_ab)  # the serve bench in graphs mode for each package in AB_BASES (as base_ab), then
      # this tree, alternated SERVE_AB_ROUNDS times
      python3 -m dsv4.cli make-tiny /tmp/serve_tiny --tokenizer bytes --vocab-size 300 > /dev/null
      for r in $(seq ${SERVE_AB_ROUNDS:-1}); do
        for b in ${AB_BASES:-ab_base}; do SERVE_PATH=$PWD/$b serve_mode graphs "${b}_$r"; done
        serve_mode graphs "cur_$r"
      done ;;
    sweep)  # tiles / splits of sparse_attn, indexer scores, hc_pre
      python3 bench/sweep_kernels.py ${SWEEP:+--only $SWEEP} --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.txt" ;;
  esac
done
