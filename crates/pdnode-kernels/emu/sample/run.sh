#!/usr/bin/env bash
# CPU check of kernels/sample.cu `sample_rows` (and `argmax_rows`) without a GPU: compiles
# common.cuh + sample.cu as C++ against the SIMT emulator of the attention tests
# (../attn/prelude.h: each CUDA thread a fiber, __syncthreads and warp
# shuffles as barriers; extra shuffles, ballots and shared atomics in shim.h) and runs main.cpp:
# sample_rows against a port of crate::sampling::device (`kept_set` + `pick_kept`) on random rows
# (vocabularies 5 .. 128256; T, top-k incl. 1, top-p incl. tiny, min-p; -inf, NaN, +inf; exact
# ties), and a grid of u on one row (shares vs weights). glibc's expf is the host's, so tokens must
# match exactly except near a boundary (the reference's margin under 1e-5, counted). It checks the
# algorithm and indexing; it cannot check speed or real-hardware memory ordering. Needs g++.
# Usage: crates/pdnode-kernels/emu/sample/run.sh   (EMU_VERBOSE=1 prints every case)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K=${EMU_KERNELS:-$here/../../kernels}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
{
    echo "#include \"$here/../attn/prelude.h\""
    echo "#include \"$here/shim.h\""
    cat "$K/common.cuh" "$K/sample.cu"
} > "$tmp/kernels.inc"
cp "$here/main.cpp" "$tmp/main.cpp"
g++ -O2 -std=c++17 -w -fno-strict-aliasing -ffp-contract=off -I"$tmp" -o "$tmp/emu" "$tmp/main.cpp"
"$tmp/emu" > "$tmp/log" || { grep -v '^PASS' "$tmp/log"; echo "EMU FAILED"; exit 1; }
if [ -n "${EMU_VERBOSE:-}" ]; then cat "$tmp/log"; fi
echo "$(grep -c '^PASS' "$tmp/log") cases passed; $(tail -1 "$tmp/log")"
