#!/usr/bin/env bash
# The GPU run, in one call on the lent H200 (no Rust there): the binaries built
# here with `--features cuda` and stripped, in $BIN (default .gpu-carry):
#   handoff        cargo build --release --features cuda
#   device_matrix  cargo test --release --features cuda --test device_matrix --no-run
#   cuda_check     cargo build --release -p handoff-kernels --features cuda --example cuda_check
# and the fla-core and einops wheels in .whl for the FLA peer.
# Prints each figure next to its peer from the same run; logs go to $OUT.
set -uo pipefail
BIN=${BIN:-.gpu-carry}
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
export PATH="$BIN:$PATH"
step() { echo; echo "== $*"; }
# SKIP_SERVE=1 leaves out the serving runs and the peers (a quick re-check);
# SKIP_KERNELS=1 leaves out the kernel timings and the FLA peers.
SKIP_SERVE=${SKIP_SERVE:-0}
SKIP_KERNELS=${SKIP_KERNELS:-0}
fail=0

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

step "kernel check: every op against the CPU reference, batch invariance"
cuda_check 2>&1 | tee "$OUT/cuda_check.txt" | tail -4 || fail=1
HANDOFF_CUDA_COPY=engines cuda_check 2>&1 | grep -E "device copy.*copies|checks," | sed 's/^/copy engines: /' || fail=1

step "verify --compute --device cuda on the shipped configs (4 requests as one batch, 32 steps)"
for c in config/small.toml config/medium.toml config/pp3-tp2-to-tp4dcp2.toml config/gpu.toml; do
  handoff verify --config "$c" --compute --device cuda --requests 4 2>&1 | tee -a "$OUT/verify.txt" | head -2 || fail=1
done

step "the compute test matrix on the GPU"
device_matrix --ignored --nocapture 2>&1 | tee "$OUT/device_matrix.txt" | grep -E "ok on|test result|failed|panicked" || fail=1

if [ "$SKIP_SERVE" = 0 ]; then
step "handoff (the built-in default end to end: up, completions vs the colocated reference) on cuda; KV and state in device memory, hand-offs through CUDA IPC"
HANDOFF_LOG=info HANDOFF_DEVICE=cuda timeout 240 handoff > "$OUT/demo.txt" 2> "$OUT/demo.log" || fail=1
tail -4 "$OUT/demo.txt"
grep -c "hand-offs through CUDA IPC" "$OUT/demo.log" | sed 's/^/role processes with device regions: /'
grep -E "ERROR|panicked" "$OUT/demo.log" | head -5

step "hand-off of the flagship request (32K tokens) between two processes through CUDA IPC, oracle-checked, against device copy and IPC copy"
timeout 240 handoff bench transfer --config config/k3-pp8-tp8dcp8.toml --transport cuda-ipc --tokens 32768 2>&1 | tee "$OUT/ipc.txt" | tail -10 || fail=1

step "bench serve on cuda, default cluster (KV and state in device memory, CUDA IPC hand-offs)"
HANDOFF_DEVICE=cuda timeout 240 handoff bench serve --concurrency 1,32,88 2>&1 | tee "$OUT/serve.txt" | tail -5 || fail=1

step "bench serve on cuda, config/medium.toml (PP3 -> TP4 x DCP2, 12 layers)"
HANDOFF_DEVICE=cuda timeout 240 handoff bench serve --config config/medium.toml --concurrency 1,32,88 2>&1 | tee "$OUT/serve-medium.txt" | tail -5 || fail=1

step "bench serve on cuda, config/gpu.toml (sized for the GPU: hidden 2048, K3's row and head shapes, PP2 -> TP2 x DCP2)"
HANDOFF_DEVICE=cuda timeout 240 handoff bench serve --config config/gpu.toml --concurrency 1,32,88 2>&1 | tee "$OUT/serve-gpu.txt" | tail -5 || fail=1

step "the hand-off with every copy on the copy engines (HANDOFF_CUDA_COPY=engines), for comparison"
HANDOFF_CUDA_COPY=engines timeout 120 handoff bench transfer --config config/k3-pp8-tp8dcp8.toml --transport cuda-ipc --tokens 32768 2>&1 | tee "$OUT/ipc-engines.txt" | grep -E "hand-off|by kind|ratio" || fail=1

fi

step "the launch-saving paths (HANDOFF_CUDA_UNITS=fused: two launches for a layer's head and MLP-unit products, one for the all-reduce, no round trip for known cursors): verify, the test matrix, gpu.toml serving"
for c in config/small.toml config/gpu.toml; do
  HANDOFF_CUDA_UNITS=fused handoff verify --config "$c" --compute --device cuda --requests 4 2>&1 | tee -a "$OUT/verify-fused.txt" | head -2 || fail=1
done
HANDOFF_CUDA_UNITS=fused device_matrix --ignored --nocapture 2>&1 | tee "$OUT/device_matrix-fused.txt" | grep -E "test result|failed|panicked" || fail=1
if [ "$SKIP_SERVE" = 0 ]; then
  HANDOFF_CUDA_UNITS=fused timeout 240 handoff bench serve --config config/gpu.toml --concurrency 1,32,88 2>&1 | tee "$OUT/serve-gpu-fused.txt" | tail -5 || fail=1
fi

step "bench compute on cuda"
timeout 120 handoff bench compute --device cuda 2>&1 | tee "$OUT/compute.txt" | tail -12 || fail=1

[ "$SKIP_SERVE" = 0 ] && [ "$SKIP_KERNELS" = 0 ] || exit $fail

step "KDA decode step vs device copy (cuda_check --bench)"
timeout 120 cuda_check --bench 2>&1 | tee "$OUT/kda_bench.txt" | tail -16 || fail=1

step "peers: device copy, FLA fused_recurrent_kda and chunk_kda (same GPU, same call)"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site timeout 180 python3 benches/peers/fla_kda.py 2>&1 | tee "$OUT/fla.txt" | grep -v Warning || fail=1
else
  echo "no .whl: FLA peer not run"; fail=1
fi
exit $fail
