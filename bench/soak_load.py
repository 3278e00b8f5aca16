#!/usr/bin/env python3
"""Mixed traffic for scripts/soak.sh, the soak's verdict, and the idle
connections of bench/idle_memory.sh.

    soak_load.py run PORT SECONDS STATUS_FILE ERRORS_JSON
        Mixed traffic through lockgate on 127.0.0.1:PORT for SECONDS, from
        one thread per worker (redis-py, RESP2):
          pass     x2  SET/GET/INCR and a 10-command pipeline on plain keys
          legacy   x4  SETNX lock:soak:legacy:{0,1,2} + EXPIRE + DEL
                       (contention: four workers on three shared keys)
          nxpx     x2  SET lock:soak:nx:{0,1} NX PX + compare-and-delete EVAL
          pub / sub    PUBLISH soak:ch <seq> / SUBSCRIBE soak:ch
          push / pop   LPUSH soak:q / BLPOP soak:q 1
          churn        a new connection: PING, SET, GET, close
        Every reply is checked; a wrong one counts as `unexpected:<worker>`,
        a release of a lock held that answers 0 as `lost:<worker>`,
        an error reply as `reply:<worker>:<first word>`, a lost or refused
        connection as `conn:<worker>`. Nothing stops the load: a worker
        reconnects and goes on. Every second STATUS_FILE gets one line,
        "<ops> <errors>"; at the end ERRORS_JSON gets
        {"ops": N, "seconds": S, "errors": {kind: count}}.

    soak_load.py lockable PORT
        Waits (up to 60 s) until lockgate on PORT grants a lock: a quorum's
        masters started just before lockgate sit out first.

    soak_load.py report CSV WARMUP_S ERRORS_JSON OUT_MD
        Judges the samples (see scripts/soak.sh for the columns and the
        thresholds), prints the summary and writes it to OUT_MD; exit 1
        when RSS, fds or tasks grew after the warm-up.

    soak_load.py idle PORT N READY_FILE
        Opens N connections to 127.0.0.1:PORT, sends PING on each and reads
        +PONG, writes READY_FILE, then holds them idle until stdin closes.
"""

import json
import os
import random
import socket
import statistics
import sys
import threading
import time

PACE = 0.002  # seconds a worker sleeps between iterations (a shared machine)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ops = 0
        self.errors = {}

    def add(self, n):
        with self.lock:
            self.ops += n

    def error(self, kind):
        """Counts one error of this kind; returns the count so far."""
        with self.lock:
            n = self.errors[kind] = self.errors.get(kind, 0) + 1
            return n

    def snapshot(self):
        with self.lock:
            return self.ops, dict(self.errors)


T0 = time.monotonic()


def say(what):
    print(f"[soak_load] {time.monotonic() - T0:7.1f}s {what}", file=sys.stderr, flush=True)


def reply_kind(e):
    """An error reply's first three words, digits dropped (a kind, not a
    message)."""
    words = "".join(c for c in str(e) if not c.isdigit()).split()[:3]
    return "_".join(words) or "?"


class Unexpected(Exception):
    pass


class Lost(Exception):
    """A lock this worker took was not released by its owner's release
    (DEL or compare-and-delete answered 0): expected only while the quorum
    is lost (two masters restarting or sitting out at once)."""


def expect(cond, what):
    if not cond:
        raise Unexpected(what)


CAD = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('del', KEYS[1]) else return 0 end"
)


def worker(name, port, stop, stats, body):
    """Runs body(r, rng) until stop, counting errors by kind; a fresh
    client after any error."""
    import redis

    rng = random.Random(name)
    r = None
    while not stop.is_set():
        try:
            if r is None:
                r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10,
                                socket_connect_timeout=5, single_connection_client=True)
            stats.add(body(r, rng))
            time.sleep(PACE)
        except Unexpected as e:
            stats.error(f"unexpected:{name.split('-')[0]}")
            say(f"{name}: unexpected: {e}")
        except Lost as e:
            stats.error(f"lost:{name.split('-')[0]}")
            say(f"{name}: lost: {e}")
        except redis.ResponseError as e:
            kind = f"reply:{name.split('-')[0]}:{reply_kind(e)}"
            if stats.error(kind) == 1:
                say(f"{name}: first {kind}: {e}")
            time.sleep(0.05)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            stats.error(f"conn:{name.split('-')[0]}")
            r = close(r)
            time.sleep(0.2)
    close(r)


def close(r):
    if r is not None:
        try:
            r.close()
        except Exception:  # noqa: BLE001 - closing a broken client
            pass
    return None


def passthrough(r, rng, me=None):
    me = me or threading.current_thread().name
    k = f"soak:plain:{me}:{rng.randrange(1000)}"
    v = str(rng.randrange(1 << 30))
    expect(r.set(k, v) is True, "SET")
    expect(r.get(k) == v.encode(), "GET after SET")
    n = r.incr("soak:counter")
    expect(isinstance(n, int) and n > 0, f"INCR {n!r}")
    p = r.pipeline(transaction=False)
    for i in range(5):
        p.set(f"soak:pipe:{me}:{i}", v)
        p.get(f"soak:pipe:{me}:{i}")
    out = p.execute()
    expect(out[0::2] == [True] * 5, f"pipeline SETs {out!r}")
    expect(all(isinstance(x, bytes) for x in out[1::2]), f"pipeline GETs {out!r}")
    return 13


def legacy(r, rng):
    k = f"lock:soak:legacy:{rng.randrange(3)}"
    token = f"t{rng.randrange(1 << 30)}"
    got = r.setnx(k, token)
    if not got:
        time.sleep(0.005)
        return 1
    expect(r.expire(k, 10) is True, "EXPIRE on a lock just taken")
    time.sleep(rng.uniform(0.001, 0.005))
    n = r.delete(k)
    if n != 1:
        raise Lost(f"DEL {k} held: {n!r}")
    return 3


def nxpx(r, rng):
    k = f"lock:soak:nx:{rng.randrange(2)}"
    token = f"t{rng.randrange(1 << 30)}"
    if not r.set(k, token, nx=True, px=5000):
        time.sleep(0.005)
        return 1
    time.sleep(rng.uniform(0.001, 0.005))
    n = r.eval(CAD, 1, k, token)
    if n != 1:
        raise Lost(f"compare-and-delete of {k} held: {n!r}")
    return 2


def publisher(r, rng, state={"seq": 0}):  # noqa: B006 - one publisher
    state["seq"] += 1
    n = r.publish("soak:ch", str(state["seq"]))
    expect(isinstance(n, int) and n >= 0, f"PUBLISH {n!r}")
    time.sleep(0.01)
    return 1


def subscriber_loop(port, stop, stats):
    """SUBSCRIBE soak:ch and read: every message a number above the last
    one seen on this subscription (gaps are allowed only across a
    resubscription)."""
    import redis

    while not stop.is_set():
        r = p = None
        try:
            r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
            p = r.pubsub()
            p.subscribe("soak:ch")
            last = None
            while not stop.is_set():
                m = p.get_message(timeout=1.0)
                if m is None:
                    continue
                stats.add(1)
                if m["type"] == "subscribe":
                    continue
                try:
                    expect(m["type"] == "message" and m["channel"] == b"soak:ch", repr(m))
                    seq = int(m["data"])
                    expect(last is None or seq > last, f"message {seq} after {last}")
                    last = seq
                except (Unexpected, ValueError) as e:
                    stats.error("unexpected:sub")
                    say(f"sub: unexpected: {e}")
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            stats.error("conn:sub")
            time.sleep(0.2)
        except redis.ResponseError as e:
            stats.error(f"reply:sub:{reply_kind(e)}")
            time.sleep(0.2)
        finally:
            for c in (p, r):
                if c is not None:
                    try:
                        c.close()
                    except Exception:  # noqa: BLE001
                        pass


def pusher(r, rng):
    n = r.lpush("soak:q", f"item{rng.randrange(1 << 30)}")
    expect(isinstance(n, int) and n >= 1, f"LPUSH {n!r}")
    if n > 1000:  # nobody pops: keep the list bounded
        r.ltrim("soak:q", 0, 99)
    time.sleep(0.02)
    return 1


def popper(r, rng):
    got = r.blpop(["soak:q"], timeout=1)
    expect(got is None or (got[0] == b"soak:q" and got[1].startswith(b"item")), f"BLPOP {got!r}")
    return 1


def churn(port, stop, stats):
    while not stop.is_set():
        s = None
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"PING\r\nSET soak:churn 1\r\nGET soak:churn\r\n")
            want = b"+PONG\r\n+OK\r\n$1\r\n1\r\n"
            buf = b""
            while len(buf) < len(want):
                chunk = s.recv(4096)
                if not chunk:
                    raise ConnectionError("closed")
                buf += chunk
            if buf != want:
                stats.error("unexpected:churn")
                say(f"churn: unexpected: {buf!r}")
            stats.add(3)
        except OSError:
            stats.error("conn:churn")
            time.sleep(0.2)
        finally:
            if s is not None:
                s.close()
        time.sleep(0.01)


def run(port, seconds, status_file, errors_json):
    port, seconds = int(port), float(seconds)
    stop = threading.Event()
    stats = Stats()
    jobs = [("pass-1", passthrough), ("pass-2", passthrough)]
    jobs += [(f"legacy-{i}", legacy) for i in range(4)]
    jobs += [(f"nxpx-{i}", nxpx) for i in range(2)]
    jobs += [("pub", publisher), ("push", pusher), ("pop", popper)]
    threads = [threading.Thread(target=worker, args=(n, port, stop, stats, b), name=n, daemon=True)
               for n, b in jobs]
    threads.append(threading.Thread(target=subscriber_loop, args=(port, stop, stats), daemon=True))
    threads.append(threading.Thread(target=churn, args=(port, stop, stats), daemon=True))
    for t in threads:
        t.start()
    start = time.monotonic()
    end = start + seconds
    while time.monotonic() < end:
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        ops, errors = stats.snapshot()
        tmp = status_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{ops} {sum(errors.values())}\n")
        os.replace(tmp, status_file)
    stop.set()
    for t in threads:
        t.join(timeout=15)
    ops, errors = stats.snapshot()
    with open(errors_json, "w") as f:
        json.dump({"ops": ops, "seconds": time.monotonic() - start, "errors": errors}, f,
                  indent=1, sort_keys=True)


def lockable(port):
    import redis

    r = redis.Redis(host="127.0.0.1", port=int(port), socket_timeout=5)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if r.set("lock:soak:ready", "1", nx=True, px=1000):
                r.delete("lock:soak:ready")
                return 0
        except redis.ResponseError:
            pass
        time.sleep(0.5)
    sys.exit("lockgate grants no lock after 60 s")


# --- the verdict ----------------------------------------------------------

RSS_GROWTH = 0.10  # RSS may grow 10 % ...
RSS_SLACK_KB = 2048  # ... + 2 MB
FD_SLACK = 10  # fds may grow by this many
TASK_SLACK = 10  # tasks too


def report(csv_path, warmup_s, errors_json, out_md):
    warmup_s = float(warmup_s)
    with open(csv_path) as f:
        header = f.readline().strip().split(",")
        rows = [dict(zip(header, map(float, line.strip().split(",")))) for line in f if line.strip()]
    with open(errors_json) as f:
        load = json.load(f)
    after = [r for r in rows if r["elapsed_s"] >= warmup_s]
    lines = []
    ok = True
    out = lines.append
    out(f"samples: {len(rows)} ({len(after)} after the {warmup_s:.0f} s warm-up)")
    out("")
    out("| series | first | after warm-up | end | max |")
    out("|---|---:|---:|---:|---:|")
    for col in ["rss_kb", "fds", "tasks", "client_conns", "redis_clients"]:
        vals = [r[col] for r in rows]
        w = [r[col] for r in after] or vals
        out(f"| {col} | {vals[0]:.0f} | {w[0]:.0f} | {vals[-1]:.0f} | {max(vals):.0f} |")
    secs = load["seconds"] or 1
    out("")
    out(f"ops: {load['ops']} in {secs:.0f} s = {load['ops'] / secs:.0f} ops/s")
    errs = load["errors"]
    out(f"errors: {sum(errs.values())}" + ("" if errs else " (none)"))
    for k in sorted(errs):
        out(f"  {k}: {errs[k]}")
    out("")
    if len(after) < 10:
        out(f"FAIL: only {len(after)} samples after the warm-up (need 10)")
        ok = False
    else:
        n = max(2, len(after) // 5)
        head, tail = after[:n], after[-n:]
        med = lambda xs, c: statistics.median(x[c] for x in xs)  # noqa: E731
        checks = [
            ("rss_kb", lambda a: a * (1 + RSS_GROWTH) + RSS_SLACK_KB,
             f"+{RSS_GROWTH:.0%} + {RSS_SLACK_KB} kB"),
            ("fds", lambda a: a + FD_SLACK, f"+{FD_SLACK}"),
            ("tasks", lambda a: a + TASK_SLACK, f"+{TASK_SLACK}"),
        ]
        out(f"growth: median of the first {n} samples after the warm-up vs the last {n}")
        for col, limit, rule in checks:
            a, b = med(head, col), med(tail, col)
            verdict = "ok" if b <= limit(a) else "GREW"
            ok &= verdict == "ok"
            out(f"  {col}: {a:.0f} -> {b:.0f} (limit {limit(a):.0f}, {rule}) {verdict}")
    out("")
    out("PASS: flat after the warm-up" if ok else "FAIL: grew after the warm-up")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    with open(out_md, "w") as f:
        f.write("# Soak summary\n\n" + text)
    return 0 if ok else 1


# --- idle connections -----------------------------------------------------

def idle(port, n, ready_file):
    port, n = int(port), int(n)
    socks, pending = [], []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"PING\r\n")
        socks.append(s)
        pending.append(s)
        if len(pending) == 200 or i == n - 1:  # read the PONGs in batches
            for t in pending:
                buf = b""
                while len(buf) < 7:
                    chunk = t.recv(16)
                    if not chunk:
                        sys.exit(f"connection closed before +PONG ({len(socks)} open)")
                    buf += chunk
                if buf != b"+PONG\r\n":
                    sys.exit(f"not +PONG: {buf!r}")
            pending = []
    with open(ready_file, "w") as f:
        f.write(f"{len(socks)}\n")
    sys.stdin.read()  # held until the script closes our stdin
    for s in socks:
        s.close()


if __name__ == "__main__":
    cmds = {"run": run, "lockable": lockable, "report": report, "idle": idle}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        sys.exit(__doc__)
    sys.exit(cmds[sys.argv[1]](*sys.argv[2:]) or 0)
