#!/usr/bin/env bash
# CPU check of the v4 decode attention kernel without a GPU: compiles attention_v4.cu (with
# common.cuh and attention_combine from attention.cu) as C++ against a tiny SIMT emulator
# (prelude.h: each CUDA thread a ucontext fiber, __syncthreads and warp shuffles as barriers,
# cp.async copies deferred to cp.async.wait_group, or immediate with EMU_SYNC=1; cp.async, ldmatrix and mma.sync by emu_v4.h from
# the PTX fragment layouts) and runs
# main.cpp: GQA groups 1-12, head_dim 64/128, several partition lengths, partitions past the
# context, token lists, block sizes 8/16/24, against an f64 reference. Needs g++ (C++17).
# Usage: crates/pdnode-kernels/emu/attn/run.sh   (about 15 s per mode)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K=$here/../../kernels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$K" "$tmp/kernels.inc" "$here/prelude.h" "$here/emu_v4.h" <<'PY'
import sys
K, out, prelude = sys.argv[1:4]
v4 = open(K + "/attention_v4.cu").read()
c = v4.index("__device__ __forceinline__ unsigned att4_smem_addr")
d = v4.index("// Two floats as bf16x2")
emu4 = open(sys.argv[4]).read()
v4 = v4[:c] + emu4 + v4[d:]
ext = "extern __shared__ __align__(16) unsigned char att4_dsmem[];"
assert ext in v4
v4 = v4.replace(ext, "__shared__ __align__(16) unsigned char att4_dsmem[ATT4_SMEM(128)];")
src = '#include "%s"\n' % prelude + open(K + "/common.cuh").read() + open(K + "/attention.cu").read() + v4
open(out, "w").write(src)
PY
cp "$here/main.cpp" "$tmp/main.cpp"
g++ -O2 -std=c++17 -w -I"$tmp" -o "$tmp/emu" "$tmp/main.cpp"
for mode in deferred immediate; do
    if [ $mode = immediate ]; then export EMU_SYNC=1; fi
    "$tmp/emu" > "$tmp/log" || { grep -v '^PASS' "$tmp/log"; echo "EMU FAILED ($mode cp.async)"; exit 1; }
    echo "$mode cp.async: $(grep -c '^PASS' "$tmp/log") cases, $(tail -1 "$tmp/log")"
done
