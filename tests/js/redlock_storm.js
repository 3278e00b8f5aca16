// A retry storm of node-redlock (npm `redlock`, pinned in package.json):
// TASKS tasks take one lock in turn, each retrying its acquisition every
// millisecond (`retryDelay: 1`, no jitter, without end), hold it HOLD ms,
// release it, for SECS seconds.
//
//   node redlock_storm.js HOST PORT REDIS_HOST REDIS_PORT KEY TASKS SECS [own|one]
//
// `own`: each task on a connection of its own; `one`: every task on one
// multiplexed connection, as ioredis apps have it.
// Prints one JSON line: acquisitions, and what Redis itself ran meanwhile
// (INFO read straight on Redis before and after): the commands it
// processed and the CPU seconds it used.
"use strict";

const Redis = require("ioredis");
const { default: Redlock } = require("redlock");

const [host, port, rhost, rport, key] = [
  process.argv[2],
  Number(process.argv[3]),
  process.argv[4],
  Number(process.argv[5]),
  process.argv[6],
];
const [tasks, secs] = [Number(process.argv[7]), Number(process.argv[8])];
const one = process.argv[9] === "one";
const HOLD = 5;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function field(info, name) {
  const m = info.match(new RegExp(`^${name}:([0-9.]+)`, "m"));
  return m ? Number(m[1]) : NaN;
}

// Commands Redis processed and the CPU seconds it used, user and system.
async function stats(direct) {
  const info = await direct.info();
  return [
    field(info, "total_commands_processed"),
    field(info, "used_cpu_user") + field(info, "used_cpu_sys"),
  ];
}

async function main() {
  const direct = new Redis({ host: rhost, port: rport });
  const shared = one ? new Redis({ host, port }) : null;
  const clients = [];
  for (let i = 0; i < tasks; i++) {
    clients.push(shared || new Redis({ host, port }));
  }
  await Promise.all(clients.map((c) => c.ping()));
  let acquisitions = 0;
  const before = await stats(direct);
  const stop = Date.now() + secs * 1000;
  await Promise.all(
    clients.map(async (c) => {
      const redlock = new Redlock([c], { retryCount: -1, retryDelay: 1, retryJitter: 0 });
      while (Date.now() < stop) {
        const lock = await redlock.acquire([key], 10000);
        await sleep(HOLD);
        await lock.release();
        acquisitions += 1;
      }
    })
  );
  const after = await stats(direct);
  console.log(
    JSON.stringify({
      acquisitions,
      calls: after[0] - before[0],
      cpu_s: after[1] - before[1],
    })
  );
  for (const c of new Set([...clients, direct])) c.disconnect();
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
