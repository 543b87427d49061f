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

Without cuobjdump (its wheel has come without the binary), --ptx KERNEL prints
the kernel's PTX size and whether it uses local memory, and with --against
REV whether its PTX has the same shape (registers and constants aside) as the
same sources at git revision REV: a refactor of a kernel's source that should
not change its code can be checked without a GPU.

  python3 tools/sass.py memcopy.hip --ptx copy_table --against HEAD~1
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


def compile_ptx(lib, program, arch):
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), program.encode(), b"handoff_kernels.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture=compute_{arch}".encode(), b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    if rc:
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        sys.exit(f"NVRTC failed ({rc}):\n{log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def entry(ptx, kernel):
    """The PTX of one kernel: from its .entry line to its closing brace."""
    m = re.search(r"^\.visible \.entry " + re.escape(kernel) + r"\(.*?^}", ptx, re.S | re.M)
    return m.group(0) if m else None


def shape(body):
    """A kernel's PTX with register numbers, constants and labels erased."""
    return [re.sub(r"\d+", "#", l.strip()) for l in body.splitlines() if l.strip() and not l.strip().startswith("//")]


def program_of(sources, read):
    program = read("prelude.h")
    for s in sources:
        program += f"\n// ---- {s}\n" + read(s)
    return program


def ptx_report(lib, a):
    here = program_of(a.sources, lambda f: open(os.path.join(HIP, f)).read())
    ptx = compile_ptx(lib, here, a.arch)
    then = None
    if a.against:
        show = lambda f: subprocess.run(["git", "show", f"{a.against}:kernels/hip/{f}"], capture_output=True, text=True, check=True, cwd=HERE).stdout
        then = compile_ptx(lib, program_of(a.sources, show), a.arch)
    for k in a.ptx:
        body = entry(ptx, k)
        if body is None:
            sys.exit(f"no kernel {k} in {' '.join(a.sources)}")
        local = "uses local memory" if re.search(r"\.local|ld\.local|st\.local", body) else "no local memory"
        print(f"{k}: {len(shape(body))} PTX lines, {local}")
        if then is not None:
            old = entry(then, k)
            if old is None:
                print(f"  not in the sources at {a.against}")
            elif shape(old) == shape(body):
                print(f"  the same shape as at {a.against}")
            else:
                import difflib
                print(f"  differs from {a.against}:")
                for line in list(difflib.unified_diff(shape(old), shape(body), a.against, "now", n=1, lineterm=""))[:60]:
                    print("   ", line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", help="files under kernels/hip (prelude.h is always first)")
    ap.add_argument("--nvrtc", default="/tmp/handoff-nvrtc", help="where the NVIDIA wheels were installed")
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--sass", action="append", default=[], help="print this kernel's SASS and opcode counts")
    ap.add_argument("--ptx", action="append", default=[], help="this kernel's PTX: its size and local memory (no cuobjdump needed)")
    ap.add_argument("--against", help="with --ptx: compare with the same sources at this git revision")
    a = ap.parse_args()
    lib = (glob.glob(os.path.join(a.nvrtc, "**", "libnvrtc.so.*"), recursive=True) or [None])[0]
    if a.ptx:
        if not lib:
            sys.exit(f"libnvrtc not under {a.nvrtc} (see the pip line in this file's doc)")
        return ptx_report(lib, a)
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
