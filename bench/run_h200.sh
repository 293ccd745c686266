#!/usr/bin/env bash
# Device runs for bench/RESULTS.md, one stage per call (each well inside the 10-minute limit):
#   bash bench/run_h200.sh check    # kernel tests on CUDA, GPU-vs-CPU and GPU-vs-transformers greedy
#                                   # (CHECKS=float32,bf16 runs only those of bench/gpu_correctness.py,
#                                   # 8 GB of KV each: CHECK_MEMORY_BUDGET)
#   bash bench/run_h200.sh decode   # hibana bench decode, qwen3-8b preset
#   bash bench/run_h200.sh agents   # hibana bench agents, qwen3-8b preset, 32 agents
#   bash bench/run_h200.sh tune     # bench/tune_decode.py: kernel sweeps, the decode step taken apart
#   bash bench/run_h200.sh small    # kernel fusion (issue 13's draft-model target): tune_decode.py --fusion on
#                                   # qwen3-0.6b (folds vs separate kernels at 0.6b and 8b shapes, decode per
#                                   # policy with kernels per step), then hibana bench decode of qwen3-0.6b and
#                                   # qwen3-8b under fusion auto / on / off
#   bash bench/run_h200.sh hybrid        # Qwen3.5: recurrent kernel tests on CUDA, tiny qwen3_5 / qwen3_5_moe vs
#                                        # transformers on the GPU, bench/tune_recurrent.py (the delta rule token
#                                        # by token against chunked, qwen3.5-35b-a3b's layer, 64 to 8192 rows),
#                                        # qwen3.5-35b-a3b batch-1 decode (HYBRID_DECODE=0:
#                                        # not; HYBRID_MODELS="qwen3.5-27b": the dense one, 54 GB, an H100's)
#   bash bench/run_h200.sh families      # issue 18: batch-1 decode of the gemma3-12b, phi4-mini,
#                                        # qwen3-30b-a3b and gpt-oss-20b presets (MODELS="phi4-mini": only
#                                        # those; MODELS=gpt-oss-120b: its 65 GB of MXFP4 weights; a preset's
#                                        # weights are on the GPU once, made as the engine loads them)
#   bash bench/run_h200.sh moe_agents    # issue 18: hibana bench agents, qwen3-30b-a3b preset, 32 agents as the
#                                        # agents stage: hibana, hibana_no_retention, then hf_reprefill with the
#                                        # transformers model on the GPU alone (MOE_MODEL, MOE_SYSTEMS: others;
#                                        # gpt-oss presets have no transformers peer). GPU memory: 61 GB of
#                                        # weights + half the rest as KV (~40 GB) while the engines run, then
#                                        # 61 GB + the peer's cache and activations (a few GB)
#   bash bench/run_h200.sh surgery       # batch-1 decode of qwen3-8b in bf16, w8 and w4 (issue 14)
#   bash bench/run_h200.sh policies      # tune_decode.py --fusion at 512 keys: MODEL's (phi4-mini) batch-1 decode
#                                        # under each of POLICIES (fusion policies and tile variants, see
#                                        # tune_decode.py's variant; default: the norm folded at K 3072 on the
#                                        # GEMV sweep's tiles against AUTO), the kernels of each step
#   bash bench/run_h200.sh prologue      # the one-launch attention prologue (partial rotary, Gemma's q/k norms):
#                                        # its kernel tests on CUDA, then tune_decode.py --skip-sweep on phi4-mini
#                                        # (PROLOGUE_MODEL: another preset): decode with the prologue split and
#                                        # fused, and the kernels of a step
#   bash bench/run_h200.sh kv8_check     # fp8 KV: its kernel tests on CUDA, GPU == CPU greedy (gpu_correctness --kv8-only)
#   bash bench/run_h200.sh kv8           # fp8 KV: 32 agents' turns/h and batch-1 decode, bf16 KV vs kv8, qwen3-8b
#   bash bench/run_h200.sh quant    # bench/tune_quant.py: int8/int4/fp8 linears against bf16 cuBLAS, Qwen3-8B shapes
#   bash bench/run_h200.sh tiles         # MoE expert tiles at T=1 (wide bf16, 4-bit x_vector), after the new
#                                        # kernels' tests on CUDA
#   bash bench/run_h200.sh gemv_tiles    # the dense GEMV's tile sweep at qwen3-0.6b and qwen3-30b-a3b shapes (MODELS=)
#   bash bench/run_h200.sh kv8_w4        # issue 14: 32 agents with fp8 KV beside bf16 KV (qwen3-8b); qwen3-32b in int4
#                                        # serving 32 agents (bf16 and w4 in one run: the bf16 one needs 65 GB)
#   bash bench/run_h200.sh a8            # issue 14: x int8 (dp4a): its kernel tests, bench/tune_quant.py --a8 at the
#                                        # Qwen3-8B layers (A8_SHAPES) and row counts (A8_ROWS: 1,4; several rows a
#                                        # program from 2), qwen3-8b decode bf16 / w8 / w4 with and
#                                        # without it, the demo model's w4 / w8 guard in bf16 on the GPU
#   bash bench/run_h200.sh a8_fold       # issue 14: qwen3-8b w4 / w8 decode with the quantize launches folded into
#                                        # the norm and SiLU kernels (Fusion.a8_fold, AUTO's) against separate
#   bash bench/run_h200.sh a8_blocks     # issue 14: the norm's / SiLU's programs a row in the x int8 folds
#                                        # (bench/a8_norm_blocks.py: BLOCKS=16x32,4x32 PASS=w4), step replay per setting
#   bash bench/run_h200.sh moe_a8        # issue 18: MXFP4 experts against int8 x: kernel tests, tune_moe.py --a8 at
#                                        # gpt-oss-20b's shape, gpt-oss-20b decode under AUTO and a8 tiles
#   bash bench/run_h200.sh step_gaps     # bench/step_gaps.py: qwen3-8b batch-1 decode at 512 keys in bf16 and w4
#                                        # (GAPS_PASSES; GAPS_ARGS="--speculation adaptive"), the step's wall time
#                                        # against its graph's replay
#   bash bench/run_h200.sh splits        # decode attention's splits past the keys (graphs) write and read nothing,
#                                        # graphs keyed by span: its kernel tests on CUDA, the bf16 demo vs
#                                        # transformers, qwen3-8b decode bf16 / w8 / w4, qwen3-0.6b decode
#   bash bench/run_h200.sh attention     # bench/tune_attention.py: decode attention's splits, tiles and merge by
#                                        # model shape at 512 and 8192 keys (ATTENTION_ARGS="--models qwen3-30b-a3b")
#   bash bench/run_h200.sh moe_a8_check  # issue 18: gpu_correctness moe_a8 (int8 x vs 16-bit x, tiny gpt_oss MXFP4
#                                        # in bf16), then hibana bench decode of gpt-oss-20b
#   bash bench/run_h200.sh quant_sweep   # bench/tune_quant.py --sweep: their tiles at 1 and 64 rows
#                                        # (QUANT_ARGS replaces "--rows 1,64", e.g. "--rows 4 --shapes o")
#   bash bench/run_h200.sh memory        # issue 17: 64 agents, tools of 1-5 s, device KV for 16: the host tier
#                                        # (hibana) against drop-and-recompute, then unbounded device KV
#   bash bench/run_h200.sh resume        # issue 17: an 8k-token qwen3-8b state parked and resumed, from host
#                                        # memory and from disk, against raw H2D / file-read bandwidth and re-prefill
#   bash bench/run_h200.sh draft_cost    # bench/draft_cost.py: the draft-model drafter's cost per drafted token
#   bash bench/run_h200.sh spec_decode   # trace-driven batch-1 decode, coding and demo traces, speculation off/k4/adaptive
#                                        # (SPEC_MODEL: another preset, e.g. qwen3.5-35b-a3b: a hybrid's verify graphs)
#   bash bench/run_h200.sh spec_agents   # trace-driven agents on the coding trace: 32 agents (off/k4/adaptive),
#                                        # then off vs adaptive at 1, 8 and 64 agents (AGENTS="64": only those)
#   bash bench/run_h200.sh grammar  # issue 15: xgrammar against llguidance on the host's CPU, then constrained
#                                   # decoding's overhead per token, qwen3-8b preset, batch 1 and 32; needs
#                                   # xgrammar (and llguidance) as wheels in .whl/ (bench/README.md)
#   bash bench/run_h200.sh train_demo   # issue 15: demo model v2 (--corpus $CORPUS --shape v2; CORPUS=v2, or v3 / v4
#                                       # with its state in bench/out/demo_train_v3 / _v4; v4 needs pycountry:
#                                       # carry .whl and put /tmp/site on PYTHONPATH first), TRAIN_MINUTES (7) of
#                                       # training a call; run it again on the same warm machine to resume
#                                       # (the state stays in bench/out/demo_train, ignored, kept between calls;
#                                       # a cold machine starts over). The first call cuts TRAIN_STEPS (4000)
#                                       # to what fits TRAIN_TOTAL_MINUTES (18) of training at its measured
#                                       # step time; the call that reaches the last step
#                                       # writes the checkpoint, evaluates it (v1 sets and heldout_v2, no
#                                       # grammar) and puts it under $OUT: demo_v2_meta.tgz and the weights in
#                                       # 15 MB pieces (files back are at most 16 MiB):
#                                       # cat model.safetensors.part-* > model.safetensors
#   bash bench/run_h200.sh moe      # issue 18: the MoE kernel tests on CUDA, then bench/tune_moe.py: fused_moe at
#                                   # Qwen3-30B-A3B (bf16) and gpt-oss-20b (MXFP4) expert shapes, T = 1, 8, 64, 512,
#                                   # against the torch reference (MOE_ARGS appended, e.g. "--sweep --tokens 1,64";
#                                   # MXFP4's decode tiles: "--models gpt-oss-20b --tokens 1,8 --sweep")
#   bash bench/run_h200.sh serve    # issue 19: hibana bench serve, the demo model (float32) and qwen3-8b's preset
#                                   # (bf16; SERVE_MODELS picks) on the GPU, 64 clients x 20
#                                   # tool-loop turns over HTTP (127.0.0.1) against the same in process; needs
#                                   # the grammar's wheels and the server's (bench/README.md) in .whl/
# BENCH_ARGS is appended to the spec_* commands (e.g. "--real-outputs --systems hibana" on an
# engine without speculation, to time the stages).
# HIBANA_COMMIT (e.g. `HIBANA_COMMIT=$(git rev-parse --short HEAD)` put into the run's command line from the
# local checkout) names the commit in the reports: the device's copy keeps the git metadata of its first copy.
# Runs from the repository root with the image's python3 (no install: PYTHONPATH). The wheel
# installs kernels/ and bench/ as hibana_kernels and hibana_bench; here a folder of links gives
# the checkout's folders those names.
set -uo pipefail
# pyproject's addopts ask for pytest-xdist's two workers, which the image lacks; a later -m wins
kernel_pytest() { python3 -m pytest -o addopts= -m "not slow or thinned" "$@"; }  # (thinned: CPU-only cuts)
NAMES="$(mktemp -d)"
trap 'rm -rf "$NAMES"' EXIT
ln -s "$PWD/kernels" "$NAMES/hibana_kernels"
ln -s "$PWD/bench" "$NAMES/hibana_bench"
export PYTHONUNBUFFERED=1 PYTHONPATH="$NAMES:$PWD${PYTHONPATH:+:$PYTHONPATH}" TQDM_DISABLE=1  # keeps carried wheels (/tmp/site)
OUT="${OUT:-bench/out}"
CHECKS="${CHECKS:-float32,speculation,surgery,kv8,fp8,bf16,families,logprobs,window,shapes,tiers,grammar,moe_fusion,graph_capture,a8_fold,moe_folds}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
case "${1:-check}" in
  check)
    # one process each, at once (tiny models leave the GPU mostly idle; in a row they take over
    # 10 minutes): the kernel tests and every check of bench/gpu_correctness.py, rows printed as
    # they come, each process's output together at the end
    # CHECK_SECONDS bounds each process, so that a call's limit still leaves every output
    LIMIT="timeout ${CHECK_SECONDS:-3600}"
    # KERNEL_TESTS=0: the checks alone; KERNEL_TESTS_K="pdl or sink": those kernel tests of both files;
    # KERNEL_JOBS=14: in that many processes (pytest-xdist and execnet carried as wheels, bench/README.md):
    # both files whole in ~80 s on an H100, where one process ran out of the 10-minute call at 12%
    if [ -n "${KERNEL_JOBS:-}" ]; then KERNEL_ARGS=(tests/test_moe_kernels.py -n "$KERNEL_JOBS" -p xdist)
    else KERNEL_ARGS=(-x); fi
    [ -n "${KERNEL_TESTS_K:-}" ] && KERNEL_ARGS+=(-k "$KERNEL_TESTS_K") &&
      { [ -n "${KERNEL_JOBS:-}" ] || KERNEL_ARGS+=(tests/test_moe_kernels.py); }
    [ "${KERNEL_TESTS:-1}" = 1 ] &&
      $LIMIT python3 -m pytest -o addopts= -m "not slow" tests/test_kernels.py "${KERNEL_ARGS[@]}" \
        -q -rs -p no:cacheprovider > "$OUT/kernel_tests.txt" 2>&1 &
    for check in ${CHECKS//,/ }; do
      $LIMIT python3 bench/gpu_correctness.py --only "$check" 2>&1 | grep -v "Token indices sequence length" \
        > "$OUT/gpu_correctness_$check.txt" &
    done
    wait
    [ -f "$OUT/kernel_tests.txt" ] && grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernel_tests.txt"
    cat "$OUT"/gpu_correctness_*.txt | tee "$OUT/gpu_correctness.txt" ;;
  decode)
    model="${DECODE_MODEL:-qwen3-8b}"  # DECODE_SYSTEMS=hibana: without the peer
    python3 -m hibana_bench.cli decode --model "$model" --context 512,8192 --generate 128 \
      ${DECODE_SYSTEMS:+--systems $DECODE_SYSTEMS} --json "$OUT/decode_$model.json" 2>&1 | tee "$OUT/decode_$model.txt" ;;
  agents)
    python3 -m hibana_bench.cli agents --model qwen3-8b --agents 32 --turns 6 --system 4096 \
      --tool-result 200 --generate 100 --peer-agents 1 \
      --json "$OUT/agents_qwen3-8b.json" 2>&1 | tee "$OUT/agents_qwen3-8b.txt" ;;
  moe_agents)
    model="${MOE_MODEL:-qwen3-30b-a3b}"
    python3 -m hibana_bench.cli agents --model "$model" --agents 32 --turns 6 --system 4096 \
      --tool-result 200 --generate 100 --peer-agents 1 \
      --systems "${MOE_SYSTEMS:-hibana,hibana_no_retention,hf_reprefill}" \
      --json "$OUT/agents_$model.json" 2>&1 | tee "$OUT/agents_$model.txt" ;;
  hybrid)
    # Qwen3.5: the recurrent kernels' tests on CUDA, the tiny qwen3_5 / qwen3_5_moe against transformers on
    # the GPU (float32, 4 agents batched), the delta rule's two kernels checked against each other and timed
    # at qwen3.5-35b-a3b's layer, then batch-1 decode of the qwen3.5-35b-a3b preset (69 GB of bf16
    # weights: an H200; HYBRID_DECODE=0 leaves it out)
    kernel_pytest tests/test_recurrent_kernels.py -q -rs -p no:cacheprovider 2>&1 | tail -5
    FAMILIES_ONLY=qwen3_5,qwen3_5_moe,qwen3_next python3 bench/gpu_correctness.py \
      --only families 2>&1 \
      | tee "$OUT/gpu_correctness_hybrid.txt"
    python3 bench/tune_recurrent.py --json "$OUT/tune_recurrent.json" 2>&1 | tee "$OUT/tune_recurrent.txt"
    if [ "${HYBRID_DECODE:-1}" = 1 ]; then
      for model in ${HYBRID_MODELS:-qwen3.5-35b-a3b}; do
        python3 -m hibana_bench.cli decode --model "$model" --context 512,8192 --generate 128 \
          --systems hibana_spec_off,hibana --json "$OUT/decode_$model.json" 2>&1 | tee "$OUT/decode_$model.txt"
      done
    fi ;;
  families)
    for model in ${MODELS:-gemma3-12b phi4-mini qwen3-30b-a3b gpt-oss-20b}; do
      python3 -m hibana_bench.cli decode --model "$model" --context 512,8192 --generate 128 \
        --systems hibana_spec_off,hibana --json "$OUT/decode_$model.json" 2>&1 | tee "$OUT/decode_$model.txt"
    done ;;
  tune)
    python3 bench/tune_decode.py 2>&1 | tee "$OUT/tune_decode.txt" ;;
  small)
    python3 bench/tune_decode.py --model qwen3-0.6b --fusion 2>&1 | tee "$OUT/tune_decode_fusion.txt"
    for model in qwen3-0.6b qwen3-8b; do
      python3 -m hibana_bench.cli decode --model "$model" --context 512,8192 --generate 128 --systems hibana \
        --fusion auto,on,off --json "$OUT/decode_fusion_$model.json" 2>&1 | tee "$OUT/decode_fusion_$model.txt"
    done ;;
  prologue)
    model="${PROLOGUE_MODEL:-phi4-mini}"
    kernel_pytest tests/test_kernels.py -q -rs -x -p no:cacheprovider -k "rotary" 2>&1 | tail -5
    python3 bench/tune_decode.py --model "$model" --skip-sweep 2>&1 | tee "$OUT/tune_decode_$model.txt" ;;
  policies)
    model="${MODEL:-phi4-mini}"
    python3 bench/tune_decode.py --model "$model" --fusion --skip-sweep --context "${CONTEXT:-512}" ${SURGERY:+--surgery $SURGERY} --policies \
      "${POLICIES:-auto,auto+norm_max_k=3072;norm_gemv=4x1024x4,auto+norm_max_k=3072;norm_gemv=4x1024x8,auto+norm_max_k=3072;norm_gemv=2x1024x4}" \
      2>&1 | tee "$OUT/policies_$model.txt" ;;
  surgery)
    python3 -m hibana_bench.cli decode --model qwen3-8b --context 512,8192 --generate 128 --systems hibana \
      --surgery w8,w4 --json "$OUT/decode_surgery_qwen3-8b.json" 2>&1 | tee "$OUT/decode_surgery_qwen3-8b.txt" ;;
  kv8_check)
    kernel_pytest tests/test_kernels.py -q -rs -x -p no:cacheprovider -k "fp8 or store_kv or attention" 2>&1 | tail -15
    python3 bench/gpu_correctness.py --kv8-only 2>&1 | tee "$OUT/gpu_correctness_kv8.txt" ;;
  kv8)
    python3 -m hibana_bench.cli agents --model qwen3-8b --agents 32 --turns 6 --system 4096 \
      --tool-result 200 --generate 100 --systems hibana --surgery kv8 \
      --json "$OUT/agents_kv8_qwen3-8b.json" 2>&1 | tee "$OUT/agents_kv8_qwen3-8b.txt"
    python3 -m hibana_bench.cli decode --model qwen3-8b --context 512,8192 --generate 128 --systems hibana \
      --surgery kv8 --json "$OUT/decode_kv8_qwen3-8b.json" 2>&1 | tee "$OUT/decode_kv8_qwen3-8b.txt" ;;
  quant)
    kernel_pytest tests/test_kernels.py -q -x -k "quant or fp8" -p no:cacheprovider 2>&1 | tail -2
    python3 bench/tune_quant.py --json "$OUT/tune_quant.json" 2>&1 | tee "$OUT/tune_quant.txt" ;;
  moe)
    kernel_pytest tests/test_moe_kernels.py -q -rs -x -m "" -p no:cacheprovider 2>&1 | tail -5  # -m "": the slow tile shapes too
    python3 bench/tune_moe.py ${MOE_ARGS:-} --json "$OUT/tune_moe.json" 2>&1 | tee "$OUT/tune_moe.txt" ;;
  tiles)
    # the MoE experts' decode tiles at one token (the wide bf16 tiles, the 4-bit x_vector variant)
    kernel_pytest tests/test_moe_kernels.py tests/test_kernels.py -q -x -p no:cacheprovider \
      -k "fused_moe_tiles or mxfp4_codes or linear_quant_tiles or pdl or norm_route or sink or silu_and_mul_linear" 2>&1 | tail -3
    python3 bench/tune_moe.py --sweep --tokens 1 --models qwen3-30b-a3b,gpt-oss-20b,qwen3-30b-a3b-w4 \
      --json "$OUT/tune_moe_tiles.json" 2>&1 | tee "$OUT/tune_moe_tiles.txt" ;;
    # (the int4 linears' x_vector: QUANT_ARGS="--formats int4 --rows 1 --shapes gate_up" bash bench/run_h200.sh
    # quant_sweep, a call of its own: ~60 tiles a shape)
  gemv_tiles)
    for model in ${MODELS:-qwen3-0.6b qwen3-30b-a3b}; do  # the dense GEMV's tiles at small widths (K <= 2048), PDL on
      python3 bench/tune_decode.py --model "$model" --gemv-sweep-only 2>&1 | tee "$OUT/tune_gemv_$model.txt"
    done ;;
  a8)
    # x int8 (dp4a) at one row: its kernel tests on CUDA, its tiles on int4 and int8 weights against the
    # 16-bit x kernels (x's quantization in each time), qwen3-8b's batch-1 decode in bf16, w8 and w4
    # with it (the default) and without (HIBANA_A8_ROWS=0), and the guard of w4 and w8 on the demo
    # model in bf16 on the GPU
    kernel_pytest tests/test_kernels.py -q -rs -x -p no:cacheprovider -k "a8 or linear_quant or dispatch" 2>&1 | tail -3
    python3 bench/gpu_correctness.py --only a8_fold 2>&1 | grep -E "PASS|FAIL"
    python3 bench/tune_quant.py --a8 --a8-rows "${A8_ROWS:-1,4}" --shapes "${A8_SHAPES:-gate_up,down,qkv,o}" \
      --json "$OUT/tune_quant_a8.json" 2>&1 \
      | grep -v "^  a8 " | tee "$OUT/tune_quant_a8.txt"
    for rows in 1 0; do
      HIBANA_A8_ROWS=$rows python3 -m hibana_bench.cli decode --model qwen3-8b --context 512,8192 --generate 128 \
        --systems hibana --surgery w8,w4 --json "$OUT/decode_a8_rows$rows.json" 2>&1 | tee "$OUT/decode_a8_rows$rows.txt"
    done
    for pass in w4 w8; do
      python3 -m hibana_core.cli surgery demo --passes $pass --device cuda --dtype bfloat16 --force 2>&1 \
        | tee "$OUT/guard_demo_${pass}_bf16.txt" | tail -12
    done ;;
  a8_fold)
    # issue 14: qwen3-8b in w4 (and w8), batch-1 decode at 512 keys, the quantize launches separate
    # against folded into the norm and SiLU-and-mul kernels that write x (Fusion.a8_fold, AUTO's), kernels per step
    for pass in ${A8_FOLD_PASSES:-w4 w8}; do
      python3 bench/tune_decode.py --model qwen3-8b --fusion --skip-sweep --context 512 --surgery $pass \
        --policies "auto+a8_fold=0,auto" 2>&1 | tee "$OUT/a8_fold_$pass.txt" | tail -4
    done ;;
  a8_blocks)
    # issue 14: the x int8 folds' blocks a program (bench/a8_norm_blocks.py; BLOCKS, PASS), graph replay per setting
    python3 bench/a8_norm_blocks.py 2>&1 | grep -E "A8_NORM_BLOCKS|replay alone|_rms_norm_a8|_silu_and_mul_a8" \
      | tee "$OUT/a8_blocks.txt" ;;
  moe_a8)
    # issue 18: MXFP4 experts against int8 x (DecodeTiles.a8): its kernel tests on CUDA, its tiles at
    # gpt-oss-20b's shape at T=1 beside the float GEMV's, then the whole gpt-oss-20b decode under AUTO
    # and three a8 tiles (A8_POLICIES)
    kernel_pytest tests/test_moe_kernels.py tests/test_kernel_compile.py -q -rs -x -p no:cacheprovider -k "a8" 2>&1 | tail -3
    python3 bench/tune_moe.py --models gpt-oss-20b --tokens 1 --a8 --json "$OUT/tune_moe_a8.json" 2>&1 \
      | tee "$OUT/tune_moe_a8.txt" | grep -E "fastest|mxfp4.*True|a8" | head -40
    python3 bench/tune_decode.py --model gpt-oss-20b --fusion --skip-sweep --context 512 --policies \
      "${A8_POLICIES:-auto,auto;mxfp4=8x256x1xa,auto;mxfp4=2x2048x2xa,auto;mxfp4=4x1024x2xa}" \
      2>&1 | tee "$OUT/decode_moe_a8_gpt-oss-20b.txt" | tail -8 ;;
  step_gaps)
    for pass in ${GAPS_PASSES:-none w4}; do
      python3 bench/step_gaps.py --model qwen3-8b --surgery "${pass#none}" --context 512 ${GAPS_ARGS:-} 2>&1 \
        | grep -v Warning | tee "$OUT/step_gaps_$pass.txt"
    done ;;
  splits)
    kernel_pytest tests/test_kernels.py -q -rs -x -p no:cacheprovider -k "paged_attention" 2>&1 | tail -2
    timeout 200 python3 bench/gpu_correctness.py --only bf16 2>&1 | grep -E "PASS|FAIL"
    python3 -m hibana_bench.cli decode --model qwen3-8b --context 512,8192 --generate 128 \
      --systems hibana --surgery w8,w4 --json "$OUT/decode_splits.json" 2>&1 | tee "$OUT/decode_splits.txt"
    python3 -m hibana_bench.cli decode --model qwen3-0.6b --context 512,8192 --generate 128 \
      --systems hibana --json "$OUT/decode_splits_qwen3-0.6b.json" 2>&1 | tee "$OUT/decode_splits_qwen3-0.6b.txt" ;;
  attention)
    # decode attention at batch 1 by model shape: split counts, decode tiles, the split merge's tiles
    python3 bench/tune_attention.py ${ATTENTION_ARGS:-} --json "$OUT/tune_attention.json" 2>&1 | tee "$OUT/tune_attention.txt" ;;
  moe_a8_check)
    python3 bench/gpu_correctness.py --only moe_a8 2>&1 | grep -E "PASS|FAIL"
    python3 -m hibana_bench.cli decode --model gpt-oss-20b --context 512,8192 --generate 128 \
      --systems hibana --json "$OUT/decode_gpt-oss-20b.json" 2>&1 | tee "$OUT/decode_gpt-oss-20b.txt" ;;
  quant_sweep)
    python3 bench/tune_quant.py --sweep ${QUANT_ARGS:---rows 1,64} --json "$OUT/tune_quant_sweep.json" 2>&1 \
      | tee "$OUT/tune_quant_sweep.txt" ;;
  kv8_w4)
    # issue 14's fp8 KV (32 agents' turns/h against bf16 KV, in one run) and qwen3-32b in int4 serving 32 agents
    python3 -m hibana_bench.cli agents --model qwen3-8b --agents 32 --turns 6 --system 4096 --tool-result 200 \
      --generate 100 --systems hibana --surgery kv8 --json "$OUT/agents_kv8_qwen3-8b.json" 2>&1 \
      | tee "$OUT/agents_kv8_qwen3-8b.txt"
    python3 -m hibana_bench.cli agents --model qwen3-32b --agents 32 --turns 3 --system 4096 --tool-result 200 \
      --generate 100 --systems hibana --surgery w4 --json "$OUT/agents_w4_qwen3-32b.json" 2>&1 \
      | tee "$OUT/agents_w4_qwen3-32b.txt" ;;
  memory)
    python3 -m hibana_bench.cli agents --model qwen3-8b --agents 64 --turns 6 --system 4096 --tool-result 200 \
      --generate 100 --tool-latency 1,5 --device-kv-agents 16 --systems "${MEMORY_SYSTEMS:-hibana,hibana_recompute}" \
      --json "$OUT/agents_memory_qwen3-8b.json" 2>&1 | tee "$OUT/agents_memory_qwen3-8b.txt"
    [ "${MEMORY_UNBOUNDED:-1}" = 1 ] &&  # MEMORY_UNBOUNDED=0: the bounded run alone
    python3 -m hibana_bench.cli agents --model qwen3-8b --agents 64 --turns 6 --system 4096 --tool-result 200 \
      --generate 100 --tool-latency 1,5 --systems hibana \
      --json "$OUT/agents_memory_unbounded_qwen3-8b.json" 2>&1 | tee "$OUT/agents_memory_unbounded_qwen3-8b.txt" ;;
  resume)
    RESUME_DIR="$OUT" python3 bench/resume_cost.py --model qwen3-8b --context 8192 --json "$OUT/resume_cost.json" \
      2>&1 | tee "$OUT/resume_cost.txt" ;;
  draft_cost)
    python3 bench/draft_cost.py --json "$OUT/draft_cost.json" 2>&1 | tee "$OUT/draft_cost.txt" ;;
  grammar)
    python3 -m hibana_bench.grammar_libs --json "$OUT/grammar_libs_h200host.json" 2>&1 \
      | tee "$OUT/grammar_libs_h200host.txt"
    python3 -m hibana_bench.cli grammar --model qwen3-8b --batch 1,32 --json "$OUT/grammar_qwen3-8b.json" 2>&1 \
      | tee "$OUT/grammar_qwen3-8b.txt" ;;
  serve)
    # the demo model in float32, where greedy outputs over HTTP must equal the in-process ones (in
    # bf16 the two runs' batches round differently); qwen3-8b: the H200 preset (random weights, the
    # demo tokenizer; bf16, its equality reported, not checked); the clients in 4 processes, so that
    # one openai SDK loop parsing every chunk does not pace the run (CLIENT_PROCESSES=1: as before)
    for model in ${SERVE_MODELS:-demo qwen3-8b}; do
      DTYPE=auto; [ "$model" = demo ] && DTYPE=float32
      python3 -m hibana_bench.cli serve --model "$model" --device cuda --dtype "$DTYPE" --clients 64 --turns 20 \
        --client-processes "${CLIENT_PROCESSES:-4}" --json "$OUT/serve_${model}_h200.json" 2>&1 | tee "$OUT/serve_${model}_h200.txt"
    done ;;
  train_demo)
    CORPUS="${CORPUS:-v2}"                 # v3 / v4: corpus_v3.py / corpus_v4.py, each its own state and tokenizer
    TRAIN_DIR="${TRAIN_DIR:-bench/out/demo_train$([ "$CORPUS" = v2 ] || echo "_$CORPUS")}"
    RESUME=""
    [ -f "$TRAIN_DIR/train_state.pt" ] && RESUME="--resume"
    python3 -m hibana_core.demo.train --corpus "$CORPUS" --shape v2 --train-dir "$TRAIN_DIR" --out "$TRAIN_DIR/model" \
      --conversations "${TRAIN_CONVERSATIONS:-250000}" --steps "${TRAIN_STEPS:-4000}" --batch-tokens 98304 \
      --checkpoint-every 250 --chunk-minutes "${TRAIN_MINUTES:-7}" --max-minutes "${TRAIN_TOTAL_MINUTES:-18}" \
      --workers 15 $RESUME ${TRAIN_ARGS:-} 2>&1 \
      | tee "$OUT/train_demo.txt"
    if [ -f "$TRAIN_DIR/model/training_report.json" ]; then
      tar czf "$OUT/demo_v2_meta.tgz" -C "$TRAIN_DIR/model" config.json generation_config.json tokenizer.json \
        tokenizer_config.json training_report.json
      split -b 15000000 -d "$TRAIN_DIR/model/model.safetensors" "$OUT/model.safetensors.part-"
      sha256sum "$TRAIN_DIR/model/model.safetensors" | tee "$OUT/model.sha256"
    fi ;;
  spec_decode)
    for spec in ${SPEC_TRACES:-coding:2 demo:8}; do  # trace:conversations
      set -- "${spec%:*}" "${spec#*:}"
      python3 -m hibana_bench.cli decode --model "${SPEC_MODEL:-qwen3-8b}" --trace "$1" --conversations "$2" \
        ${BENCH_ARGS:-} --json "$OUT/spec_decode_$1.json" 2>&1 | tee "$OUT/spec_decode_$1.txt"
    done ;;
  spec_agents)
    if [ -z "${AGENTS:-}" ]; then
      python3 -m hibana_bench.cli agents --model qwen3-8b --trace coding --agents 32 ${BENCH_ARGS:-} \
        --json "$OUT/spec_agents_32.json" 2>&1 | tee "$OUT/spec_agents_32.txt"
    fi
    for n in ${AGENTS:-1 8 64}; do
      python3 -m hibana_bench.cli agents --model qwen3-8b --trace coding --agents "$n" \
        --systems hibana_spec_off,hibana ${BENCH_ARGS:-} \
        --json "$OUT/spec_agents_$n.json" 2>&1 | tee "$OUT/spec_agents_$n.txt"
    done ;;
esac
