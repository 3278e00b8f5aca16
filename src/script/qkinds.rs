//! The quorum's Lua for shared, reentrant and counted locks and multi-key
//! locks (see [`super::kinds`] for the bookkeeping on each master): as
//! for an exclusive fencing lock on the quorum (`QFENCE_ACQUIRE`,
//! `QFENCE_COMMIT`), a grant is taken first under the instance token and
//! reports the master's counter and clock; the token, worked out from a
//! majority's, is then committed on that majority.

/// Step 1 of a shared, reentrant or counted grant on one master: as
/// [`super::kinds::KIND_LOCK`], the new holder named `p:<instance token>`
/// until committed ([`QKIND_COMMIT`]), turns across instances taken in
/// each master's queue. KEYS: as `KIND_LOCK`'s. ARGV: `KIND_LOCK`'s
/// first six, the instance token, then its last three (instance prefix,
/// fairness bound ms, a place's life ms). Reply: `{1, count, counter,
/// clock, 0}` taken; `{1, count, counter, clock, token}` an owner's entry
/// again (already committed with `token`); `{0, pttl, 0, clock, 0}` not;
/// `clock` is the master's `TIME` in µs.
pub const QKIND_TAKE: &str = concat!(
    queue!(),
    kinds_book!(),
    kinds_take!(),
    r#"
local kind, ttl, owner = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local permits, wait, waiter = tonumber(ARGV[4]) or 0, tonumber(ARGV[5]) or 0, ARGV[6]
local me, bound, life = ARGV[8] or '', tonumber(ARGV[9]) or 0, tonumber(ARGV[10]) or 0
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function counter() return tonumber(redis.call('GET', KEYS[3]) or '0') or 0 end
local now = k_now()
local found, a, b = k_find(kind, ttl, owner, permits, wait, waiter, now)
if found == 'error' then return redis.error_reply(a) end
if found == 'again' then return {1, b, counter(), clock(), tonumber(a)} end
if found == 'taken' then return {0, a, 0, clock(), 0} end
if not k_turn(found == 'free', kind, wait, waiter, me, bound, life, now) then
  return {0, k_pttl(), 0, clock(), 0}
end
k_enter('p:' .. ARGV[7], kind, owner, ttl, waiter, me, now)
return {1, 1, counter(), clock(), 0}
"#
);

/// Step 2 on the masters whose "yes" counted: the holder taken under the
/// instance token becomes `t:<token>` (the owner's entry points at it) and
/// the counter is raised to the token. KEYS: as [`QKIND_TAKE`]'s. ARGV:
/// instance token, token, owner (`''`: none). Reply: 1 committed, 0 the
/// holder is gone (its lease ended).
pub const QKIND_COMMIT: &str = r#"
local pid, tid = 'p:' .. ARGV[1], 't:' .. ARGV[2]
local rec = redis.call('HGET', KEYS[4], pid)
local till = redis.call('ZSCORE', KEYS[5], pid)
if not rec or not till then return 0 end
redis.call('HDEL', KEYS[4], pid)
redis.call('ZREM', KEYS[5], pid)
redis.call('HSET', KEYS[4], tid, rec)
redis.call('ZADD', KEYS[5], till, tid)
if ARGV[3] ~= '' then redis.call('HSET', KEYS[4], 'o:' .. ARGV[3], ARGV[2]) end
local c = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
if c < tonumber(ARGV[2]) then redis.call('SET', KEYS[3], ARGV[2]) end
return 1
"#;

/// Undoes step 1 where the grant was not made: the holder taken under
/// the instance token leaves (the key's queue's head woken if it was the
/// last). KEYS: as [`super::kinds::KIND_UNLOCK`]'s. ARGV: instance token.
/// Reply: 1 left, 0 it held nothing here.
pub const QKIND_UNDO: &str = concat!(
    kinds_book!(),
    queue!(),
    r#"
local pid = 'p:' .. ARGV[1]
if not redis.call('HGET', KEYS[4], pid) then return 0 end
local now = k_now()
k_leave(pid)
if not k_settle(now) and redis.call('EXISTS', KEYS[7]) == 1 then
  q_wake(KEYS[7], KEYS[8], KEYS[1], now)
end
return 1
"#
);

/// Step 1 of a multi-key lock on one master: every key or none, each
/// taken under the instance token as `QFENCE_ACQUIRE` takes one (its
/// owner record too), reporting each key's counter. KEYS: as
/// [`super::kinds::MULTI_LOCK`]'s. ARGV: ttl ms, instance token, how
/// long the caller still waits ms, its waiter id. Reply: `{1, 0, 0,
/// clock, counter…}` taken (the keys' counters in their order); `{0,
/// pttl, 0, clock}` not. Step 2 is `QFENCE_COMMIT` per key.
pub const QMULTI_TAKE: &str = concat!(
    multi_check!(),
    r#"
if held then return {0, busy, 0, us} end
local out = {1, 0, 0, us}
for i = 0, n - 1 do
  redis.call('SET', KEYS[4 * i + 1], ARGV[2], 'PX', ARGV[1])
  redis.call('SET', KEYS[4 * i + 2], ARGV[2], 'PX', ARGV[1])
  redis.call('ZREM', KEYS[4 * i + 4], waiter)
  out[i + 5] = tonumber(redis.call('GET', KEYS[4 * i + 3]) or '0') or 0
end
return out
"#
);
