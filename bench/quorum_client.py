"""One client's lock latency for bench/quorum.sh: sequential acquire +
release pairs, timed per pair, against lockgate (SET NX PX + DEL) and against
the lock masters directly with a client-side Redlock library (pottery).

    quorum_client.py ports N          N distinct free loopback ports
    quorum_client.py ready PORT       waits until PORT grants and releases
                                      a lock (a quorum's masters sit out
                                      for the rejoin delay at start)
    quorum_client.py run OUT.md LOAD ROUNDS PAIRS TARGET...

A TARGET is NAME=lockgate:PORT:PID or NAME=redlock:PORT,PORT,...; the
first target is the baseline the ratios are taken to. Rounds alternate the
targets (the first target of a round rotates), so a neighbour's burst on
the shared machine lands on every row alike; each row starts with a short
warm-up that is not counted. While a row runs, the other lockgates are
paused (SIGSTOP, SIGCONT after): every lockgate subscribes to release
announcements on its masters, and the lockgates share masters, so a
running one would wake on the measured row's releases. Prints the markdown
table (and writes it to OUT.md).
"""

import os
import signal
import socket
import statistics
import sys
import time

import redis

WARMUP = 50


def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ready(port, timeout=15.0):
    r = redis.Redis(port=port, protocol=2, socket_timeout=2)
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            if r.set("lock:q:ready", "1", nx=True, px=1000):
                r.delete("lock:q:ready")
                return
            last = "not acquired"
        except redis.RedisError as e:
            last = str(e)
        time.sleep(0.05)
    sys.exit(f"lockgate on port {port} did not grant a lock within {timeout:.0f} s ({last})")


class Lockgate:
    """SET lock:q:<i> <v> NX PX 10000, then DEL, through lockgate."""

    def __init__(self, name, port, pid):
        self.name = name
        self.pid = pid
        self.r = redis.Redis(port=port, protocol=2, socket_timeout=5)
        self.r.ping()

    def pair(self, i):
        key = f"lock:q:{self.name}:{i}"
        t0 = time.perf_counter_ns()
        ok = self.r.execute_command("SET", key, f"v{i}", "NX", "PX", "10000")
        gone = self.r.execute_command("DEL", key)
        t1 = time.perf_counter_ns()
        if ok not in (b"OK", True) or gone != 1:
            sys.exit(f"{self.name}: pair {i} answered {ok!r} / {gone!r}")
        return t1 - t0


class Redlock:
    """pottery's Redlock (acquire + release) on the masters directly."""

    def __init__(self, name, ports):
        from pottery import Redlock as PotteryRedlock

        self.name = name
        self.pid = None
        self.cls = PotteryRedlock
        self.masters = {redis.Redis(port=p, protocol=2, socket_timeout=5) for p in ports}
        for m in self.masters:
            m.ping()

    def pair(self, i):
        lock = self.cls(key=f"lock:q:{self.name}:{i}", masters=self.masters, auto_release_time=10)
        t0 = time.perf_counter_ns()
        ok = lock.acquire(blocking=False)
        lock.release()
        t1 = time.perf_counter_ns()
        if not ok:
            sys.exit(f"{self.name}: pair {i} not acquired")
        return t1 - t0


def percentile(sorted_ns, p):
    rank = max(1, -(-p * len(sorted_ns) // 100))
    return sorted_ns[rank - 1] / 1000.0


def run(out, load, rounds, pairs, specs):
    targets = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        kind, _, ports = rest.partition(":")
        if kind == "lockgate":
            port, _, pid = ports.partition(":")
            targets.append(Lockgate(name, int(port), int(pid)))
        elif kind == "redlock":
            targets.append(Redlock(name, [int(p) for p in ports.split(",")]))
        else:
            sys.exit(f"unknown target kind in {spec!r}")
    try:
        measure(out, load, rounds, pairs, targets)
    finally:
        pause(targets, None)


def pause(targets, running):
    """Pauses every lockgate but `running`'s (None: resumes them all)."""
    for t in targets:
        if t.pid is not None:
            os.kill(t.pid, signal.SIGCONT if running is None or t is running else signal.SIGSTOP)


def measure(out, load, rounds, pairs, targets):
    samples = {t.name: [] for t in targets}
    medians = {t.name: [] for t in targets}
    seq = 0
    for rnd in range(rounds):
        order = targets[rnd % len(targets):] + targets[: rnd % len(targets)]
        for t in order:
            pause(targets, t)
            for _ in range(WARMUP):
                seq += 1
                t.pair(seq)
            got = []
            for _ in range(pairs):
                seq += 1
                got.append(t.pair(seq))
            samples[t.name].extend(got)
            medians[t.name].append(statistics.median(got) / 1000.0)
            print(f"[quorum] round {rnd + 1} {t.name:<14} p50 {medians[t.name][-1]:7.1f} us", file=sys.stderr, flush=True)
    base = percentile(sorted(samples[targets[0].name]), 50)
    base99 = percentile(sorted(samples[targets[0].name]), 99)
    lines = [
        f"One client, sequential `SET lock:q:<i> <v> NX PX 10000` + `DEL` pairs; "
        f"{rounds} rounds x {pairs} pairs per row, rows alternating, the other lockgates paused; "
        f"load average at start {load}.",
        "",
        "| row | p50 µs | p99 µs | p50 ratio | p99 ratio | p50 per round µs |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for t in targets:
        s = sorted(samples[t.name])
        p50, p99 = percentile(s, 50), percentile(s, 99)
        per_round = " ".join(f"{m:.0f}" for m in medians[t.name])
        lines.append(f"| {t.name} | {p50:.0f} | {p99:.0f} | {p50 / base:.2f}x | {p99 / base99:.2f}x | {per_round} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv):
    if len(argv) >= 2 and argv[1] == "ports":
        print("\n".join(str(p) for p in free_ports(int(argv[2]))))
    elif len(argv) == 3 and argv[1] == "ready":
        ready(int(argv[2]))
    elif len(argv) >= 7 and argv[1] == "run":
        run(argv[2], argv[3], int(argv[4]), int(argv[5]), argv[6:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
