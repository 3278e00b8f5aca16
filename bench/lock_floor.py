#!/usr/bin/env python3
"""What carrying lock operations costs the server, in its own instructions:
the ways an exact lock with a lease and an owner record could be carried,
straight on one server under callgrind (no lockgate), per cycle (one
acquisition and one release), against a bare SETNX + DEL.

    python3 bench/lock_floor.py [--server redis-server] [--n 4000]

Rows (each pipelined on one connection, on fresh keys):
  bare            SETNX k 1; DEL k  (the incident's own commands, no lease)
  floor           SET k v NX PX; SET owner t PX; GET owner; DEL k owner
                  (the fewest plain commands such a lock needs, nothing
                  checked, nothing atomic)
  script/op       one EVALSHA per operation: EXISTS queue, SET NX PX, SET
                  PX owner; GET owner, DEL both (lockgate's fast path's
                  shape, with its argument count)
  script/B        one EVALSHA carrying B acquisitions, one carrying B
                  releases (group commit by script)
  txn/B           WATCH + EXISTS, then MULTI, B acquisitions, EXEC; WATCH +
                  MGET + EXISTS, then MULTI, B releases, EXEC (group commit
                  by transaction)

Counts, not times: a busy box does not move them (docs/performance.md,
"Where an uncontended lock's cost goes").
"""

import argparse
import os
import shutil
import sys
import tempfile

import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate  # noqa: E402  (the gate's process and callgrind helpers)

ACQ_ONE = """
if redis.call('EXISTS', KEYS[3]) == 0 then
  local ok = redis.pcall('SET', KEYS[1], ARGV[2], 'NX', ARGV[4], ARGV[5])
  if ok then redis.call('SET', KEYS[2], ARGV[3], ARGV[4], ARGV[5]) return 1 end
end
return 0
"""
REL_ONE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local d = redis.call('DEL', KEYS[1], KEYS[2]) - 1
if d > 0 then redis.call('EXISTS', KEYS[3]) end
return d
"""
ACQ_MANY = """
local out = {}
for i = 1, #KEYS, 3 do
  local j = (i - 1) / 3 * 3
  if redis.call('EXISTS', KEYS[i + 2]) == 0
      and redis.call('SET', KEYS[i], ARGV[j + 1], 'NX', 'PX', ARGV[j + 3]) then
    redis.call('SET', KEYS[i + 1], ARGV[j + 2], 'PX', ARGV[j + 3])
    out[#out + 1] = 1
  else out[#out + 1] = 0 end
end
return out
"""
REL_MANY = """
local out = {}
for i = 1, #KEYS, 3 do
  if redis.call('GET', KEYS[i + 1]) ~= ARGV[(i + 2) / 3] then out[#out + 1] = -1
  else
    out[#out + 1] = redis.call('DEL', KEYS[i], KEYS[i + 1]) - 1
    redis.call('EXISTS', KEYS[i + 2])
  end
end
return out
"""


def keys(run, i):
    return f"lock:{run}:{i}", f"owner:{run}:{i}", f"queue:{run}:{i}"


def rows(c, conn, n, shas):
    """(name, fn(run)) for every row."""

    def bare(run):
        gate.pipeline(c, [("SETNX", keys(run, i)[0], "1") for i in range(n)]
                 + [("DEL", keys(run, i)[0]) for i in range(n)])

    def floor(run):
        cmds = []
        for i in range(n):
            k, o, _ = keys(run, i)
            cmds += [("SET", k, "1", "NX", "PX", "30000"), ("SET", o, "t", "PX", "30000")]
        for i in range(n):
            k, o, _ = keys(run, i)
            cmds += [("GET", o), ("DEL", k, o)]
        gate.pipeline(c, cmds)

    def per_op(run):
        acq, rel = [], []
        for i in range(n):
            k, o, q = keys(run, i)
            # lockgate's fast acquisition's 4 keys and 10 arguments.
            acq.append(("EVALSHA", shas[0], 4, k, o, q, q + ":p", "3", "1", f"tok{i}", "PX",
                        "30000", "setnx", "inst:", "500", "2000", "1"))
            rel.append(("EVALSHA", shas[1], 4, k, o, q, q + ":p", f"tok{i}", "DEL"))
        gate.pipeline(c, acq + rel)

    def scripts(b):
        def go(run):
            cmds = []
            for s in range(0, n, b):
                ks, argv = [], []
                for i in range(s, min(s + b, n)):
                    ks += keys(run, i)
                    argv += ["1", f"tok{i}", "30000"]
                cmds.append(("EVALSHA", shas[2], len(ks), *ks, *argv))
            for s in range(0, n, b):
                ks = [k for i in range(s, min(s + b, n)) for k in keys(run, i)]
                cmds.append(("EVALSHA", shas[3], len(ks), *ks,
                             *[f"tok{i}" for i in range(s, min(s + b, n))]))
            gate.pipeline(c, cmds, 10)
        return go

    def txns(b):
        def ask(cmds):
            conn.send_packed_command(conn.pack_commands(cmds))
            return [conn.read_response() for _ in cmds]

        def go(run):
            for s in range(0, n, b):
                ks = [keys(run, i) for i in range(s, min(s + b, n))]
                ask([("WATCH", *[x for k in ks for x in k]),
                     ("EXISTS", *[k[0] for k in ks], *[k[2] for k in ks])])
                tx = [("MULTI",)]
                for i, (k, o, _) in zip(range(s, s + b), ks):
                    tx += [("SET", k, "1", "NX", "PX", "30000"), ("SET", o, f"tok{i}", "PX", "30000")]
                ask(tx + [("EXEC",)])
            for s in range(0, n, b):
                ks = [keys(run, i) for i in range(s, min(s + b, n))]
                ask([("WATCH", *[k[1] for k in ks]), ("MGET", *[k[1] for k in ks]),
                     ("EXISTS", *[k[2] for k in ks])])
                ask([("MULTI",)] + [("DEL", k, o) for k, o, _ in ks] + [("EXEC",)])
        return go

    out = [("bare SETNX + DEL", bare), ("floor", floor), ("script/op", per_op)]
    out += [(f"script/{b}", scripts(b)) for b in (4, 16, 50)]
    out += [(f"txn/{b}", txns(b)) for b in (1, 8, 32)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="redis-server")
    ap.add_argument("--n", type=int, default=4000)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lockgate-floor.")
    procs = gate.Procs(tmp)
    try:
        srv = gate.start_redis(procs, "server", callgrind=True, server=args.server)
        c = redis.Redis(port=srv.port, socket_timeout=120)
        conn = c.connection_pool.get_connection()
        shas = [c.script_load(s) for s in (ACQ_ONE, REL_ONE, ACQ_MANY, REL_MANY)]
        print(f"| {args.server}, n = {args.n} | instructions per cycle | × bare |")
        print("|---|--:|--:|")
        bare = None
        for run, (name, fn) in enumerate(rows(c, conn, args.n, shas)):
            per = srv.phase(lambda: fn(run), args.n)
            bare = bare or per
            print(f"| {name} | {per:,.0f} | {per / bare:.2f} |", flush=True)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
