#!/usr/bin/env bash
# Memory per idle client connection: lockgate against HAProxy in mode tcp
# (a 1:1 byte copier), measured the same way.
#
#   bench/idle_memory.sh            N=2000 connections per proxy
#   N=500 bench/idle_memory.sh
#
# Environment (all optional):
#   N=2000            idle client connections per proxy
#   LOCKGATE_BIN=...  use this binary instead of `cargo build --release`
#
# For each proxy in turn, in front of the same redis-server: one client
# opens N connections, sends PING on each and reads +PONG (so the proxy's
# upstream connection exists), then holds them all idle. The proxy's RSS
# (VmRSS) is read before the first connection and 2 s after the last PONG;
# per connection = (after - before) / N. Redis's connected_clients before
# and after shows the upstream side (one upstream connection per client
# for both proxies). The RSS after the client closed everything is shown
# too (memory kept by the allocator), and the growth of the virtual size
# (VmSize) per connection. HAProxy runs with its defaults (one thread per
# core); lockgate with its (one event loop), and once more as lockgate-4k
# with 4 KiB read buffers (proxy.read_chunk_bytes; default 64 KiB) to show
# what the buffers take.
#
# The machine's fd limit bounds N: the client holds N fds, each proxy 2N,
# Redis N (`ulimit -n`). The table also goes to
# bench/results/idle-memory-latest.md.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
export LC_ALL=C

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
RESULTS="$BENCH_DIR/results"
N=${N:-2000}

LOG_TAG=idle-memory
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"

[[ $N =~ ^[1-9][0-9]*$ ]] || die "N=$N is not a positive number"
need=$((2 * N + 100))
[[ $(ulimit -n) == unlimited || $(ulimit -n) -ge $need ]] ||
  die "N=$N needs about $need fds per process; ulimit -n is $(ulimit -n)"

install_missing "redis-server redis-tools haproxy" redis-server redis-cli haproxy
have python3 || die "python3 not found"

if [[ -n ${LOCKGATE_BIN:-} ]]; then
  [[ -x $LOCKGATE_BIN ]] || die "LOCKGATE_BIN=$LOCKGATE_BIN is not executable"
else
  ensure_cargo
  log "building lockgate (cargo build --release)"
  (cd "$REPO" && cargo build --release --quiet) || die "cargo build --release failed"
  LOCKGATE_BIN="$(cargo_target_dir)/release/lockgate"
fi

# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"
bench_start idle-memory

P_REDIS=$(pick_free_port)
redis-server --bind 127.0.0.1 --port "$P_REDIS" --save '' --appendonly no \
  --protected-mode no --daemonize no --maxclients $((N + 1000)) \
  --dir "$TMP" --logfile "$TMP/redis.log" &
REDIS_PID=$!
PIDS+=("$REDIS_PID")
wait_ready redis-server "$REDIS_PID" "$P_REDIS" "$TMP/redis.log"

# start_lockgate NAME [TOML_LINE]: lockgate in front of Redis on a free
# port, room for N clients, with one more [proxy] setting if given; sets
# LG_PORT and LG_PID.
start_lockgate() {
  local name=$1 extra=${2:-}
  LG_PORT=$(pick_free_port)
  printf '[proxy]\nmax_clients = %d\n%s\n' $((N + 1000)) "$extra" >"$TMP/$name.toml"
  RUST_LOG=warn "$LOCKGATE_BIN" --config "$TMP/$name.toml" --admin-listen "" \
    --listen "127.0.0.1:$LG_PORT" --upstream "127.0.0.1:$P_REDIS" >"$TMP/$name.log" 2>&1 &
  LG_PID=$!
  PIDS+=("$LG_PID")
  wait_ready "$name" "$LG_PID" "$LG_PORT" "$TMP/$name.log"
}

start_lockgate lockgate
P_LOCKGATE=$LG_PORT LOCKGATE_PID=$LG_PID
# The same lockgate with 4 KiB read buffers instead of 64 KiB, to show how
# much of its per-connection memory is the buffers.
start_lockgate lockgate-4k "read_chunk_bytes = 4096"
P_LOCKGATE_4K=$LG_PORT LOCKGATE_4K_PID=$LG_PID

P_HAPROXY=$(pick_free_port)
cat >"$TMP/haproxy.cfg" <<EOF
global
  maxconn $((N + 1000))
defaults
  mode tcp
  maxconn $((N + 1000))
  timeout connect 5s
  timeout client 1h
  timeout server 1h
frontend redis_in
  bind 127.0.0.1:$P_HAPROXY
  default_backend redis
backend redis
  server r1 127.0.0.1:$P_REDIS maxconn $((N + 1000))
EOF
haproxy -c -q -f "$TMP/haproxy.cfg" || die "haproxy rejects $TMP/haproxy.cfg"
haproxy -db -f "$TMP/haproxy.cfg" >"$TMP/haproxy.log" 2>&1 &
HAPROXY_PID=$!
PIDS+=("$HAPROXY_PID")
wait_ready haproxy "$HAPROXY_PID" "$P_HAPROXY" "$TMP/haproxy.log"

rss_kb() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }
vsz_kb() { awk '/^VmSize:/ { print $2 }' "/proc/$1/status"; }
redis_clients() {
  redis-cli -p "$P_REDIS" info clients | awk -F: '/^connected_clients:/ { sub("\r", "", $2); print $2 }'
}

# measure NAME PORT PID — one row: RSS before / with N idle / after closing.
ROWS=()
measure() {
  local name=$1 port=$2 pid=$3 before after closed c0 c1 holder i v0 v1
  sleep 1
  before=$(rss_kb "$pid")
  v0=$(vsz_kb "$pid")
  c0=$(redis_clients)
  rm -f "$TMP/ready"
  # The holder keeps its connections until its stdin (a FIFO held open
  # here on fd 8) closes.
  mkfifo "$TMP/hold"
  python3 "$BENCH_DIR/soak_load.py" idle "$port" "$N" "$TMP/ready" <"$TMP/hold" &
  holder=$!
  PIDS+=("$holder")
  exec 8>"$TMP/hold"
  for ((i = 0; i < 1200; i++)); do
    [[ -s $TMP/ready ]] && break
    kill -0 "$holder" 2>/dev/null || die "$name: the client holding $N connections failed"
    sleep 0.1
  done
  [[ -s $TMP/ready ]] || die "$name: $N connections not open after 120 s"
  sleep 2
  after=$(rss_kb "$pid")
  v1=$(vsz_kb "$pid")
  c1=$(redis_clients)
  exec 8>&-
  wait "$holder" || die "$name: the client holding the connections failed"
  local keep=() p
  for p in "${PIDS[@]}"; do [[ $p == "$holder" ]] || keep+=("$p"); done
  PIDS=("${keep[@]}")
  rm -f "$TMP/hold"
  sleep 2
  closed=$(rss_kb "$pid")
  ROWS+=("$name $before $after $closed $c0 $c1 $((v1 - v0))")
  log "$name: RSS ${before} kB -> ${after} kB with $N idle -> ${closed} kB after close; redis clients $c0 -> $c1"
}

measure lockgate "$P_LOCKGATE" "$LOCKGATE_PID"
measure haproxy "$P_HAPROXY" "$HAPROXY_PID"
measure lockgate-4k "$P_LOCKGATE_4K" "$LOCKGATE_4K_PID"

mkdir -p "$RESULTS"
{
  echo "## Memory per idle client connection ($(date -u '+%Y-%m-%d %H:%M UTC'), N=$N, $(nproc) cpus)"
  echo
  echo "| proxy | RSS before (kB) | RSS with N idle (kB) | RSS per connection (KiB) | virtual per connection (KiB) | RSS after close (kB) | Redis clients before → with N |"
  echo "|---|---:|---:|---:|---:|---:|---|"
  for row in "${ROWS[@]}"; do
    read -r name before after closed c0 c1 dv <<<"$row"
    awk -v n="$name" -v b="$before" -v a="$after" -v c="$closed" -v c0="$c0" -v c1="$c1" -v dv="$dv" -v N="$N" \
      'BEGIN { printf "| %s | %d | %d | %.1f | %.1f | %d | %d → %d |\n", n, b, a, (a - b) / N, dv / N, c, c0, c1 }'
  done
  echo
  echo "lockgate-4k: lockgate with proxy.read_chunk_bytes = 4096 (default 65536)."
  read -r _ lb la _ _ _ _ <<<"${ROWS[0]}"
  read -r _ hb ha _ _ _ _ <<<"${ROWS[1]}"
  awk -v l=$((la - lb)) -v h=$((ha - hb)) \
    'BEGIN { if (h > 0) printf "\nlockgate / HAProxy per idle connection: %.1f×\n", l / h;
             else print "\nHAProxy grew by nothing measurable: no ratio" }'
} | tee "$RESULTS/idle-memory-latest.md"
