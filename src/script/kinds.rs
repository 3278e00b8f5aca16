//! The Lua of shared, reentrant and counted locks (`LOCKGATE LOCK …
//! SHARED | OWNER`, `LOCKGATE ACQUIRE`) and of multi-key locks, sent by
//! `EVAL` on lockgate's own connection only (never on a client's, never
//! carried out without Lua: a server that refuses scripts refuses these
//! kinds, see `docs/locks.md`).
//!
//! One key `K` of these kinds is held by a set of holders:
//! - `K` itself holds [`HELD_MARK`] with the lease of the longest holder,
//!   so a `SETNX`, a `SET … NX` and an exclusive `LOCKGATE LOCK` find it
//!   taken while any holder lives, and it is gone with the last one;
//! - `lockgate:holders:{K}` (a hash): per holder `t:<token>` → `"<kind>
//!   <count> <owner>"` (kind `r` shared, `w` exclusive, `s` a permit),
//!   per owner `o:<owner>` → its token, and `.kind`;
//! - `lockgate:expiry:{K}` (a sorted set): per holder its lease's end,
//!   ms by Redis's clock; a holder past it is gone at the next call;
//! - `lockgate:writers:{K}` (a sorted set): exclusive callers waiting,
//!   each until its wait's end (at most a second ahead, renewed by each
//!   try): while one is there no new shared holder is let in, so a
//!   stream of readers cannot starve a writer, and a writer that died
//!   holds readers back a second at most.
//!
//! Tokens come from the key's fencing counter as `LOCKGATE LOCK`'s do
//! (`fence_take`), so they increase over every kind of grant of a key.

/// The value of a lock key held by shared, reentrant or counted holders:
/// never a token (tokens are digits), never what a client sets through
/// lockgate (its lock keys hold the client's own value).
pub const HELD_MARK: &str = "lockgate:held";

/// The holders' bookkeeping as Lua functions, over KEYS lock (1),
/// counter (3), holders (4), expiry (5), writers (6): `k_now()` (ms),
/// `k_token()` (a new fencing token, as a string), `k_purge(now)` (drops
/// holders and writers past their time), `k_settle(now)` (the lock key's
/// lease follows the longest holder; everything goes with the last one),
/// `k_leave(id)` (one holder out), `k_wait(now, wait, waiter)` (a
/// writer waits, the set expiring with its last waiter).
macro_rules! kinds_book {
    () => {
        r#"
local MARK = 'lockgate:held'
local function k_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function k_token()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local n = math.max(tonumber(redis.call('GET', KEYS[3]) or '0') or 0, us) + 1
  local s = string.format('%.0f', n)
  redis.call('SET', KEYS[3], s)
  return s
end
local function k_leave(id)
  local rec = redis.call('HGET', KEYS[4], id)
  if rec then
    local owner = string.match(rec, '^%S+ %S+ (.*)$') or ''
    if owner ~= '' and redis.call('HGET', KEYS[4], 'o:' .. owner) == string.sub(id, 3) then
      redis.call('HDEL', KEYS[4], 'o:' .. owner)
    end
    redis.call('HDEL', KEYS[4], id)
  end
  redis.call('ZREM', KEYS[5], id)
end
local function k_wait(now, wait, waiter)
  redis.call('ZADD', KEYS[6], now + wait, waiter)
  if redis.call('PTTL', KEYS[6]) < wait then redis.call('PEXPIRE', KEYS[6], wait) end
end
local function k_purge(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)) do k_leave(id) end
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
end
local function k_settle(now)
  local last = redis.call('ZRANGE', KEYS[5], -1, -1, 'WITHSCORES')
  if #last == 0 then
    if redis.call('GET', KEYS[1]) == MARK then redis.call('DEL', KEYS[1]) end
    redis.call('DEL', KEYS[4], KEYS[5])
    return false
  end
  local ms = math.max(tonumber(last[2]) - now, 1)
  redis.call('SET', KEYS[1], MARK, 'PX', ms)
  redis.call('PEXPIRE', KEYS[4], ms)
  redis.call('PEXPIRE', KEYS[5], ms)
  return true
end
"#
    };
}

/// A shared, reentrant or counted taking's decision and steps, as Lua
/// functions over [`kinds_book`]'s keys and the `queue!` functions (both
/// defined before), for one Redis ([`KIND_LOCK`]) and each master of the
/// quorum (`super::qkinds::QKIND_TAKE`):
/// `k_find(kind, ttl, owner, permits, wait, waiter, now)` answers
/// `'error', text`, `'again', token, count` (an owner's entry again, its
/// lease made at least `ttl` from now), `'taken', pttl` (a plain lock
/// holds the key), or `'free'`/`'held'` for what the kind may do;
/// `k_turn(free, kind, wait, waiter, me, bound, life, now)` is true when
/// the caller takes the key now, else it takes or renews its instance's
/// place in the queue (a yield on a free key wakes the head) and waits;
/// `k_enter(id, kind, owner, ttl, waiter, me, now)` makes `id` a holder.
macro_rules! kinds_take {
    () => {
        r#"
local function k_find(kind, ttl, owner, permits, wait, waiter, now)
  local v = redis.call('GET', KEYS[1])
  if v and v ~= MARK then
    if kind == 'w' and wait > 0 then k_wait(now, wait, waiter) end
    return 'taken', redis.call('PTTL', KEYS[1])
  end
  if not v then redis.call('DEL', KEYS[4], KEYS[5]) end
  k_purge(now)
  local held = redis.call('ZCARD', KEYS[5])
  local as = held > 0 and redis.call('HGET', KEYS[4], '.kind') or false
  if as and (as == 's') ~= (kind == 's') then
    return 'error', 'WRONGTYPE lockgate: this key is held as ' .. (as == 's' and 'a semaphore' or 'a lock')
  end
  if owner ~= '' then
    local mine = redis.call('HGET', KEYS[4], 'o:' .. owner)
    if mine then
      local id = 't:' .. mine
      local k, count = string.match(redis.call('HGET', KEYS[4], id) or '', '^(%S+) (%S+) ')
      if k ~= kind then
        return 'error', 'ERR lockgate: this owner holds the key as another kind of lock'
      end
      count = tonumber(count) + 1
      redis.call('HSET', KEYS[4], id, kind .. ' ' .. count .. ' ' .. owner)
      local till = math.max(tonumber(redis.call('ZSCORE', KEYS[5], id) or '0'), now + ttl)
      redis.call('ZADD', KEYS[5], till, id)
      k_settle(now)
      return 'again', mine, count
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
  return free and 'free' or 'held'
end
local function k_turn(free, kind, wait, waiter, me, bound, life, now)
  local yield, head = false, nil
  if me ~= '' and redis.call('EXISTS', KEYS[7]) == 1 then
    yield, head = q_yield(KEYS[7], KEYS[8], me, bound, now)
  end
  if free and not yield then return true end
  if kind == 'w' and wait > 0 then k_wait(now, wait, waiter) end
  if life > 0 then q_join(KEYS[7], KEYS[8], me, life, now) end
  if yield and free and redis.call('HGET', KEYS[8], '.woken') ~= head then
    q_wake(KEYS[7], KEYS[8], KEYS[1], now)
  end
  return false
end
local function k_enter(id, kind, owner, ttl, waiter, me, now)
  redis.call('HSET', KEYS[4], id, kind .. ' 1 ' .. owner, '.kind', kind)
  redis.call('ZADD', KEYS[5], now + ttl, id)
  if kind == 'w' then redis.call('ZREM', KEYS[6], waiter) end
  k_settle(now)
  if me ~= '' and redis.call('EXISTS', KEYS[7]) == 1 then
    q_leave(KEYS[7], KEYS[8], me)
    q_began(KEYS[7], KEYS[8], me, now)
    redis.call('HDEL', KEYS[8], '.woken')
  end
end
local function k_pttl()
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl < 0 then return 0 end
  return pttl
end
"#
    };
}

/// A shared, reentrant or counted acquisition of one key (see the module
/// doc). KEYS: lock, owner record (unused, for the slot), counter,
/// holders, expiry, writers, queue, places. ARGV: kind (`r` shared, `w`
/// exclusive, `s` a permit), lease ms, owner (`''`: none, not
/// reentrant), permits (for `s`), how long an exclusive caller still
/// waits ms (`0`: it does not hold readers back), its waiter id, then the
/// turns across instances as `super::FENCE_LOCK` takes them: instance
/// prefix, fairness bound ms, a place's life ms (`0`: no queue). A call
/// that finds the key taken, or yields to the queue's head, takes or
/// renews this instance's place; a grant leaves it; an owner's entry
/// again never waits.
///
/// Reply: `{token, count}` acquired (a holder's entry again: its token
/// and new count, its lease made at least `ttl` from now); `{0, pttl}`
/// not (the longest holder's time left); an error when the owner holds the
/// key as another kind, or the key is a semaphore and the call a lock (or
/// the other way round).
pub const KIND_LOCK: &str = concat!(
    queue!(),
    kinds_book!(),
    kinds_take!(),
    r#"
local kind, ttl, owner = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local permits, wait, waiter = tonumber(ARGV[4]) or 0, tonumber(ARGV[5]) or 0, ARGV[6]
local me, bound, life = ARGV[7] or '', tonumber(ARGV[8]) or 0, tonumber(ARGV[9]) or 0
local now = k_now()
local found, a, b = k_find(kind, ttl, owner, permits, wait, waiter, now)
if found == 'error' then return redis.error_reply(a) end
if found == 'again' then return {tonumber(a), b} end
if found == 'taken' then return {0, a} end
if not k_turn(found == 'free', kind, wait, waiter, me, bound, life, now) then return {0, k_pttl()} end
local tok = k_token()
k_enter('t:' .. tok, kind, owner, ttl, waiter, me, now)
if owner ~= '' then redis.call('HSET', KEYS[4], 'o:' .. owner, tok) end
return {tonumber(tok), 1}
"#
);

/// The release of one grant of any kind (`LOCKGATE UNLOCK | RELEASE`): an
/// exclusive fencing lock holding `token` is deleted as
/// [`super::FENCE_UNLOCK`] does; a holder of [`KIND_LOCK`] counts one
/// entry down and leaves at 0. The last holder gone (or a permit freed),
/// the key's queue's head is woken. KEYS: lock, owner record, counter (unused), holders,
/// expiry, writers, queue, places. ARGV: token. Reply: 1 released (an
/// entry of it), 0 `token` holds nothing here.
pub const KIND_UNLOCK: &str = concat!(
    // An exclusive lock with nobody queued, before any function is
    // defined (defining them costs every call).
    r#"
local v = redis.call('GET', KEYS[1])
local mine = v == ARGV[1] and v ~= 'lockgate:held'
if mine and redis.call('EXISTS', KEYS[7]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
if not mine and v ~= 'lockgate:held' then return 0 end
"#,
    kinds_book!(),
    queue!(),
    r#"
if mine then
  redis.call('DEL', KEYS[1], KEYS[2])
  q_wake(KEYS[7], KEYS[8], KEYS[1], q_now())
  return 1
end
local now = k_now()
k_purge(now)
local id = 't:' .. ARGV[1]
local rec = redis.call('HGET', KEYS[4], id)
if not rec then return 0 end
local kind, count, owner = string.match(rec, '^(%S+) (%S+) (.*)$')
count = tonumber(count) - 1
if count > 0 then
  redis.call('HSET', KEYS[4], id, kind .. ' ' .. count .. ' ' .. owner)
  return 1
end
k_leave(id)
-- The last holder gone, or a permit freed: the queue's head may go.
if (not k_settle(now) or kind == 's') and redis.call('EXISTS', KEYS[7]) == 1 then
  q_wake(KEYS[7], KEYS[8], KEYS[1], now)
end
return 1
"#
);

/// The extension of one grant of any kind (`LOCKGATE EXTEND`): an
/// exclusive fencing lock holding `token` as [`super::FENCE_EXTEND`]
/// does; a holder of [`KIND_LOCK`] gets `ttl` from now. A lease that ran
/// out is never brought back. KEYS: as [`KIND_UNLOCK`]'s first six.
/// ARGV: token, ttl ms. Reply: 1 extended, 0 not held.
pub const KIND_EXTEND: &str = concat!(
    r#"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] and v ~= 'lockgate:held' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 1
end
if v ~= 'lockgate:held' then return 0 end
"#,
    kinds_book!(),
    r#"
local now = k_now()
k_purge(now)
local id = 't:' .. ARGV[1]
if not redis.call('HGET', KEYS[4], id) then return 0 end
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[2]), id)
k_settle(now)
return 1
"#
);

/// The first step of every multi-key lock ([`MULTI_LOCK`],
/// `super::qkinds::QMULTI_TAKE`), over KEYS of four per key (lock, owner
/// record, counter, writers) and ARGV 3 and 4 (how long the caller still
/// waits ms, its waiter id): sets `n`, `waiter`, `now` (ms), `us` (µs),
/// `held` (any key taken) and `busy` (the longest time left of those),
/// the caller joining the waiting writers of each key held by shared or
/// counted holders.
macro_rules! multi_check {
    () => {
        r#"
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
"#
    };
}

/// All-or-none exclusive fencing locks on several keys (`LOCKGATE LOCK k1
/// k2 … ttl`): one atomic step, so two such calls on overlapping keys
/// never each hold a part and wait for the other. Each key taken is an
/// exclusive fencing lock as [`super::FENCE_LOCK`] takes it (its own
/// token, released and extended alone). KEYS: per key, lock, owner
/// record, counter, writers. ARGV: ttl ms, instance token (the owner
/// records), how long the caller still waits ms (`0`: it does not hold
/// readers back), its waiter id. Reply: `{token…}` in the keys' order, or
/// `{0, pttl}` with the longest time left of the keys held.
pub const MULTI_LOCK: &str = concat!(
    multi_check!(),
    r#"
if held then return {0, busy} end
local out = {}
for i = 0, n - 1 do
  local c = KEYS[4 * i + 3]
  local s = string.format('%.0f', math.max(tonumber(redis.call('GET', c) or '0') or 0, us) + 1)
  redis.call('SET', c, s)
  redis.call('SET', KEYS[4 * i + 1], s, 'PX', ARGV[1])
  redis.call('SET', KEYS[4 * i + 2], ARGV[2], 'PX', ARGV[1])
  redis.call('ZREM', KEYS[4 * i + 4], waiter)
  out[i + 1] = tonumber(s)
end
return out
"#
);

/// `MSETNX` naming lock keys, as one all-or-none acquisition: every key
/// is set, or none when any exists (as `MSETNX`), each lock key with its
/// lease and an owner record. KEYS: every key of the command in its
/// order, then the owner records of its lock keys in theirs. ARGV: the
/// owner records' token, then per key its value and lease ms (`0`: not a
/// lock key, set without one). Reply: 1 set, 0 not (`MSETNX`'s).
pub const MSETNX_LOCKS: &str = r#"
local n = (#ARGV - 1) / 2
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end
end
local o = n
for i = 1, n do
  local v, lease = ARGV[2 * i], ARGV[2 * i + 1]
  if lease == '0' then
    redis.call('SET', KEYS[i], v)
  else
    o = o + 1
    redis.call('SET', KEYS[i], v, 'PX', lease)
    redis.call('SET', KEYS[o], ARGV[1], 'PX', lease)
  end
end
return 1
"#;

/// The operators' read of a key held by shared, reentrant or counted
/// holders (`LOCKGATE LOCKS`), changing nothing. KEYS: lock, holders,
/// expiry, writers. Reply: `{kind, holders, entries, writers}`: kind 0
/// (not held so), 1 shared, 2 an owner's exclusive lock, 3 permits; the
/// live holders, their entries (reentrant counts summed), the exclusive
/// callers waiting.
pub const KIND_READ: &str = r#"
if redis.call('GET', KEYS[1]) ~= 'lockgate:held' then return {0, 0, 0, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. now, '+inf', 'LIMIT', 0, 10000)
local entries = 0
for _, id in ipairs(live) do
  local count = string.match(redis.call('HGET', KEYS[2], id) or '', '^%S+ (%S+) ')
  entries = entries + (tonumber(count) or 0)
end
local kind = ({r = 1, w = 2, s = 3})[redis.call('HGET', KEYS[2], '.kind') or ''] or 0
return {kind, #live, entries, redis.call('ZCOUNT', KEYS[4], '(' .. now, '+inf')}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_is_what_the_scripts_write() {
        assert!(KIND_LOCK.contains(&format!("local MARK = '{HELD_MARK}'")));
        assert!(MULTI_LOCK.contains(&format!("v == '{HELD_MARK}'")));
        // Tokens are digits: the mark is never one.
        assert!(!HELD_MARK.bytes().all(|c| c.is_ascii_digit()));
    }
}
