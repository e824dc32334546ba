#!/usr/bin/env bash
# One device call of a GPU session, from the files of scripts/gpu/stage.sh (builds nothing).
# usage: scripts/gpu/session.sh PART...   parts, run in order:
#   tests[:names]  scripts/gpu/run-all.sh over the bundle's test binaries (names: run-all parts,
#                  comma separated; default all of them, with tp)
#   transfer       scripts/gpu/transfer.sh cuda (bench-transfer GPU0 -> GPU1)
#   variants       the decode/prefill bench (bench_llama31_8b_shapes) and the fused-vs-unfused
#                  decode comparison (bench_decode_fusions, bench_decode_op_breakdown); PDL and
#                  the fusion limits and the kernel choices are config keys now (engine.cuda.*),
#                  compared inside the runs (prefill: flashv3 / flash8 / gemm on one backend)
#   decode         issue 20's decode benches: bench_decode_step_variants (fusion settings and PDL,
#                  interleaved), bench_llama31_8b_shapes (decode points only) and
#                  bench_decode_op_breakdown (1x512, 8x512); tables into the summary
#   prefill        the prefill-attention kernels: cuda_kernels' prefill_ tests (every variant,
#                  the warp-specialized wgmma kernel included), then bench_llama31_8b_shapes'
#                  prefill rows at PREFILL_LENS (default 2048,8192): whole steps and one layer
#   prefill-ncu    ncu (--clock-control none) on one 8192-token launch of each wgmma prefill
#                  kernel (NCU_KERNELS, default the wg and ws ones; speed of light, pipes,
#                  stalls), then the SM clock and power sampled
#                  through a run of the 8192-token prefill bench
#   stream         the streaming decode GEMV (gemv_stream): its cuda_kernels and cuda_graphs tests
#                  (STREAM_TESTS=0: not), bench_linear_stream (each decode linear alone, step path
#                  vs stream), then bench_decode_step_variants at STREAM_STEPS with STREAM_VARIANTS
#   stream-ncu     ncu (--clock-control none) on the gemv_stream_t1 launches of bench_linear_stream
#                  at one token (duration, DRAM throughput, warp states), then the eager op
#                  breakdown of a 1x512 step with streaming on (PDNODE_BENCH_FUSION=s8n0w8p4g1)
#   trace          one graph-replayed decode step from inside the GPU (bench_decode_trace: the
#                  traced kernel builds record each block's arrival, release and return) at
#                  TRACE_STEPS (default 1x512) for each of TRACE_VARIANTS (default "default"),
#                  then bench_decode_step_variants of the same variants untraced
#   prefill-src    ncu's warp stall sampling per SASS instruction of one 8192-token launch of each
#                  NCU_KERNELS kernel, as CSV (src-<kernel>.csv in the logs)
#   transfer-exp   scripts/gpu/transfer.sh exp (UCX variants, isolated ucx_perftest puts)
#   overlap        scripts/gpu/overlap.sh (the hand-off against prefill: one chunk vs 512-token chunks)
#   serve[:what]   scripts/gpu/serve.sh pd|colo|both (default both)
#   coldstart      scripts/gpu/coldstart.sh (first requests after start, warm-up off and on)
#   pairwarm       scripts/gpu/pairwarm.sh (first requests through a new PD pair on one GPU,
#                  router.warm_pairs off and on)
#   deepseek-pd    scripts/gpu/deepseek-pd.sh (the tiny DeepSeek-V2/V3 fixtures through PD on
#                  GPU0 against one colocated node: greedy equal, hand-offs counted)
#   deepseek-pd-tp the same with prefill at TP 2 (GPUs 0,1) and decode at TP 1 (GPU 1), then
#                  prefill TP 1 -> decode TP 2: the latent handed off between TP degrees (x2)
#   migrate        scripts/gpu/migrate.sh (live decode migration between two decode nodes on
#                  one GPU: pause, bytes, text)
#   rebalance      scripts/gpu/rebalance.sh (router.rebalance moving pinned streams: per move,
#                  the first push to a new peer and the later ones)
#   ab             two builds in one call: .gpu-pd/bundle.tar.xz (new) against .gpu-pd/base.tar.xz
#                  (an earlier TESTS_ONLY bundle, old), alternated old / new / new / old ...:
#                  bench_decode_step_variants at AB_STEPS (variant default) and, if AB_ATTN is
#                  set, bench_decode_attention_kernel (v4) at those batch x ctx points; AB_PAIRS
#                  old/new pairs (default 2)
#   smol           the demo model (.gpu-m/a from an earlier call on this machine + .gpu-m2/b):
#                  scripts/gpu/smollm2.sh
# Every log goes to one tarball $OUT/logs.tar.xz (the device tool brings back at most 8 files);
# the table of each part is printed last and kept in $OUT/summary.txt.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu}
LOGS=/tmp/pdnode-logs
PD=/tmp/pd
mkdir -p "$OUT" "$LOGS" "$PD"
if [ -e .gpu-pd/bundle.tar.xz ]; then
    rm -rf "$PD/t" && tar -xJf .gpu-pd/bundle.tar.xz -C "$PD"
fi
# The first half of the demo model waits on this machine for the call that brings the second.
[ -e .gpu-m/a ] && cp .gpu-m/a "$PD/model.a"
summary=$LOGS/summary.txt
# the profiler and the kernels the prefill-ncu / prefill-src parts profile
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
NCU_KERNELS=${NCU_KERNELS:-flash_prefill_hd128_wg flash_prefill_hd128_ws}
: > "$summary"
t_start=$SECONDS
for part in "$@"; do
    name=${part%%:*}
    arg=${part#*:}
    [ "$arg" = "$part" ] && arg=
    t0=$SECONDS
    echo "=== $part" | tee -a "$summary"
    case $name in
        tests)
            IFS=, read -r -a names <<< "${arg:-unit,kernels,model,parity,deepseek,graphs,bench,tp}"
            BIN=$PD/t OUT=$LOGS/tests bash scripts/gpu/run-all.sh "${names[@]}" 2>&1 |
                tee "$LOGS/tests.out" | tail -40 >> "$summary" ;;
        transfer)
            OUT=$LOGS/transfer bash scripts/gpu/transfer.sh cuda 2>&1 |
                tee "$LOGS/transfer.out" | tail -20 >> "$summary" ;;
        variants)
            for v in bench_llama31_8b_shapes bench_decode_fusions bench_decode_op_breakdown; do
                tag=$v
                timeout 300 "$PD/t/cuda_bench" --ignored --nocapture --test-threads=1 \
                    "$v" > "$LOGS/variant-$tag.log" 2>&1
                echo "## $v (rc=$?)" >> "$summary"
                grep -E '^BENCH (decode graph batch|decode eager|prefill)' "$LOGS/variant-$tag.log" |
                    sed -E 's/^BENCH //' >> "$summary"
            done ;;
        decode)
            for v in ${DECODE_BENCHES:-bench_decode_step_variants bench_llama31_8b_shapes bench_decode_op_breakdown}; do
                PDNODE_BENCH_PREFILL= PDNODE_BENCH_OPS=1x512,8x512 timeout 400 "$PD/t/cuda_bench" \
                    --ignored --nocapture --test-threads=1 --exact "$v" > "$LOGS/decode-$v.log" 2>&1
                echo "## $v (rc=$?)" >> "$summary"
                rows='^ceilings|^\|'
                [ "$v" = bench_llama31_8b_shapes ] && rows='^ceilings|^\| decode (graph|\+argmax D2H) \|'
                grep -E "$rows" "$LOGS/decode-$v.log" >> "$summary"
            done ;;
        stream)   # the streaming decode GEMV: its tests, each linear alone, whole graph steps
            if [ "${STREAM_TESTS:-1}" = 1 ]; then
            timeout 300 "$PD/t/cuda_kernels" --ignored --test-threads=1 --nocapture gemv_stream \
                > "$LOGS/stream-kernels.log" 2>&1
            echo "## cuda_kernels gemv_stream (rc=$?)" >> "$summary"
            grep -E '^test result|FAIL|panicked' "$LOGS/stream-kernels.log" >> "$summary"
            grep -c '^PASS' "$LOGS/stream-kernels.log" | sed 's/^/PASS lines: /' >> "$summary"
            timeout 300 "$PD/t/cuda_graphs" --ignored --test-threads=1 --nocapture \
                streaming_decode_steps_match > "$LOGS/stream-graphs.log" 2>&1
            echo "## cuda_graphs streaming_decode_steps_match (rc=$?)" >> "$summary"
            grep -E '^test result|^GRAPH|FAIL|panicked' "$LOGS/stream-graphs.log" >> "$summary"
            fi
            timeout 300 "$PD/t/cuda_bench" --ignored --nocapture --exact bench_linear_stream \
                > "$LOGS/stream-linear.log" 2>&1
            echo "## bench_linear_stream (rc=$?)" >> "$summary"
            grep -E '^ceilings|^\|' "$LOGS/stream-linear.log" >> "$summary"
            PDNODE_BENCH_STEPS=${STREAM_STEPS:-1x512,1x2048,1x8192,2x512,4x512} \
                PDNODE_BENCH_STEP_VARIANTS=${STREAM_VARIANTS:-default,s8n0w8p4g4,s8n0w8p0g4} \
                timeout 400 "$PD/t/cuda_bench" --ignored --nocapture --test-threads=1 --exact \
                bench_decode_step_variants > "$LOGS/stream-steps.log" 2>&1
            echo "## bench_decode_step_variants (rc=$?)" >> "$summary"
            grep -E '^ceilings|^\|' "$LOGS/stream-steps.log" >> "$summary" ;;
        trace)   # a replayed decode step's launches as they overlap, per variant
            for v in $(echo "${TRACE_VARIANTS:-default}" | tr ',' ' '); do
                PDNODE_BENCH_STEPS=${TRACE_STEPS:-1x512} PDNODE_BENCH_STEP_VARIANTS=$v \
                    timeout 200 "$PD/t/cuda_bench" --ignored --nocapture --test-threads=1 --exact \
                    cuda_bench_trace::bench_decode_trace > "$LOGS/trace-${v//\//_}.log" 2>&1
                echo "## bench_decode_trace $v (rc=$?)" >> "$summary"
                grep -E '^traced|^\||panicked' "$LOGS/trace-${v//\//_}.log" >> "$summary"
            done
            PDNODE_BENCH_STEPS=${TRACE_STEPS:-1x512} PDNODE_BENCH_STEP_VARIANTS=${TRACE_VARIANTS:-default} \
                timeout 300 "$PD/t/cuda_bench" --ignored --nocapture --test-threads=1 --exact \
                bench_decode_step_variants > "$LOGS/trace-steps.log" 2>&1
            echo "## bench_decode_step_variants, untraced (rc=$?)" >> "$summary"
            grep -E '^ceilings|^\|' "$LOGS/trace-steps.log" >> "$summary" ;;
        stream-ncu)   # where a streaming GEMV's time goes, alone and in an eager step
            PDNODE_BENCH_LINEAR_TOKENS=1 PDNODE_BENCH_ITERS=3 timeout 300 \
                "$NCU" --clock-control none -k "regex:^gemv_stream_t1\$" -c 24 --section SpeedOfLight \
                --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
                "$PD/t/cuda_bench" --ignored --nocapture --exact bench_linear_stream \
                > "$LOGS/ncu-stream.log" 2>&1
            echo "## ncu gemv_stream_t1 (rc=$?): per launch, in the order qkv, o, gate_up, down" >> "$summary"
            grep -E '^  gemv_stream|Duration|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|No Eligible|Dynamic Shared' \
                "$LOGS/ncu-stream.log" | head -150 >> "$summary"
            PDNODE_BENCH_FUSION=s8n0w8p4g1 PDNODE_BENCH_OPS=1x512 PDNODE_BENCH_PREFILL= timeout 300 \
                "$PD/t/cuda_bench" --ignored --nocapture --test-threads=1 --exact \
                bench_decode_op_breakdown > "$LOGS/stream-ops.log" 2>&1
            echo "## bench_decode_op_breakdown, streaming at 1 row (rc=$?)" >> "$summary"
            grep -E '^ceilings|^\|' "$LOGS/stream-ops.log" >> "$summary" ;;
        prefill)   # the prefill-attention kernels: their GPU tests, then whole steps and one layer
            timeout 300 "$PD/t/cuda_kernels" --ignored --test-threads=1 --nocapture prefill_ \
                wgmma_descriptors > "$LOGS/prefill-tests.log" 2>&1
            echo "## cuda_kernels prefill_ (rc=$?)" >> "$summary"
            grep -E '^test result|FAILED|panicked' "$LOGS/prefill-tests.log" >> "$summary"
            PDNODE_BENCH_DECODE= PDNODE_BENCH_PREFILL=${PREFILL_LENS:-2048,8192} timeout 400 \
                "$PD/t/cuda_bench" --ignored --nocapture --exact bench_llama31_8b_shapes \
                > "$LOGS/prefill-bench.log" 2>&1
            echo "## bench_llama31_8b_shapes, prefill (rc=$?)" >> "$summary"
            grep -E '^BENCH (prefill|ceiling)|^ceilings' "$LOGS/prefill-bench.log" | sed -E 's/^BENCH //' >> "$summary" ;;
        prefill-ncu)  # why a wgmma kernel runs where it does: ncu on each, SM clocks during a step
            for k in $NCU_KERNELS; do
                PDNODE_BENCH_DECODE= PDNODE_BENCH_PREFILL=8192 PDNODE_BENCH_ITERS=1 timeout 300 \
                    "$NCU" --clock-control none -k "regex:^$k\$" -s 4 -c 1 --section SpeedOfLight \
                    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                    --section WarpStateStats --section SchedulerStats --section Occupancy \
                    --metrics 'regex:^smsp__(average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio|inst_executed\.sum|inst_executed_op_ldgsts\.sum)$' \
                    "$PD/t/cuda_bench" --ignored --nocapture --exact bench_llama31_8b_shapes \
                    > "$LOGS/ncu-$k.log" 2>&1
                echo "## ncu $k (rc=$?)" >> "$summary"
                grep -E 'SM Frequency|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Executed Ipc Active|Issue Slots Busy|Registers Per Thread|Achieved Occupancy|Stall|No Eligible|One or More Eligible|Tensor|inst_executed' \
                    "$LOGS/ncu-$k.log" | head -40 >> "$summary"
                # the largest stall reasons, cycles per issued instruction
                grep -E 'issue_stalled_' "$LOGS/ncu-$k.log" | awk '{print $NF, $1}' | sort -rn | head -8 >> "$summary"
            done
            nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
                -lms 100 > "$LOGS/prefill-clocks.csv" 2>&1 &
            smi=$!
            PDNODE_BENCH_DECODE= PDNODE_BENCH_PREFILL=8192 PDNODE_BENCH_ITERS=10 timeout 300 \
                "$PD/t/cuda_bench" --ignored --nocapture --exact bench_llama31_8b_shapes \
                > "$LOGS/prefill-clocks-bench.log" 2>&1
            kill "$smi" 2>/dev/null
            echo "## SM clock / power during bench_llama31_8b_shapes at 8192 tokens (min, median, max)" >> "$summary"
            awk -F', ' '{gsub(/ MHz/,"",$2); gsub(/ W/,"",$3); print $2, $3}' "$LOGS/prefill-clocks.csv" |
                sort -n | awk '{c[NR]=$1; p[NR]=$2} END {if (NR) printf "MHz %s %s %s over %d samples\n", c[1], c[int((NR+1)/2)], c[NR], NR}' >> "$summary"
            awk -F', ' '{gsub(/ W/,"",$3); print $3}' "$LOGS/prefill-clocks.csv" | sort -n |
                awk '{p[NR]=$1} END {if (NR) printf "W %s %s %s\n", p[1], p[int((NR+1)/2)], p[NR]}' >> "$summary" ;;
        prefill-src)  # where a wgmma kernel's warps wait: ncu's stall sampling per SASS instruction
            for k in $NCU_KERNELS; do
                PDNODE_BENCH_DECODE= PDNODE_BENCH_PREFILL=8192 PDNODE_BENCH_ITERS=1 timeout 300 \
                    "$NCU" --clock-control none -k "regex:^$k\$" -s 4 -c 1 --section SourceCounters \
                    --section WarpStateStats -f -o "$LOGS/src-$k" \
                    "$PD/t/cuda_bench" --ignored --nocapture --exact bench_llama31_8b_shapes \
                    > "$LOGS/src-$k.log" 2>&1
                echo "## ncu source $k (rc=$?)" >> "$summary"
                "$NCU" -i "$LOGS/src-$k.ncu-rep" --page source --csv --print-source sass \
                    > "$LOGS/src-$k.csv" 2> "$LOGS/src-$k.err"
                rc=$?
                echo "sass rows: $(wc -l < "$LOGS/src-$k.csv") (rc=$rc)" >> "$summary"
                head -c 600 "$LOGS/src-$k.err" >> "$summary"
                rm -f "$LOGS/src-$k.ncu-rep"
            done ;;
        transfer-exp)
            OUT=$LOGS/transfer-exp bash scripts/gpu/transfer.sh exp 2>&1 |
                tee "$LOGS/transfer-exp.out" | tail -20 >> "$summary" ;;
        overlap)
            PD=$PD OUT=$LOGS/overlap bash scripts/gpu/overlap.sh 2>&1 |
                tee "$LOGS/overlap.out" | tail -12 >> "$summary" ;;
        serve)
            PD=$PD OUT=$LOGS/serve bash scripts/gpu/serve.sh "${arg:-both}" 2>&1 |
                tee "$LOGS/serve.out" | tail -40 >> "$summary" ;;
        pairwarm)
            PD=$PD OUT=$LOGS/pairwarm bash scripts/gpu/pairwarm.sh 2>&1 |
                tee "$LOGS/pairwarm.out" | tail -8 >> "$summary" ;;
        deepseek-pd)
            PD=$PD OUT=$LOGS/deepseek-pd bash scripts/gpu/deepseek-pd.sh 2>&1 |
                tee "$LOGS/deepseek-pd.out" | tail -8 >> "$summary" ;;
        deepseek-pd-tp)  # two GPUs: prefill TP 2 -> decode TP 1, then TP 1 -> TP 2
            for pg in "0,1 1" "0 0,1"; do
                read -r p d <<< "$pg"
                PREFILL_GPUS=$p DECODE_GPUS=$d PD=$PD OUT=$LOGS/deepseek-pd-tp-$p-$d \
                    bash scripts/gpu/deepseek-pd.sh 2>&1 |
                    tee "$LOGS/deepseek-pd-tp-$p-$d.out" | tail -8 >> "$summary"
            done ;;
        migrate)
            PD=$PD OUT=$LOGS/migrate bash scripts/gpu/migrate.sh 2>&1 |
                tee "$LOGS/migrate.out" | tail -16 >> "$summary" ;;
        rebalance)
            PD=$PD OUT=$LOGS/rebalance bash scripts/gpu/rebalance.sh 2>&1 |
                tee "$LOGS/rebalance.out" | tail -8 >> "$summary" ;;
        coldstart)
            PD=$PD OUT=$LOGS/coldstart bash scripts/gpu/coldstart.sh 2>&1 |
                tee "$LOGS/coldstart.out" | tail -12 >> "$summary" ;;
        ab)
            if [ ! -e .gpu-pd/base.tar.xz ]; then
                echo "FAIL ab: no .gpu-pd/base.tar.xz" >> "$summary"
            else
                rm -rf "$PD/base" && mkdir -p "$PD/base" && tar -xJf .gpu-pd/base.tar.xz -C "$PD/base"
                for round in $(seq "${AB_PAIRS:-2}"); do
                    order="old new"
                    [ $((round % 2)) = 0 ] && order="new old"  # drift within the call cancels
                    for build in $order; do
                        bin=$PD/t
                        [ $build = old ] && bin=$PD/base/t
                        PDNODE_BENCH_STEPS=${AB_STEPS:-1x512,8x512,64x512} PDNODE_BENCH_STEP_VARIANTS=default \
                            PDNODE_BENCH_ROUNDS=${AB_ROUNDS:-3} timeout 300 "$bin/cuda_bench" --ignored \
                            --nocapture --test-threads=1 --exact bench_decode_step_variants \
                            > "$LOGS/ab-steps-$build-$round.log" 2>&1
                        echo "## steps $build round $round (rc=$?)" >> "$summary"
                        grep -E '^ceilings|^\|' "$LOGS/ab-steps-$build-$round.log" >> "$summary"
                        [ -n "${AB_ATTN:-}" ] || continue
                        PDNODE_BENCH_ATTN=$AB_ATTN PDNODE_BENCH_ATTN_VARIANTS=v4 timeout 200 \
                            "$bin/cuda_bench" --ignored --nocapture --test-threads=1 --exact \
                            bench_decode_attention_kernel > "$LOGS/ab-attn-$build-$round.log" 2>&1
                        echo "## attention $build round $round (rc=$?)" >> "$summary"
                        grep -E '^OCCUPANCY|^\| V4' "$LOGS/ab-attn-$build-$round.log" >> "$summary"
                    done
                done
            fi ;;
        smol)
            if [ -e "$PD/model.a" ] && [ -e .gpu-m2/b ]; then
                cat "$PD/model.a" .gpu-m2/b > "$PD/smollm2.gguf"
                if [ "$(sha256sum "$PD/smollm2.gguf" | cut -d' ' -f1)" = "$(cat .gpu-m2/sha256)" ]; then
                    OUT=$LOGS/smol bash scripts/gpu/smollm2.sh "$PD/smollm2.gguf" "$PD/pdnode" 2>&1 |
                        tee "$LOGS/smol.out" | tail -30 >> "$summary"
                else
                    echo "FAIL the two model parts do not give the model (sha256)" >> "$summary"
                fi
            else
                echo "FAIL smol: model part missing ($PD/model.a from the earlier call, .gpu-m2/b)" >> "$summary"
            fi ;;
        *) echo "unknown part $part" >> "$summary" ;;
    esac
    echo "--- $part: $((SECONDS - t0)) s" >> "$summary"
done
echo "total $((SECONDS - t_start)) s" >> "$summary"
cp "$summary" "$OUT/summary.txt"
tar -C "$LOGS" -cJf "$OUT/logs.tar.xz" . 2>/dev/null
cat "$summary"
