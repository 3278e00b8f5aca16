#!/usr/bin/env bash
# Soak: lockgate under steady mixed traffic for a set time, with one lock
# master restarting every few minutes; fails if its memory, fds or tasks
# grow after the warm-up.
#
#   scripts/soak.sh [--minutes N] [--warmup-minutes W] [--restart-minutes R]
#                   [--out DIR]
#
#   --minutes N          how long the traffic runs (default 30)
#   --warmup-minutes W   samples before W are not judged (default 5)
#   --restart-minutes R  a lock master is restarted every R minutes, in turn
#                        (default 3; 0: never)
#   --out DIR            samples.csv, summary.md, events.log, lockgate.log and
#                        the driver's errors.json (default
#                        bench/results/soak-latest)
#   (minutes may be fractions: --minutes 0.5)
#
# Environment: LOCKGATE_BIN=... uses this binary instead of `cargo build
# --release`.
#
# Processes, all on free loopback ports and stopped by PID at exit: a
# primary redis-server and 3 lock masters (no persistence), lockgate in
# front (--lock-masters, admin listener for /metrics) and the load driver
# bench/soak_load.py (redis-py): pass-through GET/SET/INCR and pipelines,
# legacy SETNX + EXPIRE + DEL locks from 4 workers on 3 shared keys, SET NX
# PX + compare-and-delete EVAL, pub/sub, BLPOP fed by LPUSH, and connection
# churn. The driver checks every reply and counts errors by kind without
# stopping (a master restart may cost some lock errors: expected). The
# masters keep lockgate's default rejoin delay (the lease, 30 s): a
# restarted master sits out that long, so restarts closer than that leave
# one master of 3 and lose the quorum (lock errors, and releases answering
# 0, counted as lost:<worker>). Traffic starts once lockgate grants a lock.
#
# Every 5 s a row goes to samples.csv: elapsed_s, lockgate's RSS (kB,
# VmRSS), open fds, tasks (lockgate_tasks_alive), client connections
# (lockgate_connections_active), the primary's connected_clients, the
# driver's ops and errors so far. The verdict compares the median of the
# first 20 % of the samples after the warm-up with the median of the last
# 20 %: it fails (exit 1) if RSS grew more than 10 % + 2 MB, or fds or
# tasks by more than 10.
set -euo pipefail

export LC_ALL=C
LOG_TAG=soak
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,40s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

MINUTES=30
WARMUP=5
RESTART=3
OUT="$LOCKGATE_ROOT/bench/results/soak-latest"
while [ $# -gt 0 ]; do
	case "$1" in
	--minutes) MINUTES=${2:?--minutes needs a value} && shift ;;
	--warmup-minutes) WARMUP=${2:?--warmup-minutes needs a value} && shift ;;
	--restart-minutes) RESTART=${2:?--restart-minutes needs a value} && shift ;;
	--out) OUT=${2:?--out needs a value} && shift ;;
	-h | --help)
		usage
		exit 0
		;;
	*)
		usage >&2
		die "unknown argument: $1"
		;;
	esac
	shift
done
# seconds N — whole seconds in N minutes (N may be a fraction).
seconds() {
	awk -v m="$1" 'BEGIN { if (m !~ /^[0-9]*\.?[0-9]+$/) exit 1; printf "%d\n", m * 60 }' ||
		die "not a number of minutes: $1"
}
DURATION=$(seconds "$MINUTES")
WARMUP_S=$(seconds "$WARMUP")
RESTART_S=$(seconds "$RESTART")
[ "$DURATION" -gt "$WARMUP_S" ] || die "--minutes must be more than --warmup-minutes"
SAMPLE_S=5

# --- tools and binary -----------------------------------------------------------
ensure_redis
have curl || apt_install curl ca-certificates
have python3 || die "python3 not found"
python3 -c 'import redis' 2>/dev/null ||
	die "redis-py missing: python3 -m pip install -r $LOCKGATE_ROOT/tests/py/requirements.txt (or scripts/setup.sh)"
if [ -n "${LOCKGATE_BIN:-}" ]; then
	[ -x "$LOCKGATE_BIN" ] || die "LOCKGATE_BIN=$LOCKGATE_BIN is not executable"
else
	ensure_cargo
	log "building lockgate (cargo build --release)"
	(cd "$LOCKGATE_ROOT" && cargo build --release --quiet) || die "cargo build --release failed"
	LOCKGATE_BIN="$(cargo_target_dir)/release/lockgate"
fi
DRIVER="$LOCKGATE_ROOT/bench/soak_load.py"

# --- processes: everything started here is stopped by PID at exit ---------------
# shellcheck source=bench/lib.sh
. "$LOCKGATE_ROOT/bench/lib.sh"
bench_start soak
mkdir -p "$OUT"
rm -f "$OUT/samples.csv" "$OUT/summary.md" "$OUT/events.log" "$OUT/errors.json" "$OUT/lockgate.log"

# forget_pid PID — drops a stopped process from the list cleanup stops.
forget_pid() {
	local keep=() p
	for p in "${PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
	PIDS=("${keep[@]}")
}

# start_redis NAME PORT — sets STARTED_PID.
start_redis() {
	redis-server --bind 127.0.0.1 --port "$2" --save '' --appendonly no \
		--protected-mode no --daemonize no --dir "$TMP" --logfile "$TMP/$1.log" &
	STARTED_PID=$!
	PIDS+=("$STARTED_PID")
	wait_ready "redis-server $1" "$STARTED_PID" "$2" "$TMP/$1.log"
}

P_PRIMARY=$(pick_free_port)
start_redis primary "$P_PRIMARY"
P_MASTERS=() MASTER_PIDS=()
for i in 0 1 2; do
	P_MASTERS[i]=$(pick_free_port)
	start_redis "master$i" "${P_MASTERS[i]}"
	MASTER_PIDS[i]=$STARTED_PID
done
P_LOCKGATE=$(pick_free_port)
P_ADMIN=$(pick_free_port)
printf '[locks]\ninstance_id = "soak"\n' >"$TMP/lockgate.toml"
RUST_LOG=warn "$LOCKGATE_BIN" --config "$TMP/lockgate.toml" \
	--listen "127.0.0.1:$P_LOCKGATE" --upstream "127.0.0.1:$P_PRIMARY" \
	--admin-listen "127.0.0.1:$P_ADMIN" \
	--lock-masters "127.0.0.1:${P_MASTERS[0]},127.0.0.1:${P_MASTERS[1]},127.0.0.1:${P_MASTERS[2]}" \
	>"$OUT/lockgate.log" 2>&1 &
LG_PID=$!
PIDS+=("$LG_PID")
wait_ready lockgate "$LG_PID" "$P_LOCKGATE" "$OUT/lockgate.log"
log "primary :$P_PRIMARY  masters :${P_MASTERS[*]}  lockgate :$P_LOCKGATE admin :$P_ADMIN (pid $LG_PID)"
log "${MINUTES} min, warm-up ${WARMUP} min, a master restart every ${RESTART} min; out $OUT"

log "waiting until lockgate grants a lock (the masters sit out first)"
python3 "$DRIVER" lockable "$P_LOCKGATE" || die "lockgate grants no lock: see $OUT/lockgate.log"

python3 "$DRIVER" run "$P_LOCKGATE" "$DURATION" "$TMP/status" "$OUT/errors.json" \
	2>"$OUT/driver.log" &
DRIVER_PID=$!
PIDS+=("$DRIVER_PID")

# --- sampling -------------------------------------------------------------------
# metric NAME — an unlabelled sample of lockgate's /metrics (empty if none).
metric() {
	awk -v n="$1" '$1 == n { print $2; exit }' "$TMP/metrics"
}
sample() {
	local rss fds ops=0 errs=0 clients
	rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$LG_PID/status" 2>/dev/null) ||
		die "lockgate (pid $LG_PID) is gone: see $OUT/lockgate.log"
	fds=$(find "/proc/$LG_PID/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
	curl -sf --max-time 5 "http://127.0.0.1:$P_ADMIN/metrics" >"$TMP/metrics" || : >"$TMP/metrics"
	clients=$(redis-cli -p "$P_PRIMARY" info clients 2>/dev/null |
		awk -F: '/^connected_clients:/ { sub("\r", "", $2); print $2 }')
	[ -f "$TMP/status" ] && read -r ops errs <"$TMP/status"
	printf '%d,%s,%s,%s,%s,%s,%s,%s\n' "$1" "$rss" "$fds" "$(metric lockgate_tasks_alive)" \
		"$(metric lockgate_connections_active)" "${clients:-}" "$ops" "$errs" >>"$OUT/samples.csv"
}

# restart_master I — stops lock master I (SIGTERM, by PID) and starts it
# again on the same port.
restart_master() {
	local i=$1 pid=${MASTER_PIDS[$1]}
	printf '%d master%d (:%s) restarted\n' "$2" "$i" "${P_MASTERS[i]}" >>"$OUT/events.log"
	log "restarting master$i (:${P_MASTERS[i]}, pid $pid) at ${2}s"
	kill -TERM "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
	forget_pid "$pid"
	start_redis "master$i" "${P_MASTERS[i]}"
	MASTER_PIDS[i]=$STARTED_PID
}

echo "elapsed_s,rss_kb,fds,tasks,client_conns,redis_clients,ops,errors" >"$OUT/samples.csv"
START=$SECONDS
NEXT_SAMPLE=0
NEXT_RESTART=$RESTART_S
TURN=0
while kill -0 "$DRIVER_PID" 2>/dev/null; do
	now=$((SECONDS - START))
	# (not once the driver's time is up: its connections are closing)
	if [ "$now" -ge "$NEXT_SAMPLE" ] && [ "$now" -lt "$DURATION" ]; then
		sample "$now"
		NEXT_SAMPLE=$((NEXT_SAMPLE + SAMPLE_S))
	fi
	if [ "$RESTART_S" -gt 0 ] && [ "$now" -ge "$NEXT_RESTART" ] && [ "$now" -lt "$DURATION" ]; then
		restart_master $((TURN % 3)) "$now"
		TURN=$((TURN + 1))
		NEXT_RESTART=$((NEXT_RESTART + RESTART_S))
	fi
	kill -0 "$LG_PID" 2>/dev/null || die "lockgate exited during the soak: see $OUT/lockgate.log"
	sleep 1
done
wait "$DRIVER_PID" || die "the load driver failed: see $OUT/driver.log"
forget_pid "$DRIVER_PID"
[ -s "$OUT/errors.json" ] || die "the load driver wrote no $OUT/errors.json: see $OUT/driver.log"

# --- verdict --------------------------------------------------------------------
echo
status=0
python3 "$DRIVER" report "$OUT/samples.csv" "$WARMUP_S" "$OUT/errors.json" "$OUT/summary.md" || status=$?
log "samples in $OUT/samples.csv, summary in $OUT/summary.md"
exit "$status"
