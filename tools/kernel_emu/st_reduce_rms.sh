#!/usr/bin/env bash
# st_reduce (the residual add) followed by st_rms_pack, against the fused
# st_reduce_rms, on the CPU emulation (emu.cpp): the residual and the packed
# operand must be the same bits, for K3-like and odd widths.
#   tools/kernel_emu/st_reduce_rms.sh     (needs g++ >= 11)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cat "$root/kernels/hip/prelude.h" "$root/kernels/hip/step.hip" "$root/kernels/hip/step_mm.hip" "$here/st_reduce_rms_driver.cpp" > "$tmp/k.cu"
g++ -std=c++20 -O1 -D__HIPCC__ -DHK_EMU_STATIC_SHARED -I"$here" -DKSRC="\"$tmp/k.cu\"" "$here/emu.cpp" -o "$tmp/run" -lpthread
"$tmp/run"
