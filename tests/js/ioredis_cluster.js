/**
 * ioredis, unmodified, through lockgate in front of a Redis Cluster:
 * usage: node ioredis_cluster.js HOST PORT.
 *
 * Redis.Cluster asks lockgate for the cluster's layout, is told of one node
 * (lockgate) serving every slot, and sends everything there; lockgate routes
 * each command to the node that serves it. A plain `new Redis()` sees one
 * Redis: lockgate splits its cross-slot commands and walks every node for
 * SCAN. Exits 0 and prints "ioredis cluster OK" when every step worked;
 * prints the error and exits 1 otherwise. Every command has a timeout, the
 * retries are bounded and a watchdog ends the whole run after 60 s.
 */

"use strict";

const assert = require("node:assert/strict");
const Redis = require("ioredis");

const HOST = process.argv[2];
const PORT = Number(process.argv[3]);
if (!HOST || !Number.isInteger(PORT)) {
  console.error("usage: node ioredis_cluster.js HOST PORT");
  process.exit(2);
}
const T = 5000; // ms, for every connect and every command

const watchdog = setTimeout(() => {
  console.error("ioredis cluster: still running after 60 s, giving up");
  process.exit(1);
}, 60_000);

/** Options of every node connection, plain or under Redis.Cluster. */
const redisOptions = {
  connectTimeout: T,
  commandTimeout: T,
  maxRetriesPerRequest: 1,
  retryStrategy: (times) => (times > 3 ? null : 200),
};

/** A cluster client started from lockgate alone, never retrying forever. */
function cluster() {
  const c = new Redis.Cluster([{ host: HOST, port: PORT }], {
    redisOptions,
    clusterRetryStrategy: (times) => (times > 3 ? null : 200),
    slotsRefreshTimeout: T,
    enableOfflineQueue: true,
  });
  c.on("error", (e) => console.error(`cluster error: ${e.message}`));
  c.on("node error", (e, node) => console.error(`node error (${node}): ${e.message}`));
  return c;
}

/** Resolves once `client` is ready; rejects if it ends first or after T. */
function ready(client) {
  if (client.status === "ready") return Promise.resolve();
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`not ready after ${T} ms`)), T);
    client.once("ready", () => {
      clearTimeout(timer);
      resolve();
    });
    client.once("end", () => {
      clearTimeout(timer);
      reject(new Error("ended before ready"));
    });
  });
}

/** Every node `c` knows of: lockgate alone, at HOST:PORT. */
function assertOneNode(c, when) {
  const nodes = c.nodes("all").map((n) => `${n.options.host}:${n.options.port}`);
  assert.deepEqual(nodes, [`${HOST}:${PORT}`], `the nodes known ${when}`);
}

async function clusterClient() {
  const rc = cluster();
  // A MOVED or ASK would make ioredis add the real node to its pool.
  const added = [];
  rc.on("+node", (n) => added.push(`${n.options.host}:${n.options.port}`));
  await ready(rc);
  assertOneNode(rc, "at start");

  // Keys spread over every slot range of the cluster behind.
  for (let i = 0; i < 200; i++) {
    assert.equal(await rc.set(`js:c:${i}`, String(i)), "OK", `SET js:c:${i}`);
  }
  for (let i = 0; i < 200; i += 20) {
    assert.equal(await rc.get(`js:c:${i}`), String(i), `GET js:c:${i}`);
  }

  // A pipeline of INCRs over many slots (ioredis sends it to the one node).
  // (From scratch: a DEL across slots first, for a rerun on the same cluster.)
  await rc.del(...Array.from({ length: 50 }, (_, i) => `js:n:${i}`));
  const pipe = rc.pipeline();
  for (let i = 0; i < 50; i++) pipe.incr(`js:n:${i}`);
  const incrs = await pipe.exec();
  assert.deepEqual(incrs, Array.from({ length: 50 }, () => [null, 1]), "the pipeline's INCRs");

  // Hash-tagged keys in one slot: a multi-key command.
  assert.equal(await rc.mset("{t}a", "1", "{t}b", "2"), "OK");
  assert.deepEqual(await rc.mget("{t}a", "{t}b"), ["1", "2"], "MGET {t}a {t}b");

  // A multi-key DEL across slots (ioredis routes it by its first key).
  for (let i = 0; i < 5; i++) await rc.set(`js:d:${i}`, "x");
  assert.equal(await rc.del("js:d:0", "js:d:1", "js:d:2", "js:d:3", "js:d:4", "js:d:nope"), 5);
  assert.equal(await rc.exists("js:d:0", "js:d:3"), 0, "deleted on every node");

  // A transaction on one hash tag.
  const tx = await rc
    .multi()
    .set("{js:tx}a", "1")
    .set("{js:tx}n", "10")
    .incr("{js:tx}n")
    .get("{js:tx}a")
    .exec();
  assert.deepEqual(tx, [[null, "OK"], [null, "OK"], [null, 11], [null, "1"]], "MULTI/EXEC");

  // A lock the way ioredis users take one: SET NX PX, released by a Lua
  // compare-and-delete.
  const release =
    'if redis.call("get",KEYS[1]) == ARGV[1] then return redis.call("del",KEYS[1]) else return 0 end';
  assert.equal(await rc.set("lock:js:1", "token-a", "PX", 10000, "NX"), "OK", "acquire");
  assert.equal(await rc.set("lock:js:1", "token-b", "PX", 10000, "NX"), null, "held");
  assert.equal(await rc.eval(release, 1, "lock:js:1", "token-b"), 0, "release, wrong token");
  assert.equal(await rc.get("lock:js:1"), "token-a", "still held");
  assert.equal(await rc.eval(release, 1, "lock:js:1", "token-a"), 1, "release");
  assert.equal(await rc.exists("lock:js:1"), 0, "released");

  // Pub/sub: one client subscribes, another publishes.
  const sub = cluster();
  await ready(sub);
  const got = new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no message after ${T} ms`)), T);
    sub.on("message", (channel, message) => {
      clearTimeout(timer);
      resolve([channel, message]);
    });
  });
  assert.equal(await sub.subscribe("js:chan"), 1, "SUBSCRIBE js:chan");
  await rc.publish("js:chan", "hello");
  assert.deepEqual(await got, ["js:chan", "hello"], "the message");
  await sub.quit();

  assert.deepEqual(
    added.filter((n) => n !== `${HOST}:${PORT}`),
    [],
    "nodes other than lockgate that ioredis added (after a MOVED or ASK)",
  );
  assertOneNode(rc, "at the end");
  await rc.quit();
}

async function plainClient() {
  const r = new Redis({ host: HOST, port: PORT, ...redisOptions });
  r.on("error", (e) => console.error(`plain error: ${e.message}`));
  await ready(r);

  assert.equal(await r.set("js:p:1", "one"), "OK");
  assert.equal(await r.get("js:p:1"), "one");

  const pipe = r.pipeline();
  for (let i = 2; i <= 6; i++) pipe.set(`js:p:${i}`, `v${i}`);
  pipe.get("js:p:2");
  pipe.set("js:p:count", "41");
  pipe.incr("js:p:count");
  const replies = await pipe.exec();
  assert.deepEqual(
    replies,
    [...Array.from({ length: 5 }, () => [null, "OK"]), [null, "v2"], [null, "OK"], [null, 42]],
    "the plain pipeline",
  );

  // Across slots: lockgate splits and merges it in argument order.
  assert.deepEqual(
    await r.mget("js:p:1", "js:p:2", "js:p:nope", "js:p:3", "js:p:6"),
    ["one", "v2", null, "v3", "v6"],
    "MGET across slots",
  );

  // SCAN over the whole cluster: every js:c:* key the cluster client set.
  const keys = new Set();
  await new Promise((resolve, reject) => {
    const stream = r.scanStream({ match: "js:c:*", count: 50 });
    stream.on("data", (batch) => batch.forEach((k) => keys.add(k)));
    stream.on("end", resolve);
    stream.on("error", reject);
  });
  assert.equal(keys.size, 200, "SCAN MATCH js:c:* found every key");
  for (let i = 0; i < 200; i++) assert.ok(keys.has(`js:c:${i}`), `SCAN found js:c:${i}`);

  await r.quit();
}

async function main() {
  await clusterClient();
  await plainClient();
  clearTimeout(watchdog);
  console.log("ioredis cluster OK");
  // Every connection is closed: node exits by itself. If something still
  // holds the event loop, say so rather than hang.
  setTimeout(() => {
    console.error("ioredis cluster: a handle still open 10 s after closing every client");
    process.exit(1);
  }, 10_000).unref();
}

main().catch((e) => {
  console.error(`ioredis cluster FAILED: ${e && e.stack ? e.stack : e}`);
  process.exit(1);
});
