#!/usr/bin/env bash
# PD serving on the H200 x2 host: prefill node on GPU0 + decode node on GPU1 (KV over UCX 1.22 from
# the libucx-cu13 wheel) + router, against colocated replicas (role "all", engine.colocated) on
# GPU0 and GPU1, each `pdnode bench --workload mixed`. Llama-3.1-8B shapes, dummy weights (cuda
# backend). Dummy weights have no tokenizer: a word-level tokenizer.json over the bench's word
# list (128256 entries, the preset's vocab) is written next to them, so one bench word is one token.
# Needs .gpu-pd/bundle.tar.xz (scripts/gpu/pack.sh). Logs and JSON in $OUT; a table last.
# `pd` (and `both`) also: each request's KV hand-off (bytes, transfer_us, arena or host staging)
# from the prefill node's log, summarized; and greedy outputs of a few prompts (8 to 3500 tokens)
# through PD against a colocated replica on GPU0 (same dummy weights): PASS when identical.
# PD_UCX_TLS (default: UCX's choice, which includes cuda_ipc and cuda_copy). KV staging arenas
# (engine.kv_staging_tokens, 128 KiB per token): PREFILL_STAGING_TOKENS (default 32768 = 4 GiB:
# prefill takes a span when a request's first chunk has run, until its push is flushed) and
# DECODE_STAGING_TOKENS (default 131072 = 16 GiB: decode holds a span from ReserveKv to Decode,
# i.e. across prefill queueing: 64 in flight x 2048 tokens); 0 on both = the per-request
# host-staging path, for comparison. A full arena is waited for (<= 5 s) before host staging;
# the summary prints the waits and fallbacks of both nodes. The decode node's KV pool leaves room
# for its arena: PD_DECODE_MEM_FRACTION (default 0.78), PD_PREFILL_MEM_FRACTION (default 0.82)
# (of the free memory: weights + pool; the arena is allocated after the pool: check the
# "KV staging arena allocated" lines).
# PD_MAX_BATCH_TOKENS (default 8192) sets the PD nodes' prefill chunk: with e.g. 512, each
# chunk's finished KV blocks are pushed while the next chunks compute (the summary's
# early_blocks), and transfer_us is only the part left after the prompt's last chunk.
# PD_TTFT=0 skips the 4 x 4000-token TTFT probe, PD_BENCH=0 the load bench, GREEDY=0 the
# greedy comparison (scripts/gpu/overlap.sh uses them).
# CONTEXT_LENGTH (default 4096): engine.context_length of every node. WORKLOAD (default
# "--workload mixed"): the bench's workload arguments. COLO_GPUS (default "0 1"): the colocated
# replicas' GPUs; "0" runs one replica with the whole load (a one-GPU machine).
# usage: scripts/gpu/serve.sh [pd|colo|both]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/serve}
PD=${PD:-/tmp/pd}
WHAT=${1:-both}
# PD_DECODE_GPU=0 puts the decode node on GPU0 with the prefill node (a one-GPU machine; set the
# memory fractions and staging sizes below so that both fit). PD_VERIFY=false turns
# transfer.verify off on both PD nodes (the checksum's cost: compare the device-fence line).
DECODE_GPU=${PD_DECODE_GPU:-1}
NREQ=${NREQ:-256}
CONC=${CONC:-64}
SLO="--slo-ttft-ms ${SLO_TTFT_MS:-2000} --slo-tpot-ms ${SLO_TPOT_MS:-50}"
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
# Newest first, each waited for: the nodes deregister while etcd (started first) still runs.
stop_all() {
    local i
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill "${pids[$i]}" 2>/dev/null
        wait "${pids[$i]}" 2>/dev/null
    done
    pids=()
}
trap stop_all EXIT
common() { # role id listen
    cat <<T
[node]
role = "$1"
cluster = "h200"
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
context_length = ${CONTEXT_LENGTH:-4096}
block_size = 16
max_batch_tokens = ${MAX_BATCH_TOKENS:-8192}
max_running_requests = 64
mem_fraction = ${MEM_FRACTION:-0.85}
${ENGINE_EXTRA:-}
[log]
format = "human"
filter = "${LOG_FILTER:-info}"
T
}
wait_http() { # url seconds
    local i=0
    while [ $i -lt $(($2 * 5)) ]; do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; i=$((i + 1)); done
    return 1
}
rows=()
# Greedy completions of a few prompts (one word = one token) into $OUT/greedy.<name>.txt.
greedy() { # name url
    python3 - "$2" > "$OUT/greedy.$1.txt" 2> "$OUT/greedy.$1.err" <<'PY'
import json, sys, urllib.request
for n in (8, 300, 1500, 3500):
    prompt = " ".join(f"w{(i * 7919 + n) % 100000}" for i in range(n))
    body = {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 32, "temperature": 0}
    req = urllib.request.Request(sys.argv[1] + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=120))
    c = r["choices"][0]
    print(n, c.get("finish_reason"), r.get("usage", {}).get("completion_tokens"), json.dumps(c["text"]))
PY
    echo "greedy $1: rc=$? $(wc -l < "$OUT/greedy.$1.txt") prompts"
}
# 4000-token prompts, sequential, each distinct (no prefix-cache hits), into $OUT/ttft.txt:
# 4 with max_tokens 1 (the prefill node answers alone: no KV hand-off = prefill alone), then 4
# streamed with max_tokens 4 and ignore_eos (a real hand-off): time to the first streamed token.
ttft() { # url
    python3 - "$1" > "$OUT/ttft.txt" 2>&1 <<'PY'
import json, sys, time, urllib.request
def prompt(k):
    return " ".join(f"w{(i * 104729 + 7 * k + 1) % 100000}" for i in range(4000))
def post(body):
    return urllib.request.Request(sys.argv[1] + "/v1/completions", json.dumps(body).encode(),
                                  {"content-type": "application/json"})
alone, ttft = [], []
for k in range(4):
    body = {"model": "llama-3.1-8b", "prompt": prompt(100 + k), "max_tokens": 1, "temperature": 0}
    t = time.time()
    json.load(urllib.request.urlopen(post(body), timeout=120))
    alone.append((time.time() - t) * 1e3)
    print(f"prefill only (max_tokens 1) {k}: {alone[-1]:.1f} ms")
for k in range(4):
    body = {"model": "llama-3.1-8b", "prompt": prompt(k), "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t = time.time()
    first, n = None, 0
    with urllib.request.urlopen(post(body), timeout=120) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("choices"):
                n += 1
                if first is None:
                    first = (time.time() - t) * 1e3
    ttft.append(first if first is not None else float("nan"))
    print(f"streamed (max_tokens 4) {k}: first token {ttft[-1]:.1f} ms, {n} chunks, "
          f"all {(time.time() - t) * 1e3:.1f} ms")
med = lambda v: sorted(v)[len(v) // 2]
print(f"prefill_alone_ms_median {med(alone):.1f}")
print(f"ttft_ms_median {med(ttft):.1f}")
PY
    cat "$OUT/ttft.txt"
}
check_greedy() {
    if [ -s "$OUT/greedy.pd.txt" ] && cmp -s "$OUT/greedy.pd.txt" "$OUT/greedy.colo.txt"; then
        rows+=("PASS greedy PD == colocated ($(wc -l < "$OUT/greedy.pd.txt") prompts, 32 tokens each)")
    else
        rows+=("FAIL greedy PD != colocated (see $OUT/greedy.{pd,colo}.txt)")
        diff "$OUT/greedy.pd.txt" "$OUT/greedy.colo.txt" | head -c 2000
    fi
}
# The prefill node's per-request hand-off lines (debug, pdnode_node::pd), summarized.
handoffs() {
    python3 - "$OUT/prefill.log" "$OUT/decode.log" <<'PY'
import re, sys
rows = []
for line in open(sys.argv[1], errors="replace"):
    line = re.sub(r'\x1b\[[0-9;]*m', '', line)
    if "KV hand-off done" not in line:
        continue
    f = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
    rows.append((int(f.get("bytes", 0)), int(f.get("transfer_us", 0)), f.get("via", "?").strip('"'),
                 int(f.get("early_blocks", 0)), int(f.get("blocks", 0))))
print(f"KV hand-offs: {len(rows)}")
last = {}
for line in open(sys.argv[1], errors="replace"):
    if "KV hand-off done" in line:
        last = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', re.sub(r'\x1b\[[0-9;]*m', '', line)))
print(f"  prefill arena: {last.get('arena_waits', 0)} waits for room, "
      f"{last.get('arena_wait_timeouts', 0)} gave up; host-staging fallbacks {last.get('host_fallbacks', 0)}")
waits, dlast = 0, {}
for line in open(sys.argv[2], errors="replace"):
    line = re.sub(r'\x1b\[[0-9;]*m', '', line)
    if "KV reservation waited for staging arena room" in line:
        waits += 1
        dlast = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
print(f"  decode arena: {dlast.get('arena_waits', 0)} waits for room (>1 ms: {waits}), "
      f"{dlast.get('arena_wait_timeouts', 0)} gave up (host staging)")
for via in sorted({r[2] for r in rows}):
    sel = sorted(r for r in rows if r[2] == via)
    us = sorted(r[1] for r in sel)
    b = sum(r[0] for r in sel)
    p = lambda q: us[min(len(us) - 1, int(q * len(us)))]
    early = sum(r[3] for r in sel) / max(1, sum(r[4] for r in sel))
    print(f"  via {via}: {len(sel)} requests, {b / len(sel) / 2**20:.1f} MiB mean, transfer_us p50 {p(0.5)} "
          f"p90 {p(0.9)} max {us[-1]}, {b / max(1, sum(us)) / 1e3:.2f} GB/s (bytes / summed exposed time), "
          f"{100 * early:.0f}% of blocks pushed before the last prefill chunk")
for r in rows[:5]:
    print(f"  e.g. {r[0]} bytes in {r[1]} us via {r[2]}")
# Device fences (transfer.verify on a device arena): the prefill node's KVH64 of each staged span
# and the decode node's records + KVH64 check before its scatter, against the hand-off.
def field_us(path, what, key):
    out = []
    for line in open(path, errors="replace"):
        line = re.sub(r'\x1b\[[0-9;]*m', '', line)
        if what in line:
            f = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
            out.append((int(f.get("bytes", 0)), int(f.get(key, 0))))
    return out
sums = field_us(sys.argv[1], "staged span sealed", "seal_us") + field_us(sys.argv[1], "device KV summed", "sum_us")
checks = field_us(sys.argv[2], "device KV scattered and checked", "scatter_check_us")
big = lambda v: sorted(u for b, u in v if b > 100 << 20)
ho = big([(r[0], r[1]) for r in rows])
med = lambda v: v[len(v) // 2] if v else float("nan")
print(f"  device fences: {len(sums)} seals/sums at prefill, {len(checks)} checks at decode; "
      f"prompts > 100 MiB: seal/sum_us p50 {med(big(sums))}, scatter+check_us p50 {med(big(checks))}, "
      f"hand-off transfer_us p50 {med(ho)}")
PY
}
# Fixed ports stay below the ephemeral range (32768-60999): a listener on 51100 once failed with
# "Address already in use" because a client socket of the PD run held that local port.
start_colo() { # gpu
    local g=$1
    { ENGINE_EXTRA="colocated = true" common all colo-$g 127.0.0.1:$((7100 + g)); cat <<T
[registry]
kind = "memory"
[transfer]
kind = "in-process"
[router]
http_listen = "127.0.0.1:$((8100 + g))"
grpc_listen = "127.0.0.1:$((9100 + g))"
T
    } > "$OUT/colo$g.toml"
    CUDA_VISIBLE_DEVICES=$g "$BIN" start -c "$OUT/colo$g.toml" > "$OUT/colo$g.log" 2>&1 &
    pids+=($!)
}
wait_colo() { # gpu
    local g=$1 ok=0 code=
    for _ in $(seq 1 ${PROBES:-300}); do
        code=$(curl -s -o "$OUT/colo$g.probe.json" -w '%{http_code}' http://127.0.0.1:$((8100 + g))/v1/completions \
            -H 'content-type: application/json' -d '{"model":"llama-3.1-8b","prompt":"the of and","max_tokens":2}')
        [ "$code" = 200 ] && ok=1 && break
        sleep 0.5
    done
    [ $ok = 1 ] || { echo "colocated $g never answered: HTTP $code $(head -c 400 "$OUT/colo$g.probe.json")"; }
}
bench() { # name url
    # shellcheck disable=SC2086 # WORKLOAD: several arguments
    timeout 300 "$BIN" bench --url "$2" ${WORKLOAD:---workload mixed} --concurrency "$CONC" --num-requests "$NREQ" \
        --warmup 8 --ignore-eos --no-progress $SLO --out "$OUT/$1.json" > "$OUT/$1.bench.log" 2>&1
    rows+=("$1 rc=$?")
    tail -25 "$OUT/$1.bench.log"
}

if [ "$WHAT" != colo ]; then
    echo "== PD: prefill GPU0, decode GPU$DECODE_GPU, router; KV over UCX ($LIB)"
    rm -rf /tmp/pd-etcd # a fresh registry per run: no lease of an earlier run's node
    "$PD/etcd" --data-dir /tmp/pd-etcd --listen-client-urls http://127.0.0.1:2379 \
        --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
        > "$OUT/etcd.log" 2>&1 &
    pids+=($!)
    wait_http http://127.0.0.1:2379/health 30 || echo "etcd not healthy"
    reg='[registry]
kind = "etcd"
endpoints = ["http://127.0.0.1:2379"]'
    xfer="[transfer]
kind = \"ucx\"
ucx_lib = \"$LIB\"
ucx_net_devices = \"lo\"
ucx_tls = \"${PD_UCX_TLS:-}\"
verify = ${PD_VERIFY:-true}"
    pdlog="info,pdnode_node::pd=debug,pdnode_transfer::ucx=debug,pdnode_engine::engine::run::staged=debug,pdnode_cuda::backend::staging=debug"
    { MAX_BATCH_TOKENS=${PD_MAX_BATCH_TOKENS:-8192} MEM_FRACTION=${PD_PREFILL_MEM_FRACTION:-0.82} \
      ENGINE_EXTRA="kv_staging_tokens = ${PREFILL_STAGING_TOKENS:-32768}" LOG_FILTER=$pdlog \
        common prefill prefill-0 127.0.0.1:7001; echo "$reg"; echo "$xfer"; } > "$OUT/prefill.toml"
    { MAX_BATCH_TOKENS=${PD_MAX_BATCH_TOKENS:-8192} MEM_FRACTION=${PD_DECODE_MEM_FRACTION:-0.78} \
      ENGINE_EXTRA="kv_staging_tokens = ${DECODE_STAGING_TOKENS:-131072}" LOG_FILTER=$pdlog \
        common decode decode-0 127.0.0.1:7002; echo "$reg"; echo "$xfer"; } > "$OUT/decode.toml"
    cat > "$OUT/router.toml" <<T
[node]
role = "router"
cluster = "h200"
id = "router-0"
listen = "127.0.0.1:7000"
$reg
[model]
path = "$MODEL"
format = "dummy"
preset = "llama-3.1-8b"
served_name = "llama-3.1-8b"
[router]
http_listen = "127.0.0.1:8000"
grpc_listen = "127.0.0.1:50051"
prefill_policy = "round_robin"
decode_policy = "round_robin"
[log]
format = "human"
filter = "info"
T
    CUDA_VISIBLE_DEVICES=0 "$BIN" start -c "$OUT/prefill.toml" > "$OUT/prefill.log" 2>&1 &
    pids+=($!)
    if [ "$DECODE_GPU" = 0 ]; then
        # One GPU for both: the decode node sizes its pool from what the prefill node left.
        for _ in $(seq 1 240); do grep -q "engine ready" "$OUT/prefill.log" && break; sleep 0.5; done
    fi
    CUDA_VISIBLE_DEVICES=$DECODE_GPU "$BIN" start -c "$OUT/decode.toml" > "$OUT/decode.log" 2>&1 &
    pids+=($!)
    CUDA_VISIBLE_DEVICES= "$BIN" start -c "$OUT/router.toml" > "$OUT/router.log" 2>&1 &
    pids+=($!)
    wait_http http://127.0.0.1:8000/health 120 || echo "router not healthy"
    ok=0
    for _ in $(seq 1 300); do
        curl -sf http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
            -d '{"model":"llama-3.1-8b","prompt":"the of and","max_tokens":2}' > "$OUT/pd.probe.json" 2>&1 && ok=1 && break
        sleep 0.5
    done
    [ $ok = 1 ] || { echo "PD never answered"; curl -s http://127.0.0.1:8000/v1/models; tail -5 "$OUT"/prefill.log "$OUT"/decode.log "$OUT"/router.log; }
    cat "$OUT/pd.probe.json"; echo
    grep -hE "KV staging arena|no KV staging|cannot register" "$OUT/prefill.log" "$OUT/decode.log" | head -6
    [ "${GREEDY:-1}" = 1 ] && greedy pd http://127.0.0.1:8000
    [ "${PD_TTFT:-1}" = 1 ] && ttft http://127.0.0.1:8000
    [ "${PD_BENCH:-1}" = 1 ] && bench pd http://127.0.0.1:8000
    handoffs | tee "$OUT/pd.handoffs.txt"
    curl -s http://127.0.0.1:8000/metrics > "$OUT/pd.router.metrics" 2>&1
    grep -E '^pdnode_transfer' "$OUT/pd.router.metrics" | head -20
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv >> "$OUT/nvidia-smi.csv" 2>&1
    stop_all
    if [ "$WHAT" = pd ] && [ "${GREEDY:-1}" = 1 ]; then
        echo "== colocated replica on GPU0 for the greedy comparison"
        start_colo 0
        wait_colo 0
        greedy colo http://127.0.0.1:8100
        check_greedy
        stop_all
    fi
fi

if [ "$WHAT" != pd ]; then
    echo "== colocated: role all + engine.colocated, one replica per GPU (the bench's concurrency split)"
    colo_gpus=${COLO_GPUS:-0 1}
    for g in $colo_gpus; do start_colo $g; done
    for g in $colo_gpus; do wait_colo $g; done
    if [ "$WHAT" = both ] && [ "${GREEDY:-1}" = 1 ]; then
        greedy colo http://127.0.0.1:8100
        check_greedy
    fi
    if [ "$colo_gpus" = 0 ]; then # one replica (a one-GPU machine): the whole load on it
        bench colo0 http://127.0.0.1:8100
    else
        half=$((CONC / 2)) nhalf=$((NREQ / 2))
        CONC=$half NREQ=$nhalf bench colo0 http://127.0.0.1:8100 &
        b0=$!
        CONC=$half NREQ=$nhalf bench colo1 http://127.0.0.1:8101 > "$OUT/colo1.tail" 2>&1
        wait $b0
        rows+=("colo1 (see colo1.bench.log)")
    fi
    stop_all
fi

echo
nvidia-smi --query-gpu=index,name --format=csv,noheader
for f in pd colo0 colo1; do
    [ -e "$OUT/$f.bench.log" ] || continue
    echo "-- $f"; grep -iE 'ttft|tpot|goodput|throughput|error|req/s|tok/s' "$OUT/$f.bench.log" | head -14
done
[ -e "$OUT/pd.handoffs.txt" ] && cat "$OUT/pd.handoffs.txt"
printf '%s\n' "${rows[@]}"
