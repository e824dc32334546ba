#!/usr/bin/env bash
# SmolLM2-135M-Instruct (the demo GGUF) on the GPU host: `pdnode generate` with the CUDA backend
# against the CPU backend (same binary, same file, greedy) and against the Hugging Face
# transformers reference committed in crates/pdnode-engine/tests/fixtures/smollm2_q4_1_reference.json
# (transformers' GGUF loader + f32 forward). Prints PASS/FAIL lines and a table; logs go to $OUT.
# Usage: scripts/gpu/smollm2.sh MODEL.gguf [PDNODE_BINARY]
set -u
cd "$(dirname "$0")/../.."
MODEL=$1
PD=${2:-target/release/pdnode}
OUT=${OUT:-/tmp/pdnode-gpu}
mkdir -p "$OUT"
PROMPTS=("What is the capital of France?"
    "Write a haiku about the sea."
    "List three prime numbers and explain why they are prime.")
for b in cpu cuda; do
    i=0
    for p in "${PROMPTS[@]}"; do
        timeout 300 "$PD" generate --model "$MODEL" --chat --prompt "$p" --temperature 0 \
            --max-tokens 64 --json --logits-out "$OUT/smol_logits_${b}_$i.json" \
            --set engine.backend=$b $( [ $b = cuda ] && echo "--set engine.gpus=[0]" ) > "$OUT/smol_${b}_$i.json" 2> "$OUT/smol_${b}_$i.log"
        echo "generate $b prompt $i rc=$?"
        i=$((i + 1))
    done
done
python3 - "$OUT" crates/pdnode-engine/tests/fixtures/smollm2_q4_1_reference.json <<'PY'
import json, sys, math
out, refp = sys.argv[1], sys.argv[2]
ref = json.load(open(refp))
ok = True
def load(b, i):
    try:
        return json.load(open(f"{out}/smol_{b}_{i}.json")), json.load(open(f"{out}/smol_logits_{b}_{i}.json"))
    except Exception as e:
        return None, None
print(f"{'prompt':<7}{'cuda tokens':>12}{'same as cpu':>13}{'first diff':>11}{'max|dlogit|':>13}{'top1':>6}")
for i in range(3):
    c, cl = load("cpu", i)
    g, gl = load("cuda", i)
    if not c or not g:
        print(f"FAIL prompt {i}: missing output"); ok = False; continue
    a, b = c["token_ids"], g["token_ids"]
    diff = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    dl = max(abs(x - y) for x, y in zip(cl, gl))
    top1 = max(range(len(cl)), key=cl.__getitem__) == max(range(len(gl)), key=gl.__getitem__)
    same = a == b
    print(f"{i:<7}{len(b):>12}{str(same):>13}{str(diff):>11}{dl:>13.4f}{str(top1):>6}")
    print(f"  cpu : {c['text']!r}\n  cuda: {g['text']!r}")
    if i == 0:
        # against transformers: greedy ids up to the CUDA run's stop, top-64 first logits
        n = len(b)
        hf = ref["greedy_ids"][:n]
        gd = max(abs(gl[t] - v) for t, v in zip(ref["first_top_ids"], ref["first_top_values"]))
        cd = max(abs(cl[t] - v) for t, v in zip(ref["first_top_ids"], ref["first_top_values"]))
        print(f"  vs transformers: greedy ids equal={b == hf} (n={n}); max|dlogit| top-64 cuda={gd:.4f} cpu={cd:.5f}")
        if b != hf:
            ok = False; print("FAIL cuda greedy ids differ from transformers")
    if not same:
        ok = False; print(f"FAIL prompt {i}: cuda text differs from cpu at token {diff}")
print("PASS smollm2 cuda == cpu == transformers" if ok else "FAIL smollm2")
PY
