"""The Python example (examples/lockgate_locks.py) against a running
lockgate, with threads as an app has them: readers together, a writer
alone, reentrant entries per thread, a semaphore's permits never over
their count, a dead holder's permit back after its lease.

Usage: lockgate_locks_example.py HOST PORT PREFIX
Prints "checks passed" when every check held; exits non-zero otherwise.
"""

import os
import sys
import threading
import time

import redis

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from lockgate_locks import LockgateLocks  # noqa: E402

host, port, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
client = redis.Redis(host=host, port=port)
locks = LockgateLocks(client)


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}")
        sys.exit(1)


# Readers together, a writer alone.
rw = locks.read_write_lock(f"{prefix}:rw")
inside = {"readers": 0, "writers": 0, "most_readers": 0, "bad": 0}
guard = threading.Lock()


def reader():
    for _ in range(5):
        with rw.read_lock():
            with guard:
                inside["readers"] += 1
                inside["most_readers"] = max(inside["most_readers"], inside["readers"])
                inside["bad"] += inside["writers"] > 0
            time.sleep(0.02)
            with guard:
                inside["readers"] -= 1


def writer():
    for _ in range(5):
        with rw.write_lock():
            with guard:
                inside["writers"] += 1
                inside["bad"] += inside["writers"] > 1 or inside["readers"] > 0
            time.sleep(0.01)
            with guard:
                inside["writers"] -= 1


threads = [threading.Thread(target=reader) for _ in range(4)]
threads += [threading.Thread(target=writer) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
check(not any(t.is_alive() for t in threads), "every thread finished")
check(inside["bad"] == 0, f"a writer beside another holder {inside['bad']} times")
check(inside["most_readers"] >= 2, f"readers held together (at most {inside['most_readers']})")

# Reentrant per thread: entries counted, the fencing token the same.
lock = rw.write_lock()
check(lock.try_lock(0, 10_000), "the write lock taken")
first = lock.token
check(lock.try_lock(0, 10_000) and lock.token == first, "entered again, same token")
check(lock.hold_count() == 2, "two entries")
other = []
t = threading.Thread(target=lambda: other.append(rw.read_lock().try_lock(100, 1_000)))
t.start()
t.join()
check(other == [False], "another thread's reader waits for the writer")
lock.unlock()
lock.unlock()
check(lock.token is None, "free after the last entry")
with rw.read_lock() as r:
    check(r.token > first, "tokens increase over kinds")

# A semaphore of 2: never more than 2 holders, from 5 threads.
sem = locks.semaphore(f"{prefix}:sem", permits=2)
holding = {"now": 0, "most": 0}


def worker():
    for _ in range(4):
        permit = sem.acquire(lease_ms=10_000)
        with guard:
            holding["now"] += 1
            holding["most"] = max(holding["most"], holding["now"])
        time.sleep(0.01)
        with guard:
            holding["now"] -= 1
        sem.release(permit)


threads = [threading.Thread(target=worker) for _ in range(5)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=60)
check(not any(t.is_alive() for t in threads), "every semaphore thread finished")
check(holding["most"] == 2, f"at most 2 holders at once, and 2 reached ({holding['most']})")

# A holder that dies: its permit comes back with its lease, not before.
dead = sem.try_acquire(0, 300)
live = sem.try_acquire(0, 10_000)
check(dead and live, "both permits taken")
check(sem.try_acquire(0, 10_000) is None, "no third permit")
third = sem.try_acquire(5_000, 10_000)
check(third is not None, "the dead holder's permit came back with its lease")
check(sem.extend(live, 10_000), "the live holder kept its permit")
sem.release(live)
sem.release(third)
print("checks passed")
