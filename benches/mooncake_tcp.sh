#!/usr/bin/env bash
# Mooncake transfer engine over TCP on loopback: the peer figure for
# `handoff bench transfer --transport tcp`. Runs its own transfer_engine_bench as a
# target and an initiator process (P2P handshake, no metadata server), operation write.
#
# Usage: benches/mooncake_tcp.sh [BLOCK_SIZE] [DURATION_S] [THREADS]
# Needs: pip install mooncake-transfer-engine-non-cuda ; apt-get install -y libibverbs1
# MOONCAKE_BENCH may point at the transfer_engine_bench binary (the ELF inside the
# `mooncake` Python package; the bin/ entry of the same name is a Python wrapper).
set -euo pipefail

BLOCK=${1:-65536}
DURATION=${2:-5}
THREADS=${3:-2}
BUFFER=${BUFFER:-268435456}
PY=${PYTHON:-python3}

BENCH=${MOONCAKE_BENCH:-$("$PY" -c 'import mooncake, os; print(os.path.join(os.path.dirname(mooncake.__file__), "transfer_engine_bench"))')}
[ -x "$BENCH" ] || { echo "transfer_engine_bench not found at $BENCH" >&2; exit 1; }

LOG=$(mktemp -d)
TARGET_PID=
cleanup() { [ -n "$TARGET_PID" ] && kill "$TARGET_PID" 2>/dev/null || true; rm -rf "$LOG"; }
trap cleanup EXIT

"$BENCH" --mode=target --protocol=tcp --metadata_server=P2PHANDSHAKE \
  --local_server_name=127.0.0.1:17777 --buffer_size="$BUFFER" >"$LOG/target.log" 2>&1 &
TARGET_PID=$!

# With P2PHANDSHAKE the target's RPC port is picked at run time; its segment id is
# the address it logs as "Transfer Engine RPC using P2P handshake, listening on ...".
SEG=
for _ in $(seq 1 100); do
  SEG=$(grep -o 'listening on [0-9.:]*' "$LOG/target.log" | head -1 | awk '{print $3}' || true)
  [ -n "$SEG" ] && break
  sleep 0.1
done
[ -n "$SEG" ] || { cat "$LOG/target.log" >&2; echo "target did not start" >&2; exit 1; }
sleep 1  # let the target finish registering its buffer

"$BENCH" --mode=initiator --protocol=tcp --metadata_server=P2PHANDSHAKE \
  --local_server_name=127.0.0.1:17778 --segment_id="$SEG" --operation=write \
  --block_size="$BLOCK" --batch_size=128 --threads="$THREADS" --duration="$DURATION" \
  --buffer_size="$BUFFER" >"$LOG/initiator.log" 2>&1 || { cat "$LOG/initiator.log" >&2; exit 1; }

echo "mooncake tcp write block=$BLOCK threads=$THREADS cores=$(nproc): $(grep -o 'Test completed.*' "$LOG/initiator.log")"
