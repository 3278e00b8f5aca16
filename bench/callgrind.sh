#!/usr/bin/env bash
# Instructions lockgate runs per request, counted by valgrind's callgrind:
# one redis-server, lockgate in front of it under callgrind, and one
# redis-benchmark load. Unlike ops/s or CPU seconds, the count does not move
# with whatever else the shared box is doing, so it checks one change
# against another in user space (the kernel's share, system calls and
# wake-ups, is not counted: bench/passthrough.sh measures that).
#
#   bench/callgrind.sh                      SET -c 50 -P 16, 100000 requests
#   bench/callgrind.sh get 16 100000
#   bench/callgrind.sh set 1 50000 OUT.cg   keep the profile as OUT.cg
#
# Arguments: redis-benchmark test (set, get, …), pipeline depth, requests,
# and where to keep the profile (default: a temp file, removed). Prints the
# total and the count per request, then the top functions
# (callgrind_annotate). Environment: LOCKGATE_BIN (default: cargo build
# --release), CLIENTS (50), KEYSPACE (100000), TOP (25 functions),
# MODE (lockgate's proxy.upstream: dedicated, the default, or shared),
# UPSTREAM (single, the default: one redis-server; cluster: a 3-primary
# Redis Cluster, `--upstream-cluster`, every slot reached before the load).
# The cluster path's cost against one Redis's, in instructions per
# request, is then two runs of the same test:
#
#   MODE=shared bench/callgrind.sh set 16 100000
#   MODE=shared UPSTREAM=cluster bench/callgrind.sh set 16 100000
#
# The count varies by a percent or so between runs of the same binary (how
# requests fall into reads depends on timing); compare changes larger than
# that, and compare the same test, depth and count.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
export LC_ALL=C

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
TEST=${1:-set}
PIPE=${2:-16}
N=${3:-100000}
KEEP=${4:-}
CLIENTS=${CLIENTS:-50}
KEYSPACE=${KEYSPACE:-100000}
TOP=${TOP:-25}
MODE=${MODE:-dedicated}
UPSTREAM=${UPSTREAM:-single}

LOG_TAG=callgrind
# shellcheck source=scripts/common.sh
. "$BENCH_DIR/../scripts/common.sh"
# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"

install_missing "redis-server redis-tools valgrind" redis-server redis-cli redis-benchmark valgrind callgrind_annotate
if [[ -z ${LOCKGATE_BIN:-} ]]; then
  log "building lockgate (cargo build --release)"
  (cd "$REPO" && cargo build --release --quiet) || die "cargo build --release failed"
  LOCKGATE_BIN="$REPO/target/release/lockgate"
fi

bench_start callgrind
P_LOCKGATE=$(pick_free_port)
case $UPSTREAM in
  single)
    P_REDIS=$(pick_free_port)
    redis-server --port "$P_REDIS" --bind 127.0.0.1 --save '' --appendonly no \
      >"$TMP/redis.log" 2>&1 &
    REDIS_PID=$!
    PIDS+=("$REDIS_PID")
    wait_ready redis "$REDIS_PID" "$P_REDIS" "$TMP/redis.log"
    TO=(--upstream "127.0.0.1:$P_REDIS")
    ;;
  cluster)
    NODES=()
    for i in 1 2 3; do
      port=$(pick_free_port)
      mkdir -p "$TMP/node$i"
      (cd "$TMP/node$i" && exec redis-server --port "$port" --bind 127.0.0.1 --save '' \
        --appendonly no --cluster-enabled yes --cluster-node-timeout 5000 \
        >"$TMP/node$i.log" 2>&1) &
      PIDS+=($!)
      NODES+=("127.0.0.1:$port")
      wait_ready "node$i" "$!" "$port" "$TMP/node$i.log"
    done
    create_cluster "$TMP/create.log" "${NODES[@]}"
    TO=(--upstream-cluster "${NODES[0]}")
    ;;
  *) die "UPSTREAM=$UPSTREAM: single or cluster" ;;
esac

OUT=${KEEP:-$TMP/lockgate.cg}
RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$OUT" \
  "$LOCKGATE_BIN" --listen "127.0.0.1:$P_LOCKGATE" "${TO[@]}" --upstream-mode "$MODE" \
  --admin-listen "" >"$TMP/lockgate.log" 2>&1 &
LOCKGATE_PID=$!
PIDS+=("$LOCKGATE_PID")
wait_ready lockgate "$LOCKGATE_PID" "$P_LOCKGATE" "$TMP/lockgate.log"
if [[ $UPSTREAM == cluster ]]; then
  # Every node reached (its slots' keys answer) before the count starts
  # mattering: two keys in slots of different primaries, and a third.
  for ((i = 0; i < 300; i++)); do
    ok=1
    for k in "{a}" "{b}" "{c}"; do
      [[ $(redis-cli -p "$P_LOCKGATE" set "callgrind:probe:$k" 1 2>/dev/null) == OK ]] || ok=0
    done
    [[ $ok == 1 ]] && break
    sleep 0.1
  done
  [[ $ok == 1 ]] || die "lockgate did not reach every cluster node (log: $TMP/lockgate.log)"
fi

log "redis-benchmark -t $TEST -c $CLIENTS -P $PIPE -n $N through lockgate under callgrind"
redis-benchmark -h 127.0.0.1 -p "$P_LOCKGATE" -t "$TEST" -c "$CLIENTS" -P "$PIPE" -n "$N" \
  -r "$KEYSPACE" -d 3 -q >"$TMP/bench.log" 2>&1 ||
  { cat "$TMP/bench.log" >&2; die "redis-benchmark failed"; }
# Stopped by SIGTERM (a graceful drain), so callgrind writes the profile.
kill -TERM "$LOCKGATE_PID"
wait "$LOCKGATE_PID" || true

total=$(callgrind_annotate "$OUT" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
[[ -n $total ]] || die "no profile in $OUT (log: $TMP/lockgate.log)"
printf '%s -c %s -P %s, %s requests, %s mode in front of %s: %s instructions in lockgate, %s per request\n' \
  "$TEST" "$CLIENTS" "$PIPE" "$N" "$MODE" "$UPSTREAM" "$total" "$((total / N))"
callgrind_annotate "$OUT" 2>/dev/null | awk '/file:function/ { on = 1; next } on && NF' | head -n "$TOP"
if [[ -n $KEEP ]]; then log "profile kept: $KEEP (callgrind_annotate --inclusive=yes $KEEP)"; fi
