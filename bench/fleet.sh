#!/usr/bin/env bash
# Fleet storm: the incident at its real shape. lockgate runs one per app
# pod, so a hot lock key is contended through many lockgate processes in
# front of one Redis. The same CLIENTS spinning clients (bench/storm_load.rs:
# SETNX lock:fleet, on success EXPIRE as the incident's app did, hold
# HOLD_MS, DEL; SETNX again at once when refused) reach one Redis
#   direct      straight
#   N lockgates spread evenly over N lockgate processes (default config),
#               for each N in FLEETS
# alternating in one run (the order rotates from round to round). Per run,
# on the one Redis: its CPU (schedstat, ns) and INFO commandstats (reset
# before; calls made inside scripts are counted there too), so the report
# gives Redis CPU and Redis commands per acquisition, acquisitions/s, wait
# p99, and the spread of acquisitions over the instances (fewest/most per
# instance, and the instances that acquired none).
#
# Then the model (bench/fleet_model.rs): fleets too large to run as
# processes here (MODEL_FLEETS), each instance a lightweight task with one
# spinning client following the protocol with lockgate's own Lua scripts
# against the same Redis: every handoff crosses instances, the worst case
# for the store. Its table gives Redis CPU and commands per acquisition and
# the instances' probes and renewals per acquisition.
#
#   bench/fleet.sh                full run (~3 min after the build)
#   QUICK=1 bench/fleet.sh        smoke test: 3 s runs, FLEETS="1 4", MODEL_FLEETS="40 200"
#
# Environment (all optional):
#   DURATION=8  ROUNDS=1  CLIENTS=80  HOLD_MS=5  EXPIRE_S=10
#   FLEETS="1 2 10 40"            fleet sizes (real processes)
#   MODEL_FLEETS="2 10 40 200 1000" fleet sizes of the model ("": none)
#   LOCKGATE_BIN=... STORM_BIN=... MODEL_BIN=... prebuilt binaries
#
# The markdown summary is printed and written to bench/results/fleet-latest.md,
# the raw runs to bench/results/fleet-latest.jsonl. Only ratios within one
# run count on this small shared box; the run's load average is printed.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
export LC_ALL=C

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
RESULTS="$BENCH_DIR/results"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then
  DURATION=${DURATION:-3}
  FLEETS=${FLEETS-"1 4"}
  MODEL_FLEETS=${MODEL_FLEETS-"40 200"}
else
  DURATION=${DURATION:-8}
  FLEETS=${FLEETS-"1 2 10 40"}
  MODEL_FLEETS=${MODEL_FLEETS-"2 10 40 200 1000"}
fi
ROUNDS=${ROUNDS:-1}
CLIENTS=${CLIENTS:-80}
HOLD_MS=${HOLD_MS:-5}
EXPIRE_S=${EXPIRE_S:-10}
RUN_TIMEOUT=$((${DURATION%.*} + 70))

LOG_TAG=fleet
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
install_missing "redis-server redis-tools" redis-server redis-cli python3 timeout

build=()
[[ -n ${LOCKGATE_BIN:-} ]] || build+=(--bin lockgate)
[[ -n ${STORM_BIN:-} ]] || build+=(--example storm)
[[ -n ${MODEL_BIN:-} ]] || build+=(--example fleet_model)
if ((${#build[@]})); then
  log "building (cargo build --release ${build[*]})"
  (cd "$REPO" && cargo build --release --quiet "${build[@]}") || die "cargo build --release failed"
fi
LOCKGATE_BIN=${LOCKGATE_BIN:-$REPO/target/release/lockgate}
STORM_BIN=${STORM_BIN:-$REPO/target/release/examples/storm}
MODEL_BIN=${MODEL_BIN:-$REPO/target/release/examples/fleet_model}

# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_start fleet

max_fleet=0
for n in $FLEETS; do ((n > max_fleet)) && max_fleet=$n; done
mapfile -t PORTS < <(python3 "$BENCH_DIR/passthrough_report.py" ports $((max_fleet + 1)))
P_REDIS=${PORTS[0]}

mkdir -p "$TMP/redis"
redis-server --bind 127.0.0.1 --port "$P_REDIS" --save '' --appendonly no \
  --protected-mode no --daemonize no --dir "$TMP/redis" --logfile "$TMP/redis.log" &
REDIS_PID=$!
PIDS+=("$REDIS_PID")
wait_ready redis-server "$REDIS_PID" "$P_REDIS" "$TMP/redis.log"

rcli() { redis-cli -h 127.0.0.1 -p "$@"; }

# Starts N lockgates (ports 1..N of PORTS); their PIDs in FLEET_PIDS.
FLEET_PIDS=()
start_fleet() {
  local n=$1 i
  FLEET_PIDS=()
  for ((i = 1; i <= n; i++)); do
    RUST_LOG=warn "$LOCKGATE_BIN" --listen "127.0.0.1:${PORTS[$i]}" \
      --upstream "127.0.0.1:$P_REDIS" --admin-listen "" >"$TMP/lockgate-$i.log" 2>&1 &
    FLEET_PIDS+=("$!")
    PIDS+=("$!")
  done
  for ((i = 1; i <= n; i++)); do
    wait_ready "lockgate $i" "${FLEET_PIDS[$((i - 1))]}" "${PORTS[$i]}" "$TMP/lockgate-$i.log"
  done
}
stop_fleet() {
  local pid
  for pid in "${FLEET_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${FLEET_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  FLEET_PIDS=()
}

RUNS="$TMP/runs.jsonl"
: >"$RUNS"
run_one() {
  local round=$1 target=$2 ports c0 c1 t0 t1
  local out="$TMP/r$round-$target"
  if [[ $target == direct ]]; then
    ports=$P_REDIS
  else
    start_fleet "$target"
    ports=$(IFS=,; echo "${PORTS[*]:1:$target}")
  fi
  [[ $(rcli "$P_REDIS" flushall) == OK ]] || die "FLUSHALL failed"
  [[ $(rcli "$P_REDIS" config resetstat) == OK ]] || die "CONFIG RESETSTAT failed"
  c0=$(cpu_ns "$REDIS_PID")
  t0=$(now_ns)
  if ! timeout "$RUN_TIMEOUT" "$STORM_BIN" --ports "$ports" --clients "$CLIENTS" \
    --hold-ms "$HOLD_MS" --expire-s "$EXPIRE_S" --duration-s "$DURATION" --key lock:fleet \
    >"$out.json" 2>"$out.err"; then
    cat "$out.err" >&2
    die "load generator against $target failed or timed out"
  fi
  t1=$(now_ns)
  c1=$(cpu_ns "$REDIS_PID")
  rcli "$P_REDIS" info commandstats >"$out.cmdstats"
  [[ $target == direct ]] || stop_fleet
  python3 - "$out.json" "$out.cmdstats" "$target" "$round" $((c1 - c0)) $((t1 - t0)) >>"$RUNS" <<'EOF'
import json, sys
g = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
calls = {}
for l in open(sys.argv[2]):
    if l.startswith("cmdstat_"):
        name = l.split(":")[0][len("cmdstat_"):]
        if name in ("config", "info", "flushall"):
            continue
        calls[name] = int(l.split("calls=")[1].split(",")[0])
g.update(target=sys.argv[3], round=int(sys.argv[4]), redis_ns=int(sys.argv[5]),
         wall_ns=int(sys.argv[6]), calls=calls)
print(json.dumps(g))
EOF
  log "round $round $target: $(python3 - "$RUNS" <<'EOF'
import json, sys
g = json.loads(open(sys.argv[1]).readlines()[-1])
a = max(g["acquisitions"], 1)
print(f"{g['acquisitions']} acquisitions, Redis {g['redis_ns'] / a / 1e6:.3f} ms CPU and "
      f"{sum(g['calls'].values()) / a:.1f} commands per acquisition, errors {g['errors']}")
EOF
)"
}

TARGETS=(direct)
for n in $FLEETS; do TARGETS+=("$n"); done
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
log "clients $CLIENTS, hold ${HOLD_MS} ms, ${DURATION} s per run, fleets: $FLEETS, load $LOAD_START"
for ((round = 1; round <= ROUNDS; round++)); do
  for ((k = 0; k < ${#TARGETS[@]}; k++)); do
    run_one "$round" "${TARGETS[$(((k + round - 1) % ${#TARGETS[@]}))]}"
  done
done
# The model: one lightweight instance per task, the same Redis.
MODEL_RUNS="$TMP/model.jsonl"
: >"$MODEL_RUNS"
for n in $MODEL_FLEETS; do
  for ((round = 1; round <= ROUNDS; round++)); do
    out="$TMP/m$round-$n"
    [[ $(rcli "$P_REDIS" flushall) == OK ]] || die "FLUSHALL failed"
    # The model reads Redis's CPU (INFO cpu) and commands itself, after a
    # warm-up (every instance's first attempt), for the window it measures.
    timeout "$RUN_TIMEOUT" "$MODEL_BIN" --port "$P_REDIS" --instances "$n" --hold-ms "$HOLD_MS" \
      --duration-s "$DURATION" >"$out.json" 2>"$out.err" || { cat "$out.err" >&2; die "fleet model ($n) failed"; }
    python3 - "$out.json" "$round" >>"$MODEL_RUNS" <<'EOF'
import json, sys
g = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
g.update(round=int(sys.argv[2]))
print(json.dumps(g))
EOF
    log "model round $round, $n instances: $(tail -1 "$MODEL_RUNS" | cut -c1-160)"
  done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

rev=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -z $(git -C "$REPO" status --porcelain -- src 2>/dev/null) ]] || rev="$rev+dirty"
mkdir -p "$RESULTS"
cat "$RUNS" "$MODEL_RUNS" >"$RESULTS/fleet-latest.jsonl"
python3 - "$RUNS" "$MODEL_RUNS" "$rev" "$LOAD_START" "$LOAD_END" "$CLIENTS" "$HOLD_MS" "$DURATION" <<'EOF' | tee "$RESULTS/fleet-latest.md"
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
model = [json.loads(l) for l in open(sys.argv[2])]
rev, l0, l1, clients, hold, dur = sys.argv[3:9]
print(f"# Fleet storm: lockgate {rev}, {clients} clients, hold {hold} ms, {dur} s per run")
print(f"\nload average {l0} at the start, {l1} at the end; medians over rounds.\n")
def med(xs):
    return statistics.median(xs) if xs else 0.0
order = []
for r in runs:
    if r["target"] not in order:
        order.append(r["target"])
rows = {}
for t in order:
    rs = [r for r in runs if r["target"] == t]
    def per(r, v):
        return v / max(r["acquisitions"], 1)
    rows[t] = dict(
        acq_s=med([r["acquisitions"] / r["elapsed_s"] for r in rs]),
        cpu_ms=med([per(r, r["redis_ns"]) / 1e6 for r in rs]),
        cmds=med([per(r, sum(r["calls"].values())) for r in rs]),
        scripts=med([per(r, r["calls"].get("evalsha", 0) + r["calls"].get("eval", 0)) for r in rs]),
        publish=med([per(r, r["calls"].get("publish", 0)) for r in rs]),
        wait=med([r["wait_ms"]["p99"] for r in rs]),
        lo=med([min(r["per_target"]) for r in rs]),
        hi=med([max(r["per_target"]) for r in rs]),
        none=med([sum(1 for n in r["per_target"] if n == 0) for r in rs]),
        errors=sum(r["errors"] for r in rs),
        overlaps=sum(r["overlaps"] for r in rs),
    )
d = rows.get("direct")
print("| clients reach Redis through | Redis CPU/acq | vs direct | commands/acq | scripts/acq | PUBLISH/acq | acq/s | wait p99 | per instance (min–max, none) | errors | overlaps |")
print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
for t, r in rows.items():
    name = "direct" if t == "direct" else f"{t} lockgate{'s' if t != '1' else ''}"
    ratio = f"{r['cpu_ms'] / d['cpu_ms']:.3f}×" if d and d["cpu_ms"] > 0 else "–"
    spread = "–" if t == "direct" else f"{r['lo']:.0f}–{r['hi']:.0f}, {r['none']:.0f}"
    print(f"| {name} | {r['cpu_ms']:.3f} ms | {ratio} | {r['cmds']:.1f} | {r['scripts']:.1f} | {r['publish']:.2f} | {r['acq_s']:.0f} | {r['wait']:.0f} ms | {spread} | {r['errors']} | {r['overlaps']} |")
fleet = [r["cpu_ms"] for t, r in rows.items() if t != "direct" and t != "1"]
if len(fleet) >= 2 and min(fleet) > 0:
    print(f"\nRedis CPU per acquisition, largest over smallest across fleets of 2 or more: {max(fleet) / min(fleet):.2f}×")
if model:
    print("\n## The model: one spinning client per instance (every handoff crosses instances)\n")
    print("| instances | Redis CPU/acq | vs direct | commands/acq | scripts/acq | PUBLISH/acq | head probes/acq | renewals/acq | acq/s | per instance (min–max, none) | errors |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for n in sorted({m["instances"] for m in model}):
        ms = [m for m in model if m["instances"] == n]
        def per(m, v):
            return v / max(m["acquisitions"], 1)
        cpu = med([per(m, m["redis_ns"]) / 1e6 for m in ms])
        ratio = f"{cpu / d['cpu_ms']:.3f}×" if d and d["cpu_ms"] > 0 else "–"
        print(f"| {n} | {cpu:.3f} ms | {ratio} | {med([per(m, sum(m['calls'].values())) for m in ms]):.1f} "
              f"| {med([per(m, m['calls'].get('evalsha', 0)) for m in ms]):.2f} "
              f"| {med([per(m, m['calls'].get('publish', 0)) for m in ms]):.2f} "
              f"| {med([per(m, m['head_probes']) for m in ms]):.2f} | {med([per(m, m['renewals']) for m in ms]):.2f} "
              f"| {med([m['acquisitions'] / m['elapsed_s'] for m in ms]):.0f} "
              f"| {med([m['min_per_instance'] for m in ms]):.0f}–{med([m['max_per_instance'] for m in ms]):.0f}, {med([m['none'] for m in ms]):.0f} "
              f"| {sum(m['errors'] for m in ms)} |")
EOF
