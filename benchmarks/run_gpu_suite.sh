#!/usr/bin/env bash
# The GPU tests (kernels, sampler, engine equality), then W2 latency and W1 throughput, in one go.
# Usage: bash benchmarks/run_gpu_suite.sh [steps...]
#   steps: tests (all GPU tests) kernels sampler engine enginefp32 kernelbench layerbench splitsbench
#          samplerbench w2 w2hf w1 w1prof w1trace w1hf serve ttft pacing pacetrace coldstart asyncprobe poolcost
#          w5 (int4 AWQ layout, batch 1) w8a8 gemvbench stagegraphs w8a8lat w6 w1fp8 w5prof
#          streamprobe w5ablate logitsbench w8tc replayprobe stepgap decodelayers (dltests dlbench
#          dlw5 dlengine) dldiff dlncu rows (rowstests rowsbench rowsw5) rowsstress rowsncu int4steps
#          (the row-tile kernel's repeated-call test, STRESS_RUNS times, each run's report kept)
#          two GPUs: tptests tp2lat tp2serve 70btp2 70bserve ppbench arbench
#            (SPLITS_70B="tp2 pp2": the 70B splits, as tags; TP_SIZES="2 1"; PP_MODEL, PP_SETUPS)
# Logs, JUnit XML (tests) and JSON results go under $OUT (default /tmp/out).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NOTE: NVLink multicast stays off on shared multi-GPU hosts (a program using it can take the
# host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
CFG="${CFG:-benchmarks/configs}"
steps="${*:-kernels sampler engine w2 w1}"
wheels() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"; }
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40; echo "=== $name rc=${PIPESTATUS[0]}"; }
# W5's model: Llama-3-8B's config with an AWQ quantization_config (4 bits, group 128, zero points)
awq_config() { python -c "import json,sys; c=json.load(open(sys.argv[1])); c['quantization_config']={'quant_method':'awq','bits':4,'group_size':128,'zero_point':True,'version':'gemm'}; json.dump(c,open(sys.argv[2],'w'))" "$CFG/llama-3-8b.json" "$OUT/llama-3-8b-awq.json"; }
gputest() { local name=$1 limit=$2; shift 2; run "$name" "$limit" python -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/$name.xml" "$@"; }
for s in $steps; do
  case $s in
    tests)   gputest gpu_tests 900 tests/gpu ;;
    kernels) gputest kernels 420 tests/gpu/test_gpu_attention_kernels.py tests/gpu/test_gpu_elementwise_kernels.py tests/gpu/test_gpu_rope_store.py ;;
    sampler) gputest sampler 180 tests/gpu/test_gpu_sampling_kernel.py ;;
    engine)  gputest engine 480 tests/gpu/test_gpu_engine.py ;;
    kernelbench)  run kernelbench 240 python benchmarks/gpu_kernels.py ;;
    layerbench)   run layerbench 120 python benchmarks/layer_kernels_bench.py "$OUT/layer_kernels.json" ;;
    splitsbench)  run splitsbench 240 python benchmarks/decode_splits_bench.py --out "$OUT/decode_splits.json" ;;
    samplerbench) run samplerbench 120 python benchmarks/gpu_sampler.py ;;
    logitsbench)  run logitsbench 150 python benchmarks/logits_bench.py --out "$OUT/logits.json" ;;
    w2)      run w2 150 python -m peregrine.entrypoints.cli bench latency --model "$CFG/llama-3-8b.json" --output-json "$OUT/w2.json" ;;
    w2hf)    run w2hf 300 python -m peregrine.entrypoints.cli bench latency --model "$CFG/llama-3-8b.json" --iters 1 --compare-transformers --output-json "$OUT/w2hf.json" ;;
    w1)      run w1 200 python -m peregrine.entrypoints.cli bench throughput --model "$CFG/qwen3-0.6b.json" --output-json "$OUT/w1.json" ;;
    w1prof)  run w1prof 200 python -m peregrine.entrypoints.cli bench throughput --model "$CFG/qwen3-0.6b.json" --torch-profile 400:404 --torch-profile-out "$OUT/w1_profile.txt" --output-json "$OUT/w1prof.json" ;;
    serve)   wheels
             run w3 450 python benchmarks/serve_workloads.py w3 --num-prompts "${W3_PROMPTS:-1000}" --rates "${W3_RATES:-inf,32}" --out-dir "$OUT/serve"
             run w4 200 python benchmarks/serve_workloads.py w4 --w4-prompts "${W4_PROMPTS:-60}" --out-dir "$OUT/serve" ;;
    ttft)    wheels
             run probe 300 python benchmarks/ttft_probe.py --out "$OUT/ttft_probe.json"
             run w4diag 300 python benchmarks/serve_workloads.py w4 --w4-prompts "${W4_PROMPTS:-60}" --w4-no-zero-hits --out-dir "$OUT/serve_diag"
             [ -n "${W4_EXTRA_ENV:-}" ] && run w4exp 200 env $W4_EXTRA_ENV python benchmarks/serve_workloads.py w4 --w4-caching on --w4-no-zero-hits --w4-prompts "${W4_PROMPTS:-60}" --out-dir "$OUT/serve_exp" ;;
    coldstart) run coldstart 400 python benchmarks/cold_start.py --out "$OUT/cold_start.json" ;;
    asyncprobe) run asyncprobe 300 python benchmarks/async_probe.py --out "$OUT/async_probe.json" ;;
    poolcost) wheels  # tokenization in the server's pool vs inline on the event loop
             run poolcost 290 python benchmarks/pool_cost.py --json "$OUT/pool_cost.json" --finite-prompts "${POOL_FINITE_PROMPTS:-600}" -- --max-num-seqs 1024 ;;
    pacing)  wheels  # TTFT at 8 req/s with the core's launch pacer on and off, then rate inf
             run w3rate8_paced 200 python benchmarks/serve_workloads.py w3 --num-prompts 400 --rates 8 --tag _paced --out-dir "$OUT/serve"
             run w3rate8_unpaced 200 env PEREGRINE_CORE_PACING=0 python benchmarks/serve_workloads.py w3 --num-prompts 400 --rates 8 --tag _unpaced --out-dir "$OUT/serve"
             run w3inf_paced 300 python benchmarks/serve_workloads.py w3 --num-prompts 1000 --rates inf --server-args "--max-num-seqs 1024" --tag _seqs1024_paced --out-dir "$OUT/serve" ;;
    pacetrace) # TTFT inside the core at 8 req/s, per pacer margin (no HTTP); PACERS, TRACE_PROMPTS
             run pacetrace 400 python benchmarks/pacing_trace.py --pacers "${PACERS:-off,default,1.0:0.25}" --num-prompts "${TRACE_PROMPTS:-200}" --out "$OUT/pacing_trace.json" ;;
    enginefp32) gputest engine 300 tests/gpu/test_gpu_engine.py -k fp32 ;;
    w5)      awq_config
             for v in ${W5_VARIANTS:-default}; do  # one-row GEMV variants to compare (PEREGRINE_WNA16_GEMV)
               PEREGRINE_WNA16_GEMV="${v#default}" timeout 150 python -m peregrine.entrypoints.cli bench latency --model "$OUT/llama-3-8b-awq.json" --output-json "$OUT/w5_$v.json" > "$OUT/w5_$v.log" 2>&1
               python -c "import json,sys; print('w5', sys.argv[2], round(json.load(open(sys.argv[1]))['decode_tokens_per_s'], 1))" "$OUT/w5_$v.json" "$v"
             done ;;
    w8a8)    run w8a8 400 python benchmarks/w8a8_bench.py --model "$CFG/llama-3-8b.json" --output-json "$OUT/w8a8.json" ;;
    # single batch-1 rows (~25-60 s each): FP8 W8A8 online, int6 RTN; W1 with an FP8 KV cache
    w8a8lat) run w8a8lat 150 python -m peregrine.entrypoints.cli bench latency --model "$CFG/llama-3-8b.json" --quantization fp8 --output-json "$OUT/w8a8_latency.json" ;;
    w6)      run w6 150 python -m peregrine.entrypoints.cli bench latency --model "$CFG/llama-3-8b.json" --quantization rtn-int6 --output-json "$OUT/w6.json" ;;
    w1fp8)   run w1fp8 200 python -m peregrine.entrypoints.cli bench throughput --model "$CFG/qwen3-0.6b.json" --kv-cache-dtype fp8 --output-json "$OUT/w1fp8.json" ;;
    # where a W5 token's GPU time goes, kernel by kernel (ten decode steps of one request)
    w5prof)  awq_config
             run w5prof 200 python -m peregrine.entrypoints.cli bench throughput --model "$OUT/llama-3-8b-awq.json" --num-prompts 1 --min-input 128 --max-input 128 --min-output 300 --max-output 300 --torch-profile 100:110 --torch-profile-out "$OUT/w5_profile.txt" ;;
    # batch 1: the engine's time per token against its decode graph replayed back to back
    replayprobe) awq_config
             run replay_w5 200 python benchmarks/graph_replay_probe.py "$OUT/replay_w5.json" -- --model "$OUT/llama-3-8b-awq.json"
             run replay_fp8 200 python benchmarks/graph_replay_probe.py "$OUT/replay_fp8.json" -- --model "$CFG/llama-3-8b.json" --quantization fp8
             run replay_w2 200 python benchmarks/graph_replay_probe.py "$OUT/replay_w2.json" -- --model "$CFG/llama-3-8b.json" ;;
    # batch 1: what the GPU runs between two decode graphs (greedy rows, as bench latency)
    stepgap) awq_config
             run stepgap_w5 200 python benchmarks/step_gap_probe.py "$OUT/stepgap_w5.json" -- --model "$OUT/llama-3-8b-awq.json"
             run stepgap_fp8 200 python benchmarks/step_gap_probe.py "$OUT/stepgap_fp8.json" -- --model "$CFG/llama-3-8b.json" --quantization fp8 ;;
    streamprobe) run streamprobe 200 python benchmarks/gemv_stream_probe.py --out "$OUT/stream_probe.json" ;;
    # the persistent decode kernel: its GPU checks, its forms over 32 Llama-3-8B layers (DL_RINGS:
    # warps x stages; DL_VARIANTS: x steps ahead x registers; DL_X: smem and/or l2, where the
    # GEMVs read x), W5 with the one-kernel decode path
    # on and off, alternating, and the engine's check of the path
    # the persistent decode kernel: its checks, its forms' timings, W5 with it on and off, the
    # engine's path through it (each part fits one 10-minute call; decodelayers runs all four)
    # the row-tile persistent kernel: its checks, its forms' timings beside the other kernel's,
    # W5 with each form of the one-kernel path and without it
    rows|rowstests) gputest decode_rows 300 tests/gpu/test_gpu_decode_rows.py ;;&
    rowsstress) for n in $(seq "${STRESS_RUNS:-10}"); do
                  gputest "decode_rows_repeated_$n" 120 tests/gpu/test_gpu_decode_rows.py -k repeated
                done ;;
    int4steps) run int4_step_bench 120 python benchmarks/int4_step_bench.py --out "$OUT/int4_step.json" ;;
    # the row-tile kernel's warp stalls by SASS instruction, per loader form (Nsight Compute)
    rowsncu) for w in ${NCU_WAITS:-free dataflow nochunk}; do
               run "rows_ncu_$w" 200 ncu --clock-control none --profile-from-start off -k regex:decode_rows_kernel --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis -f -o "$OUT/rows_$w" python benchmarks/decode_rows_bench.py --ncu --out - --layers "${NCU_LAYERS:-8}" --placements 2x4 --waits "$w" --pre 0
               ncu --import "$OUT/rows_$w.ncu-rep" --page source --csv --print-source sass > "$OUT/rows_${w}_sass.csv" 2>&1
               ncu --import "$OUT/rows_$w.ncu-rep" --page details > "$OUT/rows_${w}_details.txt" 2>&1
             done ;;
    rows|rowsbench) run decode_rows_bench 300 python benchmarks/decode_rows_bench.py --out "$OUT/decode_rows.json" ;;&
    rows|rowsw5) awq_config
             for flag in rows 0 split; do
               PEREGRINE_DECODE_LAYERS=$flag timeout 150 python -m peregrine.entrypoints.cli bench latency --model "$OUT/llama-3-8b-awq.json" --output-json "$OUT/w5_rows_$flag.json" > "$OUT/w5_rows_$flag.log" 2>&1
               python -c "import json,sys; print('w5 PEREGRINE_DECODE_LAYERS=' + sys.argv[2], round(json.load(open(sys.argv[1]))['decode_tokens_per_s'], 1))" "$OUT/w5_rows_$flag.json" "$flag"
             done ;;&
    decodelayers|dltests) gputest decode_layers 400 tests/gpu/test_gpu_wait_count.py tests/gpu/test_gpu_decode_layer_ring.py ;;&
    decodelayers|dlbench) run decode_layers_bench 330 python benchmarks/decode_layer_ring.py --out "$OUT/decode_layers.json" --rings "${DL_RINGS:-4x16}" --variants "${DL_VARIANTS:-4x128}" --x "${DL_X:-smem,l2}" --pair "${DL_PAIR:-0}" --f16 "${DL_F16:-0}" --pipe "${DL_PIPE:-0}" --xsum "${DL_XSUM:-0}" --per-sm "${DL_PER_SM:-1}" --poll "${DL_POLL:-1}" --x-pairs "${DL_XPAIRS:-0}" ${DL_FORMS:+--forms "$DL_FORMS"} ${DL_ACC2:+--acc2 "$DL_ACC2"} ;;&
    decodelayers|dlw5) awq_config
             for flag in 1 0 1 0; do
               PEREGRINE_DECODE_LAYERS=$flag timeout 150 python -m peregrine.entrypoints.cli bench latency --model "$OUT/llama-3-8b-awq.json" --output-json "$OUT/w5_layers$flag.json" > "$OUT/w5_layers$flag.log" 2>&1
               python -c "import json,sys; print('w5 one kernel' if sys.argv[2] == '1' else 'w5 kernel a phase', round(json.load(open(sys.argv[1]))['decode_tokens_per_s'], 1))" "$OUT/w5_layers$flag.json" "$flag"
             done ;;&
    decodelayers|dlengine) gputest one_kernel_decode 500 tests/gpu/test_gpu_one_kernel_decode.py ;;&
    decodelayers|dltests|dlbench|dlw5|dlengine) ;;
    # the one-kernel path against the layers inside the engine, step by step
    dldiff)  run one_kernel_diff 400 python benchmarks/one_kernel_diff.py --out "$OUT/one_kernel_diff.json" ;;
    # the persistent kernel's warp stalls by SASS instruction (Nsight Compute)
    dlncu)   run dl_ncu 400 ncu --clock-control none --profile-from-start off -k regex:decode_layers_kernel --section WarpStateStats --section SchedulerStats --section SourceCounters --section SpeedOfLight -f -o "$OUT/dl_ring" python benchmarks/decode_layer_ring.py --ncu --out "$OUT/dl_ncu.json" --layers "${DL_LAYERS:-8}" --rings "${DL_RINGS:-4x16}" --variants "${DL_VARIANTS:-4x128}" --x "${DL_X:-smem}" --pair "${DL_PAIR:-0}" --f16 "${DL_F16:-0}" --pipe "${DL_PIPE:-0}" --xsum "${DL_XSUM:-0}" --forms ring
             run dl_ncu_sass 120 ncu --import "$OUT/dl_ring.ncu-rep" --page source --csv --print-source sass
             run dl_ncu_details 60 ncu --import "$OUT/dl_ring.ncu-rep" --page details ;;
    w5ablate) awq_config  # W5 with parts of the step left out (time only): each part's share
             for p in ${ABLATE_PARTS:-none norm attention rope_store gemv norm,attention,rope_store gemv,norm,attention,rope_store,lm_head}; do
               timeout 150 python benchmarks/ablate.py "$p" -- bench latency --model "$OUT/llama-3-8b-awq.json" --output-json "$OUT/w5_ablate_${p//,/+}.json" > "$OUT/w5_ablate_${p//,/+}.log" 2>&1
               python -c "import json,sys; print('w5 without', sys.argv[2], round(json.load(open(sys.argv[1]))['decode_tokens_per_s'], 1))" "$OUT/w5_ablate_${p//,/+}.json" "$p"
             done ;;
    # the 8-bit tensor-core GEMV: per call (FP8 per channel and in 128 x 128 blocks, int8), then
    # N sequences decoding together with it off (TC_GEMV_MAX_M=0) and on: online FP8, block FP8,
    # INT8
    w8tc)    run w8tc_calls 200 python benchmarks/fp8_tc_bench.py --out "$OUT/fp8_tc.json"
             run w8tc_calls_block 200 python benchmarks/fp8_tc_bench.py --block --out "$OUT/fp8_tc_block.json"
             python -c "import json,sys; c=json.load(open(sys.argv[1])); c['quantization_config']={'quant_method':'fp8','fmt':'e4m3','activation_scheme':'dynamic','weight_block_size':[128,128]}; json.dump(c,open(sys.argv[2],'w'))" "$CFG/llama-3-8b.json" "$OUT/llama-3-8b-fp8-block.json"
             run w8tc_calls_int8 200 python benchmarks/fp8_tc_bench.py --int8 --out "$OUT/int8_tc.json"
             python -c "import json,sys; from peregrine.testing.fp8_pack import compressed_tensors_config as q; c=json.load(open(sys.argv[1])); c['quantization_config']=q('int8_dynamic'); json.dump(c,open(sys.argv[2],'w'))" "$CFG/llama-3-8b.json" "$OUT/llama-3-8b-int8.json"
             for model in "$CFG/llama-3-8b.json --quantization fp8" "$OUT/llama-3-8b-fp8-block.json" "$OUT/llama-3-8b-int8.json"; do
               for n in ${W8TC_SEQS:-2 4 8}; do for tc in 0 8; do
                 rm -f "$OUT/w8tc.json"
                 timeout 200 python benchmarks/with_constants.py peregrine.layers.quantization.fp8.TC_GEMV_MAX_M=$tc -- bench throughput --model $model --num-prompts "$n" --min-input 128 --max-input 128 --min-output 512 --max-output 512 --output-json "$OUT/w8tc.json" > "$OUT/w8tc_run.log" 2>&1
                 python -c "import json,sys; print(sys.argv[2], round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" "$OUT/w8tc.json" "${model##*/} seqs=$n TC_GEMV_MAX_M=$tc"
               done; done
             done ;;
    gemvbench) run gemvbench 300 python benchmarks/gemv_bench.py --models 8b --rows "${GEMV_ROWS:-1,2,4}" --variants "${GEMV_VARIANTS:-inplace,inplace_prefetch,half2,half2_prefetch,half2_prefetch2,half2_async}" --out "$OUT/gemv.json" ;;
    stagegraphs) gputest stagegraphs 180 tests/gpu/test_gpu_stage_graphs.py ;;
    w1trace) run w1trace 200 python benchmarks/step_trace.py --model "$CFG/qwen3-0.6b.json" --out "$OUT/w1_trace.json" ;;
    # two GPUs: tensor / pipeline parallelism against one GPU (dummy weights)
    tptests) gputest tptests 420 tests/gpu/test_gpu_tensor_parallel.py tests/gpu/test_gpu_pipeline_parallel.py ;;
    tp2lat)  for tp in ${TP_SIZES:-2 1 2 1}; do  # W2 batch 1, alternating
               timeout 200 python -m peregrine.entrypoints.cli bench latency --model "$CFG/llama-3-8b.json" -tp "$tp" --output-json "$OUT/w2_tp$tp.json" > "$OUT/w2_tp${tp}_run.log" 2>&1
               python -c "import json,sys; print('w2 tp', sys.argv[2], round(json.load(open(sys.argv[1]))['decode_tokens_per_s'], 1))" "$OUT/w2_tp$tp.json" "$tp" || tail -30 "$OUT/w2_tp${tp}_run.log"
             done ;;
    tp2serve) wheels  # W3 at TP=2 and TP=1
             for tp in ${TP_SIZES:-2 1}; do
               run "w3_tp$tp" 450 python benchmarks/serve_workloads.py w3 --num-prompts "${W3_PROMPTS:-1000}" --rates "${W3_RATES:-inf}" --server-args="-tp $tp" --tag "_tp$tp" --out-dir "$OUT/serve"
             done ;;
    70btp2)  for tag in ${SPLITS_70B:-tp2 pp2}; do  # Llama-2-70B bf16 batch 1
               split="-${tag:0:2} ${tag:2}"
               run "70b_$tag" 400 python -m peregrine.entrypoints.cli bench latency --model "$CFG/llama-2-70b.json" $split --output-json "$OUT/w2_70b_$tag.json"
             done ;;
    70bserve) wheels  # a W3-style load on Llama-2-70B
             for tag in ${SPLITS_70B:-tp2 pp2}; do
               split="-${tag:0:2} ${tag:2}"
               run "w3_70b_$tag" 550 python benchmarks/serve_workloads.py w3 --config "$CFG/llama-2-70b.json" --num-prompts "${W3_PROMPTS:-1000}" --rates "${W3_RATES:-inf}" --server-args="$split" --tag "_70b_$tag" --out-dir "$OUT/serve"
             done ;;
    arbench) run arbench 200 python benchmarks/all_reduce_bench.py --world "${AR_WORLD:-2}" --out "$OUT/all_reduce.json" ;;
    ppbench) run ppbench 500 python benchmarks/pp_bench.py --model "${PP_MODEL:-$CFG/llama-3-8b.json}" --setups "${PP_SETUPS:-tp1,tp2,pp2}" --output-json "$OUT/pp_bench.json" ;;
    w1hf)    run w1hf 400 python -m peregrine.entrypoints.cli bench throughput --model "$CFG/qwen3-0.6b.json" --compare-transformers --hf-requests 32 --output-json "$OUT/w1hf.json" ;;
  esac
done
# PACK=1: everything under $OUT in one archive (for a runner that brings back only a few files).
if [ -n "${PACK:-}" ]; then
  (cd "$OUT" && tar czf /tmp/results.tgz . && find . -mindepth 1 -delete && mv /tmp/results.tgz results.tgz)
fi
