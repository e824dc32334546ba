#!/usr/bin/env bash
# Builds the CUDA test and benchmark binaries on a build host (no GPU or CUDA needed) and puts
# them, stripped, into .gpu/ for scripts/gpu/run-all.sh on the GPU host (device `run` with
# carry: [".gpu"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
GPU_DIR=${GPU_DIR:-.gpu}
mkdir -p "$GPU_DIR"
if [ -d .git ]; then grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude; fi
PROFILE_ARGS=${PROFILE_ARGS:-}
{
    cargo test -p pdnode-cuda $PROFILE_ARGS --no-run --message-format=json \
        --test cuda_kernels --test cuda_model --test cuda_parity --test cuda_deepseek --test cuda_tp --test cuda_graphs --lib 2>/dev/null
    cargo test -p pdnode-cuda-bench $PROFILE_ARGS --no-run --message-format=json --test cuda_bench --test cuda_tp_bench 2>/dev/null
} |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        t = m["target"]
        name = t["name"] if t["kind"] != ["lib"] else "cuda_unit"
        print(name, m["executable"])
' | while read -r name exe; do
    cp "$exe" "$GPU_DIR/$name"
    strip "$GPU_DIR/$name"
done
ls -la "$GPU_DIR"
du -sh "$GPU_DIR"
