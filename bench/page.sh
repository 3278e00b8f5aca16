#!/usr/bin/env bash
# What the status page costs lockgate: the same pass-through load through
# a lockgate without the admin listener (no page, no history sampled:
# "off"), through one with it and no one looking ("closed": the history
# sampled every 2 s), and with the page open in a headless Chromium
# ("open": it asks /status.json every second: the new history samples,
# the hot keys, the locks table read from Redis), alternating in one run.
#
#   bench/page.sh                  3 rounds of each
#   QUICK=1 bench/page.sh          1 round, smaller -n
#
# Environment (all optional):
#   ROUNDS=3  N=2000000  LOCKGATE_BIN=...
#
# Per run: redis-benchmark -c 50 -P 16 SET/GET ops/s and lockgate's CPU per
# command (utime+stime from /proc); a few lock keys are held during the
# run so the page's locks table has rows to read from Redis. Reported:
# medians, and "closed" and "open" against "off".
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/common.sh
source "$REPO/scripts/common.sh"
# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"

QUICK=${QUICK:-0}
ROUNDS=${ROUNDS:-3}
N=${N:-2000000}
if [[ $QUICK == 1 ]]; then ROUNDS=1 N=200000; fi
CLK_TCK=$(getconf CLK_TCK)
CHROMIUM=/usr/bin/chromium
[[ -x $CHROMIUM ]] || die "no $CHROMIUM (apt-get install -y chromium)"

bench_start page
log() { echo "[page] $*" >&2; }
if [[ -z ${LOCKGATE_BIN:-} ]]; then
  (cd "$REPO" && cargo build --release --quiet) || die "cargo build failed"
  LOCKGATE_BIN=$REPO/target/release/lockgate
fi

P_REDIS=$(pick_free_port)
(cd "$TMP" && exec redis-server --port "$P_REDIS" --bind 127.0.0.1 --save "" --appendonly no >"$TMP/redis.log" 2>&1) &
PIDS+=($!)
wait_ready redis "$!" "$P_REDIS" "$TMP/redis.log"
P_LG=$(pick_free_port)
P_ADMIN=$(pick_free_port)
RUST_LOG=warn "$LOCKGATE_BIN" --listen "127.0.0.1:$P_LG" --admin-listen "127.0.0.1:$P_ADMIN" \
  --upstream "127.0.0.1:$P_REDIS" >"$TMP/lockgate.log" 2>&1 &
PIDS+=($!)
LG_PID=$!
wait_ready lockgate "$LG_PID" "$P_LG" "$TMP/lockgate.log"
P_OFF=$(pick_free_port)
RUST_LOG=warn "$LOCKGATE_BIN" --listen "127.0.0.1:$P_OFF" --admin-listen "" \
  --upstream "127.0.0.1:$P_REDIS" >"$TMP/lockgate-off.log" 2>&1 &
PIDS+=($!)
OFF_PID=$!
wait_ready lockgate-off "$OFF_PID" "$P_OFF" "$TMP/lockgate-off.log"
# Held locks for the page's table (leases of a minute, renewed each round).
hold_locks() {
  local i
  for i in 1 2 3 4 5; do
    redis-cli -h 127.0.0.1 -p "$P_REDIS" del "lock:bench:page:$i" >/dev/null
    redis-cli -h 127.0.0.1 -p "$P_LG" setnx "lock:bench:page:$i" held >/dev/null
  done
}


BROWSER_PID=
open_page() {
  setsid "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --user-data-dir="$TMP/chromium" \
    --remote-debugging-port=0 "http://127.0.0.1:$P_ADMIN/" >"$TMP/chromium.log" 2>&1 &
  BROWSER_PID=$!
  PIDS+=("$BROWSER_PID")
  # Chromium starts, loads the page and polls within this (its log says
  # if it could not).
  sleep 3
  kill -0 "$BROWSER_PID" 2>/dev/null || die "chromium exited: $(tail -5 "$TMP/chromium.log")"
}
close_page() {
  kill -TERM -- "-$BROWSER_PID" 2>/dev/null || kill -TERM "$BROWSER_PID" 2>/dev/null || true
  wait "$BROWSER_PID" 2>/dev/null || true
  BROWSER_PID=
}

TSV=$TMP/runs.tsv
printf 'round\ttest\tpage\trps\tcpu_s\n' >"$TSV"
run_one() {
  local round=$1 test=$2 page=$3 t0 t1 rps pid=$LG_PID port=$P_LG
  if [[ $page == off ]]; then pid=$OFF_PID port=$P_OFF; fi
  hold_locks
  [[ $page == open ]] && open_page
  t0=$(cpu_ticks "$pid")
  redis-benchmark -h 127.0.0.1 -p "$port" -t "$test" -c 50 -P 16 -n "$N" -r 100000 -d 3 --csv >"$TMP/out.csv" 2>/dev/null ||
    die "redis-benchmark $test failed"
  t1=$(cpu_ticks "$pid")
  [[ $page == open ]] && close_page
  rps=$(tail -n 1 "$TMP/out.csv" | cut -d, -f2 | tr -d '"')
  printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$test" "$page" "$rps" \
    "$(awk -v d=$((t1 - t0)) -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", d / hz }')" >>"$TSV"
  log "round $round $test page $page: $rps ops/s"
}

LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
for ((round = 1; round <= ROUNDS; round++)); do
  for test in set get; do
    case $((round % 3)) in
    1) order=(off closed open) ;;
    2) order=(closed open off) ;;
    *) order=(open off closed) ;;
    esac
    for page in "${order[@]}"; do run_one "$round" "$test" "$page"; done
  done
done

python3 - "$TSV" "$LOAD0" "$(cut -d' ' -f1-3 /proc/loadavg)" "$N" <<'EOF'
import csv, statistics, sys
tsv, load0, load1, n = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
rows = list(csv.DictReader(open(tsv), delimiter="\t"))
print(f"page bench, load average {load0} at the start, {load1} at the end; medians of {len(set(r['round'] for r in rows))} round(s), -c 50 -P 16")
print()
print("| test | page | ops/s | lockgate CPU µs/op |")
print("|---|---|---:|---:|")
med = {}
for t in ("set", "get"):
    for p in ("off", "closed", "open"):
        rs = [r for r in rows if r["test"] == t and r["page"] == p]
        med[t, p] = (statistics.median(float(r["rps"]) for r in rs),
                     statistics.median(float(r["cpu_s"]) for r in rs) / n * 1e6)
        print(f"| {t} | {p} | {med[t, p][0]:.0f} | {med[t, p][1]:.3f} |")
print()
for t in ("set", "get"):
    r0, c0 = med[t, "off"]
    for p in ("closed", "open"):
        r1, c1 = med[t, p]
        print(f"{t}: page {p} {r1 / r0:.3f}x the ops/s and {c1 / c0:.3f}x the CPU per command of no admin listener")
EOF
