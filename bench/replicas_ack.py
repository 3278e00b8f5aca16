#!/usr/bin/env python3
"""What replica acknowledgement (`locks.replicas_ack`) costs an
uncontended lock, through one lockgate in front of a real primary and its
real replica: keys under `lock:acked:` wait for the replica (one pattern's
`replicas_ack = 1`), keys under `lock:plain:` do not; the two alternate in
one run, so only their ratios count.

    python3 bench/replicas_ack.py --lockgate target/release/lockgate \\
        [--threads 1,16] [--secs 3] [--rounds 3] [--shape set|tx] [--cluster]

Each of `threads` redis-py threads, on its own connection, cycles
`SET key v NX PX 10000` then `DEL key` on keys of its own (never
contended); with `--shape tx`, the incident's transaction in place of
the `SET`: `MULTI`, `SETNX key v`, `EXPIRE key 10`, `EXEC` (lockgate
waits for the replica at `EXEC`). With `--cluster`, lockgate is in front
of a Redis Cluster of 3 primaries with a replica each (each shard's
acker waits for its own replica; the keys spread over the shards), and
the primaries' and the replicas' figures are their sums. Per cycle: the acquisition's latency (p50, p99), the
primary's CPU (its process, `/proc`: replication included), the
commands it ran (`INFO commandstats`, those inside scripts counted), and
the replica's CPU; and the acknowledgement rounds lockgate asked per
acquisition (one round answers every grant waiting: group commit).
"""

import argparse
import itertools
import os
import shutil
import subprocess
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


def server(procs, name, extra=()):
    port = gate.free_port()
    p = procs.start(name, ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                           "--save", "", "--appendonly", "no", *extra])
    gate.wait_ping(procs, name, p, port)
    return port, p


def linked(port):
    return redis.Redis(port=port).info("replication").get("master_link_status") == "up"


def start_pair(procs):
    """A primary and its replica: (seed port, [(port, proc)] of primaries, of replicas)."""
    primary = server(procs, "primary")
    replica = server(procs, "replica", ("--replicaof", "127.0.0.1", str(primary[0])))
    while not linked(replica[0]):
        time.sleep(0.1)
    return primary[0], [primary], [replica]


def start_cluster(procs):
    """3 primaries with a replica each, every replica linked."""
    nodes = [server(procs, f"node{i}", ("--cluster-enabled", "yes", "--cluster-config-file",
                                        os.path.join(procs.tmp, f"nodes-{i}.conf")))
             for i in range(6)]
    subprocess.run(["redis-cli", "--cluster", "create",
                    *[f"127.0.0.1:{port}" for port, _ in nodes],
                    "--cluster-replicas", "1", "--cluster-yes"],
                   check=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        roles = {port: redis.Redis(port=port).info("replication")["role"] for port, _ in nodes}
        ok = all("cluster_state:ok" in subprocess.run(
            ["redis-cli", "-p", str(port), "CLUSTER", "INFO"], capture_output=True,
            text=True).stdout for port, _ in nodes)
        replicas = [n for n in nodes if roles[n[0]] == "slave"]
        if ok and len(replicas) == 3 and all(linked(port) for port, _ in replicas):
            break
        if time.monotonic() > deadline:
            sys.exit("the cluster did not come up")
        time.sleep(0.2)
    primaries = [n for n in nodes if roles[n[0]] == "master"]
    return nodes[0][0], primaries, replicas


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))] if s else 0.0


def cycles(port, mode, threads, secs, shape):
    lat, count, errors = [], [0], [0]
    lock = threading.Lock()
    stop = time.monotonic() + secs

    def worker(t):
        c = redis.Redis(port=port, single_connection_client=True)
        mine, n = [], 0
        while time.monotonic() < stop:
            key = f"lock:{mode}:{t}:{n % 64}"
            t0 = time.perf_counter()
            if shape == "tx":
                p = c.pipeline(transaction=True)
                p.setnx(key, "v")
                p.expire(key, 10)
                got = p.execute()[0]
            else:
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
    ap.add_argument("--shape", choices=("set", "tx"), default="set")
    ap.add_argument("--cluster", action="store_true")
    args = ap.parse_args()
    args.lockgate = os.path.abspath(args.lockgate)
    tmp = tempfile.mkdtemp(prefix="lockgate-replicas-ack.")
    procs = gate.Procs(tmp)
    try:
        if args.cluster:
            seed, primaries, replicas = start_cluster(procs)
        else:
            seed, primaries, replicas = start_pair(procs)
        lg = gate.start_lockgate(procs, args, "lockgate", seed, CONFIG, callgrind=False,
                                 cluster=args.cluster)
        direct = [redis.Redis(port=port) for port, _ in primaries]

        def commands_all():
            return sum(commands(r) for r in direct)

        def cpu_of(nodes):
            return sum(cpu_s(p.pid) for _, p in nodes)

        print("| threads | round | keys | cycles/s | acquisition p50 / p99 ms | primary CPU µs/cycle "
              "| primary commands/cycle | replica CPU µs/cycle | rounds/acquisition |")
        print("|--:|--:|---|--:|--:|--:|--:|--:|--:|")
        ratios = {}
        for t, r in itertools.product([int(x) for x in args.threads.split(",")],
                                      range(args.rounds)):
            row = {}
            for mode in ("plain", "acked"):
                c0, p0, r0 = commands_all(), cpu_of(primaries), cpu_of(replicas)
                k0 = metric(lg.port, "lock_replica_ack_rounds")
                n, lat, errors = cycles(lg.port, mode, t, args.secs, args.shape)
                c1, p1, r1 = commands_all(), cpu_of(primaries), cpu_of(replicas)
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
        where = "a 3-primary cluster" if args.cluster else "a primary and its replica"
        print(f"(shape {args.shape}, {where}; load average {os.getloadavg()[0]:.2f})")
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
