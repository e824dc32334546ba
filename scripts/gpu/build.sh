#!/usr/bin/env bash
# Builds the CUDA test and benchmark binaries on a build host (no GPU or CUDA needed) and puts
# them, stripped, into .gpu/ for scripts/gpu/run-all.sh on the GPU host (device `run` with
# carry: [".gpu"]).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
PROFILE_ARGS=${PROFILE_ARGS:-}
cargo test -p pdnode-engine $PROFILE_ARGS --no-run --message-format=json \
    --test cuda_kernels --test cuda_model --test cuda_bench --lib 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        t = m["target"]
        name = t["name"] if t["kind"] != ["lib"] else "engine_unit"
        print(name, m["executable"])
' | while read -r name exe; do
    cp "$exe" ".gpu/$name"
    strip ".gpu/$name"
done
ls -la .gpu
du -sh .gpu
