#!/usr/bin/env bash
# Run lockgate in front of a throwaway local Redis.
#
#   scripts/demo.sh            build, start Redis + lockgate, stay in the
#                              foreground until Ctrl-C / SIGTERM
#   scripts/demo.sh --smoke    same start, then PING and SET/GET through
#                              lockgate, print the results, stop, exit 0
#   scripts/demo.sh --cluster  a local 3-primary Redis Cluster instead of
#                              one Redis, lockgate in front of it
#                              (--upstream-cluster; with --smoke: a write
#                              read back on the node that serves its key,
#                              and a lock leased there)
#   scripts/demo.sh --tls      also a TLS listener on 127.0.0.1:6381 (or
#                              LOCKGATE_TLS_PORT), with a throwaway CA and
#                              certificate made by openssl (with --smoke: PING
#                              over TLS too)
#   scripts/demo.sh --storm    the incident: a holder that crashed (took the
#                              lock, never released it), then 50 clients
#                              spinning on SETNX for STORM_SECONDS (60);
#                              prints where to look (the status page's
#                              charts, LOCKGATE LOCKS) and what lockgate
#                              sent to Redis, then stays up (with --smoke:
#                              a 5 s storm, checked to be absorbed, exit)
#
# Environment:
#   LOCKGATE_PORT   port lockgate listens on, on 127.0.0.1 (default 6380)
#   LOCKGATE_ADMIN_PORT  its status page and /metrics (default 9480)
#   STORM_SECONDS   how long --storm spins (default 60)
#   RUST_LOG        lockgate's log filter (default info)
#
# Missing redis-server/redis-tools are installed with apt-get, a missing Rust
# toolchain with rustup. Redis runs without persistence on a free loopback
# port, in a temporary directory that is removed on exit; both processes are
# stopped by PID when the script ends, however it ends (short of SIGKILL).
set -euo pipefail

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,34s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

MODE=run
TLS=0
CLUSTER=0
STORM=0
while [ $# -gt 0 ]; do
	case "$1" in
	--smoke) MODE=smoke ;;
	--storm) STORM=1 ;;
	--cluster) CLUSTER=1 ;;
	--tls) TLS=1 ;;
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

LOCKGATE_PORT="${LOCKGATE_PORT:-6380}"
case "$LOCKGATE_PORT" in
'' | *[!0-9]*) die "LOCKGATE_PORT must be a port number, got '$LOCKGATE_PORT'" ;;
esac
if [ "$LOCKGATE_PORT" -lt 1 ] || [ "$LOCKGATE_PORT" -gt 65535 ]; then
	die "LOCKGATE_PORT out of range: $LOCKGATE_PORT"
fi

cd "$LOCKGATE_ROOT"
CONFIG="$LOCKGATE_ROOT/config/lockgate.toml"
[ -f "$CONFIG" ] || die "missing $CONFIG"

ensure_redis
ensure_cargo

log "cargo build --release"
cargo build --release || die "cargo build --release failed"
LOCKGATE_BIN="$(cargo_target_dir)/release/lockgate"
[ -x "$LOCKGATE_BIN" ] || die "built binary not found at $LOCKGATE_BIN"
"$LOCKGATE_BIN" --config "$CONFIG" --check >/dev/null ||
	die "$CONFIG is not a valid lockgate configuration"

# Something else answering on the port would make the demo (and the smoke
# test) talk to the wrong server: refuse instead.
is_port_free "$LOCKGATE_PORT" ||
	die "127.0.0.1:$LOCKGATE_PORT is already in use; choose another with LOCKGATE_PORT=..."

WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/lockgate-demo.XXXXXX")"
REDIS_PID=""
REDIS_PORT=""
LOCKGATE_PID=""
CLUSTER_PIDS=()
CLUSTER_NODES=()

# stop_pid PID NAME SECONDS — SIGTERM, wait up to SECONDS, then SIGKILL.
stop_pid() {
	local pid="$1" name="$2" secs="$3" i
	if kill -0 "$pid" 2>/dev/null; then
		log "stopping $name (pid $pid)"
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < secs * 10; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		if kill -0 "$pid" 2>/dev/null; then
			warn "$name (pid $pid) ignored SIGTERM for ${secs}s; sending SIGKILL"
			kill -KILL "$pid" 2>/dev/null || true
		fi
	fi
	wait "$pid" 2>/dev/null || true
}

# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
	local rc=$?
	trap - EXIT INT TERM HUP
	# lockgate first, so it can drain replies while Redis is still up.
	# Its shutdown_grace_ms is 5 s by default.
	if [ -n "$LOCKGATE_PID" ]; then stop_pid "$LOCKGATE_PID" lockgate 8; fi
	if [ -n "$REDIS_PID" ]; then stop_pid "$REDIS_PID" redis-server 5; fi
	for pid in ${CLUSTER_PIDS[@]+"${CLUSTER_PIDS[@]}"}; do stop_pid "$pid" redis-server 5; done
	rm -rf "$WORKDIR"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

rcli() { redis-cli -h 127.0.0.1 "$@" </dev/null 2>&1; }

# Redis gets its own session (setsid) so that Ctrl-C in the terminal reaches
# only this script and lockgate: Redis stays up while lockgate drains.
SETSID=()
if have setsid; then SETSID=(setsid); fi

start_redis() {
	local port pid i
	for _ in 1 2 3 4 5; do
		port="$(pick_free_port)"
		${SETSID[@]+"${SETSID[@]}"} redis-server \
			--bind 127.0.0.1 --port "$port" \
			--save '' --appendonly no \
			--dir "$WORKDIR" --logfile "$WORKDIR/redis.log" \
			--daemonize no </dev/null &
		pid=$!
		for ((i = 0; i < 50; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			if [ "$(rcli -p "$port" ping)" = PONG ]; then
				# Make sure the Redis that answers is the one we started.
				REDIS_PID="$(rcli -p "$port" info server |
					sed -n 's/^process_id:\([0-9]*\).*/\1/p')"
				if [ "$REDIS_PID" = "$pid" ]; then
					REDIS_PORT="$port"
					return 0
				fi
				REDIS_PID=""
				break
			fi
			sleep 0.1
		done
		warn "redis-server did not come up on port $port; retrying on another port"
		stop_pid "$pid" redis-server 2
	done
	[ -f "$WORKDIR/redis.log" ] && tail -n 20 "$WORKDIR/redis.log" >&2
	die "could not start redis-server"
}

# start_cluster: three redis-server --cluster-enabled yes nodes on free
# ports (each node's bus port, 10000 higher, free too), joined with
# redis-cli --cluster create, waited for until every node says
# cluster_state:ok.
start_cluster() {
	local i port pid dir j
	for i in 1 2 3; do
		dir="$WORKDIR/node$i"
		mkdir -p "$dir"
		for _ in 1 2 3 4 5; do
			port="$(pick_free_port)"
			is_port_free "$((port + 10000))" || continue
			${SETSID[@]+"${SETSID[@]}"} redis-server \
				--bind 127.0.0.1 --port "$port" --cluster-enabled yes \
				--cluster-config-file "$dir/nodes.conf" --cluster-node-timeout 5000 \
				--save '' --appendonly no --dir "$dir" --logfile "$dir/redis.log" \
				--daemonize no </dev/null &
			pid=$!
			for ((j = 0; j < 50; j++)); do
				[ "$(rcli -p "$port" ping)" = PONG ] && break
				sleep 0.1
			done
			if [ "$(rcli -p "$port" ping)" = PONG ]; then
				CLUSTER_PIDS+=("$pid")
				CLUSTER_NODES+=("127.0.0.1:$port")
				break
			fi
			stop_pid "$pid" redis-server 2
		done
	done
	[ "${#CLUSTER_NODES[@]}" = 3 ] || die "could not start three cluster nodes"
	create_cluster "$WORKDIR/create.log" "${CLUSTER_NODES[@]}"
}

if [ "$CLUSTER" = 1 ]; then
	log "starting a 3-primary Redis Cluster (no persistence) in $WORKDIR"
	start_cluster
	log "cluster nodes ${CLUSTER_NODES[*]}"
else
	log "starting redis-server (no persistence) in $WORKDIR"
	start_redis
	log "redis-server pid $REDIS_PID on 127.0.0.1:$REDIS_PORT"
fi

if [ "$TLS" = 1 ]; then
	LOCKGATE_TLS_PORT="${LOCKGATE_TLS_PORT:-6381}"
	command -v openssl >/dev/null || install_missing openssl openssl
	T="$WORKDIR/tls"
	mkdir -p "$T"
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 7 \
		-subj /CN=lockgate-demo-ca -keyout "$T/ca.key" -out "$T/ca.pem" 2>/dev/null ||
		die "openssl: cannot make the demo CA"
	openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=127.0.0.1 \
		-keyout "$T/server.key" -out "$T/server.csr" 2>/dev/null || die "openssl: cannot make a key"
	printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >"$T/san.ext"
	openssl x509 -req -in "$T/server.csr" -CA "$T/ca.pem" -CAkey "$T/ca.key" \
		-CAcreateserial -days 7 -extfile "$T/san.ext" -out "$T/server.pem" 2>/dev/null ||
		die "openssl: cannot sign the demo certificate"
	# The shipped file with [proxy.tls] filled in.
	awk -v listen="127.0.0.1:$LOCKGATE_TLS_PORT" -v cert="$T/server.pem" -v key="$T/server.key" '
		/^\[/ { in_tls = ($0 == "[proxy.tls]") }
		in_tls && /^listen = / { $0 = "listen = \"" listen "\"" }
		in_tls && /^cert_file = / { $0 = "cert_file = \"" cert "\"" }
		in_tls && /^key_file = / { $0 = "key_file = \"" key "\"" }
		{ print }' "$CONFIG" >"$T/lockgate.toml"
	CONFIG="$T/lockgate.toml"
	"$LOCKGATE_BIN" --config "$CONFIG" --check >/dev/null || die "$CONFIG is not valid"
	log "TLS listener on 127.0.0.1:$LOCKGATE_TLS_PORT, CA $T/ca.pem"
fi

ADMIN_PORT="${LOCKGATE_ADMIN_PORT:-9480}"
LOCKGATE_ARGS=(--config "$CONFIG" --listen "127.0.0.1:$LOCKGATE_PORT" --admin-listen "127.0.0.1:$ADMIN_PORT")
if [ "$CLUSTER" = 1 ]; then
	LOCKGATE_ARGS+=(--upstream-cluster "$(
		IFS=,
		echo "${CLUSTER_NODES[*]}"
	)")
else
	LOCKGATE_ARGS+=(--upstream "127.0.0.1:$REDIS_PORT")
fi
log "starting: $LOCKGATE_BIN ${LOCKGATE_ARGS[*]}"
if [ "$MODE" = smoke ]; then
	"$LOCKGATE_BIN" "${LOCKGATE_ARGS[@]}" </dev/null >"$WORKDIR/lockgate.log" 2>&1 &
else
	"$LOCKGATE_BIN" "${LOCKGATE_ARGS[@]}" </dev/null &
fi
LOCKGATE_PID=$!

lockgate_failed() {
	[ -f "$WORKDIR/lockgate.log" ] && tail -n 40 "$WORKDIR/lockgate.log" >&2
	die "$*"
}

ready=0
for ((i = 0; i < 150; i++)); do
	kill -0 "$LOCKGATE_PID" 2>/dev/null || break
	if [ "$(rcli -p "$LOCKGATE_PORT" ping)" = PONG ]; then
		ready=1
		break
	fi
	sleep 0.1
done
if [ "$ready" -ne 1 ]; then
	kill -0 "$LOCKGATE_PID" 2>/dev/null || {
		st=0
		wait "$LOCKGATE_PID" || st=$?
		LOCKGATE_PID=""
		lockgate_failed "lockgate exited during startup (status $st)"
	}
	lockgate_failed "lockgate did not answer PING on 127.0.0.1:$LOCKGATE_PORT within 15 s"
fi
log "lockgate pid $LOCKGATE_PID on 127.0.0.1:$LOCKGATE_PORT"

# LOCKGATE STATS counter NAME.
stat() {
	rcli -p "$LOCKGATE_PORT" LOCKGATE STATS | awk -v n="$1" 'prev == n { print; exit } { prev = $0 }'
}

# The incident at its shape: the holder took the lock and crashed before
# its EXPIRE (here: SETNX, then the connection closes; lockgate leased the
# bare SETNX), and every session spins on SETNX. Sets STORM_ATTEMPTS (what
# the clients sent) and STORM_SENT (what reached Redis), from LOCKGATE
# STATS.
storm() {
	local secs=$1 lock="lock:demo:storm" taken attempts0 sent0
	taken=$(rcli -p "$LOCKGATE_PORT" setnx "$lock" crashed-holder)
	[ "$taken" = 1 ] || die "the storm's lock is taken already ($taken)"
	printf '
  The storm: a holder took %s and crashed; 50 clients spin on
' "$lock"
	printf '  SETNX %s for %s s. Look at:
' "$lock" "$secs"
	printf '    http://127.0.0.1:%s/   the charts: attempts from clients against those sent to Redis
' "$ADMIN_PORT"
	printf '    redis-cli -p %s LOCKGATE LOCKS     who holds it, who waits
' "$LOCKGATE_PORT"
	printf '    redis-cli -p %s LOCKGATE HOTKEYS   the hottest lock keys

' "$LOCKGATE_PORT"
	attempts0=$(stat lock_attempts)
	sent0=$(stat lock_attempts_sent)
	timeout "$secs" redis-benchmark -h 127.0.0.1 -p "$LOCKGATE_PORT" -c 50 -n 1000000000 -q \
		SETNX "$lock" spinner >/dev/null 2>&1 || true
	STORM_ATTEMPTS=$(($(stat lock_attempts) - attempts0))
	STORM_SENT=$(($(stat lock_attempts_sent) - sent0))
	echo "  storm over: $STORM_ATTEMPTS attempts from clients, $STORM_SENT sent to Redis"
}

if [ "$STORM" = 1 ]; then
	if [ "$MODE" = smoke ]; then
		storm 5
		[ "$STORM_ATTEMPTS" -gt 1000 ] || lockgate_failed "the storm made only $STORM_ATTEMPTS attempts"
		[ $((STORM_SENT * 10)) -lt "$STORM_ATTEMPTS" ] ||
			lockgate_failed "the storm was not absorbed: $STORM_SENT of $STORM_ATTEMPTS attempts reached Redis"
		echo "storm smoke test passed"
		exit 0
	fi
	storm "${STORM_SECONDS:-60}"
fi

if [ "$MODE" = smoke ]; then
	key="demo:smoke:$$:$RANDOM"
	value="hello-from-lockgate-$RANDOM"
	fail=0
	check() { # check WHAT GOT WANT
		if [ "$2" = "$3" ]; then
			printf '  %-50s -> %s\n' "$1" "$2"
		else
			printf '  %-50s -> %s   (expected %s)\n' "$1" "$2" "$3"
			fail=1
		fi
	}
	if [ "$CLUSTER" = 1 ]; then
		# lockgate reads the slot map just after it starts: until then
		# commands are answered CLUSTERDOWN.
		for ((i = 0; i < 100; i++)); do
			[ "$(rcli -p "$LOCKGATE_PORT" set "$key" x)" = OK ] && break
			sleep 0.1
		done
		REDIS_PORT="${CLUSTER_NODES[0]##*:}"
		echo "smoke test through lockgate 127.0.0.1:$LOCKGATE_PORT (cluster ${CLUSTER_NODES[*]}):"
	else
		echo "smoke test through lockgate 127.0.0.1:$LOCKGATE_PORT (redis 127.0.0.1:$REDIS_PORT):"
	fi
	check "redis-cli -p $LOCKGATE_PORT ping" "$(rcli -p "$LOCKGATE_PORT" ping)" PONG
	check "redis-cli -p $LOCKGATE_PORT set $key ..." \
		"$(rcli -p "$LOCKGATE_PORT" set "$key" "$value")" OK
	check "redis-cli -p $LOCKGATE_PORT get $key" \
		"$(rcli -p "$LOCKGATE_PORT" get "$key")" "$value"
	# The write must have landed on the Redis behind lockgate (on a
	# cluster: the node serving the key; redis-cli -c follows MOVED).
	check "redis-cli -c -p $REDIS_PORT get $key (direct)" \
		"$(rcli -c -p "$REDIS_PORT" get "$key")" "$value"
	if [ "$CLUSTER" = 1 ]; then
		# A bare SETNX leased on the node serving it, through one connection.
		lock="lock:demo:$$"
		check "setnx $lock, then pttl > 0 (one connection)" \
			"$(printf 'SETNX %s me\nPTTL %s\n' "$lock" "$lock" | redis-cli -h 127.0.0.1 -p "$LOCKGATE_PORT" 2>&1 |
				awk 'NR == 1 { a = $0 } NR == 2 { print a, ($0 > 0 ? "leased" : "NOT LEASED " $0) }')" "1 leased"
		check "redis-cli -c -p $REDIS_PORT exists $lock (direct)" \
			"$(rcli -c -p "$REDIS_PORT" exists "$lock")" 1
	fi
	check "redis-cli -p $LOCKGATE_PORT del $key" \
		"$(rcli -p "$LOCKGATE_PORT" del "$key")" 1
	if [ "$TLS" = 1 ]; then
		check "redis-cli -p $LOCKGATE_TLS_PORT --tls ping" \
			"$(rcli -p "$LOCKGATE_TLS_PORT" --tls --cacert "$T/ca.pem" ping)" PONG
	fi
	kill -0 "$LOCKGATE_PID" 2>/dev/null || { fail=1 && echo "  lockgate is no longer running"; }
	if [ "$fail" -ne 0 ]; then
		lockgate_failed "smoke test FAILED"
	fi
	echo "smoke test passed"
	exit 0
fi

if [ "$CLUSTER" = 1 ]; then
	BEHIND="a Redis Cluster: ${CLUSTER_NODES[*]} (no persistence)"
else
	BEHIND="redis-server 127.0.0.1:$REDIS_PORT (pid $REDIS_PID, no persistence)"
fi
cat <<EOF

  lockgate is listening on 127.0.0.1:$LOCKGATE_PORT (pid $LOCKGATE_PID)
  in front of $BEHIND

  Status page:    http://127.0.0.1:$ADMIN_PORT/
  Connect with:   redis-cli -p $LOCKGATE_PORT
  Try:            redis-cli -p $LOCKGATE_PORT set greeting hello
                  redis-cli -p $LOCKGATE_PORT get greeting

  Press Ctrl-C to stop both.

EOF
if [ "$TLS" = 1 ]; then
	echo "  TLS:            redis-cli -p $LOCKGATE_TLS_PORT --tls --cacert $T/ca.pem ping"
	echo
fi

st=0
wait "$LOCKGATE_PID" || st=$?
LOCKGATE_PID=""
warn "lockgate exited on its own (status $st)"
exit "$st"
