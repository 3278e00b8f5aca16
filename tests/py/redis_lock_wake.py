"""python-redis-lock's waiters, through lockgate, when the holder's wake-up
never comes: the holder takes the lock without an expiry (lockgate gives it
its default lease) and never releases it, as a crashed worker. Each waiter
blocks on the lock's signal list with no timeout (BLPOP ... 0), as the
library does for a lock without expiry; once it has the lock it releases
it (its release pushes the next waiter's wake-up).

Usage: redis_lock_wake.py HOST PORT NAME WAIT_S SHAPE WAITERS
SHAPE: "own" (each waiter its own client, one connection per thread) or
"pool" (the holder and every waiter share one client: redis-py's pool
lends each command whichever connection was returned last).
Prints one JSON line: {"acquired": n, "waited_s": [..]}: how many waiters
got the lock within WAIT_S seconds, and when each did.
"""

import json
import sys
import threading
import time

import redis
import redis_lock

host, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
wait_s, shape, waiters = float(sys.argv[4]), sys.argv[5], int(sys.argv[6])
shared = redis.Redis(host=host, port=port)


def client():
    return shared if shape == "pool" else redis.Redis(host=host, port=port)


holder = redis_lock.Lock(client(), name, expire=None)
assert holder.acquire(blocking=False), "the holder could not take a free lock"

start = time.monotonic()
waited = []
done = threading.Lock()


def wait():
    lock = redis_lock.Lock(client(), name, expire=None)
    if lock.acquire(blocking=True):
        with done:
            waited.append(time.monotonic() - start)
        lock.release()


ts = [threading.Thread(target=wait, daemon=True) for _ in range(waiters)]
for t in ts:
    t.start()
deadline = start + wait_s
for t in ts:
    t.join(max(deadline - time.monotonic(), 0))
with done:
    print(json.dumps({"acquired": len(waited), "waited_s": sorted(waited)}))
sys.stdout.flush()
# Waiters still blocked are left to the process's end (daemon threads).
