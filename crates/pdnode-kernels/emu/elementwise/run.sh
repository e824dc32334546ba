#!/usr/bin/env bash
# CPU check of the elementwise kernels without a GPU: compiles common.cuh + elementwise.cu as C++
# against the SIMT emulator of the attention tests (../attn/prelude.h: each
# CUDA thread a fiber, __syncthreads and warp shuffles as barriers) and runs main.cpp: swiglu_v8
# bit-identical to swiglu on random bf16 bits (NaN, inf, huge values included) at several shapes
# and with fewer rows on grid y than tokens (the row loop); add_rmsnorm_v4 and add_rmsnorm
# against an f64 reference with delta on/off and row selection, at the block sizes the wrapper
# picks; every output written, nothing past the buffers touched. It checks indexing and coverage;
# it cannot check speed or real-hardware memory ordering. Needs g++ (C++17).
# Usage: crates/pdnode-kernels/emu/elementwise/run.sh   (about 20 s; EMU_VERBOSE=1
# prints every case)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K=${EMU_KERNELS:-$here/../../kernels}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
{
    echo "#include \"$here/../attn/prelude.h\""
    echo "struct uint2 { unsigned x, y; };"
    echo "static inline float rsqrtf(float x) { return 1.f / sqrtf(x); }"
    cat "$K/common.cuh" "$K/elementwise.cu"
} > "$tmp/kernels.inc"
cp "$here/main.cpp" "$tmp/main.cpp"
g++ -O2 -std=c++17 -w -fno-strict-aliasing -I"$tmp" -o "$tmp/emu" "$tmp/main.cpp"
"$tmp/emu" > "$tmp/log" || { grep -v '^PASS' "$tmp/log"; echo "EMU FAILED"; exit 1; }
if [ -n "${EMU_VERBOSE:-}" ]; then cat "$tmp/log"; fi
echo "$(grep -c '^PASS' "$tmp/log") cases passed; $(tail -1 "$tmp/log")"
