"""Real Python lock clients through lockgate with the Redlock quorum.

Usage: quorum_clients.py LOCKGATE_HOST LOCKGATE_PORT PRIMARY_PORT MASTER_PORT,MASTER_PORT,...

1. redis-py's `Lock` (SET NX PX to acquire; Lua by EVALSHA to extend,
   reacquire and release), RESP2 and RESP3, through lockgate: the lock must
   land on a majority of the lock masters (checked on each master
   directly), never on the primary, and behave as on one Redis.
2. pottery's `Redlock` with lockgate as its only master: acquire, locked(),
   extend, release, and a second Redlock on the same key fails while the
   first holds.

Prints each failed check and exits 1 if any failed; exits 2 when redis-py
(8.x) or pottery is missing, with the pip command that installs them.
"""

import sys
import time

INSTALL = "python3 -m pip install -q 'redis>=8,<9' 'pottery==3.0.1'"

try:
    import redis
    from redis.exceptions import LockError, LockNotOwnedError
except ImportError as e:  # the Rust test shows this message as its failure
    print(f"redis-py is not installed for {sys.executable} ({e}); install it with: {INSTALL}", file=sys.stderr)
    sys.exit(2)

try:
    from pottery import Redlock
    from pottery.exceptions import ReleaseUnlockedLock
except ImportError as e:
    print(f"pottery is not installed for {sys.executable} ({e}); install it with: {INSTALL}", file=sys.stderr)
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


def raises(exc, fn, what):
    try:
        fn()
    except exc:
        check(True, what)
        return
    except Exception as e:  # noqa: BLE001 - any other error is a failure
        check(False, f"{what}: raised {type(e).__name__}: {e}")
        return
    check(False, f"{what}: no {exc.__name__} raised")


class Stores:
    """Direct connections to the primary and to every lock master."""

    def __init__(self, primary_port, master_ports):
        self.primary = redis.Redis(port=primary_port, protocol=2, socket_timeout=5)
        self.masters = [redis.Redis(port=p, protocol=2, socket_timeout=5) for p in master_ports]
        self.majority = len(self.masters) // 2 + 1

    def holding(self, key, value):
        """How many masters hold `key` with `value`."""
        return sum(1 for m in self.masters if m.get(key) == value)

    def anywhere(self, key):
        """Masters (by index) where `key` exists, and whether the primary has it."""
        return [i for i, m in enumerate(self.masters) if m.exists(key)], bool(self.primary.exists(key))

    def on_quorum(self, key, value, what):
        held = self.holding(key, value)
        check(held >= self.majority, f"{what}: {key} held on {held} of {len(self.masters)} masters")
        check(not self.primary.exists(key), f"{what}: {key} never written to the primary")

    def gone(self, key, what):
        # A release is answered once a majority agrees; the other masters
        # run it right after (docs/quorum.md): awaited, within 2 s.
        deadline = time.monotonic() + 2
        masters, primary = self.anywhere(key)
        while (masters or primary) and time.monotonic() < deadline:
            time.sleep(0.02)
            masters, primary = self.anywhere(key)
        check(masters == [] and not primary, f"{what}: {key} left on masters {masters}, primary {primary}")


def until_gone(r, key, within):
    """Polls lockgate (a quorum read) until `key` is gone; True if it went."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if r.exists(key) == 0:
            return True
        time.sleep(0.02)
    return False


def redis_py(host, port, protocol, stores):
    def client():
        return redis.Redis(host=host, port=port, protocol=protocol, socket_timeout=10)

    r1, r2 = client(), client()
    name = f"lock:py:{protocol}"

    lock1 = r1.lock(name, timeout=5)
    check(lock1.acquire(blocking=False) is True, f"[redis-py {protocol}] acquire")
    token = lock1.local.token
    stores.on_quorum(name, token, f"[redis-py {protocol}] after acquire")
    check(lock1.locked() is True, f"[redis-py {protocol}] locked()")
    check(lock1.owned() is True, f"[redis-py {protocol}] owned()")
    check(r1.get(name) == token, f"[redis-py {protocol}] GET (quorum read) is the client's token")
    pttl = r1.pttl(name)
    check(4000 < pttl <= 5000, f"[redis-py {protocol}] PTTL of a 5 s lease: {pttl}")

    lock2 = r2.lock(name, timeout=5)
    check(lock2.acquire(blocking=False) is False, f"[redis-py {protocol}] second lock refused while held")
    started = time.monotonic()
    check(
        lock2.acquire(blocking=True, blocking_timeout=0.3) is False,
        f"[redis-py {protocol}] second lock's blocking acquire times out while held",
    )
    # redis-py gives up once its next 0.1 s retry would pass the timeout.
    check(time.monotonic() - started >= 0.15, f"[redis-py {protocol}] it did retry before giving up")
    check(lock2.owned() is False, f"[redis-py {protocol}] second lock does not own it")
    stores.on_quorum(name, token, f"[redis-py {protocol}] after refused acquisitions")

    check(lock1.extend(10) is True, f"[redis-py {protocol}] extend(10) (EVALSHA on the quorum)")
    pttl = r1.pttl(name)
    check(13000 < pttl <= 15000, f"[redis-py {protocol}] extend added 10 s: PTTL {pttl}")
    for i, m in enumerate(stores.masters):
        if m.get(name) == token:
            p = m.pttl(name)
            check(13000 < p <= 15000, f"[redis-py {protocol}] master {i} extended too: PTTL {p}")
    check(lock1.reacquire() is True, f"[redis-py {protocol}] reacquire()")
    pttl = r1.pttl(name)
    check(4000 < pttl <= 5000, f"[redis-py {protocol}] reacquire set 5 s again: PTTL {pttl}")

    intruder = r2.lock(name, timeout=5)
    intruder.local.token = b"not-the-holders-token"
    raises(LockNotOwnedError, lambda: intruder.extend(1), f"[redis-py {protocol}] foreign extend refused")
    raises(LockNotOwnedError, intruder.release, f"[redis-py {protocol}] foreign release refused")
    stores.on_quorum(name, token, f"[redis-py {protocol}] after the intruder")

    lock1.release()
    check(lock1.locked() is False, f"[redis-py {protocol}] not locked() after release")
    stores.gone(name, f"[redis-py {protocol}] after release")
    raises(LockError, lock1.release, f"[redis-py {protocol}] releasing twice raises LockError")

    # Blocking (bounded) from here on when the lock is free: right after a
    # failed attempt lockgate may answer "not acquired" without asking the
    # masters for up to its probe interval (retry-storm control).
    check(
        lock2.acquire(blocking=True, blocking_timeout=2) is True,
        f"[redis-py {protocol}] second lock acquires after release",
    )
    stores.on_quorum(name, lock2.local.token, f"[redis-py {protocol}] second holder")
    lock2.release()
    stores.gone(name, f"[redis-py {protocol}] after the second release")

    with r1.lock(name, timeout=5, blocking_timeout=2) as held:
        check(held.owned() is True, f"[redis-py {protocol}] `with` holds the lock")
        check(r2.lock(name, timeout=1).acquire(blocking=False) is False, f"[redis-py {protocol}] held inside `with`")
    stores.gone(name, f"[redis-py {protocol}] `with` released it")

    # The lease runs out: the old holder may neither extend nor release.
    short = r1.lock(name, timeout=0.3)
    check(short.acquire(blocking=True, blocking_timeout=2) is True, f"[redis-py {protocol}] short (0.3 s) lock")
    check(until_gone(r2, name, 3.0), f"[redis-py {protocol}] the 0.3 s lease ran out")
    other = r2.lock(name, timeout=10)
    check(
        other.acquire(blocking=True, blocking_timeout=2) is True,
        f"[redis-py {protocol}] another client takes the lapsed lock",
    )
    raises(LockNotOwnedError, lambda: short.extend(1), f"[redis-py {protocol}] lapsed extend refused")
    raises(LockNotOwnedError, short.release, f"[redis-py {protocol}] lapsed release refused")
    stores.on_quorum(name, other.local.token, f"[redis-py {protocol}] new holder untouched by the lapsed one")
    other.release()
    stores.gone(name, f"[redis-py {protocol}] new holder released")
    r1.close()
    r2.close()


def pottery(host, port, stores):
    lg = redis.Redis(host=host, port=port, socket_timeout=10)
    # pottery prefixes the key: `redlock:lock:pot`, a lock key by `*:lock:*`.
    first = Redlock(key="lock:pot", masters={lg}, auto_release_time=5)
    key = first.key
    check(key == "redlock:lock:pot", f"[pottery] key is {key!r}")
    check(first.locked() == 0, "[pottery] locked() is 0 before acquire")
    check(first.acquire(blocking=False) is True, "[pottery] acquire")
    left = first.locked()  # seconds, as a float
    check(4 < left <= 5, f"[pottery] locked() is the lease left: {left} s")
    value = lg.get(key)
    check(value is not None, "[pottery] GET through lockgate sees the lock")
    stores.on_quorum(key, value, "[pottery] after acquire")

    second = Redlock(key="lock:pot", masters={lg}, auto_release_time=5)
    check(second.acquire(blocking=False) is False, "[pottery] a second Redlock fails while the first holds")
    started = time.monotonic()
    check(second.acquire(timeout=0.4) is False, "[pottery] a second Redlock's blocking acquire times out")
    check(time.monotonic() - started >= 0.3, "[pottery] it did wait its timeout")
    check(second.locked() == 0, "[pottery] the second Redlock does not hold it")
    raises(ReleaseUnlockedLock, second.release, "[pottery] the second Redlock cannot release it")
    stores.on_quorum(key, value, "[pottery] after the second Redlock's attempts")

    first.extend()
    left = first.locked()
    check(4 < left <= 5, f"[pottery] extend() renewed the lease: {left} s")
    first.release()
    check(first.locked() == 0, "[pottery] locked() is 0 after release")
    stores.gone(key, "[pottery] after release")
    raises(ReleaseUnlockedLock, first.release, "[pottery] releasing twice raises ReleaseUnlockedLock")

    check(second.acquire(timeout=2) is True, "[pottery] the second Redlock acquires after release")
    stores.on_quorum(key, lg.get(key), "[pottery] second holder")
    check(first.acquire(blocking=False) is False, "[pottery] now the first one fails")
    second.release()
    stores.gone(key, "[pottery] after the second release")

    with Redlock(key="lock:pot", masters={lg}, auto_release_time=5, context_manager_timeout=2) as held:
        check(held.locked() > 0, "[pottery] context manager holds it")
        check(first.acquire(blocking=False) is False, "[pottery] held inside `with`")
    stores.gone(key, "[pottery] context manager released it")
    lg.close()


def main():
    host, port, primary = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    masters = [int(p) for p in sys.argv[4].split(",")]
    major = int(redis.__version__.split(".")[0])
    if major < 8:
        print(f"redis-py {redis.__version__} found, expected 8.x: {INSTALL}", file=sys.stderr)
        sys.exit(2)
    stores = Stores(primary, masters)
    for protocol in (2, 3):
        redis_py(host, port, protocol, stores)
    pottery(host, port, stores)
    if FAILED:
        print(f"{len(FAILED)} of {len(FAILED) + PASSED} checks failed", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {PASSED} checks passed (redis-py {redis.__version__}, pottery, {len(masters)} masters)")


if __name__ == "__main__":
    main()
