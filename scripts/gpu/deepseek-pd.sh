#!/usr/bin/env bash
# A DeepSeek PD run on one GPU (issue 22): the tiny DeepSeek-V2 and -V3 checkpoints of the
# engine's fixtures (latent attention, MoE; word-level tokenizer, "w17" is token 17) served on
# the CUDA backend by a prefill node and a decode node on GPU0 with a router in front (etcd,
# latent KV over UCX: cuda_ipc/cuda_copy), then by one colocated node (role "all") on GPU0.
# Greedy completions (32 tokens) of the fixture's reference prompt and of prompts of 40, 120 and
# 200 tokens through both: PASS when PD == colocated for every prompt, when the reference
# prompt's tokens are transformers' greedy tokens, and when the prefill node counted the
# hand-offs (pdnode_transfer_handoffs_total, outcome "ok"). Needs the full bundle
# (PERFTEST=0 scripts/gpu/pack.sh). Logs in $OUT; a table last.
# PREFILL_GPUS / DECODE_GPUS (default "0"): the GPUs of each PD node, e.g. "0,1" for a
# tensor-parallel group of two (the latent goes whole between TP degrees; a two-GPU machine);
# the colocated node stays on GPU0 at TP 1.
# usage: OUT=/tmp/x [PREFILL_GPUS=0,1] scripts/gpu/deepseek-pd.sh [deepseek_v2 deepseek_v3]
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/deepseek-pd}
# shellcheck source=scripts/gpu/common.sh
. scripts/gpu/common.sh
FIX=$PWD/crates/pdnode-engine/tests/fixtures
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(deepseek_v2 deepseek_v3)
rows=()
PREFILL_GPUS=${PREFILL_GPUS:-0}
DECODE_GPUS=${DECODE_GPUS:-0}
tp_of() { echo $(($(tr -cd , <<< "$1" | wc -c) + 1)); }
node_toml() { # role id listen model [staging tokens] [gpus]
    local gpus=${6:-0}
    cat <<T
[node]
role = "$1"
cluster = "ds"
id = "$2"
listen = "$3"
[model]
path = "$FIX/$4"
format = "hf"
served_name = "tiny"
[engine]
backend = "${BACKEND:-cuda}"
gpus = [$gpus]
tensor_parallel = $(tp_of "$gpus")
context_length = 256
block_size = 16
num_kv_blocks = 256
max_batch_tokens = 512
max_running_requests = 8
kv_staging_tokens = ${5:-0}
[log]
format = "human"
filter = "info"
T
}
# Greedy completions of the prompts into $OUT/greedy.<tag>.txt (one line each).
greedy() { # tag url model
    python3 - "$2" "$FIX/$3/reference.json" > "$OUT/greedy.$1.txt" 2> "$OUT/greedy.$1.err" <<'PY'
import json, sys, urllib.request
ref = json.load(open(sys.argv[2]))
# prompt_ids[0] is BOS (1), which the tokenizer adds.
prompts = [" ".join(f"w{t}" for t in ref["prompt_ids"][1:])]
prompts += [" ".join(f"w{(i * 37 + n) % 120 + 3}" for i in range(n)) for n in (40, 120, 200)]
for p in prompts:
    body = {"model": "tiny", "prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(sys.argv[1] + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=60))
    print(json.dumps(r["choices"][0]["text"].split()))
print("HF", json.dumps([f"w{t}" for t in ref["greedy_ids"][:32]]))
PY
    echo "greedy $1: rc=$? $(wc -l < "$OUT/greedy.$1.txt") lines"
}
for m in "${models[@]}"; do
    echo "== $m: PD (prefill on GPUs $PREFILL_GPUS, decode on GPUs $DECODE_GPUS, router; latent KV over UCX)"
    start_etcd "ds-$m" "etcd.$m.log"
    reg='[registry]
kind = "etcd"
endpoints = ["http://127.0.0.1:2379"]'
    xfer="[transfer]
kind = \"ucx\"
ucx_lib = \"$LIB\"
ucx_net_devices = \"lo\"
verify = true"
    { node_toml prefill "$m-prefill" 127.0.0.1:7101 "$m" 4096 "$PREFILL_GPUS"; echo "$reg"; echo "$xfer"; } > "$OUT/$m.prefill.toml"
    { node_toml decode "$m-decode" 127.0.0.1:7102 "$m" 4096 "$DECODE_GPUS"; echo "$reg"; echo "$xfer"; } > "$OUT/$m.decode.toml"
    cat > "$OUT/$m.router.toml" <<T
[node]
role = "router"
cluster = "ds"
id = "$m-router"
listen = "127.0.0.1:7100"
$reg
[model]
path = "$FIX/$m"
format = "hf"
served_name = "tiny"
[router]
http_listen = "127.0.0.1:8200"
grpc_listen = ""
[log]
format = "human"
filter = "info"
T
    for r in prefill decode router; do
        "$BIN" start -c "$OUT/$m.$r.toml" > "$OUT/$m.$r.log" 2>&1 &
        pids+=($!)
    done
    wait_http http://127.0.0.1:8200/health 120 || echo "router not healthy"
    ok=0
    for _ in $(seq 1 240); do
        curl -sf http://127.0.0.1:8200/v1/completions -H 'content-type: application/json' \
            -d '{"model":"tiny","prompt":"w5 w6 w7","max_tokens":2}' > "$OUT/$m.probe.json" 2>&1 && ok=1 && break
        sleep 0.5
    done
    [ $ok = 1 ] || { echo "PD never answered"; tail -5 "$OUT/$m".{prefill,decode,router}.log; }
    greedy "$m.pd" http://127.0.0.1:8200 "$m"
    handoffs=$(curl -s http://127.0.0.1:8200/metrics | grep -E "^pdnode_transfer_handoffs_total\{node=\"$m-prefill\",outcome=\"ok\"\}" | awk '{print $2}')
    grep -hiE "error|panic" "$OUT/$m".{prefill,decode}.log | head -5
    stop_all
    echo "== $m: colocated (role all) on GPU0"
    node_toml all "$m-all" 127.0.0.1:7103 "$m" > "$OUT/$m.all.toml"
    printf '[router]\nhttp_listen = "127.0.0.1:8201"\ngrpc_listen = ""\n' >> "$OUT/$m.all.toml"
    "$BIN" start -c "$OUT/$m.all.toml" > "$OUT/$m.all.log" 2>&1 &
    pids+=($!)
    wait_http http://127.0.0.1:8201/health 120 || echo "colocated not healthy"
    greedy "$m.colo" http://127.0.0.1:8201 "$m"
    stop_all
    pd=$OUT/greedy.$m.pd.txt
    colo=$OUT/greedy.$m.colo.txt
    n=$(grep -vc '^HF' "$pd" 2>/dev/null)
    if [ "${n:-0}" -ge 4 ] && cmp -s "$pd" "$colo"; then
        rows+=("PASS $m: greedy PD (TP $(tp_of "$PREFILL_GPUS") -> $(tp_of "$DECODE_GPUS")) == colocated ($n prompts, 32 tokens each)")
    else
        rows+=("FAIL $m: greedy PD != colocated (see $pd, $colo)")
        diff "$pd" "$colo" | head -c 1500
    fi
    if [ "$(head -1 "$pd")" = "$(grep '^HF' "$pd" | cut -d' ' -f2-)" ]; then
        rows+=("PASS $m: reference prompt == transformers' greedy tokens")
    else
        rows+=("FAIL $m: reference prompt: $(head -1 "$pd" | head -c 200) vs HF $(grep '^HF' "$pd" | head -c 200)")
    fi
    if [ "${handoffs:-0}" != 0 ] && [ -n "${handoffs:-}" ]; then
        rows+=("PASS $m: prefill node's hand-offs ok = $handoffs")
    else
        rows+=("FAIL $m: no hand-off counted on the prefill node")
    fi
done
echo "== deepseek PD: prefill GPUs $PREFILL_GPUS, decode GPUs $DECODE_GPUS"
printf '%s\n' "${rows[@]}" | tee "$OUT/summary.txt"
