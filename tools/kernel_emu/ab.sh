#!/usr/bin/env bash
# Runs one kernel source's driver on the CPU emulation (emu.cpp, the HIP
# spellings of prelude.h) for this tree's source and the same file at git
# revision REV, over each case (a quoted argument list for the driver, which
# writes its outputs to the file named last), and compares the outputs bit
# for bit. Exits 1 when any case differs.
#   tools/kernel_emu/ab.sh SOURCE DRIVER REV "CASE" ...
#   (SOURCE under kernels/hip, DRIVER under tools/kernel_emu; needs g++ >= 11)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
src=$1 driver=$2 rev=$3; shift 3
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git -C "$root" show "$rev:kernels/hip/$src" > "$tmp/old.hip"
git -C "$root" show "$rev:kernels/hip/prelude.h" > "$tmp/old-prelude.h"
cp "$root/kernels/hip/$src" "$tmp/new.hip"; cp "$root/kernels/hip/prelude.h" "$tmp/new-prelude.h"
for w in old new; do
  cat "$tmp/$w-prelude.h" "$tmp/$w.hip" "$here/$driver" > "$tmp/$w.cu"
  g++ -std=c++20 -O1 -D__HIPCC__ ${EMU_FLAGS:-} -I"$here" -DKSRC="\"$tmp/$w.cu\"" "$here/emu.cpp" -o "$tmp/$w" -lpthread
done
fail=0
for s in "$@"; do
  # shellcheck disable=SC2086
  "$tmp/old" $s "$tmp/o.bin" >/dev/null; "$tmp/new" $s "$tmp/n.bin"
  if cmp -s "$tmp/o.bin" "$tmp/n.bin"; then echo "  equal bits"; else echo "  DIFFERENT"; fail=1; fi
done
exit $fail
