#!/usr/bin/env bash
# Retry-storm benchmark: the incident lockgate exists for ("the
# incident, side by side"). Many clients contend for one lock key through
# each target, alternating in one run:
#   direct     redis-server
#   twemproxy  nutcracker (one pool, one server) in front of its own redis-server
#   lockgate   lockgate (default config) in front of its own redis-server
# and three workloads, DURATION seconds each:
#   a (poll)   150 clients: SETNX lock:storm <id>, sleep 1 ms, again (the
#              'Redis in Action' loop with time.sleep(.001))
#   b (spin)   50 clients: SETNX with no sleep
#   c (try)    a holder keeps lock:storm for the whole run; 20 clients each
#              send one SETNX on it every 1500 ms (staggered), never retrying
#              sooner: try-locks (cron de-duplication), which lockgate must
#              answer at once, not park, as its spin window is 1000 ms
# In a and b a winner holds the lock 200 ms, DELs it through the same target
# and goes back to trying. The clients are bench/storm_load.rs (raw RESP, one
# connection each, every reply awaited before the next attempt; c is its
# --try-every-ms mode).
#
#   bench/storm.sh             full run (3 workloads x 3 targets x 10 s: ~2 min
#                              after the build)
#   QUICK=1 bench/storm.sh     smoke test: 2 s runs, short idle baseline
#
# Environment (all optional):
#   DURATION=10       seconds per run (QUICK=1: 2)
#   ROUNDS=1          rounds; the order of the targets rotates from workload
#                     to workload and round to round; the report shows medians
#   HOLD_MS=200       how long a winner holds the lock
#   POLL_CLIENTS=150  POLL_SLEEP_US=1000  SPIN_CLIENTS=50
#   TRY_CLIENTS=20    TRY_EVERY_MS=1500 (must exceed lockgate's spin_window_ms)
#   IDLE_S=5          seconds of idle baseline per Redis (QUICK=1: 2)
#   RUN_TIMEOUT=      seconds before one run is given up (default DURATION+60)
#   LOCKGATE_BIN=...  use this lockgate binary instead of building it
#   STORM_BIN=...     use this load generator instead of building it
#
# Per run it records, on the target's own Redis: INFO commandstats (reset just
# before), the CPU of redis-server (utime+stime from /proc/PID/stat, and the
# ns-precise /proc/PID/task/*/schedstat) and of the proxy, and the load
# generator's JSON line (acquisitions, per-client counts, wait and handoff
# percentiles, unfinished waits; for c the try-lock reply latencies) and, for
# lockgate, its LOCKGATE STATS counters before and after (parked attempts,
# handoffs, ...). The markdown summary, with lockgate's
# PASS/MISS against the issue's targets, is printed and written to
# bench/results/storm-latest.md; the raw runs go to
# bench/results/storm-latest.jsonl and the rest of the report's input to
# storm-latest.meta.tsv (bench/storm_report.py re-renders them). The box is small and shared: compare
# targets within one run, not absolute numbers across runs.
#
# nutcracker closes the connection on commands it does not proxy (HELLO,
# CLIENT, SELECT, CONFIG): the generator sends only SETNX and DEL, and the
# resets and INFO go to each Redis directly.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
export LC_ALL=C

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
HELPER="$BENCH_DIR/storm_report.py"
RESULTS="$BENCH_DIR/results"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then
  DURATION=${DURATION:-2}
  IDLE_S=${IDLE_S:-2}
else
  DURATION=${DURATION:-10}
  IDLE_S=${IDLE_S:-5}
fi
ROUNDS=${ROUNDS:-1}
HOLD_MS=${HOLD_MS:-200}
POLL_CLIENTS=${POLL_CLIENTS:-150}
POLL_SLEEP_US=${POLL_SLEEP_US:-1000}
SPIN_CLIENTS=${SPIN_CLIENTS:-50}
TRY_CLIENTS=${TRY_CLIENTS:-20}
TRY_EVERY_MS=${TRY_EVERY_MS:-1500}
RUN_TIMEOUT=${RUN_TIMEOUT:-$((${DURATION%.*} + 60))}

LOG_TAG=storm
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"

# --- tools --------------------------------------------------------------------
install_missing "redis-server redis-tools nutcracker" redis-server redis-cli nutcracker python3 timeout

CLK_TCK=$(getconf CLK_TCK)

# The retry defaults as documented in config/lockgate.toml (lockgate runs
# without a file).
retry_default() {
  sed -n "/^\[locks.retry\]/,/^\[/s/^$1 *= *\([0-9]*\).*/\1/p" "$REPO/config/lockgate.toml" | head -1
}
SPIN_WINDOW_MS=$(retry_default spin_window_ms)
[[ $SPIN_WINDOW_MS =~ ^[0-9]+$ ]] || die "no locks.retry.spin_window_ms in config/lockgate.toml"
((TRY_EVERY_MS > SPIN_WINDOW_MS)) ||
  die "TRY_EVERY_MS=$TRY_EVERY_MS must exceed spin_window_ms ($SPIN_WINDOW_MS): the try-lock clients would be spinners"

# --- lockgate and the load generator ------------------------------------------
build=()
[[ -n ${LOCKGATE_BIN:-} ]] || build+=(--bin lockgate)
[[ -n ${STORM_BIN:-} ]] || build+=(--example storm)
if ((${#build[@]})); then
  log "building (cargo build --release ${build[*]})"
  (cd "$REPO" && cargo build --release --quiet "${build[@]}") || die "cargo build --release failed"
fi
LOCKGATE_BIN=${LOCKGATE_BIN:-$REPO/target/release/lockgate}
STORM_BIN=${STORM_BIN:-$REPO/target/release/examples/storm}
[[ -x $LOCKGATE_BIN ]] || die "LOCKGATE_BIN=$LOCKGATE_BIN is not executable"
[[ -x $STORM_BIN ]] || die "STORM_BIN=$STORM_BIN is not executable"

# --- processes: everything started here is killed by PID at exit -------------
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_start storm

mapfile -t PORTS < <(python3 "$BENCH_DIR/passthrough_report.py" ports 6)
P_REDIS_A=${PORTS[0]} P_REDIS_B=${PORTS[1]} P_REDIS_C=${PORTS[2]}
P_TWEM=${PORTS[3]} P_TWEM_STATS=${PORTS[4]} P_LOCKGATE=${PORTS[5]}

start_redis() {
  local name=$1 port=$2
  mkdir -p "$TMP/$name"
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
    --protected-mode no --daemonize no --dir "$TMP/$name" --logfile "$TMP/$name.log" &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
  wait_ready "redis-server ($name)" "$LAST_PID" "$port" "$TMP/$name.log"
}
start_redis redis-direct "$P_REDIS_A"
REDIS_A_PID=$LAST_PID
start_redis redis-twemproxy "$P_REDIS_B"
REDIS_B_PID=$LAST_PID
start_redis redis-lockgate "$P_REDIS_C"
REDIS_C_PID=$LAST_PID

cat >"$TMP/nutcracker.yml" <<EOF
storm:
  listen: 127.0.0.1:$P_TWEM
  redis: true
  hash: fnv1a_64
  distribution: ketama
  auto_eject_hosts: false
  servers:
   - 127.0.0.1:$P_REDIS_B:1
EOF
nutcracker -t -c "$TMP/nutcracker.yml" >/dev/null 2>&1 || die "nutcracker rejects $TMP/nutcracker.yml"
nutcracker -c "$TMP/nutcracker.yml" -s "$P_TWEM_STATS" -a 127.0.0.1 \
  -p "$TMP/nutcracker.pid" -o "$TMP/nutcracker.log" &
TWEM_PID=$!
PIDS+=("$TWEM_PID")
wait_ready nutcracker "$TWEM_PID" "$P_TWEM" "$TMP/nutcracker.log"

RUST_LOG=warn "$LOCKGATE_BIN" --listen "127.0.0.1:$P_LOCKGATE" --upstream "127.0.0.1:$P_REDIS_C" \
  >"$TMP/lockgate.log" 2>&1 &
LOCKGATE_PID=$!
PIDS+=("$LOCKGATE_PID")
wait_ready lockgate "$LOCKGATE_PID" "$P_LOCKGATE" "$TMP/lockgate.log"

TARGETS=(direct twemproxy lockgate)
declare -A PORT_OF=([direct]=$P_REDIS_A [twemproxy]=$P_TWEM [lockgate]=$P_LOCKGATE)
declare -A REDIS_PORT_OF=([direct]=$P_REDIS_A [twemproxy]=$P_REDIS_B [lockgate]=$P_REDIS_C)
declare -A REDIS_PID_OF=([direct]=$REDIS_A_PID [twemproxy]=$REDIS_B_PID [lockgate]=$REDIS_C_PID)
declare -A PROXY_PID_OF=([direct]="" [twemproxy]=$TWEM_PID [lockgate]=$LOCKGATE_PID)

rcli() { redis-cli -h 127.0.0.1 -p "$@"; }

# Every path reaches its own Redis, and SETNX/DEL on a lock key work through
# it; through lockgate the lock gets a lease (it is taken over, not passed on).
# The lock is taken, checked and released on one connection, as the load
# generator does: lockgate lets a connection that never acquired release only
# acquisitions made after it opened, so a DEL from a fresh redis-cli is refused.
for t in "${TARGETS[@]}"; do
  p=${PORT_OF[$t]} r=${REDIS_PORT_OF[$t]}
  [[ $(rcli "$p" set "storm:probe:$t" ok) == OK ]] || die "SET through $t failed"
  [[ $(rcli "$r" get "storm:probe:$t") == ok ]] || die "value written through $t not in its Redis"
  mapfile -t probe < <(printf '%s\n' 'setnx lock:storm:probe a' 'setnx lock:storm:probe b' \
    'pttl lock:storm:probe' 'del lock:storm:probe' | rcli "$p")
  [[ ${probe[0]:-} == 1 ]] || die "SETNX through $t did not acquire a free lock (${probe[*]})"
  [[ ${probe[1]:-} == 0 ]] || die "second SETNX through $t acquired a held lock (${probe[*]})"
  if [[ $t == lockgate ]] && ! ((${probe[2]:-0} > 0)); then
    die "SETNX through lockgate left no lease on the lock (PTTL ${probe[2]:-})"
  fi
  [[ ${probe[3]:-} == 1 ]] || die "DEL through $t did not release the lock (${probe[*]})"
done
log "redis :$P_REDIS_A/:$P_REDIS_B/:$P_REDIS_C  nutcracker :$P_TWEM  lockgate :$P_LOCKGATE (tmp $TMP)"

# utime+stime of a process (all its threads), in clock ticks.

reset_redis() {
  local r=$1
  [[ $(rcli "$r" flushall) == OK ]] || die "FLUSHALL on :$r failed"
  [[ $(rcli "$r" config resetstat) == OK ]] || die "CONFIG RESETSTAT on :$r failed"
}

# --- idle baseline: each Redis's own CPU with its proxy connected -------------
mkdir -p "$RESULTS"
META="$TMP/meta.tsv"
: >"$META"
for t in "${TARGETS[@]}"; do reset_redis "${REDIS_PORT_OF[$t]}"; done
declare -A IDLE0
for t in "${TARGETS[@]}"; do IDLE0[$t]=$(cpu_ns "${REDIS_PID_OF[$t]}"); done
t0=$(now_ns)
sleep "$IDLE_S"
t1=$(now_ns)
for t in "${TARGETS[@]}"; do
  c1=$(cpu_ns "${REDIS_PID_OF[$t]}")
  rate=$(awk -v c=$((c1 - IDLE0[$t])) -v w=$((t1 - t0)) 'BEGIN { printf "%.9f", c / w }')
  printf 'idle_%s\t%s\n' "$t" "$rate" >>"$META"
  log "idle $t redis: $(awk -v r="$rate" 'BEGIN { printf "%.2f", r * 1000 }') ms CPU/s"
done

# --- the floor: what one lone round trip costs an idle Redis on this box ------
# FLOOR_N PINGs at 5/s (the acquisition rate of the runs) on one connection to
# the direct Redis: its CPU above idle per PING. An acquisition through any
# proxy needs at least one round trip to Redis, so this bounds how low "Redis
# CPU per acquisition" can go here (waking an idle Redis is the cost).
FLOOR_N=${FLOOR_N:-25}
fp=${REDIS_PID_OF[direct]}
f0=$(cpu_ns "$fp")
ft0=$(now_ns)
{ for _ in $(seq "$FLOOR_N"); do echo PING; sleep 0.2; done; } | rcli "${REDIS_PORT_OF[direct]}" >/dev/null
ft1=$(now_ns)
f1=$(cpu_ns "$fp")
idle_direct=$(awk -F'\t' '$1 == "idle_direct" { print $2 }' "$META")
floor=$(awk -v c=$((f1 - f0)) -v w=$((ft1 - ft0)) -v i="$idle_direct" -v n="$FLOOR_N" \
  'BEGIN { v = (c - i * w) / n / 1e6; if (v < 0) v = 0; printf "%.4f", v }')
printf 'floor_ms\t%s\n' "$floor" >>"$META"
log "one lone round trip (PING at 5/s) costs the direct Redis $floor ms CPU above idle"

# --- runs ---------------------------------------------------------------------
RUNS="$TMP/runs.jsonl"
: >"$RUNS"

# workload id, clients, sleep between attempts (µs), try-lock interval (ms;
# 0: the contention loop)
WORKLOADS=(
  "poll $POLL_CLIENTS $POLL_SLEEP_US 0"
  "spin $SPIN_CLIENTS 0 0"
  "try $TRY_CLIENTS 0 $TRY_EVERY_MS"
)

run_one() {
  local round=$1 wl=$2 clients=$3 sleep_us=$4 try_ms=$5 target=$6
  local port=${PORT_OF[$target]} rport=${REDIS_PORT_OF[$target]} rpid=${REDIS_PID_OF[$target]}
  local ppid=${PROXY_PID_OF[$target]} out="$TMP/r$round-$wl-$target"
  local t0 t1 rt0 rt1 rn0 rn1 pt0=0 pt1=0
  reset_redis "$rport"
  : >"$out.lg0"
  : >"$out.lg1"
  if [[ $target == lockgate ]]; then rcli "$port" lockgate stats >"$out.lg0"; fi
  if [[ -n $ppid ]]; then pt0=$(cpu_ticks "$ppid"); fi
  rt0=$(cpu_ticks "$rpid")
  rn0=$(cpu_ns "$rpid")
  t0=$(now_ns)
  if ! timeout "$RUN_TIMEOUT" "$STORM_BIN" --port "$port" --clients "$clients" \
    --sleep-us "$sleep_us" --hold-ms "$HOLD_MS" --duration-s "$DURATION" \
    --try-every-ms "$try_ms" >"$out.json" 2>"$out.err"; then
    cat "$out.err" >&2
    die "load generator ($wl) against $target failed or timed out"
  fi
  t1=$(now_ns)
  rn1=$(cpu_ns "$rpid")
  rt1=$(cpu_ticks "$rpid")
  if [[ -n $ppid ]]; then pt1=$(cpu_ticks "$ppid"); fi
  rcli "$rport" info commandstats >"$out.cmdstats"
  if [[ $target == lockgate ]]; then rcli "$port" lockgate stats >"$out.lg1"; fi
  python3 "$HELPER" record "$RUNS" "$out.json" "$out.cmdstats" "$out.lg0" "$out.lg1" \
    round="$round" workload="$wl" target="$target" \
    wall_s="$(awk -v d=$((t1 - t0)) 'BEGIN { printf "%.6f", d / 1e9 }')" \
    redis_ticks=$((rt1 - rt0)) redis_ns=$((rn1 - rn0)) proxy_ticks=$((pt1 - pt0))
  python3 - "$out.json" "$out.cmdstats" "$out.lg0" "$out.lg1" "$round" "$wl" "$target" <<'EOF' >&2
import json, sys
g = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
calls = sum(int(l.split("calls=")[1].split(",")[0]) for l in open(sys.argv[2])
            if l.startswith("cmdstat_") and not l.startswith(("cmdstat_config", "cmdstat_info")))
def stats(path):
    lines = [l.strip() for l in open(path) if l.strip()]
    return {lines[i]: int(lines[i + 1]) for i in range(0, len(lines) - 1, 2)}
lg0, lg1 = stats(sys.argv[3]), stats(sys.argv[4])
parked = f"  parked {lg1['lock_parked'] - lg0.get('lock_parked', 0)}" if "lock_parked" in lg1 else ""
head = f"[storm] round {sys.argv[5]} {sys.argv[6]:<4} {sys.argv[7]:<9} {calls / g['elapsed_s']:>9.0f} cmds/s  "
if g.get("mode") == "try":
    lat = g["latency_ms"]
    print(head + f"{g['attempts']:>3} try-locks, {g['acquired']} acquired  "
          f"reply p50 {lat['p50']:.2f} ms p99 {lat['p99']:.2f} ms{parked}  errors {g['errors']}")
else:
    acq = g["acquisitions"]
    print(head + f"{acq:>3} acquisitions ({g['distinct_acquirers']} clients)  "
          f"wait p99 {g['wait_ms']['p99'] / 1000:.2f} s{parked}  errors {g['errors']}")
EOF
}

log "duration ${DURATION}s x ${#WORKLOADS[@]} workloads x ${#TARGETS[@]} targets x $ROUNDS round(s), hold ${HOLD_MS} ms (QUICK=$QUICK)"
LOAD_AT_START=$(cut -d' ' -f1-3 /proc/loadavg)
for ((round = 1; round <= ROUNDS; round++)); do
  for ((w = 0; w < ${#WORKLOADS[@]}; w++)); do
    read -r wl clients sleep_us try_ms <<<"${WORKLOADS[$w]}"
    for ((k = 0; k < ${#TARGETS[@]}; k++)); do
      target=${TARGETS[$(((k + w + round - 1) % ${#TARGETS[@]}))]}
      run_one "$round" "$wl" "$clients" "$sleep_us" "$try_ms" "$target"
    done
  done
done

# --- report -------------------------------------------------------------------
rev=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(git -C "$REPO" status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null) ]]; then
  rev="$rev+dirty"
fi
{
  printf 'date\t%s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
  printf 'lockgate\t%s\n' "$("$LOCKGATE_BIN" --version | awk '{print $2}') @ $rev"
  printf 'redis\t%s\n' "$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')"
  printf 'nutcracker\t%s\n' "$(nutcracker --version 2>&1 | sed -n 's/.*nutcracker-\([^ ]*\).*/\1/p' | head -1)"
  printf 'cpus\t%s\n' "$(nproc)"
  printf 'load\t%s\n' "$LOAD_AT_START"
  printf 'rounds\t%s\nduration\t%s\nhold_ms\t%s\nquick\t%s\n' "$ROUNDS" "$DURATION" "$HOLD_MS" "$QUICK"
  printf 'poll_clients\t%s\npoll_sleep_us\t%s\nspin_clients\t%s\n' "$POLL_CLIENTS" "$POLL_SLEEP_US" "$SPIN_CLIENTS"
  printf 'try_clients\t%s\ntry_every_ms\t%s\n' "$TRY_CLIENTS" "$TRY_EVERY_MS"
  printf 'clk_tck\t%s\n' "$CLK_TCK"
  for k in probe_interval_ms park_ms spin_window_ms; do
    printf '%s\t%s\n' "$k" "$(retry_default "$k")"
  done
} >>"$META"

cp "$RUNS" "$RESULTS/storm-latest.jsonl"
cp "$META" "$RESULTS/storm-latest.meta.tsv"
echo
python3 "$HELPER" report "$RUNS" "$META" "$RESULTS/storm-latest.md"
echo
log "written: bench/results/storm-latest.md (summary), bench/results/storm-latest.jsonl (per run),"
log "  bench/results/storm-latest.meta.tsv (the rest of the report's input)"
