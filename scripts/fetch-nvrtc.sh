#!/usr/bin/env bash
# Puts NVIDIA's NVRTC library (the PyPI wheel nvidia-cuda-nvrtc, CUDA 13) under .cache/nvrtc, so
# the test suite can compile the CUDA kernels exactly as the CUDA backend does at start, on a
# machine with no GPU and no CUDA toolkit (crates/pdnode-kernels/tests/kernels_compile.rs).
# Idempotent: does nothing when the library is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${PDNODE_NVRTC_VERSION:-13.0.88}
DEST=.cache/nvrtc
if ls "$DEST"/lib/libnvrtc.so.* >/dev/null 2>&1; then
    echo "[fetch-nvrtc] present in $DEST" >&2
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "[fetch-nvrtc] downloading nvidia-cuda-nvrtc==$VERSION" >&2
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "nvidia-cuda-nvrtc==$VERSION"
mkdir -p "$DEST/lib"
python3 - "$tmp"/nvidia_cuda_nvrtc-*.whl "$DEST/lib" <<'PY'
import sys, zipfile, os
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        base = os.path.basename(n)
        if "/lib/" in n and base.startswith("libnvrtc") and ".alt." not in base:
            with z.open(n) as src, open(os.path.join(dest, base), "wb") as dst:
                dst.write(src.read())
PY
ls "$DEST"/lib >&2
