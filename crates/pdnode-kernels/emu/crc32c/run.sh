#!/usr/bin/env bash
# CPU check of the device CRC32C kernel (kernels/crc32c.cu) without a GPU: compiles the kernel as
# C++ (one OS thread per CUDA thread, __syncthreads as a block barrier, warp shuffles through a
# per-warp exchange buffer) and runs main.cpp: random bytes of many lengths and unaligned starts,
# several chunk sizes, each against a bitwise CRC32C. Needs g++ (C++20). Usage:
# crates/pdnode-kernels/emu/crc32c/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K=$here/../../kernels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$K/crc32c.cu" "$tmp/kernels.inc"  # needs nothing of common.cuh but the PDL macros (no-ops here)
g++ -O2 -std=c++20 -pthread -w -I"$tmp" -o "$tmp/emu" "$here/main.cpp"
"$tmp/emu"
