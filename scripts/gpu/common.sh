# Sourced by the GPU scripts that start pdnode processes from the bundle (migrate.sh,
# pairwarm.sh): after the caller set OUT (and PD), unpacks .gpu-pd/bundle.tar.xz into $PD once,
# sets BIN, LIB (the bundle's libucp) and the UCX environment, writes the dummy Llama-3.1-8B
# tokenizer into $MODEL (VOCAB entries, default 128256), and gives `pids` + `stop_all` (newest
# first, each waited for; run on exit), `wait_http URL SECONDS` and `start_etcd NAME [LOG]` (a fresh
# etcd on 127.0.0.1:2379 over /tmp/NAME-etcd, its log in $OUT/LOG (etcd.log), its PID in `pids`).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PD=${PD:-/tmp/pd}
mkdir -p "$OUT" "$PD"
[ -x "$PD/pdnode" ] || tar -xJf .gpu-pd/bundle.tar.xz -C "$PD" || { echo "no bundle"; exit 1; }
BIN=$PD/pdnode
LIB=$PD/ucx/libucx/lib/libucp.so.0
export LD_LIBRARY_PATH=$PD/ucx/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_NET_DEVICES=lo NO_COLOR=1
MODEL=$PD/dummy-llama8b
mkdir -p "$MODEL"
python3 scripts/gpu/dummy-tokenizer.py "$MODEL" "${VOCAB:-128256}"
pids=()
stop_all() {
    local i
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill "${pids[$i]}" 2>/dev/null
        wait "${pids[$i]}" 2>/dev/null
    done
    pids=()
}
trap stop_all EXIT
wait_http() { # url seconds
    local i=0
    while [ $i -lt $(($2 * 5)) ]; do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; i=$((i + 1)); done
    return 1
}
start_etcd() { # name [log file under $OUT]
    rm -rf "/tmp/$1-etcd"
    "$PD/etcd" --data-dir "/tmp/$1-etcd" --listen-client-urls http://127.0.0.1:2379 \
        --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
        > "$OUT/${2:-etcd.log}" 2>&1 &
    pids+=($!)
    wait_http http://127.0.0.1:2379/health 30 || echo "etcd not healthy"
}
