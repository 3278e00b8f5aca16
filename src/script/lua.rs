//! The Lua scripts lock operations run as, on the client's own upstream
//! connection (so their replies keep their place in the pipeline for free).
//! Each script is one atomic step on Redis: a lock key never exists without
//! a lease, and it never changes without its owner record.
//!
//! Every script takes `ARGV[1]`: `"1"` asks for `{reply, facts…}` so the
//! lock layer can learn the outcome (acquired? denied? lease lapsed?); the
//! writer half unwraps `reply` for the client. `"0"` (inside `MULTI`, where
//! Redis queues the call and `EXEC` returns an array the client expects
//! unchanged) returns just `reply`. `reply` always has exactly the shape the
//! client's original command returns.
//!
//! Owner records (`lockgate:owner:{key}`) hold the acquisition token
//! `instance_id:seq` and carry the lock's lease.

/// The owner check every release and extension makes, as a Lua function
/// the scripts start with: `allows(owner, tok, alt, prefix, any, born)`
/// returns (allowed, lapsed, stale). `owner`: the owner record (false when
/// absent); `tok`: the token this connection acquired with (`''`: it never
/// did); `alt`: the same connection's attempts not settled yet, newline
/// separated (`''`: none), any of which may be the one the owner record
/// holds; `any`: ownership `any`; `born`: the number of the first token
/// this instance issued after the connection opened. A connection that
/// acquired may act only on that acquisition (else its lease lapsed); one
/// that never did may act on keys without owner record (plain data) and on
/// this instance's acquisitions made since it opened (the pooled rule: a
/// connection opened after an acquisition cannot be the pool connection
/// that made it, so a holder's late release after a reconnect is refused,
/// `stale`, and waits for the lease instead).
macro_rules! owner_check {
    () => {
        r#"
local function allows(owner, tok, alt, prefix, any, born)
  if any then return true, 0, 0 end
  if not owner then
    if tok == '' then return true, 0, 0 end
    return false, 1, 0
  end
  if tok ~= '' then
    if owner == tok or (alt ~= '' and string.find('\n' .. alt .. '\n', '\n' .. owner .. '\n', 1, true)) then
      return true, 0, 0
    end
    return false, 1, 0
  end
  if string.sub(owner, 1, #prefix) ~= prefix then return false, 0, 0 end
  if (tonumber(string.sub(owner, #prefix + 1)) or 0) >= tonumber(born) then return true, 0, 0 end
  return false, 0, 1
end
"#
    };
}

/// The key's cross-instance queue, as Lua functions the acquiring and
/// releasing scripts start with. Instances whose attempts on a lock key
/// failed wait in the store, in two keys in the lock's hash slot: the
/// queue `lockgate:queue:{key}` (a sorted set: member the instance prefix,
/// score since when, in the store's clock in ms, that instance has waited)
/// and the places' ends `lockgate:places:{key}` (a hash: instance prefix →
/// the store time in ms its place lapses unless renewed). Every cost is
/// O(log N) in the queue's length N, none O(N):
///
/// - `q_join(qk, sk, me, ttl, now)`: a failed attempt of `me` takes a place
///   (keeping its `since` while its place has not lapsed) or renews it for
///   `ttl × scale` ms, `scale` = its rank in the queue, 1 to 64, which it
///   returns: an instance far back renews its place that much less often
///   (every `scale × ttl / 3`), so the renewals of a queue of N cost
///   O(log N) per `ttl`, not N. Both keys expire when the longest place
///   does; the field `.ttl` keeps `ttl`.
/// - `q_head(qk, sk, now)`: the instance first in the queue and its
///   `since`, after dropping at most 16 heads whose place lapsed (an
///   instance that died or stopped waiting: nothing of it blocks longer
///   than its `ttl`), counted in `q_dropped` (a fact of the scripts, so
///   lockgate counts them: `lock_queue_places_lapsed`).
/// - `q_yield(qk, sk, me, bound, now)`: (yield, head): yield to the head,
///   another instance, when it has waited longer than `bound` ms
///   (`locks.retry.max_local_preference_ms`) and longer than `me`, or when
///   `me`'s turn with the lock has lasted longer than its share of the
///   bound, `bound / n` for n instances in the queue: so turns have equal
///   lengths and the head waits about `bound` at most, whatever n. A turn
///   begins when an instance acquires while others wait (the field
///   `.turn` of the places hash, `start prefix`); its local handoffs
///   continue it.
/// - `q_wake(qk, sk, key, now)`: the lock is free: wake the head alone,
///   `PUBLISH lockgate:wake:<prefix> key` (one subscriber: its own
///   channel), so a release costs one message whatever the fleet's size.
///   A head nobody listens for (`PUBLISH` reached no subscriber: its
///   instance is gone, its connections closed with it) loses its place at
///   once, counted in `q_dropped`, and the next is woken. The woken head's
///   place is cut to `ttl` from now: a live head acquires or renews within
///   it; a hung one (its place long, from far back) lapses then. Returns
///   the head woken, also kept as the field `.woken`, so an attempt that
///   yields on the free lock does not wake it twice.
/// - `q_leave(qk, sk, me)`: `me` acquired, or stopped waiting; 1 if it
///   had a place.
macro_rules! queue {
    () => {
        r#"
local q_dropped = 0
local function q_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function q_leave(qk, sk, me)
  local left = redis.call('ZREM', qk, me)
  if left == 1 then
    -- The last place gone, the places' hash goes too (its '.ttl' and
    -- '.turn' alone would outlive the queue).
    if redis.call('EXISTS', qk) == 0 then redis.call('DEL', sk) else redis.call('HDEL', sk, me) end
  end
  return left
end
local function q_head(qk, sk, now)
  for _ = 1, 16 do
    local h = redis.call('ZRANGE', qk, 0, 0, 'WITHSCORES')
    if #h == 0 then return nil, nil end
    if tonumber(redis.call('HGET', sk, h[1]) or '0') >= now then return h[1], tonumber(h[2]) end
    q_leave(qk, sk, h[1])
    q_dropped = q_dropped + 1
  end
  return nil, nil
end
local function q_turn(sk, me, now)
  local t = redis.call('HGET', sk, '.turn')
  if t then
    local c = string.find(t, ' ', 1, true)
    if c and string.sub(t, c + 1) == me then return tonumber(string.sub(t, 1, c - 1)) or now end
  end
  return now
end
local function q_began(qk, sk, me, now)
  -- Only while others wait: a turn is a share among them (and a hash
  -- written without a queue would have no expiry).
  if redis.call('EXISTS', qk) == 0 or redis.call('EXISTS', sk) == 0 then return end
  if q_turn(sk, me, now) == now then redis.call('HSET', sk, '.turn', now .. ' ' .. me) end
end
local function q_yield(qk, sk, me, bound, now)
  local head, since = q_head(qk, sk, now)
  if not head or head == me or bound <= 0 then return false, head end
  if now - since > bound then
    local mine = redis.call('ZSCORE', qk, me)
    if (not mine) or since < tonumber(mine) then return true, head end
  end
  local share = bound / math.max(redis.call('ZCARD', qk), 1)
  return now - q_turn(sk, me, now) > share, head
end
local function q_join(qk, sk, me, ttl, now)
  local ends = redis.call('HGET', sk, me)
  if not ends or tonumber(ends) < now then redis.call('ZADD', qk, now, me) end
  local scale = math.min(math.max(redis.call('ZRANK', qk, me), 1), 64)
  local life = ttl * scale
  redis.call('HSET', sk, me, now + life, '.ttl', ttl)
  -- Each key on its own: neither may ever stay without an expiry.
  if redis.call('PTTL', qk) < life then redis.call('PEXPIRE', qk, life) end
  if redis.call('PTTL', sk) < life then redis.call('PEXPIRE', sk, life) end
  return scale
end
local function q_wake(qk, sk, key, now)
  for _ = 1, 16 do
    local head = q_head(qk, sk, now)
    if not head then return nil end
    if redis.call('PUBLISH', 'lockgate:wake:' .. head, key) > 0 then
      local grace = now + tonumber(redis.call('HGET', sk, '.ttl') or '0')
      if tonumber(redis.call('HGET', sk, head) or '0') > grace then redis.call('HSET', sk, head, grace) end
      redis.call('HSET', sk, '.woken', head)
      return head
    end
    -- Nobody listens on its channel: its instance is gone (a killed
    -- sidecar's connections close with it). The next one.
    q_leave(qk, sk, head)
    q_dropped = q_dropped + 1
  end
  return nil
end
"#
    };
}

/// Acquire: `SET k v NX <ttl>` plus the owner record, atomically.
/// KEYS: lock, owner record, queue, places (see the `queue!` functions). ARGV: info,
/// value, token, ttl kind (`PX`/`EX`/`PXAT`/`EXAT`), ttl, shape (`setnx` →
/// 1/0, `set` → OK/nil, `setget` → old value), instance prefix, fairness
/// bound ms (`0`: off), a place's life in the queue ms (`0`: no queue),
/// renew (`1`: a failed attempt takes or renews this instance's place;
/// `0`: its place was renewed less than a third of its life ago, so an
/// attempt on a held lock is only `PTTL`, the probe's whole cost).
/// Facts: acquired (1/0), the key's PTTL afterwards (the holder's remaining
/// lease when not acquired), the master's clock with info `"2"` (the
/// quorum's acquisitions; `TIME`, µs since the epoch, fact
/// [`ACQUIRE_CLOCK_FACT`], read in the same atomic step as the `SET NX` it
/// vouches for, see [`crate::lock::quorum::clock`]; 0 otherwise), yielded (1: not tried,
/// the queue's head goes first, see `q_yield`, fact
/// [`ACQUIRE_YIELD_FACT`]), behind (not acquired and another instance is
/// first in the key's queue: this one's place's scale, 1 to 64, fact
/// [`ACQUIRE_BEHIND_FACT`]; it waits for its wake-up, renewing its place
/// every scale × `ttl / 3`; 0: first or no queue), the lapsed places
/// dropped from the queue (fact [`ACQUIRE_DROPPED_FACT`]), and the life of
/// the place it took or renewed (fact [`ACQUIRE_PLACED_FACT`]). A failed attempt takes or
/// renews this instance's place in the queue (also with the bound off: a
/// release wakes the queue's head, see [`RELEASE`]); a yielded attempt on
/// a free lock wakes the head at once, not at its next probe. Uncontended
/// (no queue), it runs `EXISTS`, `SET NX` and the owner record's `SET`,
/// nothing else. The owner record gets the lock's own expiry option, so an
/// acquisition asks no PTTL unless its lease is a deadline (`PXAT`/`EXAT`).
///
/// Info `"3"` (the uncontended `SETNX`, see [`crate::lock::fast`]): with
/// no queue on the key, the attempt is only `SET NX` and the owner record,
/// before the queue's functions are defined (defining them costs every
/// call), and its reply, acquired, is `1`. Otherwise (a queue, or the key
/// held: the `SET NX` is tried again, and fails) as info `"1"`: a failed
/// attempt takes its place in the queue as always.
pub const ACQUIRE: &str = concat!(
    r#"
if ARGV[1] == '3' and redis.call('EXISTS', KEYS[3]) == 0 then
  local ok = redis.pcall('SET', KEYS[1], ARGV[2], 'NX', ARGV[4], ARGV[5])
  if type(ok) == 'table' and ok.err then return ok end
  if ok then
    redis.call('SET', KEYS[2], ARGV[3], ARGV[4], ARGV[5])
    return 1
  end
end
-- A probe of a held lock whose place in the queue needs no renewal (or
-- without a queue): not acquired, nothing else to do. Held, it cannot be
-- taken, so there is nothing to yield; before the queue's functions are
-- defined (defining them costs every call).
if (ARGV[10] == '0' or ARGV[9] == '0') and ARGV[6] ~= 'setget' and ARGV[1] ~= '0' then
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl ~= -2 then
    local reply = 0
    if ARGV[6] == 'set' then reply = false end
    local clock = 0
    if ARGV[1] == '2' then
      local t = redis.call('TIME')
      clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
    end
    return {reply, 0, pttl, clock, 0, 0, 0, 0}
  end
end
"#,
    queue!(),
    r#"
local bound, ttl, me = tonumber(ARGV[8]) or 0, tonumber(ARGV[9]) or 0, ARGV[7]
local now, yield, head = 0, false, nil
-- No instance waiting (no queue): no clock to read, nothing to weigh.
local queued = ttl > 0 and redis.call('EXISTS', KEYS[3]) == 1
if queued then
  now = q_now()
  yield, head = q_yield(KEYS[3], KEYS[4], me, bound, now)
end
local old = false
if ARGV[6] == 'setget' then
  old = redis.pcall('GET', KEYS[1])
  if type(old) == 'table' and old.err then return old end
end
local ok = false
if not yield then
  ok = redis.pcall('SET', KEYS[1], ARGV[2], 'NX', ARGV[4], ARGV[5])
  if type(ok) == 'table' and ok.err then return ok end
end
local acquired, pttl, behind, placed = 0, 0, 0, 0
if ok then
  acquired = 1
  redis.call('SET', KEYS[2], ARGV[3], ARGV[4], ARGV[5])
  if ARGV[4] == 'PX' then pttl = tonumber(ARGV[5])
  elseif ARGV[4] == 'EX' then pttl = tonumber(ARGV[5]) * 1000
  else pttl = redis.call('PTTL', KEYS[1]) end
  if queued then
    q_leave(KEYS[3], KEYS[4], me)
    q_began(KEYS[3], KEYS[4], me, now)
    -- Taken: any wake-up sent before is spent.
    redis.call('HDEL', KEYS[4], '.woken')
  end
else
  pttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then
    if now == 0 then now = q_now() end
    local scale = q_join(KEYS[3], KEYS[4], me, ttl, now)
    if head and head ~= me then behind = scale end
    placed = ttl * scale
  end
  -- Held back for a longer waiter elsewhere: wake it now, not at its
  -- next probe.
  -- (Once: a release that freed it woke the head already.)
  if yield and pttl == -2 and redis.call('HGET', KEYS[4], '.woken') ~= head then
    q_wake(KEYS[3], KEYS[4], KEYS[1], now)
  end
end
local reply = old
if ARGV[6] == 'setnx' then reply = acquired elseif ARGV[6] == 'set' then reply = ok end
local yielded = yield and 1 or 0
if ARGV[1] == '1' or ARGV[1] == '3' then return {reply, acquired, pttl, 0, yielded, behind, q_dropped, placed} end
if ARGV[1] == '2' then
  local t = redis.call('TIME')
  return {reply, acquired, pttl, tonumber(t[1]) * 1000000 + tonumber(t[2]), yielded, behind, q_dropped, placed}
end
return reply
"#
);

/// Where [`ACQUIRE`]'s facts (after the reply) carry the master's clock.
pub const ACQUIRE_CLOCK_FACT: usize = 2;

/// Where [`ACQUIRE`]'s facts say it yielded to another instance.
pub const ACQUIRE_YIELD_FACT: usize = 3;

/// Where [`ACQUIRE`]'s facts say another instance is first in the queue.
pub const ACQUIRE_BEHIND_FACT: usize = 4;

/// Where [`ACQUIRE`]'s facts count the lapsed places it dropped.
pub const ACQUIRE_DROPPED_FACT: usize = 5;

/// Where [`ACQUIRE`]'s facts give the life (ms) of the place a failed
/// attempt took or renewed in the key's queue (0: it took none): the
/// instance's place needs no renewal for a third of it.
pub const ACQUIRE_PLACED_FACT: usize = 6;

/// Where [`RELEASE`]'s and [`RELEASE_HANDOFF`]'s facts count the lapsed
/// places they dropped.
pub const RELEASE_DROPPED_FACT: usize = 6;

/// Where a [`RELEASE`] (as a script, or carried out as a transaction where
/// the server refuses scripts, see [`crate::lock::txn`]) counts the lock
/// keys it deleted that had no owner record (set directly on Redis):
/// freed, so this instance's view follows at once and its waiters may try.
/// The queue's wake-up says so too, but later, over the subscription: an
/// attempt sent right after the `DEL` was answered could be answered "not
/// acquired" from the view meanwhile (`tests/it/storm_handoff.rs`,
/// `a_closed_spinners_place_does_not_hold_newcomers_back`, on a loaded box).
pub const RELEASE_FREED_FACT: usize = 7;

/// Where [`RELEASE_HANDOFF`]'s facts give, when it yielded, the scale of
/// the releasing instance's new place in the queue (as
/// [`ACQUIRE_BEHIND_FACT`]).
pub const HANDOFF_BEHIND_FACT: usize = 7;

/// Owner-checked release for `DEL`/`UNLINK`.
/// KEYS: n quadruples (lock key, owner record, queue, places; see
/// the `queue!` functions), then ordinary keys. A release of a key with a queue wakes
/// the queue's head alone (`lockgate:wake:<prefix>`), whichever instance
/// it is: one message per release, however many instances wait. Inside
/// `MULTI` (info `"0"`) too: this instance sees no facts there, and if its
/// own attempts wait first in the queue the wake-up is how it learns.
/// ARGV: info, n, command (`DEL`/`UNLINK`), ownership (`instance`/`any`,
/// or `value`: a lock library's release script carried out here, which
/// releases a key whose value is its token, its owner record unread, and
/// fails with `WRONGTYPE` on a key that is not a string, as the library's
/// script does),
/// instance prefix (`id:`), the connection's birth (see `allows`), then n
/// tokens (`''` = this connection never acquired that key), then n lists of
/// unsettled attempts (`''`: none). A key with no owner record (set directly on Redis) is
/// deleted as before, unless this connection acquired it (then its lease
/// lapsed and the key, if any, is someone else's).
/// Reply: the number deleted, as DEL. Facts: released, denied, lapsed, 0
/// (where [`RELEASE_HANDOFF`] says handed), stale (denied by the pooled
/// rule's age check), 0 (where it says yielded), lapsed places dropped
/// ([`RELEASE_DROPPED_FACT`]), keys deleted without an owner record
/// ([`RELEASE_FREED_FACT`]).
pub const RELEASE: &str = concat!(
    owner_check!(),
    queue!(),
    r#"
local n = tonumber(ARGV[2])
local cmd, any, prefix, born = ARGV[3], ARGV[4] == 'any', ARGV[5], ARGV[6]
local by_value = ARGV[4] == 'value'
local total, released, denied, lapsed, stale, freed = 0, 0, 0, 0, 0, 0
local seen = {}
for i = 1, n do
  local key, rec, qk, sk = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  local tok, alt = ARGV[6 + i], ARGV[6 + n + i]
  if seen[key] and not by_value then tok = '' end
  seen[key] = true
  local owner = redis.call('GET', rec)
  local allowed, lapse, young = false, 0, 0
  if by_value then
    allowed = redis.call('GET', key) == tok
  else
    allowed, lapse, young = allows(owner, tok, alt, prefix, any, born)
  end
  lapsed = lapsed + lapse
  stale = stale + young
  if allowed then
    local d = 0
    if owner then
      -- The owner record exists (just read): one call deletes both.
      d = redis.call(cmd, key, rec) - 1
      released = released + d
    else
      d = redis.call(cmd, key)
      freed = freed + d
    end
    total = total + d
    if d > 0 and redis.call('EXISTS', qk) == 1 then q_wake(qk, sk, key, q_now()) end
  else
    denied = denied + 1
  end
end
if #KEYS > 4 * n then total = total + redis.call(cmd, unpack(KEYS, 4 * n + 1)) end
if ARGV[1] == '1' then return {total, released, denied, lapsed, 0, stale, 0, q_dropped, freed} end
return total
"#
);

/// [`RELEASE`] of one lock key that also hands it over, in the same step,
/// to the oldest attempt parked on this instance (retry storms): when the
/// release is allowed the lock is overwritten with the next holder's
/// value, owner record and lease instead of deleted, so it is never free
/// in between and nobody needs waking. KEYS: lock, owner record, queue,
/// places (see the `queue!` functions). ARGV: info, command (`DEL`/`UNLINK`), ownership,
/// instance prefix, token (as [`RELEASE`]), next value, next token, next
/// lease ms, the newer unsettled attempts (as [`RELEASE`]), the
/// connection's birth, fairness bound ms and a place's life ms (as
/// [`ACQUIRE`]). Reply: the number deleted, as DEL. Facts: released,
/// denied, lapsed, handed (1/0), stale, yielded (1: the queue's head goes
/// first, see `q_yield`, so the lock was released and that instance woken,
/// not handed, and the waiter it was for takes a place in the queue),
/// lapsed places dropped ([`RELEASE_DROPPED_FACT`]), and that place's scale
/// ([`HANDOFF_BEHIND_FACT`]).
/// A lock key that is not a string is deleted as DEL would, not handed.
pub const RELEASE_HANDOFF: &str = concat!(
    owner_check!(),
    queue!(),
    r#"
local key, rec, qk, sk = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner = redis.call('GET', rec)
local allowed, lapsed, stale = false, 0, 0
if ARGV[3] == 'value' then
  allowed = redis.call('GET', key) == ARGV[5]
else
  allowed, lapsed, stale = allows(owner, ARGV[5], ARGV[9], ARGV[4], ARGV[3] == 'any', ARGV[10])
end
local d, handed, yielded, behind = 0, 0, 0, 0
if allowed then
  local bound = tonumber(ARGV[11]) or 0
  local queued = redis.call('EXISTS', qk) == 1
  local now, yield = 0, false
  if queued then
    now = q_now()
    yield = q_yield(qk, sk, ARGV[4], bound, now)
  end
  local old = false
  if yield then
    yielded = 1
    old = {err = 'yield'}
  else
    old = redis.pcall('SET', key, ARGV[6], 'PX', ARGV[8], 'GET')
  end
  if type(old) == 'table' and old.err then
    if owner then d = redis.call(ARGV[2], key, rec) - 1 else d = redis.call(ARGV[2], key) end
    if d > 0 and queued then q_wake(qk, sk, key, now) end
    -- Its own waiter waits on, behind the head it yielded to: its place
    -- taken now, not at its next attempt.
    if yield then behind = q_join(qk, sk, ARGV[4], tonumber(ARGV[12]) or 0, now) end
  else
    redis.call('SET', rec, ARGV[7], 'PX', ARGV[8])
    if old then d = 1 end
    handed = 1
    -- Kept locally (within its turn): this instance's next waiters go to
    -- the back of the queue, behind the instances waiting now.
    if queued then
      q_leave(qk, sk, ARGV[4])
      q_began(qk, sk, ARGV[4], now)
    end
  end
end
local released = 0
if owner then released = d end
local denied = 1
if allowed then denied = 0 end
if ARGV[1] == '1' then return {d, released, denied, lapsed, handed, stale, yielded, q_dropped, behind} end
return d
"#
);

/// An instance woken for a key it no longer waits on passes its turn: it
/// leaves the key's queue and, if the lock is free, wakes the new head.
/// KEYS: lock, owner record (unused), queue, places. ARGV: instance
/// prefix. Reply: 1 if it was in the queue.
pub const PASS: &str = concat!(
    queue!(),
    r#"
local left = q_leave(KEYS[3], KEYS[4], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[3]) == 1 then
  q_wake(KEYS[3], KEYS[4], KEYS[1], q_now())
end
return left
"#
);

/// Owner-checked `EXPIRE`/`PEXPIRE`/`EXPIREAT`/`PEXPIREAT`: the lock and its
/// owner record move together. KEYS: lock, owner record. ARGV: info,
/// ownership, instance prefix, token, unsettled attempts, the connection's
/// birth (as [`RELEASE`]), command (uppercase), its arguments after the key. Reply: as
/// the command (0 when refused). Facts: allowed (1/0), lapsed, the lock's
/// PTTL afterwards (so lockgate's view of the lease follows the client's),
/// stale.
pub const EXTEND: &str = concat!(
    owner_check!(),
    r#"
local owner = redis.call('GET', KEYS[2])
local allowed, lapsed, stale = allows(owner, ARGV[4], ARGV[5], ARGV[3], ARGV[2] == 'any', ARGV[6])
local reply = 0
local pttl = -3
if allowed then
  reply = redis.pcall(ARGV[7], KEYS[1], unpack(ARGV, 8))
  if type(reply) == 'table' and reply.err then return reply end
  if reply == 1 and #ARGV == 8 and (ARGV[7] == 'EXPIRE' or ARGV[7] == 'PEXPIRE') then
    -- A relative lease that was set: it is the argument, no PTTL to ask
    -- (a script's clock stands still); not above 0, the key is gone.
    pttl = tonumber(ARGV[8])
    if ARGV[7] == 'EXPIRE' then pttl = pttl * 1000 end
    if pttl <= 0 then pttl = -2 end
  else
    pttl = redis.call('PTTL', KEYS[1])
  end
  if owner then
    if pttl > 0 then
      redis.call('PEXPIRE', KEYS[2], pttl)
    elseif pttl == -2 then
      redis.call('DEL', KEYS[2])
    end
  end
end
if ARGV[1] == '1' then return {reply, allowed and 1 or 0, lapsed, pttl, stale} end
return reply
"#
);

/// Takeover for `GETSET`, `SET` without NX, `GETDEL`, `GETEX`: run the
/// command, keep the lease it had (or give the default if it had none), and
/// make the owner record this connection's. KEYS: lock, owner record.
/// ARGV: info, token, default lease ms, command, its arguments after the
/// key. Reply: as the command. Facts: the key's PTTL afterwards.
pub const TAKEOVER: &str = r#"
local before = redis.call('PTTL', KEYS[1])
local reply = redis.pcall(ARGV[4], KEYS[1], unpack(ARGV, 5))
if type(reply) == 'table' and reply.err then return reply end
local after = redis.call('PTTL', KEYS[1])
if after == -1 then
  local lease = tonumber(ARGV[3])
  if before > 0 then lease = before end
  redis.call('PEXPIRE', KEYS[1], lease)
  after = lease
end
if after > 0 then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', after)
else
  redis.call('DEL', KEYS[2])
end
if ARGV[1] == '1' then return {reply, after} end
return reply
"#;

/// Renewal by the watchdog: extend only while the owner record still holds
/// this token and the lock still holds the value acquired with it (a client
/// may release with its own Lua, which leaves the owner record behind), and
/// never shorten a longer lease the client asked for. KEYS: lock, owner
/// record. ARGV: token, lease ms, value (`''`: not known, not checked).
/// Reply: 1 renewed, 0 not ours any more.
pub const RENEW: &str = r#"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
local v = redis.call('GET', KEYS[1])
if not v or (ARGV[3] ~= '' and v ~= ARGV[3]) then
  redis.call('DEL', KEYS[2])
  return 0
end
local lease = tonumber(ARGV[2])
local pttl = redis.call('PTTL', KEYS[1])
if pttl < lease then
  redis.call('PEXPIRE', KEYS[1], lease)
  pttl = lease
end
redis.call('PEXPIRE', KEYS[2], pttl)
return 1
"#;

/// Release by token (release on disconnect), with the same checks as
/// [`RENEW`]; the queue's head is woken as by [`RELEASE`]. KEYS: lock,
/// owner record, queue, places. ARGV: token, value (`''`: not checked).
/// Reply: 1 released, 0 not ours.
pub const RELEASE_TOKEN: &str = concat!(
    queue!(),
    r#"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
local v = redis.call('GET', KEYS[1])
if not v or (ARGV[2] ~= '' and v ~= ARGV[2]) then
  redis.call('DEL', KEYS[2])
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
if redis.call('EXISTS', KEYS[3]) == 1 then q_wake(KEYS[3], KEYS[4], KEYS[1], q_now()) end
return 1
"#
);

/// After a client's own script on lock keys (a lock library's release,
/// extension or reacquire, which knows nothing of owner records): the
/// key's owner record made true to what the script did, in one atomic
/// step. KEYS: lock, owner record, queue, places. ARGV: the token this
/// instance holds the key by and the value it acquired it with (`''`:
/// not held through the connection that ran the script; only the first
/// and the adoption rule apply, and it never replies `-3` or `-1`); then,
/// when not held, a new token and the values the script was given that
/// may be a lock's.
/// - The lock key is gone (the script released it): its owner record goes
///   too, and if there was one, the queue's head is woken, as a release
///   wakes it. Reply `-2`; `-3` when there was no record left (the holding
///   by the token is over all the same). An acquisition writes both keys
///   in one step, so an owner record without its lock key belongs to
///   nobody.
/// - The lock key is there and its owner record holds another token: the
///   holding by the token is over (released, then acquired again by
///   somebody before this step ran: it runs behind the client's script,
///   not with it). Nothing changes. Reply `-1`.
/// - The lock key is a hash, its owner record holds the token, and the
///   holder field it was adopted with is gone (a shared hash lock, such as
///   Redisson's read lock, left by this holder while others still hold
///   it): the holding is over and the owner record goes (the next
///   holder's own script is adopted then). Reply `-1`.
/// - The lock key is there with a lease, the owner record holds the token
///   and the key still the value it was acquired with (a hash lock: still
///   has that holder field; the same acquisition): the owner record's expiry becomes the key's, so the
///   record lasts exactly as long as the lease the script set. Reply `1`
///   when it moved.
/// - Not held through the connection, the lock key has a lease and no
///   owner record, and its value (a string) or one of its fields (a
///   hash) is one the script was given (the script acquired it:
///   node-redlock's multi-key acquisition, Redisson's hash lock with its
///   holder field, any library's `SET … NX PX` inside a script): an
///   owner record with the new token, lapsing with the key. Reply `{2, i,
///   pttl}`, `i` the value's place among those given.
/// - Otherwise nothing. Reply `0`.
pub const RECONCILE: &str = concat!(
    r#"
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 then
  if redis.call('DEL', KEYS[2]) == 0 then
    if ARGV[1] == '' then return 0 end
    return -3
  end
  if redis.call('EXISTS', KEYS[3]) == 1 then
"#,
    queue!(),
    r#"
    q_wake(KEYS[3], KEYS[4], KEYS[1], q_now())
  end
  return -2
end
if ARGV[1] == '' then
  if #ARGV < 4 or pttl < 0 or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
  local kind = redis.call('TYPE', KEYS[1]).ok
  if kind ~= 'string' and kind ~= 'hash' then return 0 end
  local value = kind == 'string' and redis.call('GET', KEYS[1])
  for i = 4, #ARGV do
    if ARGV[i] == value or (kind == 'hash' and redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1) then
      redis.call('SET', KEYS[2], ARGV[3], 'PX', pttl)
      return {2, i - 3, pttl}
    end
  end
  return 0
end
local owner = redis.call('GET', KEYS[2])
if owner ~= ARGV[1] then
  if owner then return -1 end
  return 0
end
if pttl < 0 then return 0 end
local value = redis.pcall('GET', KEYS[1])
if type(value) == 'table' then
  if redis.call('HEXISTS', KEYS[1], ARGV[2]) == 0 then
    redis.call('DEL', KEYS[2])
    return -1
  end
elseif value ~= ARGV[2] then
  return 0
end
if redis.call('PTTL', KEYS[2]) == pttl then return 0 end
redis.call('PEXPIRE', KEYS[2], pttl)
return 1
"#
);

/// The release of one lock key by the connection that holds it (its own
/// token, no attempt unsettled, see `LockService::fast_path`): [`RELEASE`]'s
/// check and delete, with the queue's functions defined only when a queue
/// is there to wake (defining them costs every call). KEYS: lock, owner
/// record, queue, places. ARGV: token, `DEL` or `UNLINK`, and for a
/// release by value (a lock library's release script) the value: then the
/// key's value is what is checked, as the library's script checks it.
/// Reply: the number deleted, as the client's command (`0` when the owner
/// record was gone: deleted behind lockgate's back); `-1` not this token's
/// (the lease lapsed: the client's `0`) or, by value, not that value;
/// `{deleted, lapsed places dropped}` after a wake-up that dropped lapsed
/// places.
pub const RELEASE_FAST: &str = concat!(
    r#"
local d
if ARGV[3] then
  if redis.call('GET', KEYS[1]) ~= ARGV[3] then return -1 end
  redis.call(ARGV[2], KEYS[1], KEYS[2])
  d = 1
else
  if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
  d = redis.call(ARGV[2], KEYS[1], KEYS[2]) - 1
end
if d > 0 and redis.call('EXISTS', KEYS[3]) == 1 then
"#,
    queue!(),
    r#"
  q_wake(KEYS[3], KEYS[4], KEYS[1], q_now())
  if q_dropped > 0 then return {d, q_dropped} end
end
return d
"#
);

/// The extension of a held lock by its holder with a relative lease
/// (`EXPIRE k s` / `PEXPIRE k ms`, no option; see
/// `LockService::fast_path`): [`EXTEND`]'s check and move, the owner record
/// following the lock. KEYS: lock, owner record. ARGV: token, `EXPIRE` or
/// `PEXPIRE`, the amount. Reply: as the command; `-1` not this token's
/// (the client's `0`). A lock key gone behind lockgate's back takes its
/// owner record with it.
pub const EXTEND_FAST: &str = r#"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local r = redis.call(ARGV[2], KEYS[1], ARGV[3])
if r == 1 then redis.call(ARGV[2], KEYS[2], ARGV[3]) else redis.call('DEL', KEYS[2]) end
return r
"#;

/// A fixed error reply, for refusals that must take a command's place in a
/// transaction. ARGV: the error text (with its code).
pub const ERROR: &str = "return redis.error_reply(ARGV[1])";

/// [`FENCE_LOCK`]'s taking of a free lock, as a Lua function:
/// `fence_take()` sets the token (see there) and returns it, and leaves
/// the key's waiting writers; `fence_waits()`, on a key held by shared or
/// counted holders ([`super::kinds`]), joins them while the caller waits.
// The token is formatted with '%.0f': a Lua number handed to redis.call
// is converted with too few digits for µs since the epoch (16 digits).
macro_rules! fence_take {
    () => {
        r#"
local function fence_take()
  local now = redis.call('TIME')
  local us = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local t = math.max(tonumber(redis.call('GET', KEYS[3]) or '0') or 0, us) + 1
  local s = string.format('%.0f', t)
  redis.call('SET', KEYS[3], s)
  redis.call('SET', KEYS[1], s, 'PX', ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
  if (ARGV[6] or '0') ~= '0' then redis.call('ZREM', KEYS[6], ARGV[7]) end
  return t
end
local function fence_waits()
  if (ARGV[6] or '0') ~= '0' and redis.call('GET', KEYS[1]) == 'lockgate:held' then
    local now = redis.call('TIME')
    local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    redis.call('ZADD', KEYS[6], ms + tonumber(ARGV[6]), ARGV[7])
    if redis.call('PTTL', KEYS[6]) < tonumber(ARGV[6]) then redis.call('PEXPIRE', KEYS[6], ARGV[6]) end
  end
end
"#
    };
}

/// Fencing-token acquisition (`LOCKGATE LOCK`): the lock's value is the
/// token, one more than the larger of the key's counter
/// (`lockgate:fence:{key}`, never expiring, raised to each token) and
/// Redis's clock in µs. The counter makes tokens grow while Redis keeps
/// it; the clock makes them grow when it is lost (a restart without
/// persistence, a flush): a token issued later is above every earlier one
/// as long as the clock did not step back (`docs/faults.md`).
///
/// Turns across instances are those of [`ACQUIRE`]: a failed attempt
/// takes or renews this instance's place in the key's queue, an
/// acquisition leaves it, and an attempt yields to the queue's head (see
/// `q_yield`; a yield on a free lock wakes the head). Without a queue on
/// the key the attempt is `EXISTS` and the taking, nothing else.
///
/// KEYS: lock, owner record, counter, queue, places, waiting writers.
/// ARGV: ttl ms, instance token for the owner record, instance prefix,
/// fairness bound ms (`0`: off), a place's life in the queue ms (`0`: no
/// queue), how long the caller still waits ms (`0`, or absent: it holds
/// no shared holder back), its waiter id. Reply: `{token, 0, 0}` when
/// acquired, `{0, holder's pttl, yielded (1/0)}`
/// when not.
pub const FENCE_LOCK: &str = concat!(
    fence_take!(),
    r#"
if redis.call('EXISTS', KEYS[4]) == 0 then
  if redis.call('EXISTS', KEYS[1]) == 0 then return {fence_take(), 0, 0} end
  if ARGV[5] == '0' then
    fence_waits()
    return {0, redis.call('PTTL', KEYS[1]), 0}
  end
end
"#,
    queue!(),
    r#"
local bound, life, me = tonumber(ARGV[4]) or 0, tonumber(ARGV[5]) or 0, ARGV[3]
local now = q_now()
local yield, head = false, nil
if redis.call('EXISTS', KEYS[4]) == 1 then yield, head = q_yield(KEYS[4], KEYS[5], me, bound, now) end
if not yield and redis.call('EXISTS', KEYS[1]) == 0 then
  local t = fence_take()
  if redis.call('EXISTS', KEYS[4]) == 1 then
    q_leave(KEYS[4], KEYS[5], me)
    q_began(KEYS[4], KEYS[5], me, now)
    redis.call('HDEL', KEYS[5], '.woken')
  end
  return {t, 0, 0}
end
local pttl = redis.call('PTTL', KEYS[1])
if life > 0 then q_join(KEYS[4], KEYS[5], me, life, now) end
if yield and pttl == -2 and redis.call('HGET', KEYS[5], '.woken') ~= head then
  q_wake(KEYS[4], KEYS[5], KEYS[1], now)
end
fence_waits()
return {0, pttl, yield and 1 or 0}
"#
);

/// `LOCKGATE UNLOCK`: delete only if the lock still holds this token,
/// waking the queue's head as [`RELEASE`] does. KEYS: lock, owner record,
/// queue, places. ARGV: token. Reply: 1 released, 0 not.
pub const FENCE_UNLOCK: &str = concat!(
    queue!(),
    r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
if redis.call('EXISTS', KEYS[3]) == 1 then q_wake(KEYS[3], KEYS[4], KEYS[1], q_now()) end
return 1
"#
);

/// `LOCKGATE EXTEND`: extend only a lock that still holds this token, so
/// an expired lock is never resurrected. KEYS: lock, owner record. ARGV:
/// token, ttl ms. Reply: 1 extended, 0 not.
pub const FENCE_EXTEND: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"#;

/// Quorum fencing, step 1 on each master: take the lock under an instance
/// token and report the key's token counter and the master's clock; the
/// token is one more than the larger of the largest counter and the median
/// clock among the masters whose "yes" counted, so it keeps growing even
/// when every counter was lost (`docs/quorum.md`). Turns across instances
/// as in [`FENCE_LOCK`], on each master's own queue, and a caller that
/// waits holds new shared holders back as there. KEYS: lock, owner
/// record, counter, queue, places, waiting writers. ARGV: ttl ms,
/// instance token, instance prefix, fairness bound ms, a place's life ms
/// (`0`: no queue), how long the caller still waits ms (`0` or absent:
/// not at all), its waiter id. Reply:
/// `{1, 0, counter, clock, 0}` taken, `{0, pttl, 0, clock, yielded}` not;
/// `clock` is the master's `TIME` in µs (see [`crate::lock::quorum::clock`]).
pub const QFENCE_ACQUIRE: &str = concat!(
    r#"
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function take()
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
  if (ARGV[6] or '0') ~= '0' then redis.call('ZREM', KEYS[6], ARGV[7]) end
  return {1, 0, tonumber(redis.call('GET', KEYS[3]) or '0'), clock(), 0}
end
local function waits()
  if (ARGV[6] or '0') ~= '0' and redis.call('GET', KEYS[1]) == 'lockgate:held' then
    local t = redis.call('TIME')
    redis.call('ZADD', KEYS[6], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[6]), ARGV[7])
    if redis.call('PTTL', KEYS[6]) < tonumber(ARGV[6]) then redis.call('PEXPIRE', KEYS[6], ARGV[6]) end
  end
end
if redis.call('EXISTS', KEYS[4]) == 0 then
  if redis.call('EXISTS', KEYS[1]) == 0 then return take() end
  if ARGV[5] == '0' then
    waits()
    return {0, redis.call('PTTL', KEYS[1]), 0, clock(), 0}
  end
end
"#,
    queue!(),
    r#"
local bound, life, me = tonumber(ARGV[4]) or 0, tonumber(ARGV[5]) or 0, ARGV[3]
local now = q_now()
local yield, head = false, nil
if redis.call('EXISTS', KEYS[4]) == 1 then yield, head = q_yield(KEYS[4], KEYS[5], me, bound, now) end
if not yield and redis.call('EXISTS', KEYS[1]) == 0 then
  if redis.call('EXISTS', KEYS[4]) == 1 then
    q_leave(KEYS[4], KEYS[5], me)
    q_began(KEYS[4], KEYS[5], me, now)
    redis.call('HDEL', KEYS[5], '.woken')
  end
  return take()
end
local pttl = redis.call('PTTL', KEYS[1])
if life > 0 then q_join(KEYS[4], KEYS[5], me, life, now) end
if yield and pttl == -2 and redis.call('HGET', KEYS[5], '.woken') ~= head then
  q_wake(KEYS[4], KEYS[5], KEYS[1], now)
end
waits()
return {0, pttl, 0, clock(), yield and 1 or 0}
"#
);

/// Where [`QFENCE_ACQUIRE`]'s reply carries the master's clock.
pub const QFENCE_CLOCK_FACT: usize = 3;

/// Quorum fencing, step 2 on the acquiring majority: the lock's value
/// becomes the token (see [`QFENCE_ACQUIRE`]) and the counter is raised to
/// it, so any later majority (which overlaps this one) reads at least this
/// token while its masters keep their data.
/// KEYS: lock, owner record, counter. ARGV: instance token, token.
/// Reply: 1 committed, 0 the lock is no longer ours.
pub const QFENCE_COMMIT: &str = r#"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
local c = tonumber(redis.call('GET', KEYS[3]) or '0')
if c < tonumber(ARGV[2]) then redis.call('SET', KEYS[3], ARGV[2]) end
return 1
"#;

/// A guarded write (`[[locks.guards]]`, [`crate::lock::guard`]): the
/// owner rule of [`RELEASE`] for each lock the write's keys map to, then
/// the write itself, in one atomic step. KEYS: the locks' owner records.
/// ARGV: info (`"1"`), m, instance prefix, the connection's birth, then per
/// lock: token (`''`: the connection holds no acquisition of it),
/// unsettled attempts (newline separated), refuse-late (`1`/`0`),
/// refuse-unlocked (`1`/`0`); then the write, name first. Per lock a
/// standing: 0 held (its own acquisition, or by the pooled rule this
/// instance's since the connection opened), 1 its acquisition ended (no
/// owner record), 2 another acquisition owns it, 3 never taken and free,
/// 4 never taken and someone else's. The write runs unless some lock
/// refuses it. Reply: `{reply, 1, standings…}` when run (the write's reply,
/// an error included, as Redis gave it), `{0, 0, standings…}` when refused.
pub const GUARD: &str = concat!(
    guard_check!(),
    r#"
if refuse then return {0, 0, unpack(standings)} end
local reply = redis.pcall(unpack(ARGV, 4 * m + 5))
return {reply, 1, unpack(standings)}
"#
);

/// A transaction with guarded writes, run whole once its locks are checked
/// ([`crate::lock::guard::Guarded::Exec`]): KEYS and ARGV up to the locks
/// as [`GUARD`], then the number of commands and, per command, its number
/// of arguments and the arguments (name first). Reply: `{replies, 1,
/// standings…}` (`replies` as `EXEC`'s array, each command's error in its
/// slot) when run, `{0, 0, standings…}` when refused: nothing ran.
pub const GUARD_TX: &str = concat!(
    guard_check!(),
    r#"
if refuse then return {0, 0, unpack(standings)} end
local at = 4 * m + 5
local n = tonumber(ARGV[at])
at = at + 1
local replies = {}
for c = 1, n do
  local argc = tonumber(ARGV[at])
  replies[c] = redis.pcall(unpack(ARGV, at + 1, at + argc))
  at = at + argc + 1
end
return {replies, 1, unpack(standings)}
"#
);

/// What a client script whose keys are guarded starts with
/// ([`crate::lock::guard::wrapped`]): the lock check on lockgate's keys
/// and arguments, which come first, then those are taken off `KEYS` and
/// `ARGV`, and the client's body follows inside a function.
pub const GUARD_SCRIPT_HEAD: &str = concat!(
    "local __lockgate_refuse, __lockgate_standings, __lockgate_m = (function()\n",
    guard_check!(),
    r#"
return refuse, standings, m
end)()
if __lockgate_refuse then return {0, 0, unpack(__lockgate_standings)} end
for _ = 1, __lockgate_m do table.remove(KEYS, 1) end
for _ = 1, 4 * __lockgate_m + 4 do table.remove(ARGV, 1) end
local __lockgate_reply = (function()
"#
);

/// What a client script whose keys are guarded ends with (see
/// [`GUARD_SCRIPT_HEAD`]).
pub const GUARD_SCRIPT_TAIL: &str = r#"
end)()
if __lockgate_reply == nil then __lockgate_reply = false end
return {__lockgate_reply, 1, unpack(__lockgate_standings)}
"#;

/// The lock check [`GUARD`] and [`GUARD_TX`] start with: for each of the
/// m locks, the standing of this connection (see [`GUARD`]), and whether
/// any refuses the write (`refuse`).
macro_rules! guard_check {
    () => {
        r#"
local m = tonumber(ARGV[2])
local prefix, born = ARGV[3], tonumber(ARGV[4])
local standings = {}
local refuse = false
for i = 1, m do
  local tok, alt = ARGV[4 * i + 1], ARGV[4 * i + 2]
  local owner = redis.call('GET', KEYS[i])
  local s
  if owner and ((tok ~= '' and owner == tok) or (alt ~= '' and string.find('\n' .. alt .. '\n', '\n' .. owner .. '\n', 1, true))) then
    s = 0
  elseif tok ~= '' then
    if owner then s = 2 else s = 1 end
  elseif owner and string.sub(owner, 1, #prefix) == prefix and (tonumber(string.sub(owner, #prefix + 1)) or 0) >= born then
    s = 0
  elseif owner then
    s = 4
  else
    s = 3
  end
  standings[i] = s
  if (ARGV[4 * i + 3] == '1' and (s == 1 or s == 2)) or (ARGV[4 * i + 4] == '1' and s >= 3) then
    refuse = true
  end
end
"#
    };
}
use guard_check;
