#!/usr/bin/env bash
# The KV hand-off against the prefill forward pass, on the H200 x2 host (issue 5): PD with
# Llama-3.1-8B shapes (dummy weights), 4000-token prompts (KV ~500 MiB each), sequential, through
# scripts/gpu/serve.sh pd's TTFT probe, run twice:
#   - one prefill chunk (max_batch_tokens 8192): the engine gathers the KV into the arena right
#     after the prompt's step, the node then puts + flushes (push after prefill);
#   - 512-token chunks: each chunk's finished blocks are gathered and put while later chunks
#     compute; only what is left after the last chunk is exposed.
# The probe: 4 prompts with max_tokens 1 (the prefill node answers alone, no hand-off: prefill
# alone), then 4 streamed with max_tokens 4 (a real hand-off: time to the first streamed token).
# Push alone = the median transfer_us of the hand-offs (puts + flush after the last chunk).
# Logs under $OUT/{one,chunked}; a table last.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pdnode-gpu/overlap}
for run in one:8192 chunked:${CHUNK:-512}; do
    name=${run%%:*} mbt=${run##*:}
    echo "== PD, max_batch_tokens $mbt"
    OUT=$OUT/$name PD_MAX_BATCH_TOKENS=$mbt PD_BENCH=0 GREEDY=0 scripts/gpu/serve.sh pd \
        > "$OUT.$name.log" 2>&1
    tail -12 "$OUT.$name.log"
done
python3 - "$OUT" <<'PY'
import os, re, sys
def load(d):
    t = open(f"{d}/ttft.txt").read() if os.path.exists(f"{d}/ttft.txt") else ""
    num = lambda k: float(m.group(1)) if (m := re.search(k + r" ([0-9.]+)", t)) else float("nan")
    rows = []
    if os.path.exists(f"{d}/prefill.log"):
        for line in open(f"{d}/prefill.log", errors="replace"):
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            if "KV hand-off done" in line:
                f = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
                rows.append((int(f.get("bytes", 0)), int(f.get("transfer_us", 0)),
                             int(f.get("early_blocks", 0)), int(f.get("blocks", 1)),
                             f.get("via", "?").strip('"')))
    big = [r for r in rows if r[0] > 100 << 20]
    us = sorted(r[1] for r in big)
    return dict(ttft=num("ttft_ms_median"), alone=num("prefill_alone_ms_median"),
                push=us[len(us) // 2] / 1e3 if us else float("nan"), n=len(big),
                bytes=big[0][0] if big else 0, via=",".join(sorted({r[4] for r in big})),
                early=sum(r[2] for r in big) / max(1, sum(r[3] for r in big)))
one, ch = load(sys.argv[1] + "/one"), load(sys.argv[1] + "/chunked")
print(f"4000-token prompt, KV {one['bytes'] / 2**20:.0f} MiB per request, medians "
      f"({one['n']} / {ch['n']} hand-offs via {one['via']} / {ch['via']})")
print(f"  prefill alone, one chunk (max_tokens 1)        {one['alone']:8.1f} ms")
print(f"  prefill alone, 512-token chunks (max_tokens 1) {ch['alone']:8.1f} ms")
print(f"  push alone after prefill (puts + flush)        {one['push']:8.1f} ms  "
      f"({one['bytes'] / max(1e-9, one['push'] / 1e3) / 1e9:.0f} GB/s)")
print(f"  TTFT, push after prefill (one chunk)           {one['ttft']:8.1f} ms")
print(f"  TTFT, push overlapped (512-token chunks)       {ch['ttft']:8.1f} ms  (exposed push "
      f"{ch['push']:.1f} ms, {100 * ch['early']:.0f}% of blocks sent before the last chunk)")
PY
