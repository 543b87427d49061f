#!/usr/bin/env bash
# The GPU run, in one call on the lent H200 (no Rust there). Binaries built here
# with `--features cuda` and stripped, in $BIN (default .gpu-carry):
#   handoff        cargo build --release --features cuda --bin handoff
#   device_matrix  cargo test --release --features cuda --test device_matrix --no-run
#   cuda_check     cargo build --release -p handoff-kernels --features cuda --example cuda_check
# and, for the FLA peer, the fla-core and einops wheels in .whl.
#
#   bash benches/h200.sh [STAGE ...]     (no stage: all of them, in this order)
#
# Stages:
#   check    cuda_check: every kernel against the CPU reference, batch invariance
#   verify   verify --compute --device cuda on the shipped configs (device regions,
#            the fused decode step, disaggregated vs colocated on the GPU, vs the CPU)
#   matrix   the compute test matrix on the GPU (device_matrix --ignored)
#   compute  bench compute --config config/gpu.toml --device cuda (the fused step
#            at B = 1, 8, 32, 88 against its floor), then the PyTorch peer of the
#            same model and weights (benches/peers/torch_model.py), side by side
#   matmul   cuda_check --bench-matmul: the fused step's tensor-core products,
#            next to torch.matmul from the peer (run `compute` first in the call)
#   wgprobe  benches/gpu/mm_wg_probe.cu (nvcc, sm_90a): the warpgroup product's
#            variants against the mma.sync one, bit for bit and timed
#   copyprobe benches/gpu/copy_probe.cu (nvcc): the hand-off's copy kernel and its
#            variants on the flagship pass's copy list, against the device copy
#   kernels  cuda_check --bench: KDA step, chunked prefill, MLA partial, matmuls
#   dense    cuda_check --bench-dense: the generic matmul's kernels (over all of k:
#            matmul_wg, matmul_tcb; split over k) at prefill shapes
#   probe    benches/gpu/mm_probe.cu (nvcc): the fused step's st_mm alone at the
#            decode shapes, then Nsight Compute's view of the 88 x 7168^2 one
#   fla      FLA's fused_recurrent_kda and chunk_kda (needs .whl)
#   serve    bench serve on the default and on config/gpu.toml
#   tail     bench serve on config/gpu-32k.toml with 32K-token prompts: the
#            hand-off tail of layer-wise streaming against the stage's prefill
#   systems  handoff up on config/gpu.toml under a C32 load: where each role's
#            engine time went (/metrics, benches/peers/serve_systems.py)
#   systems-nomps  the same with [device] mps = false (the roles take turns on
#            the GPU in time slices, not side by side under up's MPS server)
#   trace    the same at HANDOFF_LOG=debug: each request's steps between the
#            roles (benches/peers/trace_phases.py), the log gzipped into $OUT
#   profile  bench prefill at serving batches, then each kernel's time in a
#            1 x 1024-token and a 32 x 80-token prefill (Nsight Compute)
#   transfer the flagship hand-off through CUDA IPC
#   ncu-mla  the same for the MLA partial (st_mla_part_tc)
#   ncu-step Nsight Compute on one B = 88 launch of the fused step's st_kda and
#            st_mm_w2 inside bench compute (launch-skip past B = 1, 8, 32:
#            st_kda runs 126 times a batch size, st_mm_w2 777 at B = 32), with
#            the source-level counters (where a warp's instructions stall)
# Prints each figure next to its peer from the same call; logs go to $OUT.
set -uo pipefail
BIN=${BIN:-.gpu-carry}
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
export PATH="$BIN:$PATH"
step() { echo; echo "== $*"; }
# handoff up on a config (default config/gpu.toml) under a C32 load; each
# role's engine time by system, into $OUT/$1.txt.
systems_run() {
  HANDOFF_DEVICE=cuda handoff up --config "${2:-config/gpu.toml}" --port 8123 > "$OUT/$1-up.log" 2>&1 &
  local up=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8123/health >/dev/null 2>&1 && break; sleep 0.5; done
  timeout 200 python3 benches/peers/serve_systems.py --url http://127.0.0.1:8123 --concurrency 32 --requests 256 2>&1 | tee "$OUT/$1.txt" || fail=1
  kill -INT $up; sleep 2; kill -9 $up 2>/dev/null; wait $up 2>/dev/null
}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(check verify matrix compute matmul probe kernels fla serve systems transfer)
fail=0

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader

for s in "${stages[@]}"; do
case "$s" in
check)
  step "kernel check: every op against the CPU reference, batch invariance"
  timeout 300 cuda_check 2>&1 | tee "$OUT/cuda_check.txt" | grep -E "FAIL|step matmul|checks," || fail=1
  ;;
verify)
  step "verify --compute --device cuda (4 requests as one batch, 32 steps): regions in device memory, the fused decode step"
  for c in config/small.toml config/trained.toml config/trained-pp4-tp4dcp4.toml config/medium.toml config/pp3-tp2-to-tp4dcp2.toml config/gpu.toml; do
    timeout 240 handoff verify --config "$c" --compute --device cuda --requests 4 2>&1 | tee -a "$OUT/verify.txt" | head -6 || fail=1
  done
  ;;
matrix)
  step "the compute test matrix on the GPU"
  timeout 400 device_matrix --ignored --nocapture 2>&1 | tee "$OUT/device_matrix.txt" | grep -E "ok on|test result|failed|panicked|diverged" || fail=1
  ;;
compute)
  step "bench compute on cuda, config/gpu.toml: the fused decode step through device regions, against its floor"
  timeout 300 handoff bench compute --config config/gpu.toml --device cuda --plot "$OUT/compute-gpu.svg" 2>&1 | tee "$OUT/compute-gpu.txt" | tail -14 || fail=1
  step "the same model in plain PyTorch (same weights), eager and CUDA graph"
  handoff weights --config config/gpu.toml --out /tmp/gpu-weights.safetensors >/dev/null || fail=1
  PYTHONUNBUFFERED=1 timeout 300 python3 benches/peers/torch_model.py --config config/gpu.toml --weights /tmp/gpu-weights.safetensors 2>&1 | tee "$OUT/torch.txt" | grep -v Warning || fail=1
  step "handoff (the default: graphs, dependent launches) vs PyTorch (CUDA graph), decode step of config/gpu.toml"
  for b in 1 8 32 88; do
    ours=$(grep -E "fused step batch +$b at" "$OUT/compute-gpu.txt" | sed -E 's/.*us \(graph\) +([0-9.]+) us \(graph, dependent launches\).*/\1/')
    peer=$(grep -E "torch decode step batch $b:" "$OUT/torch.txt" | sed -E 's/.*graph ([0-9.]+) us.*/\1/')
    [ -n "$ours" ] && [ -n "$peer" ] && awk -v b="$b" -v o="$ours" -v p="$peer" 'BEGIN { printf "  batch %3d: handoff %8.1f us, torch graph %8.1f us: %.2fx the peer\n", b, o, p, o / p }'
  done
  ;;
matmul)
  step "the fused step's tensor-core products (cuda_check --bench-matmul)"
  timeout 120 cuda_check --bench-matmul 2>&1 | tee "$OUT/matmul.txt" | tail -16 || fail=1
  if [ -f "$OUT/torch.txt" ]; then
    step "step_matmul vs torch.matmul in the same call (ours bf16 x bf16 = 1 term; f32: ours 3 terms vs cuBLAS f32)"
    for shape in "1x7168.7168x7168" "88x7168.7168x7168" "4096x4096.4096x4096" "1x2048.2048x2048" "88x2048.2048x2048"; do
      for kind in "bf16 weights, 1 term|bf16" "f32 weights, 3 terms|f32"; do
        ours_k=${kind%%|*}; peer_k=${kind##*|}
        ours=$(grep -F "step_matmul $ours_k | ${shape/./ . }" "$OUT/matmul.txt" | awk -F'|' '{print $4}' | tr -d ' ')
        peer=$(grep -F "torch.matmul $peer_k $shape:" "$OUT/torch.txt" | sed -E 's/.*: ([0-9.]+) us.*/\1/')
        [ -n "$ours" ] && [ -n "$peer" ] && awk -v s="$shape" -v k="$peer_k" -v o="$ours" -v p="$peer" 'BEGIN { printf "  %s %s: ours %.1f us, torch %.1f us: %.2fx of torch\n", k, s, o, p, p / o }'
      done
    done
  fi
  ;;
probe)
  step "st_mm alone (nvcc build of kernels/hip, benches/gpu/mm_probe.cu)"
  nvcc -O3 -arch=sm_90 -std=c++17 -diag-suppress 1556 -I kernels/hip -include prelude.h benches/gpu/mm_probe.cu -o /tmp/mm_probe || fail=1
  for shape in "88 7168 7168 1" "88 7168 7168 2" "88 7168 7168 3" "88 2048 10240 2" "88 2048 2048 2" "32 2048 10240 2" "512 2048 10240 3"; do
    /tmp/mm_probe $shape
  done 2>&1 | tee "$OUT/probe.txt"
  timeout 120 ncu --clock-control none -k regex:st_mm -c 1 --section SpeedOfLight --section Occupancy --section SchedulerStats /tmp/mm_probe 88 7168 7168 1 2>&1 \
    | grep -E "Duration|Throughput|Warps Per Scheduler|Issued Warp|Achieved Occupancy" | tee "$OUT/probe-ncu.txt"
  ;;
wgprobe)
  step "st_mm_wg (the warpgroup product) against the step's mma.sync product, same bits (nvcc build of benches/gpu/mm_wg_probe.cu)"
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 1556,177,550 -I kernels/hip -include prelude.h \
    benches/gpu/mm_wg_probe.cu -o /tmp/mm_wg_probe || fail=1
  for shape in "88 7168 7168 1" "88 7168 7168 3" "88 2048 10256 3" "88 2048 8192 3" "88 4096 2048 3" "32 2048 10256 3" \
               "64 2048 10256 3" "17 2048 8192 3" "8 2048 10256 3" "1 7168 7168 1" "88 2048 2048 2" "120 2048 8192 3"; do
    timeout 60 /tmp/mm_wg_probe $shape
  done 2>&1 | tee "$OUT/wgprobe.txt"
  ;;
copyprobe)
  step "the hand-off's copy kernel (memcopy.hip) against its variants and the device copy, on the flagship pass's copy list (nvcc build of benches/gpu/copy_probe.cu)"
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels/hip -include prelude.h \
    benches/gpu/copy_probe.cu -o /tmp/copy_probe || fail=1
  timeout 120 /tmp/copy_probe benches/gpu/flagship-copies.txt 2>&1 | tee "$OUT/copyprobe.txt" || fail=1
  ;;
kernels)
  step "kernel timings (cuda_check --bench)"
  timeout 300 cuda_check --bench 2>&1 | tee "$OUT/kernels.txt" | tail -40 || fail=1
  ;;
dense)
  step "the generic matmul at prefill shapes: matmul_wg and matmul_tcb vs split over k (cuda_check --bench-dense)"
  timeout 200 cuda_check --bench-dense 2>&1 | tee "$OUT/dense.txt" | grep "matmul kernels" || fail=1
  ;;
fla)
  step "peers: FLA fused_recurrent_kda and chunk_kda (same GPU, same call)"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && \
      PYTHONPATH=/tmp/site timeout 180 python3 benches/peers/fla_kda.py 2>&1 | tee "$OUT/fla.txt" | grep -v Warning || fail=1
  else
    echo "no .whl: FLA peer not run"; fail=1
  fi
  ;;
serve)
  step "bench serve on cuda, default cluster (KV and state in device memory, CUDA IPC hand-offs)"
  HANDOFF_DEVICE=cuda timeout 240 handoff bench serve --concurrency 1,32,88 2>&1 | tee "$OUT/serve.txt" | tail -6 || fail=1
  step "bench serve on cuda, config/gpu.toml"
  HANDOFF_DEVICE=cuda timeout 240 handoff bench serve --config config/gpu.toml --concurrency 1,32,88 2>&1 | tee "$OUT/serve-gpu.txt" | tail -6 || fail=1
  ;;
tail)
  step "the hand-off tail at 32K-token prompts on cuda (layer-wise streaming): its share of the stage's prefill"
  HANDOFF_DEVICE=cuda timeout 300 handoff bench serve --config config/gpu-32k.toml --prompt-tokens 32768 --concurrency 1 --requests 3 2>&1 | tee "$OUT/tail-32k.txt" | tail -5 || fail=1
  ;;
systems)
  step "handoff up on cuda, config/gpu.toml, C32: each role's engine time by system"
  systems_run systems
  ;;
trace)
  step "the same at HANDOFF_LOG=debug: where a request waits between the roles"
  HANDOFF_LOG=debug systems_run trace
  python3 benches/peers/trace_phases.py "$OUT/trace-up.log" 2>&1 | tee "$OUT/trace-phases.txt" || fail=1
  gzip -f "$OUT/trace-up.log"
  ;;
ncu-step|ncu-mla)
  # ncu-mla: the fused step's MLA partial (2 launches a step, 21 steps a batch size).
  targets="st_kda:385 st_mm_w2:790"
  [ "$s" = ncu-mla ] && targets="st_mla_part_tc:129"
  step "Nsight Compute: one B = 88 launch each of ${targets//:[0-9]*/} in bench compute"
  for k in $targets; do
    name=${k%%:*}; skip=${k##*:}
    timeout 240 ncu --clock-control none -k regex:"^$name\$" --launch-skip "$skip" -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --section SchedulerStats --section SourceCounters \
      handoff bench compute --config config/gpu.toml --device cuda > "$OUT/ncu-$name.txt" 2>&1 || fail=1
    grep -E "Grid Size|Duration|DRAM Throughput|Issued Warp|Eligible Warps|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Stall|stall" "$OUT/ncu-$name.txt" | head -40
  done
  ;;
systems-nomps)
  # config/gpu.toml runs its roles under an MPS server of up's own ([device]
  # mps = true); the same run with mps = false shows what that is worth (the
  # roles' contexts then take turns on the GPU in time slices).
  step "the same with mps = false (time slices)"
  sed 's/^mps = true/mps = false/' config/gpu.toml > /tmp/gpu-nomps.toml
  systems_run systems-nomps /tmp/gpu-nomps.toml
  ;;
profile)
  step "bench prefill (config/gpu.toml): batches of serving prompts and one long prompt"
  for shape in "32 80" "8 80" "1 80" "1 1024" "4 1024"; do
    set -- $shape
    timeout 120 handoff bench prefill --config config/gpu.toml --device cuda --prompts $1 --tokens $2
  done 2>&1 | tee "$OUT/prefill.txt"
  step "Nsight Compute: each kernel's time in one pass of 1 x 1024 tokens (and the warm-up)"
  timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    handoff bench prefill --config config/gpu.toml --device cuda --prompts 1 --tokens 1024 --reps 1 > "$OUT/prefill-ncu.txt" 2>&1 || fail=1
  awk '/^  [a-z_0-9]+ \(/{name=$1; inv=$NF} /gpu__time_duration.sum/{t[name]+=inv*$NF; n[name]+=inv} END{for (k in t) printf "%10.1f us %6d launches  %s\n", t[k], n[k], k}' "$OUT/prefill-ncu.txt" | sort -rn | head -25
  step "Nsight Compute: each kernel's time in one serving pass of 32 x 80 tokens (and the warm-up)"
  timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    handoff bench prefill --config config/gpu.toml --device cuda --prompts 32 --tokens 80 --reps 1 > "$OUT/prefill32-ncu.txt" 2>&1 || fail=1
  awk '/^  [a-z_0-9]+ \(/{name=$1; inv=$NF} /gpu__time_duration.sum/{t[name]+=inv*$NF; n[name]+=inv} END{for (k in t) printf "%10.1f us %6d launches  %s\n", t[k], n[k], k}' "$OUT/prefill32-ncu.txt" | sort -rn | head -25
  step "Nsight Compute: one matmul_tcb launch of that pass (issue and stall view)"
  timeout 120 ncu --clock-control none -k regex:matmul_tcb -s 20 -c 1 --section SpeedOfLight --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    handoff bench prefill --config config/gpu.toml --device cuda --prompts 1 --tokens 1024 --reps 1 2>&1 \
    | grep -E "Duration|Throughput|Warps Per Scheduler|Issued Warp|stalled" | tee "$OUT/prefill-ncu-tcb.txt"
  ;;
transfer)
  step "hand-off of the flagship request (32K tokens) between two processes through CUDA IPC, oracle-checked"
  timeout 240 handoff bench transfer --config config/k3-pp8-tp8dcp8.toml --transport cuda-ipc --tokens 32768 2>&1 | tee "$OUT/ipc.txt" | tail -10 || fail=1
  ;;
*)
  echo "unknown stage $s"; fail=1
  ;;
esac
done
exit $fail
