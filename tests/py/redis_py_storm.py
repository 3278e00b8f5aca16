"""A retry storm of redis-py's Lock: THREADS threads, each on its own
connection, take one lock in turn with a blocking acquire that polls every
SLEEP seconds, hold it HOLD seconds, release it, for SECS seconds.

Usage: redis_py_storm.py HOST PORT REDIS_HOST REDIS_PORT KEY THREADS SECS [own|pool] [redis-py|pottery|python-redis-lock]

With "pool" the threads share one client whose LIFO pool
(`BlockingConnectionPool`, which hands out the connection returned last) has
half as many connections as there are threads, so a release goes out on
whichever connection the pool hands the holder, often not the one it
acquired on.
With "pottery" the threads lock with pottery's `Redlock` (its one master
the address given, its key `redlock:KEY`), retrying every SLEEP seconds at
most (its own `_RETRY_DELAY`, 0.2 s by default, set to SLEEP) until it has
the lock.
With "python-redis-lock" the threads lock with python-redis-lock's `Lock`
(its key `lock:KEY`, a 10 s lease), which polls nothing: a waiter blocks on
the lock's signal list (`BLPOP`, at most 5 s) until a release pushes to it.
Prints one JSON line: acquisitions, and what Redis itself ran meanwhile
(INFO read straight on Redis before and after): the commands it
processed and the CPU seconds it used.
"""

import json
import sys
import threading
import time

import redis

if len(sys.argv) > 9 and sys.argv[9] == "pottery":
    from pottery import Redlock
    Redlock._RETRY_DELAY = 0.001

if len(sys.argv) > 9 and sys.argv[9] == "python-redis-lock":
    import redis_lock
host, port, rhost, rport, key = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
threads, secs = int(sys.argv[6]), float(sys.argv[7])
pooled = len(sys.argv) > 8 and sys.argv[8] == "pool"
library = sys.argv[9] if len(sys.argv) > 9 else "redis-py"
SLEEP, HOLD = 0.001, 0.005

direct = redis.Redis(host=rhost, port=rport)


def stats():
    """Commands Redis processed (scripts' own calls inside them not
    counted) and the CPU seconds it used, user and system."""
    calls = direct.info("stats")["total_commands_processed"]
    cpu = direct.info("cpu")
    return calls, cpu["used_cpu_user"] + cpu["used_cpu_sys"]


acquired = [0] * threads
stop = time.monotonic() + secs
start_line = threading.Barrier(threads + 1)


shared = redis.Redis(connection_pool=redis.BlockingConnectionPool(
    host=host, port=port, max_connections=max(2, threads // 2), timeout=20))


def worker(i):
    r = shared if pooled else redis.Redis(host=host, port=port)
    r.ping()
    start_line.wait()
    while time.monotonic() < stop:
        if library == "python-redis-lock":
            lock = redis_lock.Lock(r, key, expire=10)
            got = lock.acquire(blocking=True, timeout=5)
        elif library == "pottery":
            lock = Redlock(key=key, masters={r}, auto_release_time=10)
            got = lock.acquire(blocking=True, timeout=5)
        else:
            lock = r.lock(key, timeout=10, sleep=SLEEP, blocking_timeout=5)
            got = lock.acquire()
        if got:
            time.sleep(HOLD)
            lock.release()
            acquired[i] += 1


ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
for t in ts:
    t.start()
start_line.wait()
before = stats()
for t in ts:
    t.join()
after = stats()
print(json.dumps({
    "acquisitions": sum(acquired),
    "calls": after[0] - before[0],
    "cpu_s": after[1] - before[1],
}))
