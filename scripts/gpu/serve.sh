#!/usr/bin/env bash
# PD serving on the H200 x2 host: prefill node on GPU0 + decode node on GPU1 (KV over UCX 1.22 from
# the libucx-cu13 wheel) + router, against colocated replicas (role "all", engine.colocated) on
# GPU0 and GPU1, each `pdnode bench --workload mixed`. Llama-3.1-8B shapes, dummy weights (cuda
# backend). Dummy weights have no tokenizer: a word-level tokenizer.json over the bench's word
# list (128256 entries, the preset's vocab) is written next to them, so one bench word is one token.
# Needs .gpu-pd/bundle.tar.xz (scripts/gpu/pack.sh). Logs and JSON in $OUT; a table last.
# usage: scripts/gpu/serve.sh [pd|colo|both]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/serve}
PD=${PD:-/tmp/pd}
WHAT=${1:-both}
NREQ=${NREQ:-256}
CONC=${CONC:-64}
SLO="--slo-ttft-ms ${SLO_TTFT_MS:-2000} --slo-tpot-ms ${SLO_TPOT_MS:-50}"
mkdir -p "$OUT" "$PD"
[ -x "$PD/pdnode" ] || tar -xJf .gpu-pd/bundle.tar.xz -C "$PD" || { echo "no bundle"; exit 1; }
BIN=$PD/pdnode
LIB=$PD/ucx/libucx/lib/libucp.so.0
export LD_LIBRARY_PATH=$PD/ucx/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_NET_DEVICES=lo
MODEL=$PD/dummy-llama8b
mkdir -p "$MODEL"
python3 - "$MODEL" "${VOCAB:-128256}" <<'PY'
import json, re, sys
words = re.findall(r'^\s*"([^"\\]+)",$', open("crates/pdnode-bench/src/text.rs").read(), re.M)
vocab, seen = {}, set()
for w in ["<unk>"] + words:
    if w not in seen:
        seen.add(w); vocab[w] = len(vocab)
i = 0
while len(vocab) < int(sys.argv[2]):
    vocab.setdefault(f"w{i}", len(vocab)); i += 1
tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
       "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
       "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
json.dump(tok, open(sys.argv[1] + "/tokenizer.json", "w"))
print("tokenizer.json:", len(words), "bench words,", len(vocab), "entries")
PY

pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done; pids=(); }
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
context_length = 4096
block_size = 16
max_batch_tokens = 8192
max_running_requests = 64
mem_fraction = 0.85
${ENGINE_EXTRA:-}
[log]
format = "human"
filter = "info"
T
}
wait_http() { # url seconds
    local i=0
    while [ $i -lt $(($2 * 5)) ]; do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; i=$((i + 1)); done
    return 1
}
rows=()
bench() { # name url
    timeout 300 "$BIN" bench --url "$2" --workload mixed --concurrency "$CONC" --num-requests "$NREQ" \
        --warmup 8 --ignore-eos --no-progress $SLO --out "$OUT/$1.json" > "$OUT/$1.bench.log" 2>&1
    rows+=("$1 rc=$?")
    tail -25 "$OUT/$1.bench.log"
}

if [ "$WHAT" != colo ]; then
    echo "== PD: prefill GPU0, decode GPU1, router; KV over UCX ($LIB)"
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
staging_mib = 4096"
    { common prefill prefill-0 127.0.0.1:7001; echo "$reg"; echo "$xfer"; } > "$OUT/prefill.toml"
    { common decode decode-0 127.0.0.1:7002; echo "$reg"; echo "$xfer"; } > "$OUT/decode.toml"
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
    CUDA_VISIBLE_DEVICES=1 "$BIN" start -c "$OUT/decode.toml" > "$OUT/decode.log" 2>&1 &
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
    bench pd http://127.0.0.1:8000
    curl -s http://127.0.0.1:8000/metrics > "$OUT/pd.router.metrics" 2>&1
    grep -E '^pdnode_transfer' "$OUT/pd.router.metrics" | head -20
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv >> "$OUT/nvidia-smi.csv" 2>&1
    stop_all
fi

if [ "$WHAT" != pd ]; then
    echo "== colocated: role all + engine.colocated, one replica per GPU (the bench's concurrency split)"
    for g in 0 1; do
        { ENGINE_EXTRA="colocated = true" common all colo-$g 127.0.0.1:$((7100 + g)); cat <<T
[registry]
kind = "memory"
[transfer]
kind = "in-process"
[router]
http_listen = "127.0.0.1:$((8100 + g))"
grpc_listen = "127.0.0.1:$((51100 + g))"
T
        } > "$OUT/colo$g.toml"
        CUDA_VISIBLE_DEVICES=$g "$BIN" start -c "$OUT/colo$g.toml" > "$OUT/colo$g.log" 2>&1 &
        pids+=($!)
    done
    for g in 0 1; do
        ok=0
        for _ in $(seq 1 ${PROBES:-300}); do
            code=$(curl -s -o "$OUT/colo$g.probe.json" -w '%{http_code}' http://127.0.0.1:$((8100 + g))/v1/completions \
                -H 'content-type: application/json' -d '{"model":"llama-3.1-8b","prompt":"the of and","max_tokens":2}')
            [ "$code" = 200 ] && ok=1 && break
            sleep 0.5
        done
        [ $ok = 1 ] || { echo "colocated $g never answered: HTTP $code $(head -c 400 "$OUT/colo$g.probe.json")"; }
    done
    half=$((CONC / 2)) nhalf=$((NREQ / 2))
    CONC=$half NREQ=$nhalf bench colo0 http://127.0.0.1:8100 &
    b0=$!
    CONC=$half NREQ=$nhalf bench colo1 http://127.0.0.1:8101 > "$OUT/colo1.tail" 2>&1
    wait $b0
    rows+=("colo1 (see colo1.bench.log)")
    stop_all
fi

echo
nvidia-smi --query-gpu=index,name --format=csv,noheader
for f in pd colo0 colo1; do
    [ -e "$OUT/$f.bench.log" ] || continue
    echo "-- $f"; grep -iE 'ttft|tpot|goodput|throughput|error|req/s|tok/s' "$OUT/$f.bench.log" | head -14
done
printf '%s\n' "${rows[@]}"
