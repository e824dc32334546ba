#!/usr/bin/env bash
# Live decode migration on ONE GPU (issue 21; a one-GPU machine: three processes on GPU0, KV
# between them over UCX cuda_ipc): etcd, a router, a prefill node and two decode nodes,
# Llama-3.1-8B shapes, dummy weights (cuda backend). 8 streams (distinct 1000-token prompts,
# 256 output tokens, greedy, ignore_eos) are run once to the end (the reference), then again;
# `pdnode drain decode-0 --migrate` moves decode-0's streams to
# decode-1 (1 s into the run). Reported: streams moved, KV bytes and push time per stream (decode-0's log), the
# router's reserve + push + Decode per move (its log), each client's longest gap between two
# tokens (moved and unmoved streams), and whether every text equals the reference (it need
# not: with 8 streams the batches differ between runs, and so may greedy picks on dummy
# weights). Then one stream alone, moved off its decode node: its text must equal its run alone.
# Needs .gpu-pd/bundle.tar.xz (scripts/gpu/pack.sh). Table last.
# usage: scripts/gpu/migrate.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/migrate}
. scripts/gpu/common.sh
node() { # role id listen mem_fraction http
    cat <<T
[node]
role = "$1"
cluster = "mig"
id = "$2"
listen = "$3"
http_listen = "$5"
drain_timeout_s = 60
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
# The same prompts run more than once: no prefix-cache hit may change a greedy pick.
prefix_cache = false
kv_staging_tokens = 16384
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
start_etcd mig
node prefill prefill-0 127.0.0.1:7001 0.30 127.0.0.1:9001 > "$OUT/prefill.toml"
node decode decode-0 127.0.0.1:7002 0.45 127.0.0.1:9002 > "$OUT/decode-0.toml"
node decode decode-1 127.0.0.1:7003 0.75 127.0.0.1:9003 > "$OUT/decode-1.toml"
cat > "$OUT/router.toml" <<T
[node]
role = "router"
cluster = "mig"
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
[log]
format = "human"
filter = "info"
T
# One GPU for all: each node sizes its pool from what the ones before it left.
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
BIN=$BIN python3 - > "$OUT/probe.txt" 2>&1 <<'PY'
import json, os, subprocess, threading, time, urllib.request
URL = "http://127.0.0.1:8000/v1/completions"
N, MAX = 8, 256
def prompt(k, n=1000):
    return " ".join(f"w{(i * 104729 + 7 * k + 13) % 100000}" for i in range(n))
def run(k, res):
    body = {"model": "llama-3.1-8b", "prompt": prompt(k), "max_tokens": MAX, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(URL, json.dumps(body).encode(), {"content-type": "application/json"})
    times, text = [], []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            c = json.loads(line[5:]).get("choices")
            if c:
                times.append(time.time())
                text.append(c[0].get("text", ""))
    res[k] = (times, "".join(text))
def all_streams(drain_at=None):
    res = {}
    th = [threading.Thread(target=run, args=(k, res)) for k in range(N)]
    for t in th:
        t.start()
    drained = None
    if drain_at is not None:
        # The streams' prefills take well under a second: by then each has many tokens.
        time.sleep(drain_at)
        t0 = time.time()
        out = subprocess.run([os.environ["BIN"], "drain", "--etcd", "http://127.0.0.1:2379",
                              "--cluster", "mig", "decode-0", "--migrate"],
                             capture_output=True, text=True, timeout=60)
        drained = (t0, out.returncode, out.stdout.strip() + out.stderr.strip()[-300:])
    for t in th:
        t.join()
    return res, drained
ref, _ = all_streams()
res, drained = all_streams(drain_at=1.0)
print("drain:", drained)
gaps = []
for k in range(N):
    times, text = res[k]
    gap = max((b - a for a, b in zip(times, times[1:])), default=0) * 1e3
    same = text == ref[k][1]
    gaps.append((gap, same, len(times)))
    print(f"stream {k}: {len(times)} chunks, longest gap {gap:.1f} ms, same text: {same}")
print("ROWGAPS", json.dumps(gaps))
PY
# Phase 2: one stream alone (batch 1 on every node, so the text does not depend on what else
# runs): the reference, then the same stream moved off whichever decode node runs it (decode-0
# started again first: the drain above stopped it).
CUDA_VISIBLE_DEVICES=0 "$BIN" start -c "$OUT/decode-0.toml" > "$OUT/decode-0b.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 240); do
    curl -s http://127.0.0.1:8000/metrics | grep -q 'pdnode_router_nodes{role="decode"} 2' && break
    sleep 0.5
done
BIN=$BIN python3 - > "$OUT/single.txt" 2>&1 <<'PY'
import json, os, re, subprocess, threading, time, urllib.request
URL = "http://127.0.0.1:8000/v1/completions"
def run(res):
    words = " ".join(f"w{(i * 104729 + 99) % 100000}" for i in range(1000))
    body = {"model": "llama-3.1-8b", "prompt": words, "max_tokens": 256, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(URL, json.dumps(body).encode(), {"content-type": "application/json"})
    times, text = [], []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                c = json.loads(line[5:]).get("choices")
                if c:
                    times.append(time.time())
                    text.append(c[0].get("text", ""))
    res["out"] = (times, "".join(text))
ref = {}
run(ref)
ref2 = {}
run(ref2)
res = {}
t = threading.Thread(target=run, args=(res,))
t.start()
time.sleep(1.0)
on = []
for name, port in (("decode-0", 9002), ("decode-1", 9003)):
    m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    if re.search(r'pdnode_kv_owned_blocks\{[^}]*owner="request"[^}]*\} [1-9]', m):
        on.append(name)
print("running on:", on)
if on:
    out = subprocess.run([os.environ["BIN"], "drain", "--etcd", "http://127.0.0.1:2379",
                          "--cluster", "mig", on[0], "--migrate"], capture_output=True, text=True, timeout=60)
    print("drain:", out.returncode, out.stdout.strip())
t.join()
times, text = res["out"]
gaps = [b - a for a, b in zip(times, times[1:])]
gap = max(gaps, default=0) * 1e3
at = gaps.index(max(gaps)) + 1 if gaps else 0
a, b = ref["out"][1], text
div = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
print(f"alone twice, same text: {ref['out'][1] == ref2['out'][1]}; moved after chunk {at} (of {len(times)});"
      f" first differing character {div} of {len(a)}; reference around it: {a[max(0, (div or 0) - 40):(div or 0) + 40]!r};"
      f" moved: {b[max(0, (div or 0) - 40):(div or 0) + 40]!r}")
print(f"ROWSINGLE moved off {on[0] if on else '-'}: {len(times)} chunks, longest gap {gap:.1f} ms (after chunk {at}), same text as alone: {text == ref['out'][1]} (alone twice: {ref['out'][1] == ref2['out'][1]})")
PY
cat "$OUT/single.txt"
cat "$OUT/probe.txt"
sleep 3
strip() { sed 's/\x1b\[[0-9;]*m//g' "$1"; }
moves=$(strip "$OUT/router.log" | grep -c "stream moved to another decode node")
router_ms=$(strip "$OUT/router.log" | grep "stream moved to another decode node" | grep -o ' ms=[0-9]*' | cut -d= -f2 | sort -n | tr '\n' ' ')
bytes=$(strip "$OUT/decode-0.log" | grep "decode migrated" | grep -o 'bytes=[0-9]*' | cut -d= -f2 | sort -n | tr '\n' ' ')
push=$(strip "$OUT/decode-0.log" | grep "decode migrated" | grep -o 'transfer_us=[0-9]*' | cut -d= -f2 | sort -n | tr '\n' ' ')
left=$(strip "$OUT/decode-0.log" | grep -o "drain by migration.*" | head -1)
gaps=$(grep '^ROWGAPS' "$OUT/probe.txt" | sed 's/^ROWGAPS //')
echo
echo "| streams moved | KV bytes per moved stream | push transfer_us (decode-0) | router reserve+push+Decode ms | clients (longest gap ms, same text, chunks) | decode-0 drain |"
echo "|---|---|---|---|---|---|"
echo "| $moves | ${bytes:-none} | ${push:-none} | ${router_ms:-none} | ${gaps:-probe failed} | ${left:-none} |"
echo
grep '^ROWSINGLE' "$OUT/single.txt" || echo "single stream: probe failed"
