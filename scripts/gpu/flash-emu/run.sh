#!/usr/bin/env bash
# Runs the flash prefill-attention kernels (crates/pdnode-kernels/kernels/prefill_flash*.cu) on the
# CPU, no GPU needed: the kernel source is compiled as host C++ with one OS thread per CUDA thread,
# and the warp-collective PTX (ldmatrix, mma.sync m16n8k16, shfl) replaced by emulations written
# from the PTX ISA fragment layouts (helpers.inc), cp.async by a synchronous copy. Checks every
# kernel variant against a double-precision reference. It catches indexing, masking and softmax
# mistakes; it cannot catch a misreading of the PTX layouts (the emulation encodes that reading)
# or races that only asynchronous copies expose. Usage: scripts/gpu/flash-emu/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
k=$root/crates/pdnode-kernels/kernels
python3 - "$k" "$here/helpers.inc" "$work/kern.inc" <<'PY'
import sys
k, helpers, dst = sys.argv[1:]
src = open(k + "/prefill_flash.cu").read() + open(k + "/prefill_flash_v3.cu").read()
a = src.index("__device__ __forceinline__ unsigned fp_smem_addr")
b = src.index("// Keys k0 .. k0 + BN - 1")
src = src[:a] + open(helpers).read() + src[b:]
src = src.replace("extern __shared__ __align__(16) unsigned char fp_dyn_smem[];",
                  "static __align__(16) unsigned char fp_dyn_smem[147456];")
open(dst, "w").write(open(k + "/common.cuh").read() + src)
PY
g++ -std=c++20 -O2 -pthread -w -I"$work" "$here/emu.cpp" -o "$work/emu"
"$work/emu"
