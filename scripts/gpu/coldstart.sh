#!/usr/bin/env bash
# The first requests after a node starts, with and without the warm-up (issue 20): a colocated
# node (role "all", engine.colocated, in-memory registry) on GPU0, Llama-3.1-8B shapes, dummy
# weights (cuda backend). For each engine.cuda.warm_up_context in WARM (default "0 4096"): start
# the node, time its start until the router's /health answers (no request sent), then 4 requests
# one after another, each a distinct 500-token prompt (no prefix-cache hit), 64 streamed output
# tokens, ignore_eos: TTFT (send to first token) and TPOT (the rest over 63 tokens); then two
# 777-token prompts (a prefill length not seen yet: its first-use cost); then 8 concurrent
# 500-token requests. The node's "backend warmed up"
# line says what the warm-up ran. After each sequential request the router's /metrics gives the
# engine's forward-pass time of that request (pdnode_engine_step_seconds: its prefill steps' sum,
# its decode steps' mean), so a slow first TTFT splits into the forward pass and the rest. Needs .gpu-pd/bundle.tar.xz (scripts/gpu/pack.sh). Table last.
# usage: scripts/gpu/coldstart.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/coldstart}
PD=${PD:-/tmp/pd}
mkdir -p "$OUT" "$PD"
[ -x "$PD/pdnode" ] || tar -xJf .gpu-pd/bundle.tar.xz -C "$PD" || { echo "no bundle"; exit 1; }
BIN=$PD/pdnode
MODEL=$PD/dummy-llama8b
mkdir -p "$MODEL"
python3 scripts/gpu/dummy-tokenizer.py "$MODEL" 128256
pid=
stop() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; pid=; }
trap stop EXIT
rows=()
for w in ${WARM:-0 4096}; do
    cat > "$OUT/node-$w.toml" <<T
[node]
role = "all"
cluster = "cold"
id = "cold-$w"
listen = "127.0.0.1:7300"
[model]
path = "$MODEL"
format = "dummy"
preset = "llama-3.1-8b"
served_name = "llama-3.1-8b"
[engine]
backend = "cuda"
gpus = [0]
colocated = true
context_length = 4096
block_size = 16
max_batch_tokens = 8192
max_running_requests = 64
mem_fraction = 0.85
[engine.cuda]
warm_up_context = $w
[registry]
kind = "memory"
[transfer]
kind = "in-process"
[router]
http_listen = "127.0.0.1:8300"
grpc_listen = "127.0.0.1:9300"
[log]
format = "human"
T
    t0=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=0 "$BIN" start -c "$OUT/node-$w.toml" > "$OUT/node-$w.log" 2>&1 &
    pid=$!
    ok=0
    for _ in $(seq 1 900); do
        curl -sf http://127.0.0.1:8300/health >/dev/null 2>&1 && ok=1 && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    t1=$(date +%s.%N)
    if [ $ok != 1 ]; then
        rows+=("warm_up_context=$w: never ready; log tail: $(tail -3 "$OUT/node-$w.log" | tr '\n' ' ')")
        stop
        continue
    fi
    start_s=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
    warm=$(grep -o 'backend warmed up.*' "$OUT/node-$w.log" | head -1)
    python3 - "$w" > "$OUT/probe-$w.txt" 2>&1 <<'PY'
import json, sys, threading, time, urllib.request
URL = "http://127.0.0.1:8300/v1/completions"
def prompt(k, n=500):
    return " ".join(f"w{(i * 104729 + 7 * k + 1 + int(sys.argv[1])) % 100000}" for i in range(n))
def one(k, out, n=500):
    body = {"model": "llama-3.1-8b", "prompt": prompt(k, n), "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(URL, json.dumps(body).encode(), {"content-type": "application/json"})
    t = time.time()
    first, n = None, 0
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("choices") and ev["choices"][0].get("text"):
                n += 1
                if first is None:
                    first = time.time()
    end = time.time()
    out[k] = ((first - t) * 1e3, (end - first) * 1e3 / max(n - 1, 1), n)
def steps():
    # The engine's forward-pass histograms (pdnode_engine_step_seconds), as the router last read
    # them from the node's stats: {phase: (sum s, count)}.
    time.sleep(0.6)
    out = {}
    with urllib.request.urlopen("http://127.0.0.1:8300/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            for phase in ("prefill", "decode"):
                for part in ("sum", "count"):
                    if line.startswith(f"pdnode_engine_step_seconds_{part}{{") and f'phase="{phase}"' in line:
                        s, c = out.get(phase, (0.0, 0))
                        v = float(line.rsplit(" ", 1)[1])
                        out[phase] = (v, c) if part == "sum" else (s, int(v))
    return out
seq = {}
fwd = []
before = steps()
for k in range(4):
    one(k, seq)
    after = steps()
    d = {ph: (after.get(ph, (0, 0))[0] - before.get(ph, (0, 0))[0],
              after.get(ph, (0, 0))[1] - before.get(ph, (0, 0))[1]) for ph in ("prefill", "decode")}
    before = after
    pf = d["prefill"][0] * 1e3
    dm = d["decode"][0] * 1e3 / max(d["decode"][1], 1)
    fwd.append(f"{pf:.1f} / {dm:.2f}")
    print(f"sequential {k}: TTFT {seq[k][0]:.1f} ms, TPOT {seq[k][1]:.2f} ms, {seq[k][2]} chunks; "
          f"forward: prefill {pf:.1f} ms over {d['prefill'][1]} steps, decode mean {dm:.2f} ms over {d['decode'][1]}")
# A prompt length not seen yet (777 tokens): what a new prefill shape costs once warm.
one(5, seq, 777)
one(6, seq, 777)
print(f"777 tokens, first: TTFT {seq[5][0]:.1f} ms; second: {seq[6][0]:.1f} ms")
conc = {}
ts = [threading.Thread(target=one, args=(10 + k, conc)) for k in range(8)]
for t in ts: t.start()
for t in ts: t.join()
ttfts = sorted(v[0] for v in conc.values())
tpots = sorted(v[1] for v in conc.values())
print(f"8 concurrent: TTFT max {ttfts[-1]:.1f} ms median {ttfts[3]:.1f} ms, TPOT max {tpots[-1]:.2f} ms median {tpots[3]:.2f} ms")
print("ROW", " | ".join(f"{seq[k][0]:.1f} / {seq[k][1]:.2f}" for k in range(4)),
      f"| {ttfts[-1]:.1f} / {tpots[-1]:.2f} | {seq[5][0]:.1f} / {seq[6][0]:.1f}",
      "|", " ; ".join(fwd))
PY
    cat "$OUT/probe-$w.txt"
    row=$(grep '^ROW' "$OUT/probe-$w.txt" | sed 's/^ROW //')
    rows+=("| $w | $start_s | ${row:-probe failed} | ${warm:-no warm-up line} |")
    stop
done
echo
echo "| warm_up_context | start to ready (s) | 1st TTFT / TPOT (ms) | 2nd | 3rd | 4th | 8 concurrent: max TTFT / max TPOT (ms) | 777 tokens: 1st / 2nd TTFT (ms) | forward pass, 1st ; 2nd ; 3rd ; 4th request: prefill total / decode step mean (ms) | warm-up |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
