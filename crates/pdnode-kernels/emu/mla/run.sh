#!/usr/bin/env bash
# CPU check of the MLA and MoE kernels (kernels/mla.cu, kernels/moe.cu) without a GPU: compiles
# them (with common.cuh) as C++ against the tiny SIMT emulator of emu/attn/prelude.h (each CUDA
# thread a ucontext fiber; __syncthreads and warp shuffles as barriers), plus prelude_mla.h here
# (shared-memory atomicAdd) and ../attn/emu_v4.h (ldmatrix, mma.sync), and runs main.cpp: every kernel on several shapes against a C++
# reference (f64 for the attention math, a port of cpu/moe.rs `route` for the routing), and
# mla_attn_combine and moe_combine bit for bit against the loops they replaced (main.cpp's
# mla_attn_combine_loop, moe_combine_loop).
# Prints one PASS line per case. Needs g++ (C++17) and python3.
# Usage: crates/pdnode-kernels/emu/mla/run.sh   (about a minute)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K=$here/../../kernels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$K" "$tmp/kernels.inc" "$here/../attn/prelude.h" "$here/prelude_mla.h" "$here/../attn/emu_v4.h" <<'PY'
import sys
K, out, prelude, ext, v4 = sys.argv[1:6]
# emu_v4.h: the ldmatrix / mma.sync helpers of attention_v4.cu that mla_attn_split_tc uses
src = '#include "%s"\n#include "%s"\n' % (prelude, ext)
src += open(v4).read()
for f in ["common.cuh", "mla.cu", "moe.cu"]:
    src += open(K + "/" + f).read()
open(out, "w").write(src)
PY
cp "$here/main.cpp" "$tmp/main.cpp"
g++ -O2 -std=c++17 -w -fno-strict-aliasing -I"$tmp" -o "$tmp/emu" "$tmp/main.cpp"
"$tmp/emu" | tee "$tmp/log"
if grep -q '^FAIL' "$tmp/log"; then echo "EMU FAILED"; exit 1; fi
echo "all $(grep -c '^PASS' "$tmp/log") cases PASS"
