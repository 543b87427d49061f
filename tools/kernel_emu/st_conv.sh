#!/usr/bin/env bash
# step.hip's st_conv (the short conv in place) on the CPU emulation in this
# tree and at git revision REV (default HEAD): outputs and both ranks' conv
# regions compared bit for bit, f32 / bf16 / f16 state, widths 4 and 2 (the
# history in registers) and 9 (past ST_CONV_HIST: the loop).
#   tools/kernel_emu/st_conv.sh [REV]     (needs g++ >= 11)
exec "$(dirname "$0")/ab.sh" step.hip st_conv_driver.cpp "${1:-HEAD}" "4 0 3" "4 1 3" "4 2 2" "2 1 3" "9 1 2" "1 0 2"
