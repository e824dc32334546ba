#!/usr/bin/env bash
# `router.rebalance` on ONE GPU (issue 21): a prefill node and two decode nodes on GPU0 (KV
# between the processes over UCX cuda_ipc), a router whose decode policy is the sticky `manual`
# one with `router.rebalance.min_gap = 2` (one move per 300 ms), etcd; Llama-3.1-8B shapes,
# dummy weights. 6 streams with one routing key (all pinned to one decode node; distinct
# 1000-token prompts, 512 tokens out, greedy, ignore_eos): the router moves streams to the idle
# node until the two differ by less than 2 (6/0 -> 3/3: three moves, one source, one target).
# Reported per move, in order: the KV bytes and the push time on the source (the first push to
# a new peer opens its UCX endpoint and maps its IPC memory; the later ones reuse them), and the
# router's reserve + push + Decode time; each client's longest gap between two tokens.
# Needs .gpu-pd/bundle.tar.xz (scripts/gpu/pack.sh). Table last.
# usage: scripts/gpu/rebalance.sh
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
staging_mib = 1024
[log]
format = "human"
filter = "info"
T
}
rm -rf /tmp/reb-etcd
"$PD/etcd" --data-dir /tmp/reb-etcd --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
    > "$OUT/etcd.log" 2>&1 &
pids+=($!)
wait_http http://127.0.0.1:2379/health 30 || echo "etcd not healthy"
node prefill prefill-0 127.0.0.1:7001 0.30 > "$OUT/prefill.toml"
node decode decode-0 127.0.0.1:7002 0.45 > "$OUT/decode-0.toml"
node decode decode-1 127.0.0.1:7003 0.75 > "$OUT/decode-1.toml"
cat > "$OUT/router.toml" <<T
[node]
role = "router"
cluster = "reb"
id = "router-0"
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
[router.rebalance]
min_gap = 2
interval_ms = 300
[log]
format = "human"
filter = "info"
T
for n in prefill decode-0 decode-1; do
    CUDA_VISIBLE_DEVICES=0 "$BIN" start -c "$OUT/$n.toml" > "$OUT/$n.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 240); do grep -q "engine ready" "$OUT/$n.log" && break; sleep 0.5; done
done
CUDA_VISIBLE_DEVICES= "$BIN" start -c "$OUT/router.toml" > "$OUT/router.log" 2>&1 &
pids+=($!)
if ! wait_http http://127.0.0.1:8000/health 180; then
    echo "never ready: $(tail -3 "$OUT/decode-1.log")"
    exit 1
fi
sleep 2
python3 - > "$OUT/probe.txt" 2>&1 <<'PY'
import json, threading, time, urllib.request
URL = "http://127.0.0.1:8000/v1/completions"
def run(k, res):
    words = " ".join(f"w{(i * 104729 + 7 * k + 13) % 100000}" for i in range(1000))
    body = {"model": "llama-3.1-8b", "prompt": words, "max_tokens": 512, "temperature": 0,
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
th = [threading.Thread(target=run, args=(k, res)) for k in range(6)]
for t in th:
    t.start()
for t in th:
    t.join()
gaps = [round(max((b - a for a, b in zip(t, t[1:])), default=0) * 1e3, 1) for t in (res[k] for k in range(6))]
print("ROWGAPS", gaps, "chunks", [len(res[k]) for k in range(6)])
PY
cat "$OUT/probe.txt"
sleep 1
strip() { sed 's/\x1b\[[0-9;]*m//g' "$1"; }
moves=$(strip "$OUT/router.log" | grep "stream moved to another decode node" | grep -o ' ms=[0-9]*' | cut -d= -f2 | tr '\n' ' ')
pushes=$(cat "$OUT/decode-0.log" "$OUT/decode-1.log" | sed 's/\x1b\[[0-9;]*m//g' | grep "decode migrated" | sort |
    grep -o 'bytes=[0-9]* transfer_us=[0-9]*' | sed 's/bytes=//; s/ transfer_us=/ B in /; s/$/ us/' | tr '\n' ';')
gaps=$(grep '^ROWGAPS' "$OUT/probe.txt" | sed 's/^ROWGAPS //')
echo
echo "| moves (router ms, in order) | pushes in order (bytes, time) | clients' longest gaps (ms) |"
echo "|---|---|---|"
echo "| ${moves:-none} | ${pushes:-none} | ${gaps:-probe failed} |"
