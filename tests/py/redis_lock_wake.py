"""python-redis-lock's waiter, through lockgate, when the holder's wake-up
never comes: the holder takes the lock without an expiry (lockgate gives it
its default lease) and never releases it, as a crashed worker. The waiter
blocks on the lock's signal list with no timeout (BLPOP ... 0), as the
library does for a lock without expiry.

Usage: redis_lock_wake.py HOST PORT NAME WAIT_S
Prints one JSON line: {"acquired": bool, "waited_s": float}, where
acquired says whether the waiter got the lock within WAIT_S seconds.
"""

import json
import sys
import threading
import time

import redis
import redis_lock

host, port, name, wait_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
holder_conn = redis.Redis(host=host, port=port)
waiter_conn = redis.Redis(host=host, port=port)

holder = redis_lock.Lock(holder_conn, name, expire=None)
assert holder.acquire(blocking=False), "the holder could not take a free lock"

waiter = redis_lock.Lock(waiter_conn, name, expire=None)
got = {}


def wait():
    start = time.monotonic()
    got["acquired"] = waiter.acquire(blocking=True)
    got["waited_s"] = time.monotonic() - start


t = threading.Thread(target=wait, daemon=True)
t.start()
t.join(wait_s)
acquired = not t.is_alive() and got.get("acquired", False)
print(json.dumps({"acquired": acquired, "waited_s": got.get("waited_s", wait_s)}))
sys.stdout.flush()
# A waiter still blocked is left to the process's end (a daemon thread).
