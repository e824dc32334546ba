#!/usr/bin/env bash
# KV hand-off figures on the H200 host, from prebuilt files in .gpu/ (no Rust there):
#   .gpu/pdnode   (cargo build --release -p pdnode && cp target/release/pdnode .gpu/ && strip .gpu/pdnode)
#   .gpu/whl/libucx_cu13-1.22.0-*.whl   (see /work/shared/GPU.md "UCX with CUDA there")
# Runs `pdnode bench-transfer --local` against the wheel's UCX 1.22 (host memory, tcp and shared
# memory) with the KV shape of a 4k-token Llama-3.1-8B prompt (32 layers x 256 blocks x 64 KiB =
# 512 MiB, TP=1) and the wheel's ucx_perftest as the ceiling: host put_bw, and GPU0 -> GPU1
# cuda_ipc put_bw with one visible GPU per process. Logs in $OUT; a table is printed last.
# usage: scripts/gpu/transfer.sh [quick|cuda|exp]   (quick: fewer requests, smaller sweep; cuda: device
# rows only; exp: the device 4k-token row under UCX variants, and ucx_perftest with few iterations:
# what one isolated put costs against the pipelined figure)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/transfer}
# With .gpu-pd/bundle.tar.xz (scripts/gpu/pack.sh: pdnode + trimmed UCX 1.22, one carried file):
if [ -e .gpu-pd/bundle.tar.xz ] && [ -z "${BIN:-}" ]; then
    mkdir -p /tmp/pd && { [ -x /tmp/pd/pdnode ] || tar -xJf .gpu-pd/bundle.tar.xz -C /tmp/pd; }
    BIN=/tmp/pd/pdnode UCX_DIR=/tmp/pd/ucx
fi
BIN=${BIN:-.gpu/pdnode}
UCX_DIR=${UCX_DIR:-/tmp/ucx}
mkdir -p "$OUT"
REQS=5
SIZES="16K,64K,256K,1M"
[ "${1:-}" = quick ] && REQS=2 && SIZES="64K"

if [ ! -e "$UCX_DIR/libucx/lib/libucp.so.0" ]; then
    whl=$(ls .gpu/whl/libucx_cu13-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || { echo "no .gpu/whl/libucx_cu13-*.whl (see GPU.md)"; exit 1; }
    python3 -m zipfile -e "$whl" "$UCX_DIR" && chmod +x "$UCX_DIR"/libucx/bin/*
fi
LIB=$UCX_DIR/libucx/lib/libucp.so.0
PERFTEST="$UCX_DIR/libucx/bin/ucx_perftest"
export LD_LIBRARY_PATH=$UCX_DIR/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_NET_DEVICES=lo
"$UCX_DIR/libucx/bin/ucx_info" -v > "$OUT/ucx_info.txt" 2>&1
"$UCX_DIR/libucx/bin/ucx_info" -d 2>/dev/null | grep -E 'Transport:|Device:' | sort -u > "$OUT/ucx_transports.txt"
nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
[ -x "$BIN" ] || { echo "no $BIN (build it on a build host, see the header)"; exit 1; }

rows=()
row() { rows+=("$(printf '%-34s %s' "$1" "$2")"); }

bench() { # name timeout_s args...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$BIN" bench-transfer --local --ucx-lib "$LIB" --timeout-s "$limit" "$@" \
        > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -E '^bench-transfer:|^ *layer-blk| KiB | MiB ' "$OUT/$name.log" | grep -v RESULT
    local res
    res=$(grep '^RESULT ' "$OUT/$name.log" | sed -E 's/.*"block_bytes":([0-9]+).*"push_gbps":([0-9.e-]+).*"e2e_gbps":([0-9.e-]+).*"latency_ms_p50":([0-9.e-]+).*/blk=\1 push=\2 e2e=\3 p50ms=\4/' |
        awk '{ printf "%s; ", $0 }')
    row "$name" "rc=$rc ${res:-$(grep -m1 -E 'error' "$OUT/$name.log")}"
}

perftest() { # name tls mem size server_env client_env
    local name=$1 tls=$2 mem=$3 size=$4 senv=$5 cenv=$6 port=$((20000 + RANDOM % 20000))
    local iters=${PT_ITERS:-100} warm=${PT_WARMUP:-}
    env $senv UCX_TLS="$tls" "$PERFTEST" -p "$port" -t ucp_put_bw -m "$mem" -s "$size" -n "$iters" ${warm:+-w $warm} \
        > "$OUT/$name.server.log" 2>&1 &
    local srv=$! out="" i=0
    while [ $i -lt 50 ]; do
        out=$(env $cenv UCX_TLS="$tls" timeout 120 "$PERFTEST" 127.0.0.1 -p "$port" -t ucp_put_bw \
            -m "$mem" -s "$size" -n "$iters" ${warm:+-w $warm} 2>&1) && break
        i=$((i + 1)); sleep 0.2
    done
    kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
    echo "$out" > "$OUT/$name.log"
    local mbs
    mbs=$(echo "$out" | awk '/Final:/ { print $7 }')
    row "$name" "$(awk -v m="${mbs:-0}" 'BEGIN { printf "%.2f GB/s", m * 1048576 / 1e9 }')"
}

LLAMA="--layers 32 --blocks-per-request 256 --block-bytes 64K --requests $REQS --warmup 1"
if [ "${1:-}" = exp ]; then
    CU="--tls cuda_ipc,cuda_copy,tcp --mem cuda:0 --server-mem cuda:1"
    bench exp-4lpp 30 $CU $LLAMA --layers-per-put 4
    UCX_PROTO_ENABLE=n bench exp-4lpp-proto-v1 30 $CU $LLAMA --layers-per-put 4
    UCX_CUDA_IPC_CACHE=n bench exp-4lpp-no-ipc-cache 60 $CU $LLAMA --layers-per-put 4
    UCX_CUDA_IPC_MAX_STREAMS=1 bench exp-4lpp-1-stream 30 $CU $LLAMA --layers-per-put 4
    for n in 1 3 10 100; do
        PT_ITERS=$n PT_WARMUP=1 perftest "pt-512MiB-n$n" cuda_ipc,cuda_copy,tcp cuda 536870912 \
            CUDA_VISIBLE_DEVICES=1 CUDA_VISIBLE_DEVICES=0
    done
    PT_ITERS=1 PT_WARMUP=1 perftest pt-64MiB-n1 cuda_ipc,cuda_copy,tcp cuda 67108864 \
        CUDA_VISIBLE_DEVICES=1 CUDA_VISIBLE_DEVICES=0
    printf '%s\n' "${rows[@]}"
    exit 0
fi
HOST=1
[ "${1:-}" = cuda ] && HOST=0
[ $HOST = 1 ] && echo "== 1. host memory, UCX 1.22 (binding compatibility + figures)"
[ $HOST = 1 ] && bench host-tcp-sweep 300 --tls tcp --block-bytes "$SIZES" --requests "$REQS"
[ $HOST = 1 ] && bench host-sm-sweep 300 --tls sm --block-bytes "$SIZES" --requests "$REQS"
[ $HOST = 1 ] && bench host-sm-llama8b-4k 300 --tls sm $LLAMA
[ $HOST = 1 ] && bench host-sm-llama8b-4k-pool 300 --tls sm $LLAMA --pool-placement
[ $HOST = 1 ] && bench host-sm-llama8b-4k-8lpp 300 --tls sm $LLAMA --layers-per-put 8
echo "== 2. device memory: cuMemAlloc staging on GPU0 (client) and GPU1 (server), one GPU per process"
CU="--tls cuda_ipc,cuda_copy,tcp --mem cuda:0 --server-mem cuda:1"
bench cuda-llama8b-4k 30 $CU $LLAMA
bench cuda-llama8b-4k-4lpp 30 $CU $LLAMA --layers-per-put 4
bench cuda-llama8b-4k-32lpp 30 $CU $LLAMA --layers-per-put 32
# Block-size sweep at the same 512 MiB per request (puts stay one layer = 16 MiB each: the device
# staging is contiguous per layer, so block size changes only the untimed gather).
for bb in 16K:1024 1M:16; do
    bench "cuda-512MiB-blk${bb%%:*}" 30 $CU --layers 32 --block-bytes "${bb%%:*}" \
        --blocks-per-request "${bb##*:}" --requests "$REQS" --warmup 1
done
# Smaller requests (one put per layer of 64 KiB x n blocks): 512 and 64 tokens.
for n in 32 4; do
    bench "cuda-64K-x${n}blk" 30 $CU --layers 32 --block-bytes 64K --blocks-per-request "$n" \
        --requests "$REQS" --warmup 1
done
echo "== 3. ceilings: ucx_perftest put_bw (one layer = 16 MiB, the request = 512 MiB)"
[ $HOST = 1 ] && perftest pt-host-sm-16MiB sm host 16777216 "" ""
[ "${1:-}" = quick ] || [ $HOST = 0 ] || perftest pt-host-sm-512MiB sm host 536870912 "" ""
perftest pt-cuda_ipc-gpu0-gpu1-64KiB cuda_ipc,cuda_copy,tcp cuda 65536 CUDA_VISIBLE_DEVICES=1 CUDA_VISIBLE_DEVICES=0
perftest pt-cuda_ipc-gpu0-gpu1-16MiB cuda_ipc,cuda_copy,tcp cuda 16777216 CUDA_VISIBLE_DEVICES=1 CUDA_VISIBLE_DEVICES=0
perftest pt-cuda_ipc-gpu0-gpu1-512MiB cuda_ipc,cuda_copy,tcp cuda 536870912 CUDA_VISIBLE_DEVICES=1 CUDA_VISIBLE_DEVICES=0

echo
head -1 "$OUT/ucx_info.txt"
echo "(NVLink copy peak GPU0 -> GPU1 measured with cudarc: 395 GB/s; target >= 0.9 of it)"
printf '%s\n' "${rows[@]}"
