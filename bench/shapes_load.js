#!/usr/bin/env node
/*
 * One lock storm over one multiplexed connection, as ioredis, Lettuce,
 * StackExchange.Redis and node-redis send every task's commands.
 *
 *   node bench/shapes_load.js --port P [--tasks 50] [--hold-ms 2000]
 *        [--duration-s 4] [--gone --seed-port R] [--reader-every-ms 5]
 *
 * One ioredis connection; `--tasks` async tasks spin `SETNX KEY id` with
 * no sleep between attempts; the task that gets it holds it `--hold-ms`
 * and `DEL`s it on the same connection. With `--gone` nobody wins: the key
 * is set first (on --seed-port, the Redis behind the target) by a holder
 * that is gone. With `--reader-every-ms`, one more task on the same
 * connection `GET`s a plain key that often and times each reply.
 *
 * Prints one JSON line: acquisitions (total and per task), attempts, the
 * gap from each release (its DEL sent) to the next acquisition (ms), the reader's
 * latencies (ms: p50, p99, max), errors. Needs ioredis: NODE_PATH (or
 * tests/js/node_modules, which scripts/setup.sh fills).
 */
"use strict";

const path = require("path");
let Redis;
try {
  Redis = require("ioredis");
} catch (_) {
  Redis = require(path.join(__dirname, "..", "tests", "js", "node_modules", "ioredis"));
}

function args() {
  const a = { host: "127.0.0.1", port: 0, key: "lock:shapes", tasks: 50, holdMs: 2000,
    durationS: 4, gone: false, seedPort: 0, readerEveryMs: 0 };
  const v = process.argv.slice(2);
  for (let i = 0; i < v.length; i++) {
    const next = () => v[++i];
    switch (v[i]) {
      case "--host": a.host = next(); break;
      case "--port": a.port = Number(next()); break;
      case "--key": a.key = next(); break;
      case "--tasks": a.tasks = Number(next()); break;
      case "--hold-ms": a.holdMs = Number(next()); break;
      case "--duration-s": a.durationS = Number(next()); break;
      case "--gone": a.gone = true; break;
      case "--seed-port": a.seedPort = Number(next()); break;
      case "--reader-every-ms": a.readerEveryMs = Number(next()); break;
      default: throw new Error(`unknown argument ${v[i]}`);
    }
  }
  if (!a.port) throw new Error("--port is required");
  return a;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const now = () => Number(process.hrtime.bigint()) / 1e6;

function pct(values, p) {
  if (!values.length) return null;
  const s = [...values].sort((x, y) => x - y);
  return s[Math.min(s.length - 1, Math.round((p / 100) * (s.length - 1)))];
}

async function main() {
  const a = args();
  const opts = { host: a.host, maxRetriesPerRequest: 0, enableOfflineQueue: true };
  if (a.gone) {
    const seed = new Redis({ ...opts, port: a.seedPort || a.port });
    await seed.set(a.key, "gone", "PX", Math.round(a.durationS * 1000) + 30000);
    seed.disconnect();
  }
  const r = new Redis({ ...opts, port: a.port });
  await r.set("shapes:data", "x");
  const end = now() + a.durationS * 1000;
  const per = new Array(a.tasks).fill(0);
  const gaps = [];
  const reads = [];
  let attempts = 0, errors = 0, releasedAt = null, holder = null, overlaps = 0;

  async function task(i) {
    while (now() < end) {
      attempts++;
      let won;
      try {
        won = await r.setnx(a.key, `t${i}`);
      } catch (_) {
        errors++;
        await sleep(10);
        continue;
      }
      if (won !== 1) continue;
      const t = now();
      if (holder !== null) overlaps++;
      holder = i;
      if (releasedAt !== null) gaps.push(t - releasedAt);
      releasedAt = null;
      per[i]++;
      await sleep(a.holdMs);
      holder = null;
      // The release starts now: the next holder may be answered before
      // this task sees the DEL's reply.
      releasedAt = now();
      try {
        await r.del(a.key);
      } catch (_) {
        errors++;
      }
    }
  }

  async function reader() {
    while (now() < end) {
      const t = now();
      try {
        await r.get("shapes:data");
        reads.push(now() - t);
      } catch (_) {
        errors++;
      }
      await sleep(a.readerEveryMs);
    }
  }

  const start = now();
  const all = [];
  for (let i = 0; i < a.tasks; i++) all.push(task(i));
  if (a.readerEveryMs > 0) all.push(reader());
  await Promise.all(all);
  const elapsed = (now() - start) / 1000;
  r.disconnect();
  console.log(JSON.stringify({
    shape: a.gone ? "mux-gone" : "mux",
    tasks: a.tasks,
    elapsed_s: Number(elapsed.toFixed(3)),
    acquisitions: per.reduce((x, y) => x + y, 0),
    per_worker: per,
    attempts,
    errors,
    overlaps,
    gap_ms: { p50: pct(gaps, 50), p99: pct(gaps, 99), max: gaps.length ? Math.max(...gaps) : null,
      n: gaps.length },
    reader_ms: { p50: pct(reads, 50), p99: pct(reads, 99), max: reads.length ? Math.max(...reads) : null,
      n: reads.length },
  }));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
