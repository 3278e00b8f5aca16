"""Redisson's read-write lock and fair lock as their wire shows them, driven
against one address (straight on Redis, or lockgate in front of it):
tests/it/locks_redisson.rs runs it both ways and compares the outcomes.

The scripts below are written here after Redisson's documented data model,
not taken from Redisson:
- read-write lock: one hash per lock, field `mode` (`read` or `write`), a
  field per holder (`<uuid>:<thread>` for a reader, `...:write` for the
  writer) counting its entries, a key `{<lock>}:<holder>:rwlock_timeout:<n>`
  per read entry, unlock messages on `redisson_rwlock:{<lock>}`;
- fair lock: the hash lock, with a queue of waiters
  (`redisson_lock_queue:{<lock>}`, a list) and their deadlines
  (`redisson_lock_timeout:{<lock>}`, a sorted set, in the client's clock),
  a waiter first in line taking the lock when it is free, a waiter whose
  deadline passed dropped from the head.
The clock the fair lock is given is this script's own, made up, so both
runs see the same numbers; leases are real (30 s), and only whether a
lease came back (a holder's time left) is compared, not its value.

Usage: redisson_wire.py HOST PORT SHAPE
SHAPE: own (each holder its own connection), pool (the holders share one
LIFO pool of 2), one (every holder on one connection, in turn).
Prints one JSON object of outcomes. Keys: lock:rw:*, lock:fair:* (lock keys
under lockgate's defaults); the database is flushed first.
"""

import json
import sys

import redis

host, port, shape = sys.argv[1], int(sys.argv[2]), sys.argv[3]
LEASE = 30000

READ_LOCK = """
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then
  redis.call('hset', KEYS[1], 'mode', 'read')
  redis.call('hset', KEYS[1], ARGV[2], 1)
  redis.call('set', KEYS[2] .. ':1', 1, 'px', ARGV[1])
  redis.call('pexpire', KEYS[1], ARGV[1])
  return nil
end
if mode == 'read' or (mode == 'write' and redis.call('hexists', KEYS[1], ARGV[3]) == 1) then
  local n = redis.call('hincrby', KEYS[1], ARGV[2], 1)
  redis.call('set', KEYS[2] .. ':' .. n, 1, 'px', ARGV[1])
  redis.call('pexpire', KEYS[1], math.max(redis.call('pttl', KEYS[1]), tonumber(ARGV[1])))
  return nil
end
return redis.call('pttl', KEYS[1])
"""

READ_UNLOCK = """
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then
  redis.call('publish', KEYS[2], ARGV[1])
  return 1
end
if redis.call('hexists', KEYS[1], ARGV[2]) == 0 then return nil end
local n = redis.call('hincrby', KEYS[1], ARGV[2], -1)
if n == 0 then redis.call('hdel', KEYS[1], ARGV[2]) end
redis.call('del', KEYS[3] .. ':' .. (n + 1))
if redis.call('hlen', KEYS[1]) > 1 then return 0 end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], ARGV[1])
return 1
"""

WRITE_LOCK = """
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then
  redis.call('hset', KEYS[1], 'mode', 'write')
  redis.call('hset', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[1])
  return nil
end
if mode == 'write' and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  redis.call('hincrby', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], redis.call('pttl', KEYS[1]) + tonumber(ARGV[1]))
  return nil
end
return redis.call('pttl', KEYS[1])
"""

WRITE_UNLOCK = """
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then
  redis.call('publish', KEYS[2], ARGV[1])
  return 1
end
if mode ~= 'write' or redis.call('hexists', KEYS[1], ARGV[3]) == 0 then return nil end
local n = redis.call('hincrby', KEYS[1], ARGV[3], -1)
if n > 0 then
  redis.call('pexpire', KEYS[1], ARGV[2])
  return 0
end
redis.call('hdel', KEYS[1], ARGV[3])
if redis.call('hlen', KEYS[1]) == 1 then
  redis.call('del', KEYS[1])
  redis.call('publish', KEYS[2], ARGV[1])
else
  redis.call('hset', KEYS[1], 'mode', 'read')
end
return 1
"""

FAIR_LOCK = """
local now = tonumber(ARGV[4])
while true do
  local first = redis.call('lindex', KEYS[2], 0)
  if first == false then break end
  if tonumber(redis.call('zscore', KEYS[3], first)) > now then break end
  redis.call('zrem', KEYS[3], first)
  redis.call('lpop', KEYS[2])
end
if redis.call('exists', KEYS[1]) == 0 and
   (redis.call('exists', KEYS[2]) == 0 or redis.call('lindex', KEYS[2], 0) == ARGV[2]) then
  redis.call('lpop', KEYS[2])
  redis.call('zrem', KEYS[3], ARGV[2])
  redis.call('hset', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[1])
  return nil
end
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  redis.call('hincrby', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[1])
  return nil
end
local deadline = redis.call('zscore', KEYS[3], ARGV[2])
if deadline ~= false then return tonumber(deadline) - tonumber(ARGV[3]) - now end
local last = redis.call('lindex', KEYS[2], -1)
local ttl
if last ~= false then
  ttl = tonumber(redis.call('zscore', KEYS[3], last)) - now
else
  ttl = redis.call('pttl', KEYS[1])
end
redis.call('zadd', KEYS[3], ttl + tonumber(ARGV[3]) + now, ARGV[2])
redis.call('rpush', KEYS[2], ARGV[2])
return ttl
"""

FAIR_UNLOCK = """
local n = redis.call('hexists', KEYS[1], ARGV[2])
if n == 0 then return nil end
n = redis.call('hincrby', KEYS[1], ARGV[2], -1)
if n > 0 then
  redis.call('pexpire', KEYS[1], ARGV[1])
  return 0
end
redis.call('del', KEYS[1])
local next = redis.call('lindex', KEYS[2], 0)
if next ~= false then redis.call('publish', KEYS[3] .. ':' .. next, 0) end
return 1
"""


def shaped(n):
    """n holders' clients, as SHAPE says."""
    if shape == "own":
        return [redis.Redis(host=host, port=port) for _ in range(n)]
    if shape == "pool":
        pool = redis.BlockingConnectionPool(host=host, port=port, max_connections=2, timeout=10)
        return [redis.Redis(connection_pool=pool)] * n
    one = redis.Redis(host=host, port=port, single_connection_client=True)
    return [one] * n


def outcome(reply, nil="acquired"):
    """A reply as compared: a lease left is only "held"; nil is what the
    script means by it (a lock script: acquired; an unlock: not held)."""
    if reply is None:
        return nil
    if isinstance(reply, int) and reply > 1:
        return "held"
    return reply


def main():
    admin = redis.Redis(host=host, port=port)
    admin.flushdb()
    out = {}

    # Read-write lock: two readers together, the writer kept out until
    # both left, then a reader kept out until the writer left; the writer
    # may also read (its read entry outlives its write unlock).
    k = "lock:rw:orders"
    chan, a, b, w = "redisson_rwlock:{%s}" % k, "uuid-aaaa:1", "uuid-bbbb:1", "uuid-wwww:1"
    ra, rb, rw = shaped(3)

    def read(c, holder):
        return outcome(c.eval(READ_LOCK, 2, k, "{%s}:%s:rwlock_timeout" % (k, holder),
                              LEASE, holder, holder + ":write"))

    def unread(c, holder):
        return outcome(c.eval(READ_UNLOCK, 3, k, chan, "{%s}:%s:rwlock_timeout" % (k, holder),
                              0, holder), "not held")

    def write(c, holder):
        return outcome(c.eval(WRITE_LOCK, 1, k, LEASE, holder + ":write"))

    def unwrite(c, holder):
        return outcome(c.eval(WRITE_UNLOCK, 2, k, chan, 0, LEASE, holder + ":write"), "not held")

    steps = [
        ("a reads", read(ra, a)),
        ("b reads", read(rb, b)),
        ("a reads again", read(ra, a)),
        ("w writes while read", write(rw, w)),
        ("a unreads", unread(ra, a)),
        ("a unreads again", unread(ra, a)),
        ("w still kept out", write(rw, w)),
        ("b unreads", unread(rb, b)),
        ("w writes", write(rw, w)),
        ("w writes again", write(rw, w)),
        ("a reads while written", read(ra, a)),
        ("w reads too", read(rw, w)),
        ("w unwrites", unwrite(rw, w)),
        ("w unwrites again", unwrite(rw, w)),
        ("mode after", admin.hget(k, "mode")),
        ("a reads beside w's read", read(ra, a)),
        ("w unreads", unread(rw, w)),
        ("a unreads last", unread(ra, a)),
        ("gone", admin.exists(k)),
        ("b unreads a free lock", unread(rb, b)),
    ]
    out["rwlock"] = [[name, r.decode() if isinstance(r, bytes) else r] for name, r in steps]

    # Fair lock: waiters queue in order; a free lock goes to the first in
    # line, not to whoever asks; a waiter whose deadline passed is dropped.
    k = "lock:fair:orders"
    queue, timeouts = "redisson_lock_queue:{%s}" % k, "redisson_lock_timeout:{%s}" % k
    chan = "redisson_lock__channel:{%s}" % k
    fa, fb, fc = shaped(3)
    ha, hb, hc = "uuid-aaaa:1", "uuid-bbbb:1", "uuid-cccc:1"

    def lock(c, holder, now, wait=5000):
        return outcome(c.eval(FAIR_LOCK, 3, k, queue, timeouts, LEASE, holder, wait, now))

    def unlock(c, holder):
        return outcome(c.eval(FAIR_UNLOCK, 3, k, queue, chan, LEASE, holder), "not held")

    steps = [
        ("a locks", lock(fa, ha, 1000)),
        ("b queues", lock(fb, hb, 1001)),
        ("c queues", lock(fc, hc, 1002)),
        ("b asks again", lock(fb, hb, 1003)),
        ("queue", [x.decode() for x in admin.lrange(queue, 0, -1)]),
        ("a unlocks", unlock(fa, ha)),
        ("c asks first", lock(fc, hc, 1004)),
        ("b takes its turn", lock(fb, hb, 1005)),
        ("a queues behind c", lock(fa, ha, 1006)),
        ("b unlocks", unlock(fb, hb)),
        ("c's deadline passed, a takes it", lock(fa, ha, 10_000_000)),
        ("queue after", [x.decode() for x in admin.lrange(queue, 0, -1)]),
        ("a unlocks", unlock(fa, ha)),
        ("c unlocks what it does not hold", unlock(fc, hc)),
        ("gone", admin.exists(k)),
    ]
    out["fair"] = [[name, r] for name, r in steps]
    print(json.dumps(out))


main()
