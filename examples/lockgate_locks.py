"""Read/write locks and semaphores over lockgate's lock API, in the shape
of Redisson's RReadWriteLock and RPermitExpirableSemaphore, for Python
code with redis-py (any version that speaks to Redis).

Every grant comes from lockgate with a fencing token and a lease; who
holds what is decided in Redis, so apps in other languages that use the
same API (or another copy of this file) share these locks. See
docs/locks.md for the commands and their guarantees.

    import redis
    from lockgate_locks import LockgateLocks

    locks = LockgateLocks(redis.Redis(port=6380))   # lockgate's port
    rw = locks.read_write_lock("lock:report")
    with rw.read_lock():                 # many readers at once
        ...
    with rw.write_lock():                # alone: no reader, no writer
        ...
    sem = locks.semaphore("lock:pool", permits=3)
    permit = sem.try_acquire(wait_ms=1000, lease_ms=10_000)
    if permit:
        try:
            ...
        finally:
            sem.release(permit)

As in Redisson, a lock is reentrant per thread: the owner lockgate is told
is this object's id and the thread's, so the same thread may take a lock
it holds again (a count), and must unlock it as many times.
"""

import threading
import time
import uuid

# The longest WAIT lockgate accepts in one call; longer waits loop.
MAX_WAIT_MS = 60_000


class LockgateLocks:
    """The factory: one per redis-py client (a connection pool)."""

    def __init__(self, client, client_id=None):
        self.client = client
        self.id = client_id or uuid.uuid4().hex

    def read_write_lock(self, name):
        """RReadWriteLock: `read_lock()` and `write_lock()` on one key."""
        return ReadWriteLock(self, name)

    def semaphore(self, name, permits):
        """RPermitExpirableSemaphore: `permits` holders at most, each
        permit with its own lease and id (its fencing token)."""
        return Semaphore(self, name, permits)

    def owner(self):
        """This thread's owner id, as lockgate's OWNER."""
        return f"{self.id}:{threading.get_ident()}"

    def call(self, *args):
        return self.client.execute_command("LOCKGATE", *args)


def _grant(reply):
    """(token, validity_ms) of a grant, or None when not granted."""
    if reply is None:
        return None
    token, validity = reply
    return int(token), int(validity)


class Lock:
    """One side of a ReadWriteLock: RLock's lock / tryLock / unlock."""

    def __init__(self, locks, name, shared):
        self.locks = locks
        self.name = name
        self.shared = shared
        # Per thread: (token, entries) of what this thread holds.
        self._held = threading.local()

    def try_lock(self, wait_ms=0, lease_ms=30_000):
        """Takes the lock within `wait_ms`; True when held (again)."""
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            args = ["LOCK", self.name, lease_ms, "WAIT", min(left, MAX_WAIT_MS)]
            if self.shared:
                args.append("SHARED")
            args += ["OWNER", self.locks.owner()]
            got = _grant(self.locks.call(*args))
            if got is not None:
                token, _ = got
                entries = getattr(self._held, "entries", 0)
                self._held.token, self._held.entries = token, entries + 1
                return True
            if left <= MAX_WAIT_MS:
                return False

    def lock(self, lease_ms=30_000):
        """Waits as long as it takes."""
        while not self.try_lock(MAX_WAIT_MS, lease_ms):
            pass

    def unlock(self):
        """One entry released; the lock is free once none is left."""
        token = getattr(self._held, "token", None)
        if token is None:
            raise RuntimeError(f"{self.name}: not held by this thread")
        released = self.locks.call("UNLOCK", self.name, token)
        self._held.entries -= 1
        if self._held.entries == 0:
            self._held.token = None
        if released != 1:
            raise RuntimeError(f"{self.name}: the lease ran out before unlock")

    def extend(self, lease_ms):
        """The lease made `lease_ms` from now; False when it ran out."""
        token = getattr(self._held, "token", None)
        return token is not None and self.locks.call("EXTEND", self.name, token, lease_ms) == 1

    @property
    def token(self):
        """This thread's fencing token for the lock (None: not held)."""
        return getattr(self._held, "token", None)

    def hold_count(self):
        return getattr(self._held, "entries", 0)

    def __enter__(self):
        self.lock()
        return self

    def __exit__(self, *exc):
        self.unlock()


class ReadWriteLock:
    """RReadWriteLock: readers share the key, a writer has it alone, and a
    waiting writer holds new readers back (lockgate's rule)."""

    def __init__(self, locks, name):
        self._read = Lock(locks, name, shared=True)
        self._write = Lock(locks, name, shared=False)

    def read_lock(self):
        return self._read

    def write_lock(self):
        return self._write


class Semaphore:
    """RPermitExpirableSemaphore: `try_acquire` gives a permit id (its
    fencing token) or None; `release(permit)` gives it back; a holder
    that dies frees its permit when the permit's lease ends."""

    def __init__(self, locks, name, permits):
        self.locks = locks
        self.name = name
        self.permits = permits

    def try_acquire(self, wait_ms=0, lease_ms=30_000):
        args = ["ACQUIRE", self.name, self.permits, lease_ms, "WAIT", min(wait_ms, MAX_WAIT_MS)]
        got = _grant(self.locks.call(*args))
        return None if got is None else got[0]

    def acquire(self, lease_ms=30_000):
        while True:
            permit = self.try_acquire(MAX_WAIT_MS, lease_ms)
            if permit is not None:
                return permit

    def release(self, permit):
        if self.locks.call("UNLOCK", self.name, permit) != 1:
            raise RuntimeError(f"{self.name}: permit {permit} no longer held")

    def extend(self, permit, lease_ms):
        return self.locks.call("EXTEND", self.name, permit, lease_ms) == 1
