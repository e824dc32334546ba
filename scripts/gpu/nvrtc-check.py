#!/usr/bin/env python3
"""Compiles the CUDA kernels (crates/pdnode-kernels/kernels) with NVRTC for sm_90, as the CUDA
backend does at start, and prints the compile log with ptxas register/spill counts per kernel.
Needs no GPU, only libnvrtc (the PyPI wheel nvidia-cuda-nvrtc; scripts/fetch-nvrtc.sh puts it in
.cache/nvrtc). Exit status 0 when the program compiles. Usage: nvrtc-check.py [--arch sm_90]"""
import ctypes, glob, os, re, sys

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
arch = sys.argv[sys.argv.index("--arch") + 1] if "--arch" in sys.argv else "sm_90"
cands = []
for d in [os.environ.get("PDNODE_NVRTC_DIR", ""), os.path.join(root, ".cache/nvrtc"), "/tmp/nvrtc"]:
    if d:
        cands += sorted(glob.glob(os.path.join(d, "**/libnvrtc.so*"), recursive=True))
cands = [c for c in cands if "builtins" not in c and "alt" not in c]
if not cands:
    sys.exit("libnvrtc not found: run scripts/fetch-nvrtc.sh (or set PDNODE_NVRTC_DIR)")
# libnvrtc dlopens its builtins by name: load them first from the same folder.
for b in sorted(glob.glob(os.path.join(os.path.dirname(cands[0]), "libnvrtc-builtins.so*"))):
    if "alt" not in b:
        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        break
lib = ctypes.CDLL(cands[0])
# The same sources, in the same order, as crates/pdnode-kernels/src/lib.rs.
dev = open(os.path.join(root, "crates/pdnode-kernels/src/lib.rs")).read()
files = re.findall(r'include_str!\("\.\./kernels/([\w.]+)"\)', dev)
kdir = os.path.join(root, "crates/pdnode-kernels/kernels")
src = "".join(open(os.path.join(kdir, f)).read() for f in files)
prog = ctypes.c_void_p()
lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"pdnode.cu", 0, None, None)
opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-lineinfo", b"--ptxas-options=-v"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
text = log.value.decode(errors="replace")
# ptxas -v: "Compiling entry function 'X'" ... "Used N registers" ... "bytes spill stores"
name = None
for line in text.splitlines():
    m = re.search(r"Compiling entry function '(\w+)'", line)
    if m:
        name = m.group(1)
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        print(f"{name:40s} {m.group(1):>4s} regs")
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and name and (m.group(1) != "0" or m.group(2) != "0"):
        print(f"{name:40s} SPILLS stores={m.group(1)} loads={m.group(2)}")
        continue
    if "ptxas info" in line or "bytes stack frame" in line or not line.strip():
        continue
    print(line)
print(f"files: {', '.join(files)}")
print("NVRTC: OK" if rc == 0 else f"NVRTC: FAILED (code {rc})")
sys.exit(0 if rc == 0 else 1)
