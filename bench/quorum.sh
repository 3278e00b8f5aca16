#!/usr/bin/env bash
# Lock latency on the Redlock quorum: what one client's acquire + release
# pair costs through lockgate with 3 and 5 lock masters, compared with
# lockgate in front of one Redis (quorum off) and with a client-side Redlock
# library (pottery) on the same masters directly.
#
#   bench/quorum.sh               full run (~60-90 s on 2 shared cores)
#   QUICK=1 bench/quorum.sh       smoke test: 1 round, few pairs
#
# Environment (all optional):
#   ROUNDS=6          rounds; the rows alternate within each round and the
#                     first row rotates from round to round
#   PAIRS=750         timed pairs per row and round (after 50 untimed)
#   LOCKGATE_BIN=...  use this binary instead of `cargo build --release`
#
# One client does sequential `SET lock:q:<i> <v> NX PX 10000` + `DEL` pairs
# (redis-py, RESP2) and times each pair; the table gives p50/p99 µs per row
# and their ratios to the first row (one Redis through lockgate), and the
# load average at the start. It also goes to bench/results/quorum-latest.md.
#
# Processes: one primary and 5 masters (redis-server, no persistence), and
# three lockgates: quorum off (upstream = the primary), the first 3 masters,
# all 5 masters. A quorum of 1 master is not a row: lockgate refuses fewer
# than 3 (`locks.quorum.masters`). The lockgates run with
# rejoin_delay_ms = 100, else they would make the masters, started moments
# before, sit out for the default lease first; the script waits until each
# grants a lock. The rows share masters, so each uses keys of its own, and
# while a row runs the other lockgates are paused (SIGSTOP; SIGCONT after),
# else their release-announcement subscriptions would wake on its releases.
set -euo pipefail

export LC_ALL=C

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
HELPER="$BENCH_DIR/quorum_client.py"
RESULTS="$BENCH_DIR/results"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then
  ROUNDS=${ROUNDS:-1}
  PAIRS=${PAIRS:-200}
else
  ROUNDS=${ROUNDS:-6}
  PAIRS=${PAIRS:-750}
fi

LOG_TAG=quorum
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"

# --- tools --------------------------------------------------------------------
install_missing "redis-server redis-tools" redis-server redis-cli
have python3 || die "python3 not found"
python3 -c 'import redis' 2>/dev/null ||
  die "redis-py missing: python3 -m pip install -r $REPO/tests/py/requirements.txt"
python3 -c 'import pottery' 2>/dev/null ||
  die "pottery missing: python3 -m pip install -r $REPO/tests/py/requirements.txt"

# --- lockgate -----------------------------------------------------------------
if [[ -n ${LOCKGATE_BIN:-} ]]; then
  [[ -x $LOCKGATE_BIN ]] || die "LOCKGATE_BIN=$LOCKGATE_BIN is not executable"
else
  log "building lockgate (cargo build --release)"
  (cd "$REPO" && cargo build --release --quiet) || die "cargo build --release failed"
  LOCKGATE_BIN="$(cargo_target_dir)/release/lockgate"
fi

# --- processes: everything started here is killed by PID at exit -------------
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_start quorum
# A lockgate the client paused (it died mid-row) must resume to take TERM.
resume_lockgates() {
  local pid
  for pid in "${LG_PID[@]}"; do kill -CONT "$pid" 2>/dev/null || true; done
}
declare -A LG_PID=()
trap 'resume_lockgates; cleanup' EXIT

mapfile -t PORTS < <(python3 "$HELPER" ports 9)
[[ ${#PORTS[@]} -eq 9 ]] || die "could not find 9 free loopback ports"
P_PRIMARY=${PORTS[0]}
P_MASTERS=("${PORTS[@]:1:5}")
P_LG_ONE=${PORTS[6]} P_LG_Q3=${PORTS[7]} P_LG_Q5=${PORTS[8]}

# start_redis NAME PORT
start_redis() {
  local name=$1 port=$2 pid
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
    --protected-mode no --daemonize no --dir "$TMP" --logfile "$TMP/$name.log" &
  pid=$!
  PIDS+=("$pid")
  wait_ready "redis-server $name" "$pid" "$port" "$TMP/$name.log"
}

start_redis primary "$P_PRIMARY"
for i in "${!P_MASTERS[@]}"; do start_redis "master$i" "${P_MASTERS[$i]}"; done

# start_lockgate NAME PORT [MASTER_PORT...]
start_lockgate() {
  local name=$1 port=$2 conf="$TMP/$1.toml" pid list="" m
  shift 2
  for m in "$@"; do list+="${list:+, }\"127.0.0.1:$m\""; done
  {
    printf '[locks]\ninstance_id = "bench-%s"\n' "$name"
    if [[ -n $list ]]; then
      printf '[locks.quorum]\nmasters = [%s]\nrejoin_delay_ms = 100\n' "$list"
    fi
  } >"$conf"
  RUST_LOG=warn "$LOCKGATE_BIN" --config "$conf" --admin-listen "" \
    --listen "127.0.0.1:$port" --upstream "127.0.0.1:$P_PRIMARY" >"$TMP/$name.log" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  LG_PID[$name]=$pid
  wait_ready "lockgate $name" "$pid" "$port" "$TMP/$name.log"
  python3 "$HELPER" ready "$port" || { cat "$TMP/$name.log" >&2; die "lockgate $name grants no lock"; }
}

start_lockgate one "$P_LG_ONE"
start_lockgate q3 "$P_LG_Q3" "${P_MASTERS[@]:0:3}"
start_lockgate q5 "$P_LG_Q5" "${P_MASTERS[@]}"
log "primary :$P_PRIMARY  masters :${P_MASTERS[*]}  lockgate one :$P_LG_ONE q3 :$P_LG_Q3 q5 :$P_LG_Q5 (tmp $TMP)"

join_ports() {
  local IFS=,
  printf '%s' "$*"
}

# --- runs ---------------------------------------------------------------------
mkdir -p "$RESULTS"
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
rev=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(git -C "$REPO" status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null) ]]; then
  rev="$rev+dirty"
fi
log "rounds=$ROUNDS pairs=$PAIRS lockgate @ $rev, load $LOAD"
echo
echo "## Lock latency on the quorum ($(date -u '+%Y-%m-%d %H:%M UTC'), lockgate @ $rev, $(nproc) cpus)"
echo
python3 "$HELPER" run "$RESULTS/quorum-latest.md" "$LOAD" "$ROUNDS" "$PAIRS" \
  "lockgate-1-redis=lockgate:$P_LG_ONE:${LG_PID[one]}" \
  "lockgate-q3=lockgate:$P_LG_Q3:${LG_PID[q3]}" \
  "lockgate-q5=lockgate:$P_LG_Q5:${LG_PID[q5]}" \
  "redlock-q3=redlock:$(join_ports "${P_MASTERS[@]:0:3}")" \
  "redlock-q5=redlock:$(join_ports "${P_MASTERS[@]}")"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "quorum of 1 master: not run (lockgate needs at least 3 lock masters)"
