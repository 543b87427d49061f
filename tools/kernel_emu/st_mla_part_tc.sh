#!/usr/bin/env bash
# Runs mla.hip's st_mla_part_tc on the CPU emulation (cp.async is a plain
# copy, the f64 tensor-core product its shuffle form) in this tree and at git
# revision REV (default HEAD), and compares every chunk partial bit for bit:
# bf16 and f16 rows, one block walking every chunk and grids of several.
#   tools/kernel_emu/st_mla_part_tc.sh [REV]     (needs g++ >= 11)
exec "$(dirname "$0")/ab.sh" mla.hip st_mla_part_tc_driver.cpp "${1:-HEAD}" "1 1" "3 1" "7 2"
