#!/usr/bin/env bash
# `router.rebalance` on ONE GPU (issue 21): a prefill node and two decode nodes on GPU0 (KV
# between the processes over UCX cuda_ipc), etcd, and for each `min_gap` in GAPS (default "2")
# a router whose decode policy is the sticky `manual` one with `router.rebalance.min_gap` set
# (0: off; one move per stats refresh, 100 ms); Llama-3.1-8B shapes, dummy weights. STREAMS
# streams (default 6) with one routing key, so all pinned to one decode node (distinct
# 1000-token prompts, MAX tokens out, default 512, greedy, ignore_eos): with rebalancing the
# router moves streams to the idle node until the two differ by less than min_gap. Reported per
# setting: moves, each stream's time per output token (median, worst), the longest gap, output
# tokens/s; and the first pushes' bytes and times on the source (the first push to a new peer
# opens its UCX endpoint and maps its IPC memory; the later ones reuse them).
# Needs .gpu-pd/bundle.tar.xz (scripts/gpu/pack.sh). Table last.
# usage: GAPS="0 2" STREAMS=32 MAX=1024 scripts/gpu/rebalance.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/rebalance}
. scripts/gpu/common.sh
node() { # role id listen mem_fraction
    cat <<T
[node]
role = "$1"
cluster = "reb"
id = "$2"
listen = "$3"
[model]
path = "$MODEL"
format = "dummy"
preset = "llama-3.1-8b"
served_name = "llama-3.1-8b"
[engine]
backend = "cuda"
gpus = [0]
context_length = 4096
block_size = 16
max_batch_tokens = 8192
max_running_requests = 64
mem_fraction = $4
kv_staging_tokens = 16384
prefix_cache = false
[registry]
kind = "etcd"
endpoints = ["http://127.0.0.1:2379"]
[transfer]
kind = "ucx"
ucx_lib = "$LIB"
ucx_net_devices = "lo"
[log]
format = "human"
filter = "info"
T
}
start_etcd reb
node prefill prefill-0 127.0.0.1:7001 0.30 > "$OUT/prefill.toml"
node decode decode-0 127.0.0.1:7002 0.45 > "$OUT/decode-0.toml"
node decode decode-1 127.0.0.1:7003 0.75 > "$OUT/decode-1.toml"
for n in prefill decode-0 decode-1; do
    CUDA_VISIBLE_DEVICES=0 "$BIN" start -c "$OUT/$n.toml" > "$OUT/$n.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 240); do grep -q "engine ready" "$OUT/$n.log" && break; sleep 0.5; done
done
strip() { sed 's/\x1b\[[0-9;]*m//g' "$1"; }
rows=()
for gap in ${GAPS:-2}; do
    cat > "$OUT/router-$gap.toml" <<T
[node]
role = "router"
cluster = "reb"
id = "router-$gap"
listen = "127.0.0.1:7000"
[registry]
kind = "etcd"
endpoints = ["http://127.0.0.1:2379"]
[model]
path = "$MODEL"
format = "dummy"
preset = "llama-3.1-8b"
served_name = "llama-3.1-8b"
[router]
http_listen = "127.0.0.1:8000"
grpc_listen = ""
prefill_policy = "round_robin"
decode_policy = "manual"
[router.power_of_two]
load_refresh_ms = 100
[router.rebalance]
min_gap = $gap
interval_ms = 100
[log]
format = "human"
filter = "info"
T
    CUDA_VISIBLE_DEVICES= "$BIN" start -c "$OUT/router-$gap.toml" > "$OUT/router-$gap.log" 2>&1 &
    rpid=$!
    if ! wait_http http://127.0.0.1:8000/health 180; then
        echo "never ready: $(tail -3 "$OUT/router-$gap.log")"
        kill $rpid
        continue
    fi
    sleep 2
    STREAMS=${STREAMS:-6} MAX=${MAX:-512} python3 - > "$OUT/probe-$gap.txt" 2>&1 <<'PY'
import json, os, statistics, threading, time, urllib.request
URL = "http://127.0.0.1:8000/v1/completions"
N, MAX = int(os.environ["STREAMS"]), int(os.environ["MAX"])
def run(k, res):
    words = " ".join(f"w{(i * 104729 + 7 * k + 13) % 100000}" for i in range(1000))
    body = {"model": "llama-3.1-8b", "prompt": words, "max_tokens": MAX, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(URL, json.dumps(body).encode(),
                                 {"content-type": "application/json", "x-smg-routing-key": "pinned"})
    times = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]" and json.loads(line[5:]).get("choices"):
                times.append(time.time())
    res[k] = times
res = {}
th = [threading.Thread(target=run, args=(k, res)) for k in range(N)]
t0 = time.time()
for t in th:
    t.start()
for t in th:
    t.join()
wall = time.time() - t0
tpot = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in (res[k] for k in range(N))]
gaps = [max(b - a for a, b in zip(t, t[1:])) * 1e3 for t in (res[k] for k in range(N))]
print(f"ROW {statistics.median(tpot):.2f} | {max(tpot):.2f} | {max(gaps):.1f} | {N * MAX / wall:.0f} | {sorted(len(res[k]) for k in range(N))[0]}")
PY
    kill $rpid
    wait $rpid 2>/dev/null
    cat "$OUT/probe-$gap.txt"
    moves=$(strip "$OUT/router-$gap.log" | grep -c "stream moved to another decode node")
    row=$(grep '^ROW' "$OUT/probe-$gap.txt" | sed 's/^ROW //')
    rows+=("| $gap | $moves | ${row:-probe failed} |")
    sleep 1
done
pushes=$(cat "$OUT/decode-0.log" "$OUT/decode-1.log" | sed 's/\x1b\[[0-9;]*m//g' | grep "decode migrated" | sort |
    grep -o 'bytes=[0-9]* transfer_us=[0-9]*' | sed 's/bytes=//; s/ transfer_us=/ B in /; s/$/ us/' | head -6 | tr '\n' ';')
echo
echo "pushes in order (bytes, time; first 6): ${pushes:-none}"
echo "| rebalance.min_gap | moves | TPOT p50 per stream (ms) | worst stream's TPOT (ms) | longest gap (ms) | output tok/s | fewest chunks |"
echo "|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
