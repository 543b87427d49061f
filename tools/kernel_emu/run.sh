#!/usr/bin/env bash
# Runs kda_chunk.hip's chunked KDA prefill kernels on the CPU (one std::thread
# per CUDA thread, __syncthreads a std::barrier, shuffles through a per-warp
# exchange; the HIP spellings of prelude.h, so cp.async is a plain copy) and
# compares out, state and record bit for bit with another version of the file,
# by default the one at git revision 6ed95ac (run on the H200 and checked by
# cuda_check there). For a kernel rewrite checked before a GPU is at hand.
#   tools/kernel_emu/run.sh [REV [TOL]]     (needs g++ >= 11 and python3)
# TOL: pass when every part's largest difference is within TOL of its largest
# magnitude (a rewrite whose sums round differently), not only on equal bits.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
rev=${1:-6ed95ac}; tol=${2:-}; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git -C "$root" show "$rev:kernels/hip/kda_chunk.hip" > "$tmp/old.hip"
cp "$root/kernels/hip/kda_chunk.hip" "$tmp/new.hip"
# The driver launches the two-phase kernels (before the output phase was split
# off) or the three-phase ones, whichever the file has.
for w in old new; do
  cat "$root/kernels/hip/prelude.h" "$tmp/$w.hip" "$here/driver.cpp" > "$tmp/$w.cu"
  flags=""; grep -q "kda_chunk_out" "$tmp/$w.hip" && flags="-DNEW"
  g++ -std=c++20 -O1 -D__HIPCC__ $flags -I"$here" -DKSRC="\"$tmp/$w.cu\"" "$here/emu.cpp" -o "$tmp/$w" -lpthread
done
for s in "128 128" "128 96" "100 160" "64 200"; do
  set -- $s
  "$tmp/old" "$1" "$2" "$tmp/o.bin" >/dev/null; "$tmp/new" "$1" "$2" "$tmp/n.bin" >/dev/null
  echo "dk=$1 dv=$2:"; python3 "$here/cmp.py" "$tmp/o.bin" "$tmp/n.bin" "$1" "$2" $tol
done
