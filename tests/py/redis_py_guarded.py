"""Guarded writes with unmodified redis-py (docs/guarded-writes.md).

Usage: redis_py_guarded.py HOST PORT PROTOCOL LEASE_MS

lockgate in front runs the guard `lock:order:{id}` over `order:{id}` and
`order:{id}:*` in refuse mode, with leases of LEASE_MS. A legacy holder
(SETNX, writes, a transaction pipeline, a registered script) writes its
order while it holds the lock; once its lease ran out and another client
took the lock, each of its writes fails with lockgate's refusal and the
data stays the new holder's. Prints each failed check and exits 1 if any
failed; exits 2 when redis-py is missing.
"""

import sys
import time

try:
    import redis
    from redis.exceptions import ResponseError
except ImportError as e:
    print(f"redis-py is not installed for {sys.executable} ({e})", file=sys.stderr)
    sys.exit(2)

FAILED = []
PASSED = 0


def check(cond, what):
    global PASSED
    if cond:
        PASSED += 1
    else:
        FAILED.append(what)
        print(f"FAILED: {what}", file=sys.stderr, flush=True)


def refused(fn, what):
    try:
        got = fn()
    except ResponseError as e:
        check("write refused" in str(e), f"{what}: refused with lockgate's error, got {e}")
        return
    check(False, f"{what}: refused, got {got!r}")


def main():
    host, port, protocol, lease_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    order = f"order:{protocol}"
    lock = f"lock:{order}"

    def client():
        return redis.Redis(host=host, port=port, protocol=protocol, decode_responses=True)

    holder, other = client(), client()
    check(holder.setnx(lock, "holder") is True, "the holder takes the lock")
    check(holder.set(order, "a") is True, "SET while holding")
    check(holder.hset(f"{order}:items", mapping={"sku": "1", "n": "2"}) == 2, "HSET while holding")
    with holder.pipeline(transaction=True) as p:
        p.set(order, "b")
        p.incr(f"{order}:version")
        p.hget(f"{order}:items", "sku")
        check(p.execute() == [True, 1, "1"], "a transaction pipeline while holding, applied whole")
    bump = holder.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    check(bump(keys=[f"{order}:version"], args=[10]) == 11, "a registered script while holding")
    check(holder.get(order) == "b", "reads pass")

    # Paused past the lease; another client takes the lock and writes.
    time.sleep(lease_ms / 1000 + 0.3)
    check(other.setnx(lock, "other") is True, "the next holder takes the lock")
    check(other.set(order, "c") is True, "the next holder writes")

    refused(lambda: holder.set(order, "late"), "a late SET")
    refused(lambda: holder.delete(f"{order}:items"), "a late DEL")
    refused(lambda: bump(keys=[f"{order}:version"], args=[100]), "a late registered script")

    def late_tx():
        with holder.pipeline(transaction=True) as p:
            p.incr(f"{order}:version")
            p.set(order, "late")
            return p.execute()

    refused(late_tx, "a late transaction pipeline")
    check(holder.get(order) == "c", "the data is the next holder's")
    check(holder.get(f"{order}:version") == "11", "nothing of the late transaction or script applied")
    check(holder.hgetall(f"{order}:items") == {"sku": "1", "n": "2"}, "the late DEL applied nothing")
    check(holder.get(lock) == "other", "the lock is the next holder's")
    holder.close()
    other.close()


main()
if FAILED:
    print(f"{len(FAILED)} checks failed, {PASSED} passed", file=sys.stderr)
    sys.exit(1)
print(f"{PASSED} checks passed")
