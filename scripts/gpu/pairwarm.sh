#!/usr/bin/env bash
# The first requests through a new prefill/decode pair, with and without the router's pair
# warm-up (`router.warm_pairs`, issue 20): a prefill node and a decode node on ONE GPU (GPU0, a
# one-GPU machine: KV still moves between the two processes over UCX cuda_ipc), etcd, a router.
# Llama-3.1-8B shapes, dummy weights (cuda backend), each node warmed (engine.cuda.warm_up_context
# default). For each setting in WARM (default "false true"): start everything afresh, time until
# the router's /health answers (no request sent); with warm_pairs on, also until the router's
# pdnode_router_pair_warmups_total{outcome="ok"} shows the warm-up done; then 4 sequential
# requests (distinct 500-token prompts, 16 streamed tokens, greedy, ignore_eos): TTFT each, and
# each hand-off's transfer_us from the prefill node's log (the warm-up's first, when there is
# one). ROUTER_LOG: the router's log filter (default info). Needs .gpu-pd/bundle.tar.xz (scripts/gpu/pack.sh). Table last.
# usage: scripts/gpu/pairwarm.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/pairwarm}
. scripts/gpu/common.sh
node() { # role id listen mem_fraction staging_tokens
    cat <<T
[node]
role = "$1"
cluster = "warm"
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
kv_staging_tokens = $5
[registry]
kind = "etcd"
endpoints = ["http://127.0.0.1:2379"]
[transfer]
kind = "ucx"
ucx_lib = "$LIB"
ucx_net_devices = "lo"
[log]
format = "human"
filter = "info,pdnode_node::pd=debug"
T
}
rows=()
for w in ${WARM:-false true}; do
    echo "== router.warm_pairs = $w"
    start_etcd pw "etcd-$w.log"
    node prefill prefill-0 127.0.0.1:7001 0.40 8192 > "$OUT/prefill-$w.toml"
    node decode decode-0 127.0.0.1:7002 0.70 16384 > "$OUT/decode-$w.toml"
    cat > "$OUT/router-$w.toml" <<T
[node]
role = "router"
cluster = "warm"
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
decode_policy = "round_robin"
warm_pairs = $w
[log]
format = "human"
filter = "${ROUTER_LOG:-info}"
T
    t0=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=0 "$BIN" start -c "$OUT/prefill-$w.toml" > "$OUT/prefill-$w.log" 2>&1 &
    pids+=($!)
    # One GPU for both: the decode node sizes its pool from what the prefill node left.
    for _ in $(seq 1 240); do grep -q "engine ready" "$OUT/prefill-$w.log" && break; sleep 0.5; done
    CUDA_VISIBLE_DEVICES=0 "$BIN" start -c "$OUT/decode-$w.toml" > "$OUT/decode-$w.log" 2>&1 &
    pids+=($!)
    CUDA_VISIBLE_DEVICES= "$BIN" start -c "$OUT/router-$w.toml" > "$OUT/router-$w.log" 2>&1 &
    pids+=($!)
    if ! wait_http http://127.0.0.1:8000/health 180; then
        rows+=("| $w | never ready; $(tail -2 "$OUT/decode-$w.log" | tr '\n' ' ') |")
        stop_all
        continue
    fi
    t1=$(date +%s.%N)
    warmed=-
    if [ "$w" = true ]; then
        for _ in $(seq 1 150); do
            curl -s http://127.0.0.1:8000/metrics | grep -q 'pdnode_router_pair_warmups_total{outcome="ok"}' && break
            sleep 0.1
        done
        t2=$(date +%s.%N)
        warmed=$(python3 -c "print(f'+{($t2 - $t1) * 1e3:.0f} ms')")
    fi
    ready=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
    python3 - > "$OUT/probe-$w.txt" 2>&1 <<'PY'
import json, time, urllib.request
URL = "http://127.0.0.1:8000/v1/completions"
def prompt(k, n=500):
    return " ".join(f"w{(i * 104729 + 7 * k + 13) % 100000}" for i in range(n))
# The client's own first call (urllib builds its opener, an SSL context among its handlers)
# is paid here, on /health, not by the first timed request.
for k in range(2):
    t = time.time()
    urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=10).read()
    print(f"client GET /health {k}: {(time.time() - t) * 1e3:.1f} ms")
out = []
for k in range(4):
    body = {"model": "llama-3.1-8b", "prompt": prompt(k), "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(URL, json.dumps(body).encode(), {"content-type": "application/json"})
    t = time.time()
    first = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]" and first is None:
                if json.loads(line[5:]).get("choices"):
                    first = time.time()
    out.append((first - t) * 1e3)
    iso = lambda x: time.strftime("%H:%M:%S", time.gmtime(x)) + f".{int(x * 1e6) % 1000000:06d}"
    print(f"request {k}: TTFT {out[-1]:.1f} ms (sent {iso(t)}, first token {iso(first)} UTC)")
print("ROW", " | ".join(f"{v:.1f}" for v in out))
PY
    cat "$OUT/probe-$w.txt"
    handoffs=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/prefill-$w.log" | grep "KV hand-off done" |
        grep -o 'transfer_us=[0-9]*' | cut -d= -f2 | tr '\n' ' ')
    endpoints=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/prefill-$w.log" | grep "KV hand-off done" | tail -1 |
        grep -o 'ucx_endpoints=[0-9]*')
    row=$(grep '^ROW' "$OUT/probe-$w.txt" | sed 's/^ROW //')
    rows+=("| $w | $ready | $warmed | ${row:-probe failed} | ${handoffs:-none} | ${endpoints:-} |")
    stop_all
done
echo
echo "| warm_pairs | start to /health (s) | warm-up seen | TTFT 1st | 2nd | 3rd | 4th (ms) | hand-offs' transfer_us in order (warm-up first) | last |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
