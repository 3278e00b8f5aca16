#!/usr/bin/env bash
# Fault tests over many seeds, on a quiet box and on a loaded one: the
# quorum's chaos test (tests/serial/quorum_chaos.rs) and the partition
# tests (tests/serial/partitions.rs), each seed once quiet and once with
# every core saturated by busy loops (LOAD=1 per core, started here,
# stopped at exit). Every run's verdict line is kept in a table; the whole
# output of any failure is kept in $OUT/failed-<test>-<seed>-<load>.log, so
# a failure nobody can explain can still be read afterwards.
#
#   bench/chaos.sh                  SEEDS="1..20", both loads, both tests
#   SEEDS="3 7" LOADS=busy bench/chaos.sh
#
# Environment (all optional):
#   SEEDS="1 2 … 20"     seeds (QUORUM_CHAOS_SEED, PARTITION_SEED)
#   LOADS="quiet busy"   quiet: nothing else runs; busy: a busy loop per core
#   TESTS="chaos partitions"
#   QUORUM_CHAOS_SECS=35 the chaos test's length
#   OUT=bench/results/chaos-<date>   where the table and failures go
#
# Prints, per test and load: runs, failures, and for the chaos test the
# overlaps, lost updates and starved WAIT runs it reported, with the load
# average of each run.
set -euo pipefail

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
# shellcheck source=bench/lib.sh
. "$LOCKGATE_ROOT/bench/lib.sh"
cd "$LOCKGATE_ROOT"

SEEDS=${SEEDS:-$(seq -s ' ' 1 20)}
LOADS=${LOADS:-"quiet busy"}
TESTS=${TESTS:-"chaos partitions"}
OUT=${OUT:-bench/results/chaos-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
bench_start chaos

log "building the serial test binary"
cargo test --test serial --no-run --quiet 2>"$TMP/build.log" || { cat "$TMP/build.log" >&2; die "build failed"; }

BUSY=()
busy_on() {
  local i
  for ((i = 0; i < $(nproc); i++)); do
    (while :; do :; done) &
    BUSY+=("$!")
    PIDS+=("$!")
  done
}
busy_off() {
  local pid
  for pid in "${BUSY[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  BUSY=()
}

TABLE="$OUT/table.tsv"
printf 'test\tload\tseed\tresult\tloadavg\tverdict\n' >"$TABLE"
for load in $LOADS; do
  [[ $load == busy ]] && busy_on
  for t in $TESTS; do
    case $t in
    chaos) filter=quorum_chaos::locks_stay_exclusive ;;
    partitions) filter=partitions:: ;;
    *) die "unknown test $t (chaos or partitions)" ;;
    esac
    for seed in $SEEDS; do
      logf="$TMP/run.log"
      result=ok
      QUORUM_CHAOS_SEED=$seed PARTITION_SEED=$seed \
        cargo test --quiet --test serial "$filter" -- --nocapture >"$logf" 2>&1 || result=FAILED
      verdict=$(grep -hE '^(quorum_chaos seed|partitions )' "$logf" | grep -oE 'overlaps [0-9]+|lost updates [0-9]+|liveness: [0-9]+ starved|[0-9]+ during them|starved [0-9]+ \(\+[0-9]+ near faults\)|not live [0-9]+' | tr '\n' ' ' || true)
      avg=$(cut -d' ' -f1-3 /proc/loadavg)
      printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$load" "$seed" "$result" "$avg" "$verdict" >>"$TABLE"
      printf '%-10s %-5s seed %-4s %-6s load %s  %s\n' "$t" "$load" "$seed" "$result" "$avg" "$verdict"
      [[ $result == ok ]] || cp "$logf" "$OUT/failed-$t-$seed-$load.log"
    done
  done
  [[ $load == busy ]] && busy_off
done

echo
echo "runs and failures by test and load:"
awk -F'\t' 'NR > 1 { n[$1" "$2]++; if ($4 != "ok") f[$1" "$2]++ }
  END { for (k in n) printf "  %-18s %3d runs, %3d failed\n", k, n[k], f[k] + 0 }' "$TABLE" | sort
echo "table: $TABLE"
