#!/usr/bin/env python3
"""One lock storm, as the apps with redis-py's connection handling make it.

    python3 bench/shapes_load.py --shape own|pool --port P [options]

Threads spin `SETNX KEY id` with no sleep between attempts; the one that
gets it holds it `--hold-ms`, `DEL`s it and goes back to trying. How the
threads reach Redis is the shape:

  own   each thread its own connection (`single_connection_client=True`)
  pool  one `BlockingConnectionPool(max_connections=--pool)` for all the
        threads, its connections opened before the storm (as a running
        app's are): redis-py's pool is a LIFO queue, so the connection a
        winner used goes straight back to the next spinning thread, and its
        DEL goes on whichever connection it gets then

With `--gone`, nobody ever wins: the key is set first (on --seed-port, the
Redis behind the target, `SET KEY gone PX` longer than the run) by a holder
that is gone, and the threads spin on it for the whole run.

Prints one JSON line: acquisitions (total and per thread), attempts, the
gap from each release (its DEL sent, once the pool lent a connection for
it) to the next acquisition's reply (ms: p50, p99, max), errors. Used by bench/shapes.sh and by tests/py/storm_shapes.py.
"""

import argparse
import json
import threading
import time

import redis


def pct(values, p):
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=("own", "pool"), required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--key", default="lock:shapes")
    ap.add_argument("--threads", type=int, default=20)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--hold-ms", type=float, default=2000)
    ap.add_argument("--duration-s", type=float, default=4)
    ap.add_argument("--protocol", type=int, default=2)
    ap.add_argument("--gone", action="store_true")
    ap.add_argument("--seed-port", type=int, default=0)
    a = ap.parse_args()

    if a.gone:
        seed = redis.Redis(host=a.host, port=a.seed_port or a.port)
        seed.set(a.key, "gone", px=int(a.duration_s * 1000) + 30_000)
        seed.close()

    if a.shape == "pool":
        pool = redis.BlockingConnectionPool(
            host=a.host, port=a.port, max_connections=a.pool, protocol=a.protocol, timeout=30
        )
        clients = [redis.Redis(connection_pool=pool)] * a.threads
        # A running app's pool is open before the storm: connections opened
        # during a hold are younger than the lock, and lockgate lets them
        # release only what was acquired after they opened (the pooled rule).
        warm = [pool.get_connection() for _ in range(a.pool)]
        for c in warm:
            c.send_command("PING")
            c.read_response()
        for c in warm:
            pool.release(c)
    else:
        clients = [
            redis.Redis(host=a.host, port=a.port, single_connection_client=True, protocol=a.protocol)
            for _ in range(a.threads)
        ]
    clients[0].ping()

    lock = threading.Lock()
    state = {"released_at": None, "gaps": [], "attempts": 0, "errors": 0, "holder": None,
             "overlaps": 0}
    per = [0] * a.threads
    start = time.monotonic()
    end = start + a.duration_s

    def released():
        # The DEL goes now: a handoff may answer the next holder before
        # this thread reads the DEL's reply.
        with lock:
            state["holder"] = None
            state["released_at"] = time.monotonic()

    def release(r):
        if a.shape != "pool":
            released()
            r.delete(a.key)
            return
        # As redis-py's own DEL: a connection of the pool first (the wait
        # for one is the pool's, straight on Redis too), then the command.
        c = pool.get_connection()
        try:
            released()
            c.send_command("DEL", a.key)
            c.read_response()
        finally:
            pool.release(c)

    def worker(i):
        r = clients[i]
        attempts = errors = 0
        while time.monotonic() < end:
            attempts += 1
            try:
                won = r.setnx(a.key, f"t{i}")
            except redis.RedisError:
                errors += 1
                time.sleep(0.01)
                continue
            if not won:
                continue
            now = time.monotonic()
            with lock:
                if state["holder"] is not None:
                    state["overlaps"] += 1
                state["holder"] = i
                if state["released_at"] is not None:
                    state["gaps"].append((now - state["released_at"]) * 1000)
                    state["released_at"] = None
            per[i] += 1
            time.sleep(a.hold_ms / 1000)
            try:
                release(r)
            except redis.RedisError:
                errors += 1
        with lock:
            state["attempts"] += attempts
            state["errors"] += errors

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    gaps = state["gaps"]
    print(json.dumps({
        "shape": a.shape,
        "gone": a.gone,
        "threads": a.threads,
        "elapsed_s": round(elapsed, 3),
        "acquisitions": sum(per),
        "per_worker": per,
        "attempts": state["attempts"],
        "errors": state["errors"],
        "overlaps": state["overlaps"],
        "gap_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": max(gaps) if gaps else None,
                   "n": len(gaps)},
    }))


if __name__ == "__main__":
    main()
