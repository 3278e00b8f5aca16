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
    kinds_book!(),
    queue!(),
    r#"
local kind, ttl, owner = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local permits, wait, waiter = tonumber(ARGV[4]) or 0, tonumber(ARGV[5]) or 0, ARGV[6]
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function counter() return tonumber(redis.call('GET', KEYS[3]) or '0') or 0 end
local now = k_now()
local v = redis.call('GET', KEYS[1])
if v and v ~= MARK then
  if kind == 'w' and wait > 0 then k_wait(now, wait, waiter) end
  return {0, redis.call('PTTL', KEYS[1]), 0, clock(), 0}
end
if not v then redis.call('DEL', KEYS[4], KEYS[5]) end
k_purge(now)
local held = redis.call('ZCARD', KEYS[5])
local as = held > 0 and redis.call('HGET', KEYS[4], '.kind') or false
if as and (as == 's') ~= (kind == 's') then
  local what = as == 's' and 'a semaphore' or 'a lock'
  return redis.error_reply('WRONGTYPE lockgate: this key is held as ' .. what)
end
if owner ~= '' then
  local mine = redis.call('HGET', KEYS[4], 'o:' .. owner)
  if mine then
    local id = 't:' .. mine
    local k, count = string.match(redis.call('HGET', KEYS[4], id) or '', '^(%S+) (%S+) ')
    if k ~= kind then
      return redis.error_reply('ERR lockgate: this owner holds the key as another kind of lock')
    end
    count = tonumber(count) + 1
    redis.call('HSET', KEYS[4], id, kind .. ' ' .. count .. ' ' .. owner)
    local till = math.max(tonumber(redis.call('ZSCORE', KEYS[5], id) or '0'), now + ttl)
    redis.call('ZADD', KEYS[5], till, id)
    k_settle(now)
    return {1, count, counter(), clock(), tonumber(mine)}
  end
end
local free
if kind == 'w' then
  free = held == 0
elseif kind == 'r' then
  free = (held == 0 or as == 'r') and redis.call('ZCARD', KEYS[6]) == 0
else
  free = held < permits
end
local me, bound, life = ARGV[8] or '', tonumber(ARGV[9]) or 0, tonumber(ARGV[10]) or 0
local yield, head = false, nil
if me ~= '' and redis.call('EXISTS', KEYS[7]) == 1 then
  yield, head = q_yield(KEYS[7], KEYS[8], me, bound, now)
end
if not free or yield then
  if kind == 'w' and wait > 0 then k_wait(now, wait, waiter) end
  if life > 0 then q_join(KEYS[7], KEYS[8], me, life, now) end
  if yield and free and redis.call('HGET', KEYS[8], '.woken') ~= head then
    q_wake(KEYS[7], KEYS[8], KEYS[1], now)
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl < 0 then pttl = 0 end
  return {0, pttl, 0, clock(), 0}
end
local id = 'p:' .. ARGV[7]
redis.call('HSET', KEYS[4], id, kind .. ' 1 ' .. owner, '.kind', kind)
redis.call('ZADD', KEYS[5], now + ttl, id)
if kind == 'w' then redis.call('ZREM', KEYS[6], waiter) end
k_settle(now)
if me ~= '' and redis.call('EXISTS', KEYS[7]) == 1 then
  q_leave(KEYS[7], KEYS[8], me)
  q_began(KEYS[7], KEYS[8], me, now)
  redis.call('HDEL', KEYS[8], '.woken')
end
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
pub const QMULTI_TAKE: &str = r#"
local n = #KEYS / 4
local wait, waiter = tonumber(ARGV[3]) or 0, ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local held, busy = false, 0
for i = 0, n - 1 do
  local k = KEYS[4 * i + 1]
  local v = redis.call('GET', k)
  if v then
    held = true
    busy = math.max(busy, redis.call('PTTL', k))
    if v == 'lockgate:held' and wait > 0 then
      local w = KEYS[4 * i + 4]
      redis.call('ZADD', w, now + wait, waiter)
      if redis.call('PTTL', w) < wait then redis.call('PEXPIRE', w, wait) end
    end
  end
end
if held then return {0, busy, 0, us} end
local out = {1, 0, 0, us}
for i = 0, n - 1 do
  redis.call('SET', KEYS[4 * i + 1], ARGV[2], 'PX', ARGV[1])
  redis.call('SET', KEYS[4 * i + 2], ARGV[2], 'PX', ARGV[1])
  redis.call('ZREM', KEYS[4 * i + 4], waiter)
  out[i + 5] = tonumber(redis.call('GET', KEYS[4 * i + 3]) or '0') or 0
end
return out
"#;
