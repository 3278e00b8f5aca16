-- Redisson's tryLock script as its documentation gives it: take the hash
-- lock (or enter it again) with a lease, else answer its PTTL.
-- KEYS[1]: the lock; ARGV[1]: lease ms; ARGV[2]: the holder field.
if (redis.call('exists', KEYS[1]) == 0) or (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then
  redis.call('hincrby', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[1])
  return nil
end
return redis.call('pttl', KEYS[1])
