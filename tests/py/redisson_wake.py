"""Redisson's lock as its wire shows it, through lockgate, when the
holder's unlock message is lost: the holder takes the hash lock with
Redisson's tryLock script (lease 30 s, as its watchdog's), then the lock
goes without its message (deleted by a plain DEL: a release whose PUBLISH
never reached the waiter). The waiter does what Redisson does: subscribe
to redisson_lock__channel:{<name>}, run tryLock, and on the lease left it
is answered, wait for a message up to that long, then try again.

Usage: redisson_wake.py HOST PORT KEY WAIT_S
Prints one JSON line: {"acquired": bool, "waited_s": float}.
"""

import json
import sys
import time

import redis

import os

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "redisson_try_lock.lua")) as f:
    TRY_LOCK = f.read()

host, port, key, wait_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
channel = "redisson_lock__channel:{%s}" % key
holder = redis.Redis(host=host, port=port)
waiter = redis.Redis(host=host, port=port)
assert holder.eval(TRY_LOCK, 1, key, 30000, "holder-uuid:1") is None, "the holder could not lock"

sub = waiter.pubsub()
sub.subscribe(channel)
while sub.get_message(timeout=5) is None:  # the subscription's confirmation
    pass
start = time.monotonic()
left = waiter.eval(TRY_LOCK, 1, key, 30000, "waiter-uuid:1")
assert left is not None, "the waiter took a held lock"
holder.delete(key)  # the release whose message is lost
acquired = False
while time.monotonic() - start < wait_s:
    budget = min(left / 1000.0, wait_s - (time.monotonic() - start))
    sub.get_message(timeout=max(budget, 0.001))  # woken, or the lease left passed
    left = waiter.eval(TRY_LOCK, 1, key, 30000, "waiter-uuid:1")
    if left is None:
        acquired = True
        break
print(json.dumps({"acquired": acquired, "waited_s": time.monotonic() - start}))
