#!/usr/bin/env python3
"""NVRTC -> SASS for kernel sources, on a machine without a GPU.

Compiles kernels/hip/prelude.h plus the named sources as one translation unit
(the way kernels/src/gpu/cuda/program.rs builds the device program) for sm_90a
through libnvrtc, then prints each kernel's registers, spills and shared
memory (cuobjdump -res-usage) and, with --sass, its SASS with a count of
instructions by opcode. For counting what a rewrite costs before it reaches a
GPU.

  pip install --target /tmp/handoff-nvrtc 'nvidia-cuda-nvrtc>=13,<14' 'nvidia-cuda-cuobjdump>=13,<14'
  python3 tools/sass.py --nvrtc /tmp/handoff-nvrtc kda_chunk.hip [--sass KERNEL] [--arch 90a]
"""
import argparse
import collections
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
HIP = os.path.join(HERE, "..", "kernels", "hip")


def compile_cubin(lib, program, arch):
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), program.encode(), b"handoff_kernels.cu", 0, None, None)
    if rc:
        sys.exit(f"nvrtcCreateProgram: {rc}")
    opts = [f"--gpu-architecture=sm_{arch}".encode(), b"--std=c++17", b"--generate-line-info"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(f"NVRTC failed ({rc}):\n{log.value.decode()}")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", help="files under kernels/hip (prelude.h is always first)")
    ap.add_argument("--nvrtc", default="/tmp/handoff-nvrtc", help="where the NVIDIA wheels were installed")
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--sass", action="append", default=[], help="print this kernel's SASS and opcode counts")
    a = ap.parse_args()
    lib = (glob.glob(os.path.join(a.nvrtc, "**", "libnvrtc.so.*"), recursive=True) or [None])[0]
    objdump = (glob.glob(os.path.join(a.nvrtc, "**", "bin", "cuobjdump"), recursive=True) or [None])[0]
    if not lib or not objdump:
        sys.exit(f"libnvrtc or cuobjdump not under {a.nvrtc} (see the pip line in this file's doc)")
    program = open(os.path.join(HIP, "prelude.h")).read()
    for s in a.sources:
        program += f"\n// ---- {s}\n" + open(os.path.join(HIP, s)).read()
    cubin = compile_cubin(lib, program, a.arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    res = subprocess.run([objdump, "-res-usage", path], capture_output=True, text=True, env=dict(os.environ, PATH=os.path.dirname(objdump) + ":" + os.environ["PATH"])).stdout
    for line in res.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        elif "REG:" in line:
            print(f"{name:40s} {line.strip()}")
    for k in a.sass:
        sass = subprocess.run([objdump, "-sass", "-fun", k, path], capture_output=True, text=True, env=dict(os.environ, PATH=os.path.dirname(objdump) + ":" + os.environ["PATH"])).stdout
        ops = collections.Counter()
        n = 0
        for line in sass.splitlines():
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
            if m:
                n += 1
                ops[m.group(1).split(".")[0]] += 1
        print(f"\n{k}: {n} instructions (static)")
        # Loops: each backward branch, with its body's size and opcodes (a
        # body's count times its trips is what a thread runs).
        ins = []
        for line in sass.splitlines():
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2).strip()))
        for at, text in ins:
            m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
            if m and int(m.group(1), 16) < at:
                body = [t for a2, t in ins if int(m.group(1), 16) <= a2 <= at]
                c = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
                top = " ".join(f"{o}:{v}" for o, v in c.most_common(6))
                print(f"  loop {int(m.group(1), 16):#07x}-{at:#07x}: {len(body):4d} instructions  {top}")
        for op, c in ops.most_common(30):
            print(f"  {op:12s} {c}")
        out = path + f".{k}.sass"
        open(out, "w").write(sass)
        print(f"  SASS in {out}")
    os.unlink(path)


if __name__ == "__main__":
    main()
