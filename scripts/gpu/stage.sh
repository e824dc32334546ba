#!/usr/bin/env bash
# Prepares one GPU session on the build host (no GPU needed): the release pdnode, the GPU test
# binaries (scripts/gpu/build.sh), one bundle with both plus etcd and UCX 1.22
# (scripts/gpu/pack.sh -> .gpu-pd/bundle.tar.xz), and the demo model split in two parts so that two
# back-to-back device calls can bring it (one call carries at most 64 MiB with the tree):
# .gpu-m/a goes with the first call (with .gpu-pd), .gpu-m2/b with the second.
# Then on the GPU host: scripts/gpu/session.sh (first call), scripts/gpu/session.sh smol (second).
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.gpu/ /.gpu-pd/ /.gpu-m/ /.gpu-m2/ /.whl/; do
    grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
cargo build --release -p pdnode
bash scripts/gpu/build.sh > /dev/null
PERFTEST=${PERFTEST:-0} TESTS_DIR=.gpu bash scripts/gpu/pack.sh
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ -e "$MODEL" ]; then
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    budget=$((64 * 1024 * 1024 - tree - 2 * 1024 * 1024)) # 2 MiB of slack
    bundle=$(stat -c %s .gpu-pd/bundle.tar.xz)
    first=$((budget - bundle))
    total=$(stat -c %s "$MODEL")
    [ $((total - first)) -le "$budget" ] || { echo "model does not fit two calls"; exit 1; }
    rm -rf .gpu-m .gpu-m2 && mkdir -p .gpu-m .gpu-m2
    head -c "$first" "$MODEL" > .gpu-m/a
    tail -c +$((first + 1)) "$MODEL" > .gpu-m2/b
    sha256sum "$MODEL" | cut -d' ' -f1 > .gpu-m2/sha256
    echo "model split: $first + $((total - first)) bytes"
fi
du -ch .gpu-pd .gpu-m .gpu-m2 2>/dev/null | tail -4
