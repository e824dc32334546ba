#!/usr/bin/env bash
# SLO admission above saturation (issue 21; docs/benchmarks.md "SLO admission"): one all-in-one
# node (configs/local.toml) on the simulated engine (200 us a prompt token, 10 ms an output
# token: ~3.7 prompts of ~1350 byte-tokens a second), Poisson arrivals at RATE (default 6/s),
# `pdnode bench` goodput at TTFT <= TTFT_MS (default 1500) and TPOT <= 50 ms; once with
# router.slo.ttft_ms = 0 (no admission), once with it at TTFT_MS, once more with it and
# router.slo.queue_ms = QUEUE_MS (default 1000). Binds 127.0.0.1:18000.
# usage: scripts/bench-slo.sh   (after cargo build -p pdnode)
set -u
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/pdnode}
RATE=${RATE:-6}
TTFT_MS=${TTFT_MS:-1500}
N=${N:-240}
QUEUE_MS=${QUEUE_MS:-1000}
# SETTINGS: "ttft_ms:queue_ms" pairs (default the three above).
for setting in ${SETTINGS:-0:0 $TTFT_MS:0 $TTFT_MS:$QUEUE_MS}; do
    target=${setting%%:*}
    queue=${setting##*:}
    echo "== router.slo.ttft_ms = $target, queue_ms = $queue"
    "$BIN" start --config configs/local.toml --set 'engine.backend="mock"' \
        --set 'model.format="dummy"' --set 'model.preset="smollm2-135m"' --set 'model.path=""' \
        --set 'engine.mock.prefill_us_per_token=200' --set 'engine.mock.decode_us_per_token=10000' \
        --set 'engine.max_batch_tokens=256' --set "router.slo.ttft_ms=$target" --set "router.slo.queue_ms=$queue" \
        --set 'router.http_listen="127.0.0.1:18000"' --set 'router.grpc_listen=""' \
        > "/tmp/bench-slo-$target-$queue.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do curl -sf http://127.0.0.1:18000/health >/dev/null && break; sleep 0.2; done
    "$BIN" bench --url http://127.0.0.1:18000 --workload fixed --input-len 256 --output-len 32 \
        --ignore-eos --request-rate "$RATE" --concurrency 256 --num-requests "$N" --warmup 0 \
        --slo-ttft-ms "$TTFT_MS" --slo-tpot-ms 50 --no-progress --seed 1 2>&1 | tail -4
    kill "$pid"
    wait "$pid" 2>/dev/null
done
