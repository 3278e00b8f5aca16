# shellcheck shell=bash
# Shared by the benchmark scripts (sourced, not run): a temp dir, the PIDs
# of everything started (stopped at exit: TERM, then KILL after 3 s), and a
# readiness wait, and CPU and wall-clock readings. Needs `die` from
# scripts/common.sh (sourced first).

# bench_start NAME: makes $TMP and installs the exit traps.
bench_start() {
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/lockgate-$1.XXXXXX")
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

PIDS=()
cleanup() {
  local pid i
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for ((i = 0; i < 30; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$TMP"
}

# Waits until PORT answers PING (through a proxy: Redis behind it too).
wait_ready() {
  local name=$1 pid=$2 port=$3 logf=$4 i
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || { cat "$logf" >&2 || true; die "$name exited at start (log above)"; }
    if [[ $(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null) == PONG ]]; then return 0; fi
    sleep 0.1
  done
  cat "$logf" >&2 || true
  die "$name not answering PING on port $port after 10 s"
}


# CPU time of a process (all its threads), in ns: field 1 of each thread's
# schedstat. /proc/PID/stat counts whole ticks, too coarse for an idle Redis.
cpu_ns() {
  local sum=0 t v _
  for t in /proc/"$1"/task/*/schedstat; do
    read -r v _ 2>/dev/null <"$t" || continue
    sum=$((sum + v))
  done
  echo "$sum"
}

# CPU time of a process as /proc/PID/stat counts it (utime + stime), in
# clock ticks (getconf CLK_TCK per second).
cpu_ticks() {
  local stat rest f
  read -r stat <"/proc/$1/stat"
  rest=${stat##*) }            # the fields after "(comm)", starting at field 3
  read -r -a f <<<"$rest"
  echo $((f[11] + f[12]))      # fields 14 (utime) and 15 (stime)
}

# Wall-clock time, in ns.
now_ns() { date +%s%N; }
