#!/usr/bin/env bash
# Runs mla.hip's st_mla_part_tc on the CPU emulation (emu.cpp, the HIP
# spellings of prelude.h: cp.async is a plain copy, the f64 tensor-core
# product its shuffle form) in this tree and at git revision REV (default
# HEAD), and compares every chunk partial bit for bit: bf16 and f16 rows,
# one block walking every chunk and grids of several.
#   tools/kernel_emu/st_mla_part_tc.sh [REV]     (needs g++ >= 11)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
rev=${1:-HEAD}; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git -C "$root" show "$rev:kernels/hip/mla.hip" > "$tmp/old.hip"
git -C "$root" show "$rev:kernels/hip/prelude.h" > "$tmp/old-prelude.h"
cp "$root/kernels/hip/mla.hip" "$tmp/new.hip"; cp "$root/kernels/hip/prelude.h" "$tmp/new-prelude.h"
for w in old new; do
  cat "$tmp/$w-prelude.h" "$tmp/$w.hip" "$here/st_mla_part_tc_driver.cpp" > "$tmp/$w.cu"
  g++ -std=c++20 -O1 -D__HIPCC__ -I"$here" -DKSRC="\"$tmp/$w.cu\"" "$here/emu.cpp" -o "$tmp/$w" -lpthread
done
fail=0
for s in "1 1" "3 1" "7 2"; do
  set -- $s
  "$tmp/old" "$@" "$tmp/o.bin" >/dev/null; "$tmp/new" "$@" "$tmp/n.bin"
  if cmp -s "$tmp/o.bin" "$tmp/n.bin"; then echo "  equal bits"; else echo "  DIFFERENT"; fail=1; fi
done
exit $fail
