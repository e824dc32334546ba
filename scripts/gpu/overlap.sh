#!/usr/bin/env bash
# The KV hand-off against the prefill forward pass, on the H200 x2 host (issue 5): PD with
# Llama-3.1-8B shapes (dummy weights), 4 sequential 4000-token prompts, max_tokens 1, run twice
# through scripts/gpu/serve.sh pd:
#   - one prefill chunk (max_batch_tokens 8192): the push starts after prefill; prefill alone =
#     TTFT - transfer_us, push alone = transfer_us (gather + puts + flush of ~512 MiB);
#   - 512-token chunks: each chunk's finished blocks are pushed while later chunks compute;
#     transfer_us is only what is left after the last chunk (exposed), early% what was hidden.
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
import re, sys
def load(d):
    t = open(f"{d}/ttft.txt").read() if __import__("os").path.exists(f"{d}/ttft.txt") else ""
    m = re.search(r"ttft_ms_median ([0-9.]+)", t)
    rows = []
    for line in open(f"{d}/prefill.log", errors="replace"):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        if "KV hand-off done" in line:
            f = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
            rows.append((int(f.get("bytes", 0)), int(f.get("transfer_us", 0)),
                         int(f.get("early_blocks", 0)), int(f.get("blocks", 1))))
    big = [r for r in rows if r[0] > 100 << 20] or rows
    us = sorted(r[1] for r in big)
    return (float(m.group(1)) if m else float("nan"), us[len(us) // 2] / 1e3 if us else float("nan"),
            big[0][0] if big else 0, sum(r[2] for r in big) / max(1, sum(r[3] for r in big)))
one, ch = load(sys.argv[1] + "/one"), load(sys.argv[1] + "/chunked")
print(f"4000-token prompt, KV {one[2] / 2**20:.0f} MiB per request (medians of 4 requests)")
print(f"  prefill alone (one chunk, TTFT - push)     {one[0] - one[1]:8.1f} ms")
print(f"  push alone (gather + puts + flush)         {one[1]:8.1f} ms  ({one[2] / max(1e-9, one[1] / 1e3) / 1e9:.0f} GB/s)")
print(f"  TTFT, push after prefill (one chunk)       {one[0]:8.1f} ms")
print(f"  TTFT, push overlapped (chunked)            {ch[0]:8.1f} ms  (exposed push {ch[1]:.1f} ms, "
      f"{100 * ch[3]:.0f}% of blocks sent before the last chunk)")
PY
