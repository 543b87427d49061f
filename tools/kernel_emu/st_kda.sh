#!/usr/bin/env bash
# Runs step.hip's st_kda on the CPU emulation (emu.cpp, the HIP spellings of
# prelude.h: cp.async is a plain copy) in this tree and at git revision REV
# (default HEAD), and compares out, the state regions and the ring regions bit
# for bit, over head shapes (aligned and not), ring capacities (none, small,
# K3's 16, and one past what a buffer holds) and grids (one block walking
# every item, past the kernel's item table, and several).
#   tools/kernel_emu/st_kda.sh [REV]     (needs g++ >= 11)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
rev=${1:-HEAD}; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git -C "$root" show "$rev:kernels/hip/step.hip" > "$tmp/old.hip"
git -C "$root" show "$rev:kernels/hip/prelude.h" > "$tmp/old-prelude.h"
cp "$root/kernels/hip/step.hip" "$tmp/new.hip"; cp "$root/kernels/hip/prelude.h" "$tmp/new-prelude.h"
for w in old new; do
  cat "$tmp/$w-prelude.h" "$tmp/$w.hip" "$here/st_kda_driver.cpp" > "$tmp/$w.cu"
  g++ -std=c++20 -O1 -D__HIPCC__ -I"$here" -DKSRC="\"$tmp/$w.cu\"" "$here/emu.cpp" -o "$tmp/$w" -lpthread
done
fail=0
for s in "128 128 16 1" "128 128 16 3" "128 128 0 2" "128 128 4 5" "128 128 20 2" "64 96 16 2" "100 72 6 2" "128 128 1 2"; do
  set -- $s
  "$tmp/old" "$@" "$tmp/o.bin" >/dev/null; "$tmp/new" "$@" "$tmp/n.bin"
  if cmp -s "$tmp/o.bin" "$tmp/n.bin"; then echo "  equal bits"; else echo "  DIFFERENT"; fail=1; fi
done
exit $fail
