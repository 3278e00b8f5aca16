#!/usr/bin/env bash
# The storm for the connections apps really have. One lock key, spinning
# clients with no sleep between attempts, the winner holding HOLD_MS and
# releasing with DEL, in four shapes, each straight on Redis and through
# lockgate (default config), alternating in one run:
#   own       redis-py, THREADS threads each on its own connection
#   pool      redis-py, THREADS threads on one BlockingConnectionPool of
#             POOL connections (LIFO: the winner's connection goes straight
#             back to the next spinning thread, its DEL on whichever
#             connection it gets then)
#   mux       ioredis, TASKS async tasks on one connection, the holder's
#             DEL on it too (as Lettuce, StackExchange.Redis, node-redis)
#   mux-gone  ioredis, GONE_TASKS tasks on one connection spinning on a lock
#             whose holder is gone (set on Redis before the run, for longer
#             than it), and one task GETting plain data on the same
#             connection every READER_MS, its reply latency timed
# The drivers are bench/shapes_load.py and bench/shapes_load.js.
#
# Each shape runs as one app pod, and with INSTANCES="1 2 10" as 2 and 10
# pods at once, each with the same clients: through lockgate every pod has
# its own lockgate (one per pod, as deployed), all in front of one Redis;
# straight, the same pods on that Redis.
#
#   bench/shapes.sh            full run (4 shapes x 2 targets x ROUNDS x DURATION s)
#   QUICK=1 bench/shapes.sh    2 s runs, one round
#
# Environment (all optional):
#   DURATION=4  ROUNDS=2  HOLD_MS=2000  THREADS=20  POOL=4  TASKS=50
#   GONE_TASKS=20  READER_MS=5  SHAPES="own pool mux mux-gone"  INSTANCES=1
#   LOCKGATE_BIN=...   a prebuilt lockgate (e.g. an older commit's, to compare)
#   LOCKGATE_ARGS=...  extra lockgate arguments
#
# Per run, on the target's own Redis (reset before): INFO commandstats (the
# storm's Redis time: SETNX/DEL straight, the script calls through lockgate,
# whose own time includes the commands they run; and every command Redis
# ran, those inside scripts counted too) and redis-server's CPU
# (schedstat); through lockgate its
# LOCKGATE STATS before and after (attempts, attempts sent to Redis). The
# markdown summary, with the run's load average, is printed and written to
# bench/results/shapes-latest.md (raw runs: shapes-latest.jsonl). Only
# ratios within one run count on this small shared box.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
export LC_ALL=C

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
RESULTS="$BENCH_DIR/results"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then
  DURATION=${DURATION:-2}
  ROUNDS=${ROUNDS:-1}
else
  DURATION=${DURATION:-4}
  ROUNDS=${ROUNDS:-2}
fi
HOLD_MS=${HOLD_MS:-2000}
THREADS=${THREADS:-20}
POOL=${POOL:-4}
TASKS=${TASKS:-50}
GONE_TASKS=${GONE_TASKS:-20}
READER_MS=${READER_MS:-5}
SHAPES=${SHAPES:-"own pool mux mux-gone"}
INSTANCES=${INSTANCES:-1}
RUN_TIMEOUT=$((${DURATION%.*} + 60))

LOG_TAG=shapes
# shellcheck source=scripts/common.sh
. "$BENCH_DIR/../scripts/common.sh"
install_missing "redis-server redis-tools" redis-server redis-cli
have node || die "node not found (scripts/setup.sh installs it and ioredis in tests/js)"
python3 -c 'import redis' 2>/dev/null || die "redis-py not found (scripts/setup.sh installs it)"

if [[ -z ${LOCKGATE_BIN:-} ]]; then
  log "building (cargo build --release --bin lockgate)"
  (cd "$REPO" && cargo build --release --quiet --bin lockgate) || die "cargo build --release failed"
fi
LOCKGATE_BIN=${LOCKGATE_BIN:-$REPO/target/release/lockgate}
[[ -x $LOCKGATE_BIN ]] || die "LOCKGATE_BIN=$LOCKGATE_BIN is not executable"

# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"
bench_start shapes

MOST=0
for n in $INSTANCES; do ((n > MOST)) && MOST=$n; done
((MOST >= 1)) || die "INSTANCES=$INSTANCES: at least one instance"
mapfile -t PORTS < <(python3 "$BENCH_DIR/passthrough_report.py" ports $((2 + MOST)))
P_DIRECT=${PORTS[0]} P_BEHIND=${PORTS[1]}
P_LOCKGATES=("${PORTS[@]:2}")

start_redis() {
  local name=$1 port=$2
  mkdir -p "$TMP/$name"
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
    --protected-mode no --daemonize no --dir "$TMP/$name" --logfile "$TMP/$name.log" &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
  wait_ready "redis-server ($name)" "$LAST_PID" "$port" "$TMP/$name.log"
}
start_redis redis-direct "$P_DIRECT"
DIRECT_PID=$LAST_PID
start_redis redis-lockgate "$P_BEHIND"
BEHIND_PID=$LAST_PID

for ((i = 0; i < MOST; i++)); do
  port=${P_LOCKGATES[$i]}
  # shellcheck disable=SC2086
  RUST_LOG=warn "$LOCKGATE_BIN" --listen "127.0.0.1:$port" --upstream "127.0.0.1:$P_BEHIND" \
    --admin-listen "" ${LOCKGATE_ARGS:-} >"$TMP/lockgate-$i.log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
  wait_ready "lockgate $i" "$LAST_PID" "$port" "$TMP/lockgate-$i.log"
done

declare -A REDIS_PORT_OF=([direct]=$P_DIRECT [lockgate]=$P_BEHIND)
declare -A REDIS_PID_OF=([direct]=$DIRECT_PID [lockgate]=$BEHIND_PID)
rcli() { redis-cli -h 127.0.0.1 -p "$@"; }
# The port pod I talks to: its lockgate, or Redis itself.
pod_port() { if [[ $1 == lockgate ]]; then echo "${P_LOCKGATES[$2]}"; else echo "$P_DIRECT"; fi; }

RUNS="$TMP/runs.jsonl"
: >"$RUNS"
mkdir -p "$RESULTS"

# The driver command of pod I for SHAPE against PORT (Redis behind: RPORT).
driver() {
  local shape=$1 port=$2 rport=$3
  case $shape in
  own | pool)
    echo python3 "$BENCH_DIR/shapes_load.py" --shape "$shape" --port "$port" --threads "$THREADS" \
      --pool "$POOL" --hold-ms "$HOLD_MS" --duration-s "$DURATION"
    ;;
  mux)
    echo node "$BENCH_DIR/shapes_load.js" --port "$port" --tasks "$TASKS" --hold-ms "$HOLD_MS" \
      --duration-s "$DURATION"
    ;;
  mux-gone)
    echo node "$BENCH_DIR/shapes_load.js" --port "$port" --tasks "$GONE_TASKS" --gone \
      --seed-port "$rport" --reader-every-ms "$READER_MS" --duration-s "$DURATION"
    ;;
  *) die "unknown shape $shape" ;;
  esac
}

run_one() {
  local round=$1 shape=$2 target=$3 pods=$4
  local rport=${REDIS_PORT_OF[$target]} rpid=${REDIS_PID_OF[$target]}
  local out="$TMP/r$round-$shape-$target-$pods" c0 c1 t0 t1 i port failed=0
  local running=()
  [[ $(rcli "$rport" flushall) == OK ]] || die "FLUSHALL on :$rport failed"
  [[ $(rcli "$rport" config resetstat) == OK ]] || die "CONFIG RESETSTAT on :$rport failed"
  : >"$out.lg0"
  : >"$out.lg1"
  if [[ $target == lockgate ]]; then
    for ((i = 0; i < pods; i++)); do rcli "$(pod_port lockgate "$i")" lockgate stats >>"$out.lg0"; done
  fi
  c0=$(cpu_ns "$rpid")
  t0=$(now_ns)
  for ((i = 0; i < pods; i++)); do
    port=$(pod_port "$target" "$i")
    # shellcheck disable=SC2046
    timeout "$RUN_TIMEOUT" $(driver "$shape" "$port" "$rport") >"$out.$i.json" 2>"$out.$i.err" &
    running+=($!)
  done
  for i in "${!running[@]}"; do
    if ! wait "${running[$i]}"; then
      cat "$out.$i.err" >&2
      failed=1
    fi
  done
  ((failed == 0)) || die "$shape against $target ($pods pods) failed or timed out"
  t1=$(now_ns)
  c1=$(cpu_ns "$rpid")
  rcli "$rport" info commandstats >"$out.cmdstats"
  if [[ $target == lockgate ]]; then
    for ((i = 0; i < pods; i++)); do rcli "$(pod_port lockgate "$i")" lockgate stats >>"$out.lg1"; done
  fi
  python3 "$BENCH_DIR/shapes_report.py" record "$RUNS" "$out" round="$round" shape="$shape" \
    target="$target" pods="$pods" redis_ns=$((c1 - c0)) wall_ns=$((t1 - t0))
}

log "redis :$P_DIRECT (direct), :$P_BEHIND behind lockgate :${P_LOCKGATES[*]}; ${DURATION}s runs, $ROUNDS round(s), hold ${HOLD_MS} ms, pods: $INSTANCES"
LOAD_AT_START=$(cut -d' ' -f1-3 /proc/loadavg)
read -r -a SHAPE_LIST <<<"$SHAPES"
read -r -a POD_LIST <<<"$INSTANCES"
for ((round = 1; round <= ROUNDS; round++)); do
  for pods in "${POD_LIST[@]}"; do
    for shape in "${SHAPE_LIST[@]}"; do
      # Alternate which target goes first, from shape to shape and round to round.
      if (((round + ${#shape} + pods) % 2)); then order=(direct lockgate); else order=(lockgate direct); fi
      for target in "${order[@]}"; do run_one "$round" "$shape" "$target" "$pods"; done
    done
  done
done
LOAD_AT_END=$(cut -d' ' -f1-3 /proc/loadavg)

rev=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(git -C "$REPO" status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null) ]]; then
  rev="$rev+dirty"
fi
META="$TMP/meta.tsv"
{
  printf 'date\t%s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
  printf 'lockgate\t%s\n' "$("$LOCKGATE_BIN" --version | awk '{print $2}') @ $rev ($LOCKGATE_BIN)"
  printf 'redis\t%s\n' "$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')"
  printf 'load\t%s → %s\n' "$LOAD_AT_START" "$LOAD_AT_END"
  printf 'setup\t%s s runs, %s round(s), hold %s ms, %s threads (pool of %s), %s tasks (%s on the gone holder, reader every %s ms)\n' \
    "$DURATION" "$ROUNDS" "$HOLD_MS" "$THREADS" "$POOL" "$TASKS" "$GONE_TASKS" "$READER_MS"
} >"$META"
cp "$RUNS" "$RESULTS/shapes-latest.jsonl"
echo
python3 "$BENCH_DIR/shapes_report.py" report "$RUNS" "$META" "$RESULTS/shapes-latest.md"
