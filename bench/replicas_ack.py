#!/usr/bin/env python3
"""What replica acknowledgement (`locks.replicas_ack`) costs an
uncontended lock, through one lockgate in front of a real primary and its
real replica: keys under `lock:acked:` wait for the replica (one pattern's
`replicas_ack = 1`), keys under `lock:plain:` do not; the two alternate in
one run, so only their ratios count.

    python3 bench/replicas_ack.py --lockgate target/release/lockgate \\
        [--threads 1,16] [--secs 3] [--rounds 3]

Each of `threads` redis-py threads, on its own connection, cycles
`SET key v NX PX 10000` then `DEL key` on keys of its own (never
contended). Per cycle: the acquisition's latency (p50, p99), the
primary's CPU (its process, `/proc`: replication included), the
commands it ran (`INFO commandstats`, those inside scripts counted), and
the replica's CPU; and the acknowledgement rounds lockgate asked per
acquisition (one round answers every grant waiting: group commit).
"""

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time

import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate  # noqa: E402  (the processes' helpers)

CONFIG = """
[[locks.overrides]]
pattern = "lock:acked:*"
replicas_ack = 1
replicas_ack_timeout_ms = 1000
"""

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def commands(r):
    return sum(v["calls"] for k, v in r.info("commandstats").items()
               if not k.startswith(("cmdstat_info", "cmdstat_config")))


def metric(port, name):
    # LOCKGATE STATS: a map, a flat array of name and value in RESP2.
    got = redis.Redis(port=port).execute_command("LOCKGATE", "STATS")
    pairs = got if isinstance(got, dict) else dict(zip(got[::2], got[1::2]))
    return int(pairs.get(name.encode(), 0))


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))] if s else 0.0


def cycles(port, mode, threads, secs):
    lat, count, errors = [], [0], [0]
    lock = threading.Lock()
    stop = time.monotonic() + secs

    def worker(t):
        c = redis.Redis(port=port, single_connection_client=True)
        mine, n = [], 0
        while time.monotonic() < stop:
            key = f"lock:{mode}:{t}:{n % 64}"
            t0 = time.perf_counter()
            got = c.set(key, "v", nx=True, px=10000)
            mine.append((time.perf_counter() - t0) * 1e3)
            if not got:
                errors[0] += 1
            c.delete(key)
            n += 1
        with lock:
            lat.extend(mine)
            count[0] += n

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return count[0], lat, errors[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lockgate", required=True)
    ap.add_argument("--threads", default="1,16")
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.lockgate = os.path.abspath(args.lockgate)
    tmp = tempfile.mkdtemp(prefix="lockgate-replicas-ack.")
    procs = gate.Procs(tmp)
    try:
        pport = gate.free_port()
        primary = procs.start("primary", ["redis-server", "--port", str(pport), "--bind",
                                          "127.0.0.1", "--save", "", "--appendonly", "no"])
        gate.wait_ping(procs, "primary", primary, pport)
        rport = gate.free_port()
        replica = procs.start("replica", ["redis-server", "--port", str(rport), "--bind",
                                          "127.0.0.1", "--save", "", "--appendonly", "no",
                                          "--replicaof", "127.0.0.1", str(pport)])
        gate.wait_ping(procs, "replica", replica, rport)
        direct = redis.Redis(port=pport)
        while direct.info("replication").get("connected_slaves", 0) < 1 or \
                redis.Redis(port=rport).info("replication").get("master_link_status") != "up":
            time.sleep(0.1)
        lg = gate.start_lockgate(procs, args, "lockgate", pport, CONFIG, callgrind=False)
        print("| threads | round | keys | cycles/s | acquisition p50 / p99 ms | primary CPU µs/cycle "
              "| primary commands/cycle | replica CPU µs/cycle | rounds/acquisition |")
        print("|--:|--:|---|--:|--:|--:|--:|--:|--:|")
        ratios = {}
        for t, r in itertools.product([int(x) for x in args.threads.split(",")],
                                      range(args.rounds)):
            row = {}
            for mode in ("plain", "acked"):
                c0, p0, r0 = commands(direct), cpu_s(primary.pid), cpu_s(replica.pid)
                k0 = metric(lg.port, "lock_replica_ack_rounds")
                n, lat, errors = cycles(lg.port, mode, t, args.secs)
                c1, p1, r1 = commands(direct), cpu_s(primary.pid), cpu_s(replica.pid)
                k1 = metric(lg.port, "lock_replica_ack_rounds")
                n = max(n, 1)
                row[mode] = (n / args.secs, pct(lat, 50), pct(lat, 99),
                             (p1 - p0) * 1e6 / n, (c1 - c0) / n, (r1 - r0) * 1e6 / n)
                print(f"| {t} | {r + 1} | {mode} | {n / args.secs:.0f} | {pct(lat, 50):.3f} / "
                      f"{pct(lat, 99):.3f} | {(p1 - p0) * 1e6 / n:.1f} | {(c1 - c0) / n:.2f} | "
                      f"{(r1 - r0) * 1e6 / n:.1f} | {(k1 - k0) / n:.2f} |"
                      + (f" ({errors} not acquired)" if errors else ""), flush=True)
            a, p = row["acked"], row["plain"]
            ratios.setdefault(t, []).append(
                (a[1] / p[1], a[3] / max(p[3], 1e-9), a[0] / p[0]))
        for t, rs in ratios.items():
            text = ", ".join(f"latency p50 {x:.2f}×, primary CPU {y:.2f}×, throughput {z:.2f}×"
                             for x, y, z in rs)
            print(f"acked ÷ plain, {t} threads: {text}")
        print(f"(load average {os.getloadavg()[0]:.2f})")
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
