"""Two apps on one lock name during a migration, through lockgate: legacy
workers with SETNX + EXPIRE ... DEL, and workers with redis-py's Lock
(SET NX PX, its own release script), each on its own connection. Whoever
holds the lock enters a critical section marked by INCR/DECR of a
counter key: a count above 1 is two holders at once.

Usage: cross_library.py HOST PORT KEY SECS
Prints one JSON line: {"legacy": n, "library": n, "overlaps": n}.
"""

import json
import sys
import threading
import time

import redis

host, port, key, secs = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
inside = key + ":inside"
stop = time.monotonic() + secs
counts = {"legacy": 0, "library": 0, "overlaps": 0}
mutex = threading.Lock()


def critical(r, kind):
    if r.incr(inside) != 1:
        with mutex:
            counts["overlaps"] += 1
    time.sleep(0.002)
    r.decr(inside)
    with mutex:
        counts[kind] += 1


def legacy():
    r = redis.Redis(host=host, port=port)
    while time.monotonic() < stop:
        if r.setnx(key, "legacy"):
            r.expire(key, 10)
            critical(r, "legacy")
            r.delete(key)
        else:
            time.sleep(0.001)


def library():
    r = redis.Redis(host=host, port=port)
    while time.monotonic() < stop:
        lock = r.lock(key, timeout=10, sleep=0.001, blocking_timeout=1)
        if lock.acquire():
            critical(r, "library")
            lock.release()


ts = [threading.Thread(target=f) for f in (legacy, legacy, library, library)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(json.dumps(counts))
