#!/usr/bin/env bash
# step_mm.hip's segment sums (st_reduce in every mode, st_reduce_rms) on the
# CPU emulation in this tree and at git revision REV (default HEAD), every
# output compared bit for bit: K3-like rows, more segments than a load group,
# cut quads.
#   tools/kernel_emu/st_reduce.sh [REV]     (needs g++ >= 11)
EMU_FLAGS=-DHK_EMU_STATIC_SHARED exec "$(dirname "$0")/ab.sh" step_mm.hip st_reduce_driver.cpp "${1:-HEAD}" "2048 16 5" "4608 3 5" "72 9 3" "2048 20 2" "1000 1 2" "1032 5 2"
