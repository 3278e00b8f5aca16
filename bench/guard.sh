#!/usr/bin/env bash
# What guarded writes cost ([[locks.guards]]): SET on random keys straight
# to Redis ("direct"), through a lockgate without guards ("plain"), through
# a lockgate with one guard on keys it does not cover ("unguarded": the
# guard's key test only), and on keys it covers ("guarded": each write runs
# lockgate's guard script in Redis instead of the SET; mode = "report" and
# unlocked_writers = "allow", so every write is applied and counted as
# unlocked_writer), alternating in one run (only ratios from one run count).
#
#   bench/guard.sh                 3 rounds of each
#   QUICK=1 bench/guard.sh         smoke test: 1 round, small -n
#
# Environment (all optional):
#   ROUNDS=3         rounds; the cases alternate, the first rotating
#   N_P16=500000     -n for the -c 50 -P 16 runs
#   N_P1=50000       -n for the -c 50 -P 1 runs
#   KEYSPACE=100000  redis-benchmark -r
#   RUN_TIMEOUT=120  seconds before one redis-benchmark run is given up
#   LOCKGATE_BIN=... use this binary instead of `cargo build --release`
#
# Per run: ops/s (redis-benchmark --csv), Redis's and lockgate's CPU per
# command (utime+stime from /proc), and the guard checks the run made
# (lockgate_guarded_writes_total on /metrics). Reported: medians; plain
# against direct, unguarded and guarded against plain; the script calls
# Redis counted (INFO commandstats) per guarded write; the load average.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/common.sh
source "$REPO/scripts/common.sh"
# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"

QUICK=${QUICK:-0}
ROUNDS=${ROUNDS:-3}
N_P16=${N_P16:-500000}
N_P1=${N_P1:-50000}
KEYSPACE=${KEYSPACE:-100000}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
if [[ $QUICK == 1 ]]; then ROUNDS=1 N_P16=50000 N_P1=5000; fi
CLK_TCK=$(getconf CLK_TCK)
for tool in redis-server redis-cli redis-benchmark curl python3 timeout; do
  have "$tool" || die "no $tool on the PATH"
done

bench_start guard
log() { echo "[guard] $*" >&2; }
if [[ -z ${LOCKGATE_BIN:-} ]]; then
  (cd "$REPO" && cargo build --release --quiet) || die "cargo build failed"
  LOCKGATE_BIN=$REPO/target/release/lockgate
fi

P_REDIS=$(pick_free_port)
(cd "$TMP" && exec redis-server --port "$P_REDIS" --bind 127.0.0.1 --save "" --appendonly no >"$TMP/redis.log" 2>&1) &
PIDS+=($!)
REDIS_PID=$!
wait_ready redis "$REDIS_PID" "$P_REDIS" "$TMP/redis.log"

# Two lockgates, the same but for the guard: both with an admin listener
# (the guarded one's /metrics counts the guard checks).
P_PLAIN=$(pick_free_port)
P_PLAIN_ADMIN=$(pick_free_port)
P_GUARD=$(pick_free_port)
P_GUARD_ADMIN=$(pick_free_port)
cat >"$TMP/plain.toml" <<EOF
[admin]
listen = "127.0.0.1:$P_PLAIN_ADMIN"
EOF
cat >"$TMP/guard.toml" <<EOF
[admin]
listen = "127.0.0.1:$P_GUARD_ADMIN"

[[locks.guards]]
lock = "lock:order:{id}"
data = ["order:{id}", "order:{id}:*"]
mode = "report"
unlocked_writers = "allow"
EOF
for name in plain guard; do
  "$LOCKGATE_BIN" --check --config "$TMP/$name.toml" >"$TMP/check-$name.log" 2>&1 || {
    cat "$TMP/check-$name.log" >&2
    die "lockgate --check rejects $TMP/$name.toml"
  }
done
RUST_LOG=warn "$LOCKGATE_BIN" --config "$TMP/plain.toml" --listen "127.0.0.1:$P_PLAIN" \
  --upstream "127.0.0.1:$P_REDIS" >"$TMP/lockgate-plain.log" 2>&1 &
PIDS+=($!)
PLAIN_PID=$!
RUST_LOG=warn "$LOCKGATE_BIN" --config "$TMP/guard.toml" --listen "127.0.0.1:$P_GUARD" \
  --upstream "127.0.0.1:$P_REDIS" >"$TMP/lockgate-guard.log" 2>&1 &
PIDS+=($!)
GUARD_PID=$!
wait_ready lockgate-plain "$PLAIN_PID" "$P_PLAIN" "$TMP/lockgate-plain.log"
wait_ready lockgate-guard "$GUARD_PID" "$P_GUARD" "$TMP/lockgate-guard.log"

# Guard checks lockgate made so far (applied + unlocked_writer + … : every
# outcome but unchecked, which is a write that passed without the script).
metric() {
  curl -fsS --max-time 5 "http://127.0.0.1:$P_GUARD_ADMIN/metrics" |
    awk -v want="$1" '
      /^lockgate_guarded_writes_total\{/ && index($0, "guard=\"lock:order:{id}\"") {
        o = $0; sub(/.*outcome="/, "", o); sub(/".*/, "", o)
        if (want == "checks" ? o != "unchecked" : o == want) n += $NF
      }
      END { printf "%d\n", n }'
}
# Until the guard script runs: lockgate loads Redis's command table first
# (before that, report mode passes a guarded write unchecked).
ready=0
for ((i = 0; i < 100; i++)); do
  [[ $(redis-cli -h 127.0.0.1 -p "$P_GUARD" set order:warm v 2>/dev/null) == OK ]] &&
    [[ $(metric unlocked_writer) -ge 2 ]] && { ready=1; break; }
  sleep 0.1
done
[[ $ready == 1 ]] || die "no guard checks on $P_GUARD_ADMIN/metrics after 10 s (log: $(tail -3 "$TMP/lockgate-guard.log"))"
UNCHECKED0=$(metric unchecked)
redis-cli -h 127.0.0.1 -p "$P_REDIS" config resetstat >/dev/null

TSV=$TMP/runs.tsv
printf 'round\tpipe\tcase\tn\trps\tredis_cpu_s\tlg_cpu_s\tchecks\n' >"$TSV"
CASES=(direct plain unguarded guarded)
ticks_s() { awk -v d="$1" -v hz="$CLK_TCK" 'BEGIN { printf "%.3f", d / hz }'; }
run_one() {
  local round=$1 pipe=$2 n=$3 case=$4 port lg key=user r0 r1 l0=0 l1=0 g0 g1 rps
  case $case in
    direct) port=$P_REDIS lg= ;;
    plain) port=$P_PLAIN lg=$PLAIN_PID ;;
    unguarded) port=$P_GUARD lg=$GUARD_PID ;;
    guarded) port=$P_GUARD lg=$GUARD_PID key=order ;;
  esac
  g0=$(metric checks)
  r0=$(cpu_ticks "$REDIS_PID")
  [[ -n $lg ]] && l0=$(cpu_ticks "$lg")
  timeout "$RUN_TIMEOUT" redis-benchmark -h 127.0.0.1 -p "$port" -c 50 -P "$pipe" -n "$n" -r "$KEYSPACE" \
    --csv SET "$key:__rand_int__" v >"$TMP/out.csv" 2>"$TMP/out.err" || {
    cat "$TMP/out.err" >&2
    die "redis-benchmark -P $pipe against $case failed"
  }
  r1=$(cpu_ticks "$REDIS_PID")
  [[ -n $lg ]] && l1=$(cpu_ticks "$lg")
  g1=$(metric checks)
  rps=$(tail -n 1 "$TMP/out.csv" | cut -d, -f2 | tr -d '"')
  if ! [[ $rps =~ ^[0-9.]+$ ]] || ! awk -v r="$rps" 'BEGIN { exit !(r > 0) }'; then
    cat "$TMP/out.csv" "$TMP/out.err" >&2
    die "redis-benchmark -P $pipe against $case: no ops/s"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$pipe" "$case" "$n" "$rps" \
    "$(ticks_s $((r1 - r0)))" "$(ticks_s $((l1 - l0)))" "$((g1 - g0))" >>"$TSV"
  log "round $round -P $pipe $case: $rps ops/s, $((g1 - g0)) guard checks"
}

LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
for ((round = 1; round <= ROUNDS; round++)); do
  for pn in "16 $N_P16" "1 $N_P1"; do
    read -r pipe n <<<"$pn"
    for ((k = 0; k < ${#CASES[@]}; k++)); do
      run_one "$round" "$pipe" "$n" "${CASES[$(((k + round - 1) % ${#CASES[@]}))]}"
    done
  done
done
LOAD1=$(cut -d' ' -f1-3 /proc/loadavg)

# Redis's own count of the SETs and scripts it ran during the runs.
redis-cli -h 127.0.0.1 -p "$P_REDIS" info commandstats | tr -d '\r' >"$TMP/commandstats"

python3 - "$TSV" "$LOAD0" "$LOAD1" "$TMP/commandstats" "$(metric checks)" "$(($(metric unchecked) - UNCHECKED0))" <<'EOF'
import csv, re, statistics, sys
tsv, load0, load1, cstats, checks_total, unchecked = sys.argv[1:7]
rows = list(csv.DictReader(open(tsv), delimiter="\t"))
cases = ["direct", "plain", "unguarded", "guarded"]
med = {}
print(f"guard bench, load average {load0} at the start, {load1} at the end; "
      f"medians of {len(set(r['round'] for r in rows))} round(s), -c 50, SET on random keys")
print()
print("| -P | case | ops/s | Redis CPU µs/op | lockgate CPU µs/op | guard checks/op |")
print("|---:|---|---:|---:|---:|---:|")
for pipe in dict.fromkeys(r["pipe"] for r in rows):
    for c in cases:
        rs = [r for r in rows if r["pipe"] == pipe and r["case"] == c]
        m = lambda k: statistics.median(float(r[k]) / (float(r["n"]) if k != "rps" else 1) for r in rs)
        med[pipe, c] = dict(rps=m("rps"), redis=m("redis_cpu_s") * 1e6, lg=m("lg_cpu_s") * 1e6, checks=m("checks"))
        v = med[pipe, c]
        lg = "—" if c == "direct" else f"{v['lg']:.2f}"
        print(f"| {pipe} | {c} | {v['rps']:.0f} | {v['redis']:.2f} | {lg} | {v['checks']:.2f} |")
print()
ratio = lambda a, b: f"{a / b:.2f}×" if b > 0 else "—"
for pipe in dict.fromkeys(p for p, _ in med):
    for a, b in (("plain", "direct"), ("unguarded", "plain"), ("guarded", "plain")):
        x, y = med[pipe, a], med[pipe, b]
        lg = "" if b == "direct" else f", lockgate CPU/op {ratio(x['lg'], y['lg'])}"
        print(f"-P {pipe} {a}/{b}: ops/s {ratio(x['rps'], y['rps'])}, Redis CPU/op {ratio(x['redis'], y['redis'])}{lg}")
    g, p = med[pipe, "guarded"], med[pipe, "plain"]
    print(f"-P {pipe} a guarded write costs Redis {g['redis'] - p['redis']:+.2f} µs and lockgate {g['lg'] - p['lg']:+.2f} µs more than a plain one")
print()
stats = {}
for line in open(cstats):
    m = re.match(r"cmdstat_([^:]+):calls=(\d+),usec=(\d+)", line)
    if m:
        stats[m.group(1)] = (int(m.group(2)), int(m.group(3)))
guarded_ops = sum(float(r["n"]) for r in rows if r["case"] == "guarded")
scripts = sum(stats.get(k, (0, 0))[0] for k in ("eval", "evalsha", "fcall"))
script_us = sum(stats.get(k, (0, 0))[1] for k in ("eval", "evalsha", "fcall"))
sets, set_us = stats.get("set", (0, 0))
print(f"Redis commandstats: {scripts / guarded_ops:.3f} script calls per guarded write "
      f"({scripts} calls, {script_us / max(scripts, 1):.2f} µs each inside Redis; SET {set_us / max(sets, 1):.2f} µs each)")
print(f"guard checks run: {checks_total} (in total, warm-up included; {unchecked} guarded writes passed unchecked during the runs)")
EOF
