#!/usr/bin/env bash
# Cluster benchmark: lockgate in front of a 3-primary Redis Cluster against
# redis-benchmark --cluster straight to it (a cluster-aware client: one
# connection per node per client, no proxy), and against lockgate in front
# of one Redis, alternating in one run (only ratios from one run count).
#
#   bench/cluster.sh               full run (3 rounds)
#   QUICK=1 bench/cluster.sh       smoke test: small -n, 1 round
#
# Environment (all optional):
#   ROUNDS=3         rounds; the targets alternate, the first rotating
#   N_P16=2000000    -n for the -c 50 -P 16 runs
#   N_P1=200000      -n for the -c 50 -P 1 runs
#   N_C500=200000    -n for the -c 500 -P 1 runs (connections opened)
#   KEYSPACE=100000  redis-benchmark -r
#   MODE=shared      lockgate's proxy.upstream in front of the cluster
#   LOCKGATE_BIN=... use this binary instead of `cargo build --release`
#
# Per run: ops/s (redis-benchmark --csv), lockgate's CPU seconds and the
# Redis processes' (utime+stime from /proc), and the connections the
# Redis processes accepted during the run (INFO stats). Reported: medians,
# ops/s of lockgate-in-front-of-the-cluster against the direct
# cluster-aware client, lockgate's CPU per command in front of the cluster
# against in front of one Redis, and the run's load average.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/common.sh
source "$REPO/scripts/common.sh"
# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"

QUICK=${QUICK:-0}
ROUNDS=${ROUNDS:-3}
N_P16=${N_P16:-2000000}
N_P1=${N_P1:-200000}
N_C500=${N_C500:-200000}
KEYSPACE=${KEYSPACE:-100000}
MODE=${MODE:-shared}
if [[ $QUICK == 1 ]]; then
  ROUNDS=1 N_P16=200000 N_P1=20000 N_C500=20000
fi
CLK_TCK=$(getconf CLK_TCK)

bench_start cluster
log() { echo "[cluster] $*" >&2; }
if [[ -z ${LOCKGATE_BIN:-} ]]; then
  (cd "$REPO" && cargo build --release --quiet) || die "cargo build failed"
  LOCKGATE_BIN=$REPO/target/release/lockgate
fi

# A free loopback port below 50000: a cluster node's bus listens 10000 higher.
free_port() {
  python3 -c '
import random, socket
while True:
    p = random.randint(20000, 50000)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); s2 = socket.socket(); s2.bind(("127.0.0.1", p + 10000))
        print(p); break
    except OSError:
        pass'
}

# Three cluster nodes and one plain Redis, no persistence.
NODES=()
NODE_PIDS=()
for i in 1 2 3; do
  port=$(free_port)
  mkdir -p "$TMP/node$i"
  (cd "$TMP/node$i" && exec redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --cluster-enabled yes --cluster-node-timeout 5000 >"$TMP/node$i.log" 2>&1) &
  PIDS+=($!)
  NODE_PIDS+=($!)
  NODES+=("127.0.0.1:$port")
  wait_ready "node$i" "$!" "$port" "$TMP/node$i.log"
done
create_cluster "$TMP/create.log" "${NODES[@]}"
P_SINGLE=$(free_port)
(cd "$TMP" && exec redis-server --port "$P_SINGLE" --bind 127.0.0.1 --save "" --appendonly no >"$TMP/single.log" 2>&1) &
PIDS+=($!)
SINGLE_PID=$!
wait_ready redis "$SINGLE_PID" "$P_SINGLE" "$TMP/single.log"

P_LG_CLUSTER=$(free_port)
RUST_LOG=warn "$LOCKGATE_BIN" --listen "127.0.0.1:$P_LG_CLUSTER" --admin-listen "" \
  --upstream-mode "$MODE" --upstream-cluster "${NODES[0]}" >"$TMP/lg-cluster.log" 2>&1 &
PIDS+=($!)
LG_CLUSTER_PID=$!
P_LG_SINGLE=$(free_port)
RUST_LOG=warn "$LOCKGATE_BIN" --listen "127.0.0.1:$P_LG_SINGLE" --admin-listen "" \
  --upstream-mode "$MODE" --upstream "127.0.0.1:$P_SINGLE" >"$TMP/lg-single.log" 2>&1 &
PIDS+=($!)
LG_SINGLE_PID=$!
wait_ready lockgate "$LG_CLUSTER_PID" "$P_LG_CLUSTER" "$TMP/lg-cluster.log"
wait_ready lockgate "$LG_SINGLE_PID" "$P_LG_SINGLE" "$TMP/lg-single.log"
# Every slot reachable through lockgate before measuring.
for ((i = 0; i < 100; i++)); do
  [[ $(redis-cli -p "$P_LG_CLUSTER" set "bench:probe:{a}" 1 2>/dev/null) == OK &&
    $(redis-cli -p "$P_LG_CLUSTER" set "bench:probe:{b}" 1 2>/dev/null) == OK &&
    $(redis-cli -p "$P_LG_CLUSTER" set "bench:probe:{c}" 1 2>/dev/null) == OK ]] && break
  sleep 0.1
done

sum_ticks() {
  local sum=0 pid
  for pid in "$@"; do sum=$((sum + $(cpu_ticks "$pid"))); done
  echo "$sum"
}
# Connections accepted by every Redis process (each INFO's own excluded).
conns() {
  local sum=0 n v
  for n in "${NODES[@]}" "127.0.0.1:$P_SINGLE"; do
    v=$(redis-cli -h 127.0.0.1 -p "${n##*:}" INFO stats | tr -d '\r' | sed -n 's/^total_connections_received://p')
    sum=$((sum + v - 1))
  done
  echo "$sum"
}

TSV=$TMP/runs.tsv
printf 'round\tworkload\ttarget\tn\trps\tproxy_cpu_s\tredis_cpu_s\tconns\n' >"$TSV"
# name, test, clients, pipeline, -n, keyspace (-r; 0: one key, so every
# command goes to one node: what lockgate's cluster path costs without
# spreading a pipeline over three nodes).
WORKLOADS=(
  "set_p16 set 50 16 $N_P16 $KEYSPACE"
  "get_p16 get 50 16 $N_P16 $KEYSPACE"
  "set_p16_one_key set 50 16 $N_P16 0"
  "set_p1 set 50 1 $N_P1 $KEYSPACE"
  "get_p1 get 50 1 $N_P1 $KEYSPACE"
  "set_c500 set 500 1 $N_C500 $KEYSPACE"
)
TARGETS=(direct_cluster lockgate_cluster lockgate_single)

run_one() {
  local round=$1 wl=$2 test=$3 clients=$4 pipe=$5 n=$6 keyspace=$7 target=$8
  local args=() proxy=() redis=("${NODE_PIDS[@]}") p0 p1 r0 r1 k0 k1 rps keys=()
  case $target in
    direct_cluster) args=(--cluster -h 127.0.0.1 -p "${NODES[0]##*:}") ;;
    lockgate_cluster) args=(-h 127.0.0.1 -p "$P_LG_CLUSTER") proxy=("$LG_CLUSTER_PID") ;;
    lockgate_single) args=(-h 127.0.0.1 -p "$P_LG_SINGLE") proxy=("$LG_SINGLE_PID") redis=("$SINGLE_PID") ;;
  esac
  [[ $keyspace -gt 0 ]] && keys=(-r "$keyspace")
  k0=$(conns)
  p0=0
  [[ ${#proxy[@]} -gt 0 ]] && p0=$(sum_ticks "${proxy[@]}")
  r0=$(sum_ticks "${redis[@]}")
  timeout 300 redis-benchmark "${args[@]}" -t "$test" -c "$clients" -P "$pipe" -n "$n" "${keys[@]}" \
    -d 3 --csv >"$TMP/out.csv" 2>"$TMP/out.err" || {
    cat "$TMP/out.err" >&2
    die "redis-benchmark $wl against $target failed"
  }
  p1=0
  [[ ${#proxy[@]} -gt 0 ]] && p1=$(sum_ticks "${proxy[@]}")
  r1=$(sum_ticks "${redis[@]}")
  k1=$(conns)
  rps=$(tail -n 1 "$TMP/out.csv" | cut -d, -f2 | tr -d '"')
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$wl" "$target" "$n" "$rps" \
    "$(awk -v d=$((p1 - p0)) -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", d / hz }')" \
    "$(awk -v d=$((r1 - r0)) -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", d / hz }')" \
    "$((k1 - k0))" >>"$TSV"
  log "round $round $wl $target: $rps ops/s"
}

LOAD_AT_START=$(cut -d' ' -f1-3 /proc/loadavg)
for ((round = 1; round <= ROUNDS; round++)); do
  for w in "${WORKLOADS[@]}"; do
    read -r wl test clients pipe n keyspace <<<"$w"
    for ((k = 0; k < ${#TARGETS[@]}; k++)); do
      run_one "$round" "$wl" "$test" "$clients" "$pipe" "$n" "$keyspace" "${TARGETS[$(((k + round - 1) % ${#TARGETS[@]}))]}"
    done
  done
done

python3 - "$TSV" "$LOAD_AT_START" "$(cut -d' ' -f1-3 /proc/loadavg)" "$MODE" <<'EOF'
import csv, statistics, sys
tsv, load0, load1, mode = sys.argv[1:5]
rows = list(csv.DictReader(open(tsv), delimiter="\t"))
med = {}
for wl in dict.fromkeys(r["workload"] for r in rows):
    for t in dict.fromkeys(r["target"] for r in rows):
        rs = [r for r in rows if r["workload"] == wl and r["target"] == t]
        if not rs:
            continue
        m = lambda k: statistics.median(float(r[k]) for r in rs)
        n = float(rs[0]["n"])
        med[wl, t] = dict(rps=m("rps"), proxy_us=m("proxy_cpu_s") / n * 1e6,
                          redis_us=m("redis_cpu_s") / n * 1e6, conns=m("conns"))
print(f"cluster bench ({mode} mode), load average {load0} at the start, {load1} at the end; medians of {len(set(r['round'] for r in rows))} round(s)")
print()
print("| workload | target | ops/s | lockgate CPU µs/op | Redis CPU µs/op | connections opened |")
print("|---|---|---:|---:|---:|---:|")
for (wl, t), v in med.items():
    print(f"| {wl} | {t} | {v['rps']:.0f} | {v['proxy_us']:.2f} | {v['redis_us']:.2f} | {v['conns']:.0f} |")
print()
for wl in dict.fromkeys(w for w, _ in med):
    d, c, s = med.get((wl, "direct_cluster")), med.get((wl, "lockgate_cluster")), med.get((wl, "lockgate_single"))
    if d and c and s:
        print(f"{wl}: lockgate→cluster {c['rps'] / d['rps']:.2f}× the direct cluster client's ops/s "
              f"(lockgate→one Redis {s['rps'] / d['rps']:.2f}×); "
              f"lockgate CPU per op {c['proxy_us'] / s['proxy_us']:.2f}× its single-Redis figure")
EOF
