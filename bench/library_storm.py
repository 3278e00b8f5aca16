#!/usr/bin/env python3
"""A lock library's retry storm, straight on Redis and through lockgate,
alternating in one run: redis-py's `Lock` polling every millisecond from
T threads on one key, each holding it 5 ms, the threads on their own
connections (`own`) or sharing a LIFO pool of T/2 (`pool`); the same
with pottery's `Redlock` (`--library pottery`, polling every millisecond
at most); with python-redis-lock's `Lock` (`--library python-redis-lock`,
whose waiters poll nothing: each blocks on the lock's signal list until a
release pushes to it, so a wake-up lost is a waiter asleep); or, with `--library node-redlock`, T node-redlock tasks retrying every millisecond,
on their own connections (`own`) or all on one multiplexed connection
(`one`). For each side, Redis's own CPU seconds (INFO cpu, user + system)
and the commands it processed per acquisition, and the ratio lockgate /
direct; with the run's load average (2 shared cores: only ratios from one
run count).

    python3 bench/library_storm.py --lockgate target/release/lockgate \
        [--library redis-py|pottery|node-redlock] [--threads 8,32] [--shapes own,pool] \
        [--secs 3] [--rounds 3] [--probe-ms 100]

`--probe-ms` is lockgate's `locks.retry.probe_interval_ms` (its default,
100, unless given).
"""

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate  # noqa: E402  (the gate's process helpers)

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
PY_STORM = [sys.executable, os.path.join(TESTS, "py", "redis_py_storm.py")]
# Each library's storm driver: the command that runs it, and what follows
# its arguments.
STORM = {
    "redis-py": (PY_STORM, ["redis-py"]),
    "pottery": (PY_STORM, ["pottery"]),
    "python-redis-lock": (PY_STORM, ["python-redis-lock"]),
    "node-redlock": (["node", os.path.join(TESTS, "js", "redlock_storm.js")], []),
}


def storm(library, port, redis_port, key, threads, secs, shape):
    command, tail = STORM[library]
    out = subprocess.run(
        command + ["127.0.0.1", str(port), "127.0.0.1", str(redis_port),
                   key, str(threads), str(secs), shape] + tail,
        check=True, capture_output=True, text=True, timeout=secs + 120).stdout
    v = json.loads(out)
    n = max(v["acquisitions"], 1)
    return v["acquisitions"], v["cpu_s"] * 1e6 / n, v["calls"] / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lockgate", required=True)
    ap.add_argument("--library", default="redis-py", choices=sorted(STORM))
    ap.add_argument("--threads", default="8,32")
    ap.add_argument("--shapes", default="own")
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probe-ms", type=int, default=None)
    args = ap.parse_args()
    # lockgate runs in a scratch directory: a relative path is this one's.
    args.lockgate = os.path.abspath(args.lockgate)
    tmp = tempfile.mkdtemp(prefix="lockgate-library-storm.")
    procs = gate.Procs(tmp)
    try:
        rport = gate.start_redis(procs, "redis")
        config = ""
        if args.probe_ms is not None:
            config = f"[locks.retry]\nprobe_interval_ms = {args.probe_ms}\n"
        lg = gate.start_lockgate(procs, args, "lockgate", rport, config=config, callgrind=False)
        probe = f", probe_interval_ms {args.probe_ms}" if args.probe_ms is not None else ""
        print(f"{args.library}{probe}:")
        print("| shape | threads | round | acquisitions direct / lockgate | Redis CPU µs per acquisition direct / lockgate | ratio | commands per acquisition direct / lockgate | ratio |")
        print("|---|--:|--:|--:|--:|--:|--:|--:|")
        threads = [int(x) for x in args.threads.split(",")]
        for shape, t, r in itertools.product(args.shapes.split(","), threads, range(args.rounds)):
            key = f"lock:bench:storm:{shape}:{t}:{r}"
            da, dcpu, dcmd = storm(args.library, rport, rport, key, t, args.secs, shape)
            la, lcpu, lcmd = storm(args.library, lg.port, rport, key, t, args.secs, shape)
            print(f"| {shape} | {t} | {r + 1} | {da} / {la} | {dcpu:.0f} / {lcpu:.0f} | "
                  f"{lcpu / dcpu:.2f} | {dcmd:.1f} / {lcmd:.1f} | {lcmd / dcmd:.2f} |",
                  flush=True)
        print(f"(load average {os.getloadavg()[0]:.2f})")
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
