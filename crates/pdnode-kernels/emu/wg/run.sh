#!/usr/bin/env bash
# CPU check of the wgmma prefill attention kernels (kernels/prefill_flash_wg.cu:
# flash_prefill_hd128_wg and the warp-specialized flash_prefill_hd128_ws), the descriptor
# probe and the decode GEMV that streams its weights by bulk copies (kernels/gemv_stream.cu),
# without a GPU: compiles the files (after common.cuh) as C++ against the SIMT emulator
# of emu/attn/prelude.h (each CUDA thread a ucontext fiber), with their PTX regions replaced by
# emu_wg.h (wgmma from the descriptors' 128-byte-swizzled layouts and the accumulator / A
# fragment layouts; mbarriers with arrival and transaction counts, named barriers, cp.async, TMA
# boxes from the emulator's own tensor map, 1-d bulk copies), and runs main.cpp: GQA, block sizes
# 4-256 (the ws kernel from 8), cached prefixes, windows, NaN in the pool past each context,
# against an f64 reference; gemv_stream at 1-4 tokens, every output mode, x given or normed
# in the kernel, fewer and more stages than consumer warps. Two modes: copies landing as late as a waiter needs them (deferred), and at once
# (EMU_SYNC=1). Not modelled: the register pool setmaxnreg draws on. Needs g++ (C++17).
# Usage: crates/pdnode-kernels/emu/wg/run.sh   (about a minute)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K=$here/../../kernels
tmp=${EMU_TMP:-$(mktemp -d)}
[ -n "${EMU_TMP:-}" ] || trap 'rm -rf "$tmp"' EXIT
python3 - "$K" "$tmp/kernels.inc" "$here/../attn/prelude.h" "$here/emu_wg.h" <<'PY'
import sys
K, out, prelude, emu = sys.argv[1:5]
e = open(emu).read()
head, rest = e.split("//@@ REGION wgmma\n")
reg_wgmma, rest = rest.split("//@@ REGION ws\n")
reg_ws, reg_gemv = rest.split("//@@ REGION gemv\n")
wg = open(K + "/prefill_flash_wg.cu").read()
parts = wg.split("// PTX-BEGIN")
assert len(parts) == 3, "prefill_flash_wg.cu: expected two PTX regions"
def tail(p):
    i = p.index("// PTX-END\n")
    return p[i + len("// PTX-END\n"):]
wg = parts[0] + reg_wgmma + tail(parts[1]) + reg_ws + tail(parts[2])
for old, new in [
    ("extern __shared__ __align__(1024) unsigned char wg_dyn_smem[];",
     "unsigned char* wg_dyn_smem = g_arena;"),
    ("__shared__ __align__(8) unsigned long long ws_bar[WS_NBAR];",
     "unsigned long long* ws_bar = (unsigned long long*)(g_arena + EMU_BAR_OFF);"),
]:
    assert wg.count(old) == 1, old
    wg = wg.replace(old, new)
gs = open(K + "/gemv_stream.cu").read()
gparts = gs.split("// PTX-BEGIN")
assert len(gparts) == 2, "gemv_stream.cu: expected one PTX region"
wg += gparts[0] + reg_gemv + tail(gparts[1])
import re
assert not re.search(r"\basm\s*(volatile\s*)?\(", wg), "inline PTX outside the PTX regions"
src = "#define __CUDA_ARCH_FEAT_SM90_ALL 1\n#include \"%s\"\n" % prelude
src += open(K + "/common.cuh").read() + head + wg
open(out, "w").write(src)
PY
cp "$here/main.cpp" "$tmp/main.cpp"
g++ -O2 -std=c++17 -w -Wno-psabi -I"$tmp" -o "$tmp/emu" "$tmp/main.cpp"
for mode in deferred immediate; do
    if [ $mode = immediate ]; then export EMU_SYNC=1; fi
    "$tmp/emu" > "$tmp/log" 2>&1 || { grep -v '^PASS' "$tmp/log"; echo "EMU FAILED ($mode cp.async)"; exit 1; }
    echo "$mode cp.async: $(grep -c '^PASS' "$tmp/log") cases, $(tail -1 "$tmp/log")"
done
