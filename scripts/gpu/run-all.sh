#!/usr/bin/env bash
# Runs every GPU-only test and the benchmarks from the prebuilt binaries in .gpu/ (see
# scripts/gpu/build.sh) on a GPU host. Builds nothing. Logs go to $OUT; a short table is printed
# last. Usage: scripts/gpu/run-all.sh [kernels|model|unit|parity|deepseek|graphs|bench|tp ...] (default: all but tp;
# tp needs 2 GPUs and also runs the TP=2 CUDA-graph test).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu}
BIN=${BIN:-.gpu}
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(unit kernels model parity deepseek graphs bench)
export PDNODE_FIXTURES=$PWD/crates/pdnode-engine/tests/fixtures
nvidia-smi --query-gpu=index,name,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
summary=()
run() { # name timeout_s cmd...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local res
    res=$(grep -E '^test result:' "$OUT/$name.log" | tail -1 | sed 's/^test result: //; s/; finished in.*//')
    summary+=("$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "${res:-no result line}")")
    grep -E '^test .* FAILED|panicked at|rel err|worst|^PARITY|^TP |^GRAPH ' "$OUT/$name.log" | head -24
}
for p in "${parts[@]}"; do
    case $p in
        unit) run unit 120 "$BIN/cuda_unit" --include-ignored --test-threads=1 ;;
        kernels) run kernels 480 "$BIN/cuda_kernels" --ignored --test-threads=1 --nocapture ;;
        model) run model 300 "$BIN/cuda_model" --ignored --test-threads=1 --nocapture ;;
        parity) run parity 300 "$BIN/cuda_parity" --ignored --test-threads=1 --nocapture ;;
        deepseek) run deepseek 300 "$BIN/cuda_deepseek" --ignored --test-threads=1 --nocapture ;;
        bench) run bench 420 "$BIN/cuda_bench" --ignored --nocapture ;;
        graphs) run graphs 300 "$BIN/cuda_graphs" --ignored --test-threads=1 --nocapture ;;
        tp)
            run tp 420 "$BIN/cuda_tp" --ignored --test-threads=1 --nocapture
            run tpbench 300 "$BIN/cuda_tp_bench" --ignored --test-threads=1 --nocapture
            run tpgraphs 300 "$BIN/cuda_graphs" --ignored --test-threads=1 --nocapture tp2
            ;;
        *) echo "unknown part $p" ;;
    esac
done
echo
grep -E '^ceilings|^\|' "$OUT/bench.log" 2>/dev/null
cat "$OUT/tp.log" "$OUT/tpbench.log" 2>/dev/null | grep -E '^TP |^ceilings|^\|'
echo
printf '%s\n' "${summary[@]}"
