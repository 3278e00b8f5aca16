// node-redlock (npm `redlock`, pinned in package.json) through one address:
// its multi-key acquire, extend and release scripts, its retries, its
// automatic extension and contention between clients, as an app uses them.
// Prints one JSON object of outcomes that must be the same straight on Redis
// and through lockgate (tests/it/locks_redlock.rs compares them), then
// "redlock OK".
//
//   node redlock_outcomes.js HOST PORT [multiplexed]
//
// With "multiplexed" the four contending clients share one connection (as
// ioredis apps do); otherwise each has its own.
// Keys are lock:rl:* (lock keys under lockgate's defaults). The database is
// flushed first.
"use strict";

const Redis = require("ioredis");
const { default: Redlock, ResourceLockedError, ExecutionError } = require("redlock");

const [host, port] = [process.argv[2], Number(process.argv[3])];
const multiplexed = process.argv[4] === "multiplexed";
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// What a failed redlock call was, by its class (the message holds values).
function failure(e) {
  if (e instanceof ResourceLockedError) return "locked";
  if (e instanceof ExecutionError) return "no quorum";
  return `error: ${e && e.message}`;
}

async function outcome(promise) {
  try {
    await promise;
    return "ok";
  } catch (e) {
    return failure(e);
  }
}

async function main() {
  const redis = new Redis({ host, port, maxRetriesPerRequest: 1 });
  await redis.flushdb();
  const once = new Redlock([redis], { retryCount: 0 });
  const out = {};

  // Two keys taken together; a second request overlapping one of them
  // fails whole and leaves the key it did not share untouched.
  const ab = await once.acquire(["lock:rl:a", "lock:rl:b"], 1000);
  out.value_is_the_locks = (await redis.get("lock:rl:a")) === ab.value;
  out.lease_given = (await redis.pttl("lock:rl:b")) > 0;
  out.overlapping = await outcome(once.acquire(["lock:rl:b", "lock:rl:c"], 1000));
  out.c_untouched = (await redis.exists("lock:rl:c")) === 0;
  // A legacy SETNX on a key the library holds loses, as on Redis.
  out.setnx_on_held = await redis.setnx("lock:rl:a", "legacy");

  // Extended together, then released together.
  const extended = await ab.extend(5000);
  out.extended = (await redis.pttl("lock:rl:a")) > 1000;
  out.release = await outcome(extended.release());
  out.released = await redis.exists("lock:rl:a", "lock:rl:b");
  out.after_release = await outcome(
    once.acquire(["lock:rl:b", "lock:rl:c"], 1000).then((l) => l.release())
  );

  // A lease that ran out: the release finds nothing of its own.
  const short = await once.acquire(["lock:rl:short"], 100);
  await sleep(250);
  out.release_after_expiry = await outcome(short.release());

  // Automatic extension: a section longer than the lease keeps it.
  out.using = await once.using(["lock:rl:u"], 600, { automaticExtensionThreshold: 300 }, async (signal) => {
    await sleep(1000);
    return signal.aborted ? "aborted" : "kept";
  });

  // Four clients, each with its own connection, retrying, over two keys:
  // never two in the section at once.
  const clients = [];
  for (let i = 0; i < 4; i++) {
    clients.push(multiplexed ? redis : new Redis({ host, port, maxRetriesPerRequest: 1 }));
  }
  let inside = 0;
  let overlaps = 0;
  let sections = 0;
  await Promise.all(
    clients.map(async (c) => {
      const lock = new Redlock([c], { retryCount: -1, retryDelay: 5, retryJitter: 5 });
      for (let n = 0; n < 15; n++) {
        await lock.using(["lock:rl:m1", "lock:rl:m2"], 2000, async () => {
          inside += 1;
          if (inside > 1) overlaps += 1;
          await sleep(3);
          inside -= 1;
          sections += 1;
        });
      }
    })
  );
  out.sections = sections;
  out.overlaps = overlaps;
  out.left_behind = await redis.exists("lock:rl:m1", "lock:rl:m2");

  for (const c of new Set([...clients, redis])) c.disconnect();
  console.log(JSON.stringify(out));
  console.log("redlock OK");
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
