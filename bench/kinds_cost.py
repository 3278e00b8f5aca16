#!/usr/bin/env python3
"""What each kind of lock costs Redis per grant and release, against an
exclusive fencing lock (`LOCKGATE LOCK` / `UNLOCK`), through one lockgate
in front of a real redis-server (or the quorum's masters with --quorum N).

    python3 bench/kinds_cost.py --lockgate target/release/lockgate \\
        [--n 5000] [--rounds 3] [--quorum 3]

Per kind, on one connection, `n` grants on fresh keys are pipelined, then
their `n` releases; the kinds alternate in each of `rounds` rounds, so
only ratios within the run count. Per cycle (grant + release): Redis µs
(`INFO commandstats`, the script calls at top level: what Redis spent
inside lockgate's scripts) and redis-server's CPU (its threads' run time,
sockets included), each summed over the masters with --quorum, and the
ratio of both to the exclusive lock's. The kinds:

  exclusive   LOCK k ttl                  / UNLOCK k token
  shared      LOCK k ttl SHARED           / UNLOCK
  owned       LOCK k ttl OWNER o          / UNLOCK   (reentrant)
  reentry     LOCK k ttl OWNER o, held    / UNLOCK   (an entry again)
  permit      ACQUIRE k 8 ttl             / UNLOCK
  multi2      LOCK k1 k2 ttl              / UNLOCK k1, UNLOCK k2
  msetnx2     MSETNX k1 v k2 v            / DEL k1 k2 (legacy, leased;
                                                       not with the quorum)
  setnx       SETNX k v                   / DEL k     (legacy, leased)

Prints a markdown table and the run's load average.
"""

import argparse
import os
import sys
import tempfile
import time

import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate  # noqa: E402  (the processes' helpers)

TTL = "30000"


def script_usec(r):
    """Redis µs and calls in lockgate's scripts and the top-level lock
    commands so far (eval/evalsha; setnx, del, msetnx are run inside
    scripts)."""
    stats = r.info("commandstats")
    usec = sum(v["usec"] for k, v in stats.items()
               if k in ("cmdstat_eval", "cmdstat_evalsha"))
    return usec


def cpu_ns(pid):
    """redis-server's threads' run time so far (ns)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def cycle(c, kind, run, n):
    """n grants then n releases of `kind` on fresh keys of `run`."""
    p = c.pipeline(transaction=False)
    keys = [f"lock:kc:{run}:{kind}:{i}" for i in range(n)]
    for k in keys:
        if kind == "exclusive":
            p.execute_command("LOCKGATE", "LOCK", k, TTL)
        elif kind == "shared":
            p.execute_command("LOCKGATE", "LOCK", k, TTL, "SHARED")
        elif kind in ("owned", "reentry"):
            p.execute_command("LOCKGATE", "LOCK", k, TTL, "OWNER", "o")
        elif kind == "permit":
            p.execute_command("LOCKGATE", "ACQUIRE", k, "8", TTL)
        elif kind == "multi2":
            p.execute_command("LOCKGATE", "LOCK", k + ":a", k + ":b", TTL)
        elif kind == "msetnx2":
            p.execute_command("MSETNX", k + ":a", "v", k + ":b", "v")
        elif kind == "setnx":
            p.execute_command("SETNX", k, "v")
    return keys, p.execute()


def release(c, kind, keys, granted):
    p = c.pipeline(transaction=False)
    for k, g in zip(keys, granted):
        if kind == "multi2":
            ta, tb = g[0]
            p.execute_command("LOCKGATE", "UNLOCK", k + ":a", ta)
            p.execute_command("LOCKGATE", "UNLOCK", k + ":b", tb)
        elif kind == "msetnx2":
            p.execute_command("DEL", k + ":a", k + ":b")
        elif kind == "setnx":
            p.execute_command("DEL", k)
        else:
            p.execute_command("LOCKGATE", "UNLOCK", k, int(g[0]))
    out = p.execute()
    bad = [r for r in out if r not in (1, 2)]
    if bad:
        raise SystemExit(f"kinds_cost: {kind}: releases answered {bad[:3]}")


KINDS = ["exclusive", "shared", "owned", "reentry", "permit", "multi2", "msetnx2", "setnx"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lockgate", required=True)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quorum", type=int, default=0, help="lock masters (0: one Redis)")
    args = ap.parse_args()
    args.lockgate = os.path.abspath(args.lockgate)
    tmp = tempfile.mkdtemp(prefix="kinds-cost-")
    procs = gate.Procs(tmp)
    try:
        primary = gate.start_redis(procs, "redis")
        stores = [primary]
        config = ""
        if args.quorum:
            stores = [gate.start_redis(procs, f"master{i}") for i in range(args.quorum)]
            masters = ", ".join(f'"127.0.0.1:{p}"' for p in stores)
            config = f"[locks.quorum]\nmasters = [{masters}]\nrejoin_delay_ms = 100\n"
        lg = gate.start_lockgate(procs, args, "lockgate", primary, config, callgrind=False)
        time.sleep(0.5)
        pids = {}
        for name, p in procs.procs:
            if name.startswith(("redis", "master")):
                pids[name] = p.pid
        watched = [pids["redis"]] if not args.quorum else [
            pids[f"master{i}"] for i in range(args.quorum)]
        rs = [redis.Redis(port=p) for p in stores]
        c = redis.Redis(port=lg.port)
        # MSETNX on lock keys is refused with the quorum.
        kinds = [k for k in KINDS if not (args.quorum and k == "msetnx2")]
        sums = {k: [0.0, 0.0, 0] for k in kinds}
        for rnd in range(args.rounds):
            for kind in kinds:
                run = f"{rnd}"
                if kind == "reentry":
                    # Held once already: the measured grants are entries
                    # again, each released once (the first entry after).
                    keys, first = cycle(c, "owned", f"{run}r", args.n)
                    before = (sum(script_usec(r) for r in rs), sum(cpu_ns(p) for p in watched))
                    _, again = cycle(c, "owned", f"{run}r", args.n)
                    release(c, "owned", keys, again)
                    after = (sum(script_usec(r) for r in rs), sum(cpu_ns(p) for p in watched))
                    release(c, "owned", keys, first)
                else:
                    before = (sum(script_usec(r) for r in rs), sum(cpu_ns(p) for p in watched))
                    keys, granted = cycle(c, kind, run, args.n)
                    if kind in ("msetnx2", "setnx"):
                        if any(g != 1 for g in granted):
                            raise SystemExit(f"kinds_cost: {kind}: not every grant made")
                    elif any(g is None for g in granted):
                        raise SystemExit(f"kinds_cost: {kind}: not every grant made")
                    release(c, kind, keys, granted)
                    after = (sum(script_usec(r) for r in rs), sum(cpu_ns(p) for p in watched))
                s = sums[kind]
                s[0] += after[0] - before[0]
                s[1] += (after[1] - before[1]) / 1000
                s[2] += args.n
        base = sums["exclusive"]
        base_us, base_cpu = base[0] / base[2], base[1] / base[2]
        load = open("/proc/loadavg").read().split()[:3]
        where = f"the quorum of {args.quorum}" if args.quorum else "one Redis"
        print(f"\nkinds_cost on {where}: {args.rounds} rounds of {args.n} cycles per kind, "
              f"load {' '.join(load)}\n")
        print("| kind | Redis µs in scripts per cycle | ÷ exclusive | Redis CPU µs per cycle | ÷ exclusive |")
        print("|---|---|---|---|---|")
        for kind in kinds:
            us, cpu, n = sums[kind]
            print(f"| {kind} | {us / n:.1f} | {us / n / base_us:.2f} | {cpu / n:.1f} | {cpu / n / base_cpu:.2f} |")
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
