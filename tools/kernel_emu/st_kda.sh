#!/usr/bin/env bash
# Runs step.hip's st_kda on the CPU emulation (cp.async is a plain copy) in
# this tree and at git revision REV (default HEAD), and compares out, the
# state regions and the ring regions bit for bit, over head shapes (aligned
# and not), ring capacities (none, small, K3's 16, and one past what a buffer
# holds) and grids (one block walking every item, past the kernel's item
# table, and several).
#   tools/kernel_emu/st_kda.sh [REV]     (needs g++ >= 11)
exec "$(dirname "$0")/ab.sh" step.hip st_kda_driver.cpp "${1:-HEAD}" \
  "128 128 16 1" "128 128 16 3" "128 128 0 2" "128 128 4 5" "128 128 20 2" "64 96 16 2" "100 72 6 2" "128 128 1 2"
