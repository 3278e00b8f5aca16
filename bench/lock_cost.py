#!/usr/bin/env python3
"""What a lock command costs Redis, from INFO commandstats.

    python3 bench/lock_cost.py --proxy-port P --redis-port R [--n 20000]

P is a running lockgate whose upstream is the Redis on R (both on
127.0.0.1 unless --host). On one connection through lockgate it runs, each
phase pipelined and preceded by CONFIG RESETSTAT on Redis:

  acquire  SETNX lock:bench:<run>:i v     (fresh lock keys)
  extend   EXPIRE lock:bench:<run>:i 30   (legacy EXPIRE after SETNX)
  release  DEL lock:bench:<run>:i

and reads the commandstats delta: Redis µs per call of the script command
(evalsha, else eval), Redis µs per op of the top-level commands (script
calls and SCRIPT LOAD: commandstats also counts the commands a script runs,
inside the script's own time, so those are shown as a count per op, not
added), the client-side rate, and redis-server's process CPU time per op
(its threads' schedstat run time, when Redis runs on this machine: steadier than
commandstats on a loaded box, whose µs are wall-clock and include time
Redis was descheduled; it includes reading and writing the sockets). Then the same three
phases as plain SETNX/EXPIRE/DEL straight on Redis, on keys outside the
lock patterns, for reference, and the floor: the fewest plain commands a
lock with a lease and an owner record in a key of its own needs (SET NX PX
and SET PX; GET and two PEXPIREs; GET and a DEL of both), straight on
Redis, with no check made: what no implementation of such a lock can go
under. Prints a markdown table. With
--general-port G, a second lockgate in front of the same Redis with
`locks.fast_path = false` is measured the same way (the general scripts,
for the before/after in one run); with --shared-port S, a lockgate with
`proxy.upstream = "shared"` (its lock scripts travel over the shared
connections, many clients' in one system call).

Then the cycles as an app runs them, one at a time per connection: 16
connections each take a fresh lock, wait for the reply, (extend,) release,
and go on; Redis µs (commandstats, top level) and redis-server CPU per
whole cycle, through each lockgate and directly. Pipelined phases measure
the commands' own cost; these add what each command costs in system calls,
as an app without pipelining pays it. Standalone: needs
only python3 and redis-py. Do not run it against a Redis in use (it resets
its statistics).
"""

import argparse
import asyncio
import os
import time

import redis


def commandstats(r):
    """{command: (calls, usec)} from INFO commandstats."""
    out = {}
    for name, v in r.info("commandstats").items():
        cmd = name[len("cmdstat_"):] if name.startswith("cmdstat_") else name
        out[cmd] = (int(v["calls"]), int(v["usec"]))
    return out


def cpu_seconds(pid):
    """CPU time of process `pid`, all its threads, in seconds: field 1 of
    each thread's schedstat (ns), as bench/lib.sh's cpu_ns; /proc/PID/stat
    counts whole ticks (10 ms), too coarse for a phase of a few ms. None
    when not readable here."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, IndexError, ValueError):
        return None


def phase(admin, client, commands, batch):
    """Runs `commands` pipelined on `client` after CONFIG RESETSTAT on
    `admin`; returns ({cmd: (calls, usec)}, seconds, replies, Redis process
    CPU seconds or None)."""
    pid = admin.info("server").get("process_id")
    admin.config_resetstat()
    cpu0 = cpu_seconds(pid)
    replies = []
    start = time.perf_counter()
    for i in range(0, len(commands), batch):
        p = client.pipeline(transaction=False)
        for c in commands[i:i + batch]:
            p.execute_command(*c)
        replies.extend(p.execute(raise_on_error=False))
    took = time.perf_counter() - start
    cpu1 = cpu_seconds(pid)
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    stats = commandstats(admin)
    # INFO itself is counted once it ran; leave it out.
    stats.pop("info", None)
    stats.pop("config|resetstat", None)
    stats.pop("config", None)
    return stats, took, replies, cpu


TOP = ("eval", "evalsha", "script|load")

# Commands lockgate sends for a lock command instead of a script (never
# called from its scripts): top-level wherever they appear.
NATIVE = ("msetex",)


def top_usec(stats, script):
    """Redis µs of the top-level commands of a phase: commands a script
    calls are counted in commandstats too (inside the script's own time),
    so only the script calls, SCRIPT LOAD and native commands, or the
    plain command."""
    if script in TOP or script in NATIVE:
        return sum(stats.get(c, (0, 0))[1] for c in TOP + NATIVE)
    if script == "all":
        return sum(u for _, u in stats.values())
    if script == "exec":
        # Transactions (a server that refuses scripts): EXEC's time
        # includes the commands it runs, which commandstats also counts,
        # so every command but EXEC (its own overhead left out).
        return sum(u for c, (_, u) in stats.items() if c != "exec")
    return stats.get(script, (0, 0))[1]


def row(label, stats, n, took, script, cpu):
    """One table row (see `top_usec` for the total)."""
    calls, usec = stats.get(script, (0, 0))
    per_script = f"{usec / calls:.2f}" if calls else "-"
    top = top_usec(stats, script)
    nested = 0
    if script in TOP or script in NATIVE:
        nested = sum(c for cmd, (c, _) in stats.items() if cmd not in TOP + NATIVE)
    elif script == "exec":
        nested = sum(c for cmd, (c, _) in stats.items() if cmd != "exec")
    loads = stats.get("script|load", (0, 0))[0]
    cpu_col = f"{cpu * 1e6 / n:.1f}" if cpu is not None else "-"
    return (
        f"| {label} | {n} | {script} | {per_script} | {top / n:.2f} "
        f"| {nested / n:.2f} | {loads} | {n / took:,.0f} | {cpu_col} |"
    )


def cycles(costs, n, labels):
    """A table of whole legacy lock cycles (SETNX + DEL, and SETNX + EXPIRE
    + DEL): what one costs Redis through each lockgate in `labels` against
    the same plain commands sent directly, by commandstats and by
    redis-server's CPU."""
    shapes = (
        ("SETNX + DEL", ("acquire", "release")),
        ("SETNX + EXPIRE + DEL", ("acquire", "extend", "release")),
    )
    out = [
        "| lock cycle, per cycle | through | Redis µs | direct Redis µs | ratio "
        "| redis-server CPU µs | direct CPU µs | ratio |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    ratios = []
    for shape, phases in shapes:
        for label in labels:
            cells = []
            for col in (0, 1):
                lg = [costs[(label, p)][col] for p in phases]
                dr = [costs[("direct", p)][col] for p in phases]
                if None in lg or None in dr:
                    cells += ["-", "-", "-"]
                    continue
                scale = 1 if col == 0 else 1e6
                a, b = sum(lg) * scale / n, sum(dr) * scale / n
                cells += [f"{a:.2f}", f"{b:.2f}", f"{a / b:.1f}×" if b else "-"]
                if b:
                    ratios.append((shape, label, ("commandstats", "redis-server CPU")[col], a / b))
            out.append(f"| {shape} | {label} | " + " | ".join(cells) + " |")
    out += ["", "Target, pipelined: Redis per cycle ≤ 3× direct (2× stretch):", ""]
    for shape, label, what, r in ratios:
        verdict = "PASS (≤ 2×)" if r <= 2 else ("PASS" if r <= 3 else "MISS")
        out.append(f"- {shape}, {label}: {what} {r:.1f}× direct: {verdict}")
    return "\n".join(out)


def encode(*args):
    """A RESP request."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


async def one_by_one(host, port, prefix, per_conn, conns, extend):
    """`conns` connections, each running `per_conn` lock cycles one command
    at a time (each reply awaited), on fresh keys; every reply must be 1."""

    async def worker(c):
        r, w = await asyncio.open_connection(host, port)
        for i in range(per_conn):
            k = f"{prefix}:{c}:{i}"
            steps = [("SETNX", k, "1")] + ([("EXPIRE", k, 30)] if extend else []) + [("DEL", k)]
            for cmd in steps:
                w.write(encode(*cmd))
                await w.drain()
                line = await r.readline()
                if line != b":1\r\n":
                    raise RuntimeError(f"{cmd[0]} {k}: {line!r}")
        w.close()

    await asyncio.gather(*(worker(c) for c in range(conns)))


def cycle_cost(admin, host, port, prefix, n, conns, extend):
    """(Redis top-level µs, redis-server CPU µs) per cycle of `one_by_one`."""
    pid = admin.info("server").get("process_id")
    admin.config_resetstat()
    cpu0 = cpu_seconds(pid)
    per_conn = max(1, n // conns)
    asyncio.run(one_by_one(host, port, prefix, per_conn, conns, extend))
    cpu1 = cpu_seconds(pid)
    stats = commandstats(admin)
    for c in ("info", "config|resetstat", "config"):
        stats.pop(c, None)
    done = per_conn * conns
    top = sum(stats.get(c, (0, 0))[1] for c in TOP + NATIVE)
    # Inside a script, commands are counted in the script's time too; so
    # are they inside EXEC (see `top_usec`).
    usec = top if top else top_usec(stats, "exec")
    cpu = (cpu1 - cpu0) * 1e6 / done if cpu0 is not None and cpu1 is not None else None
    return usec / done, cpu


def one_by_one_table(admin, host, ports, run, n, conns):
    """The table of `cycle_cost` for each (label, port) in `ports`, direct
    first, with each one's ratio to direct."""
    out = [
        f"Lock cycles one at a time per connection ({conns} connections, "
        f"{max(1, n // conns) * conns} cycles each, fresh keys):",
        "",
        "| cycle | " + " | ".join(f"{label} Redis µs / CPU µs" for label, _ in ports) + " |",
        "|---|" + "--:|" * len(ports),
    ]
    verdicts = []
    for shape, extend in (("SETNX + DEL", False), ("SETNX + EXPIRE + DEL", True)):
        cells, base = [], None
        for label, port in ports:
            prefix = f"lock:cycle:{run}:{label.replace(' ', '_')}:{int(extend)}"
            usec, cpu = cycle_cost(admin, host, port, prefix, n, conns, extend)
            if base is None:
                base = (usec, cpu)
                cells.append(f"{usec:.2f} / {cpu:.1f}" if cpu is not None else f"{usec:.2f} / -")
                continue
            ratio_u = f"{usec / base[0]:.1f}×" if base[0] else "-"
            ratio_c = f"{cpu / base[1]:.2f}×" if cpu is not None and base[1] else "-"
            cpu_s = f"{cpu:.1f}" if cpu is not None else "-"
            cells.append(f"{usec:.2f} ({ratio_u}) / {cpu_s} ({ratio_c})")
            if cpu is not None and base[1]:
                r = cpu / base[1]
                verdict = "PASS (≤ 2×)" if r <= 2 else ("PASS" if r <= 3 else "MISS")
                verdicts.append(f"- {shape}, {label}: redis-server CPU {r:.2f}× direct: {verdict}")
                ru = usec / base[0] if base[0] else float("inf")
                verdict = "PASS (≤ 2×)" if ru <= 2 else ("PASS" if ru <= 3 else "MISS")
                verdicts.append(f"- {shape}, {label}: commandstats {ru:.1f}× direct: {verdict}")
        out.append(f"| {shape} | " + " | ".join(cells) + " |")
    if verdicts:
        out += ["", "Target, one at a time: Redis per cycle ≤ 3× direct (2× stretch):", ""]
        out += verdicts
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proxy-port", type=int, required=True)
    ap.add_argument("--redis-port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--n", type=int, default=20000, help="operations per phase")
    ap.add_argument("--batch", type=int, default=500, help="pipeline depth")
    ap.add_argument("--prefix", default="lock:bench", help="lock key prefix (must match locks.keys)")
    ap.add_argument(
        "--general-port", type=int, help="a lockgate with locks.fast_path = false, same Redis"
    )
    ap.add_argument(
        "--shared-port", type=int, help='a lockgate with proxy.upstream = "shared", same Redis'
    )
    ap.add_argument("--conns", type=int, default=16, help="connections for the one-by-one cycles")
    args = ap.parse_args()

    admin = redis.Redis(host=args.host, port=args.redis_port)
    proxy = redis.Redis(host=args.host, port=args.proxy_port)
    direct = redis.Redis(host=args.host, port=args.redis_port)
    run = f"{os.getpid()}{int(time.time())}"
    n = args.n
    keys = [f"{args.prefix}:{run}:{i}" for i in range(n)]
    plain = [f"bench:plain:{run}:{i}" for i in range(n)]
    # Warm the connection (and, after the change, load the scripts) so the
    # table shows the steady state; SCRIPT LOADs still show in its column.
    proxy.ping()

    rows = []
    checks = []
    # Per label and phase: (Redis top-level µs, Redis process CPU s or None).
    costs = {}
    measured = [("lockgate", proxy, keys), ("direct", direct, plain)]
    if args.general_port:
        general = redis.Redis(host=args.host, port=args.general_port)
        general.ping()
        gkeys = [f"{args.prefix}:{run}:g:{i}" for i in range(n)]
        measured.insert(1, ("lockgate general", general, gkeys))
    if args.shared_port:
        shared = redis.Redis(host=args.host, port=args.shared_port)
        shared.ping()
        skeys = [f"{args.prefix}:{run}:s:{i}" for i in range(n)]
        measured.insert(len(measured) - 1, ("lockgate shared", shared, skeys))
    # The floor: the fewest plain commands, sent straight to Redis, that a
    # lock with a lease and an owner record in a key of its own needs (no
    # check made, no script): both keys set with the lease; the record read
    # and both keys' leases moved; the record read and both keys deleted.
    fkeys = [f"{args.prefix}:{run}:f:{i}" for i in range(n)]
    measured.append(("floor", direct, fkeys))
    for label, client, ks in measured:
        results = {}
        phases = (
            ("acquire (SETNX)", [("SETNX", k, "v") for k in ks]),
            ("extend (EXPIRE)", [("EXPIRE", k, 30) for k in ks]),
            ("release (DEL)", [("DEL", k) for k in ks]),
        )
        if label == "floor":
            o = "{}:owner".format
            phases = (
                (
                    "acquire (SETNX)",
                    [c for k in ks for c in (("SET", k, "v", "NX", "PX", 30000),
                                              ("SET", o(k), "t", "PX", 30000))],
                ),
                (
                    "extend (EXPIRE)",
                    [c for k in ks for c in (("GET", o(k)), ("PEXPIRE", k, 30000),
                                              ("PEXPIRE", o(k), 30000))],
                ),
                ("release (DEL)", [c for k in ks for c in (("GET", o(k)), ("DEL", k, o(k)))]),
            )
        for op, cmds in phases:
            stats, took, replies, cpu = phase(admin, client, cmds, args.batch)
            ok = sum(1 for r in replies if r == 1 or r is True)
            if label != "floor":
                checks.append(f"{label} {op}: {ok}/{n} answered 1")
            if label == "floor":
                name = "all"
            elif label.startswith("lockgate"):
                name = next((c for c in NATIVE + ("evalsha", "eval") if c in stats), None)
                # No script at all: the server refuses scripts, and lockgate
                # carries its lock operations out as transactions.
                name = name or ("exec" if "exec" in stats else "eval")
            else:
                name = op.split()[-1].strip("()").lower()
            results[op] = (stats, took, name, cpu)
        for op, (stats, took, name, cpu) in results.items():
            rows.append(row(f"{label} {op}", stats, n, took, name, cpu))
            costs[(label, op.split()[0])] = (top_usec(stats, name), cpu)

    print(f"Redis CPU per operation (INFO commandstats), n={n}, pipeline {args.batch}")
    print()
    print(
        "| phase | ops | command | µs per call | Redis µs per op (top-level, incl. SCRIPT LOAD) "
        "| commands run by the script per op | SCRIPT LOADs | ops/s (client) "
        "| redis-server CPU µs per op (process, incl. network) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(r)
    print()
    print(cycles(costs, n, [label for label, _, _ in measured if label != "direct"]))
    print()
    print(
        "(floor: the fewest plain commands a lock with a lease and an owner record "
        "in a key of its own needs, sent straight to Redis without any check: "
        "no lockgate can cost less)"
    )
    print()
    ports = [("direct", args.redis_port), ("lockgate", args.proxy_port)]
    if args.general_port:
        ports.append(("lockgate general", args.general_port))
    if args.shared_port:
        ports.append(("lockgate shared", args.shared_port))
    print(one_by_one_table(admin, args.host, ports, run, n // 4, args.conns))
    print()
    for c in checks:
        print(f"- {c}")


if __name__ == "__main__":
    main()
