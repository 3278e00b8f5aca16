"""Unmodified redis-py `Lock` against lockgate.

Usage: redis_py_lock.py HOST PORT PROTOCOL KEY_PREFIX

Runs redis-py's own lock (SET NX PX to acquire, Lua via EVALSHA to extend
and release) through lockgate and checks every step a user relies on.
Prints each failed check and exits 1 if any failed; exits 2 when redis-py
itself is missing or older than 8.x.
"""

import sys
import time

try:
    import redis
    from redis.exceptions import LockError, LockNotOwnedError
except ImportError as e:  # the Rust test shows this message as its failure
    print(
        f"redis-py is not installed for {sys.executable} ({e}); "
        "install it with: python3 -m pip install -q 'redis>=8,<9'",
        file=sys.stderr,
    )
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


def main():
    host, port, protocol, prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    major = int(redis.__version__.split(".")[0])
    if major < 8:
        print(
            f"redis-py {redis.__version__} found, expected 8.x or later: "
            "python3 -m pip install -q 'redis>=8,<9'",
            file=sys.stderr,
        )
        sys.exit(2)

    def client():
        return redis.Redis(host=host, port=port, protocol=protocol, socket_timeout=10)

    r1, r2 = client(), client()
    check(r1.ping() is True, "PING through lockgate")
    if protocol == 3:
        hello = r1.execute_command("HELLO", "3")
        check(hello.get(b"proto", hello.get("proto")) == 3, f"HELLO 3 answered proto 3: {hello!r}")

    # --- acquire, locked, owned, extend (EVALSHA), reacquire, release ---
    name = f"{prefix}:job"
    lock1 = r1.lock(name, timeout=5)
    check(lock1.acquire(blocking=False) is True, "first acquire succeeds")
    token = lock1.local.token
    check(lock1.locked() is True, "locked() after acquire")
    check(lock1.owned() is True, "owned() after acquire")
    check(r1.get(name) == token, f"GET shows the client's own token: {r1.get(name)!r} vs {token!r}")
    pttl = r1.pttl(name)
    check(4000 < pttl <= 5000, f"lease is the client's timeout=5 s, PTTL {pttl}")

    lock2 = r2.lock(name, timeout=5)
    check(lock2.acquire(blocking=False) is False, "second client's non-blocking acquire fails while held")
    check(lock2.locked() is True, "second client sees locked()")
    check(lock2.owned() is False, "second client does not own it")
    check(r1.get(name) == token, "failed acquire left the holder's value")

    check(lock1.extend(10) is True, "extend(10) by the owner")
    pttl = r1.pttl(name)
    check(13000 < pttl <= 15000, f"extend added 10 s, PTTL {pttl}")
    check(
        r1.script_exists(lock1.lua_extend.sha) == [True],
        "extend ran as EVALSHA (script cached on Redis)",
    )
    check(lock1.extend(3, replace_ttl=True) is True, "extend(3, replace_ttl=True)")
    pttl = r1.pttl(name)
    check(2000 < pttl <= 3000, f"replace_ttl set 3 s, PTTL {pttl}")
    check(lock1.reacquire() is True, "reacquire() resets the lease")
    pttl = r1.pttl(name)
    check(4000 < pttl <= 5000, f"reacquire gave back 5 s, PTTL {pttl}")
    # A client holding a stale or foreign token: the EVALSHA scripts refuse it.
    intruder = r2.lock(name, timeout=5)
    intruder.local.token = b"not-the-holders-token"
    raises(LockNotOwnedError, lambda: intruder.extend(1), "foreign-token extend raises LockNotOwnedError")
    raises(LockNotOwnedError, intruder.release, "foreign-token release raises LockNotOwnedError")
    check(r1.get(name) == token, "foreign-token extend/release left the holder's value")
    pttl = r1.pttl(name)
    check(4000 < pttl <= 5000, f"foreign-token extend left the lease, PTTL {pttl}")

    lock1.release()
    check(lock1.locked() is False, "not locked() after release")
    check(r1.get(name) is None, "key gone after release")
    raises(LockError, lock1.release, "second release of an unlocked lock raises LockError")

    check(lock2.acquire(blocking=False) is True, "second client acquires after release")
    check(lock2.owned() is True, "second client owns it")
    lock2.release()
    check(r2.get(name) is None, "key gone after the second release")

    with r1.lock(name, timeout=5, blocking_timeout=2) as held:
        check(held.owned() is True, "context manager holds the lock")
        check(r2.lock(name, timeout=1).acquire(blocking=False) is False, "held inside `with`")
    check(r1.get(name) is None, "context manager released the lock")

    # --- the lease runs out, another client takes the lock ---
    name = f"{prefix}:short"
    short = r1.lock(name, timeout=0.3)
    check(short.acquire(blocking=False) is True, "short lock (0.3 s) acquired")
    pttl = r1.pttl(name)
    check(0 < pttl <= 300, f"short lease honoured, PTTL {pttl}")
    other = r2.lock(name, timeout=10)
    started = time.monotonic()
    # redis-py's own retry loop waits for the expiry (it polls every 0.1 s).
    check(other.acquire(blocking=True, blocking_timeout=5) is True, "other client acquires after the lease ran out")
    waited = time.monotonic() - started
    check(waited < 2.0, f"the lease ran out in time (waited {waited:.2f} s)")
    other_token = other.local.token
    check(short.owned() is False, "first client no longer owns it")
    raises(LockNotOwnedError, lambda: short.extend(1), "lapsed extend raises LockNotOwnedError")
    raises(LockNotOwnedError, short.release, "lapsed release raises LockNotOwnedError")
    check(other.owned() is True, "the new holder still owns it after the lapsed release")
    check(r2.get(name) == other_token, "the new holder's value is untouched")
    pttl = r2.pttl(name)
    check(9000 < pttl <= 10000, f"the new holder's lease is untouched, PTTL {pttl}")
    other.release()
    check(r2.get(name) is None, "new holder releases")

    r1.close()
    r2.close()
    if FAILED:
        print(f"{len(FAILED)} of {len(FAILED) + PASSED} checks failed (protocol {protocol})", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {PASSED} checks passed (redis-py {redis.__version__}, protocol {protocol})")


if __name__ == "__main__":
    main()
