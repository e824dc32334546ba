#!/usr/bin/env bash
# Conditional disaggregation on a mixed workload (issue 21; docs/benchmarks.md "Prefill on the
# decode node"). Separate `pdnode start` processes on loopback around one etcd, the simulated
# engine (PREFILL_US a prompt token, 10 ms a decode step, chunks of 256 tokens), two engines in
# every mode:
#   pd        1 prefill + 1 decode node, every prompt handed off (the plain policy)
#   short     the same nodes, router.local_prefill.max_prompt_tokens = 256
#   busy      the same nodes, router.local_prefill.prefill_busy_requests = 2
#   colocated 2 colocated nodes (role "all", engine.colocated), the router pairs each with itself
# `pdnode bench --workload mixed`: 80 % short chats (~85 byte-tokens in, 64 out), 20 % long
# prompts (~2.7k tokens in, 32 out), Poisson arrivals at RATE, goodput at TTFT <= TTFT_MS and
# TPOT <= TPOT_MS. A benchmark: prints figures, checks nothing.
# Binds 127.0.0.1:12379-12380 (etcd) and 18100-18119. usage: scripts/bench-local-prefill.sh
# (after cargo build -p pdnode); MODES="pd short" limits the modes.
set -u
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/pdnode}
RATE=${RATE:-6}
N=${N:-300}
TTFT_MS=${TTFT_MS:-1000}
TPOT_MS=${TPOT_MS:-30}
PREFILL_US=${PREFILL_US:-200}
MODES=${MODES:-pd short busy colocated}
OUT=${OUT:-/tmp/bench-local-prefill}
mkdir -p "$OUT"
pids=()
stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    pids=()
}
trap 'stop_all; [ -n "${etcd_pid:-}" ] && kill "$etcd_pid" 2>/dev/null' EXIT

etcd_dir=$(mktemp -d)
etcd --data-dir "$etcd_dir" --listen-client-urls http://127.0.0.1:12379 \
    --advertise-client-urls http://127.0.0.1:12379 --listen-peer-urls http://127.0.0.1:12380 \
    > "$OUT/etcd.log" 2>&1 &
etcd_pid=$!
sleep 1

MOCK=(--set 'engine.backend="mock"' --set 'model.format="dummy"' --set 'model.preset="smollm2-135m"'
    --set 'model.path=""' --set 'engine.prefix_cache=false' --set 'engine.context_length=8192'
    --set "engine.mock.prefill_us_per_token=$PREFILL_US" --set 'engine.mock.decode_us_per_token=10000'
    --set 'engine.mock.output_len=1000' --set 'engine.max_batch_tokens=256'
    --set 'engine.max_running_requests=64' --set 'engine.num_kv_blocks=16384'
    --set 'registry.endpoints=["http://127.0.0.1:12379"]' --set 'registry.lease_ttl_s=3'
    --set 'log.filter="warn"')

# node CONFIG NAME CLUSTER INDEX [extra --set ...]
node() {
    local config=$1 name=$2 cluster=$3 i=$4
    shift 4
    "$BIN" start --config "$config" "${MOCK[@]}" --set "node.cluster=\"$cluster\"" \
        --set "node.id=\"$cluster-$name\"" --set "node.listen=\"127.0.0.1:$((18101 + i))\"" \
        --set "node.http_listen=\"127.0.0.1:$((18111 + i))\"" "$@" > "$OUT/$cluster-$name.log" 2>&1 &
    pids+=($!)
}

for mode in $MODES; do
    cluster="lp-$mode-$$"
    router_extra=()
    case $mode in
        pd) ;;
        short) router_extra=(--set 'router.local_prefill.max_prompt_tokens=256') ;;
        busy) router_extra=(--set 'router.local_prefill.prefill_busy_requests=2') ;;
        colocated) ;;
        *) echo "unknown mode $mode"; exit 2 ;;
    esac
    if [ "$mode" = colocated ]; then
        for i in 0 1; do
            node configs/local.toml "all$i" "$cluster" "$i" --set 'registry.kind="etcd"' \
                --set 'engine.colocated=true' --set "router.http_listen=\"127.0.0.1:$((18103 + i))\"" \
                --set 'router.grpc_listen=""'
        done
    else
        node configs/cpu-prefill.toml prefill0 "$cluster" 0
        node configs/cpu-decode.toml decode0 "$cluster" 1
    fi
    "$BIN" start --config configs/cpu-router.toml "${MOCK[@]}" --set "node.cluster=\"$cluster\"" \
        --set "node.id=\"$cluster-router\"" --set 'node.listen="127.0.0.1:18109"' \
        --set 'router.http_listen="127.0.0.1:18100"' --set 'router.grpc_listen=""' \
        "${router_extra[@]}" > "$OUT/$cluster-router.log" 2>&1 &
    pids+=($!)
    ok=
    for _ in $(seq 150); do
        if curl -sf http://127.0.0.1:18100/health >/dev/null; then ok=1; break; fi
        sleep 0.2
    done
    if [ -z "$ok" ]; then echo "$mode: the router never got healthy (logs in $OUT)"; stop_all; continue; fi
    sleep 2
    echo "== $mode"
    "$BIN" bench --url http://127.0.0.1:18100 --workload mixed --input-len 16 --output-len 64 \
        --long-input-len 512 --long-output-len 32 --long-fraction 0.2 --ignore-eos \
        --request-rate "$RATE" --concurrency 256 --num-requests "$N" --warmup 8 \
        --slo-ttft-ms "$TTFT_MS" --slo-tpot-ms "$TPOT_MS" --no-progress --seed 1 \
        --out "$OUT/$mode.json" 2>&1 | tail -6
    curl -s http://127.0.0.1:18100/metrics | grep -E '^pdnode_router_local_prefills_total|^pdnode_transfer_handoffs_total' || true
    stop_all
done
