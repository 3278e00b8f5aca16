#!/usr/bin/env python3
"""Helper for bench/passthrough.sh (python3 stdlib only).

Subcommands:
  ports N              print N distinct free loopback TCP ports, one a line
  csvrow FILE          parse a redis-benchmark 7 --csv file and print
                       "rps avg_ms p50_ms p99_ms" of its (single) test row
  report TSV META OUT  turn the per-run TSV into the markdown summary: print it
                       and write it to OUT
"""

import csv
import socket
import statistics
import sys

TARGETS = ["direct", "twemproxy", "haproxy", "lockgate", "lockgate_t2", "lockgate_shared"]
LABEL = {
    "direct": "direct",
    "twemproxy": "twemproxy",
    "haproxy": "HAProxy",
    "lockgate": "lockgate",
    "lockgate_t2": "lockgate ×2",
    "lockgate_shared": "lockgate shared",
}
# (workload id, row label); the ids are the ones passthrough.sh writes.
THROUGHPUT = [
    ("set_p1", "SET -c50 -P1"),
    ("get_p1", "GET -c50 -P1"),
    ("set_p16", "SET -c50 -P16"),
    ("get_p16", "GET -c50 -P16"),
]
LATENCY = [("set_c1", "SET -c1 -P1"), ("get_c1", "GET -c1 -P1")]


def ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        for s in socks:
            print(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()


def csvrow(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        sys.exit(f"passthrough_report: no result row in {path}")
    head = rows[0]
    need = ["rps", "avg_latency_ms", "p50_latency_ms", "p99_latency_ms"]
    missing = [c for c in need if c not in head]
    if missing:
        sys.exit(
            f"passthrough_report: {path}: columns {missing} missing "
            f"(needs redis-benchmark >= 7); header was {head}"
        )
    row = rows[-1]
    print(" ".join(row[head.index(c)] for c in need))


def load(tsv):
    """{(workload, target): [run dict, ...]} in round order."""
    runs = {}
    with open(tsv, newline="") as f:
        for r in csv.DictReader(f, delimiter="\t"):
            for k in ("rps", "avg_ms", "p50_ms", "p99_ms", "cpu_s", "redis_cpu_s", "wall_s"):
                r[k] = float(r[k])
            r["n"] = int(r["n"])
            # connections Redis accepted during the run (older TSVs: none)
            r["conns"] = float(r.get("conns") or "nan")
            r["round"] = int(r["round"])
            # ops per (redis + proxy) CPU-second
            r["ops_cpu"] = r["n"] / r["cpu_s"] if r["cpu_s"] > 0 else float("nan")
            # redis-server's own CPU per command, and the proxy's, in µs
            r["redis_us"] = r["redis_cpu_s"] / r["n"] * 1e6
            r["proxy_us"] = (r["cpu_s"] - r["redis_cpu_s"]) / r["n"] * 1e6
            runs.setdefault((r["workload"], r["target"]), []).append(r)
    return runs


def med(values):
    return statistics.median(values) if values else float("nan")


def spread(values):
    """(max - min) / median, in percent; '' for a single run."""
    if len(values) < 2:
        return ""
    m = statistics.median(values)
    return f" ±{(max(values) - min(values)) / m * 50:.0f}%" if m else ""


def kfmt(v):
    if v != v:  # NaN
        return "n/a"
    return f"{v / 1000:.1f}k" if v >= 10000 else f"{v:.0f}"


def usfmt(v):
    return "n/a" if v != v else f"{v:.2f}"


def ratio(a, b):
    return a / b if b else float("nan")


def report(tsv, meta_path, out):
    meta = {}
    with open(meta_path) as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition("\t")
            meta[k] = v
    runs = load(tsv)

    def vals(w, t, key):
        return [r[key] for r in runs.get((w, t), [])]

    lines = []
    emit = lines.append
    emit(f"### lockgate pass-through benchmark, {meta.get('date', '?')}")
    emit("")
    emit(
        f"lockgate {meta.get('lockgate', '?')} · redis {meta.get('redis', '?')} · "
        f"nutcracker {meta.get('nutcracker', '?')} · HAProxy {meta.get('haproxy', '?')} · "
        f"{meta.get('cpus', '?')} CPUs, load avg {meta.get('load', '?')} at start · "
        f"medians of {meta.get('rounds', '?')} rounds (± = half the min–max spread) · "
        f"-n P1 {meta.get('n_p1', '?')}, P16 {meta.get('n_p16', '?')}, c1 {meta.get('n_c1', '?')} · "
        f"keyspace {meta.get('keyspace', '?')}, {meta.get('data_size', '?')}-byte values"
        + (" · **QUICK smoke run, not a measurement**" if meta.get("quick") == "1" else "")
    )
    emit("")
    emit(
        "CPU = utime+stime of redis-server + the proxy over each run "
        "(redis-benchmark excluded); ops/CPU-s = requests / that. Redis µs/op = "
        "redis-server's own CPU per request (how much busier the proxy makes the Redis "
        "behind it); proxy µs/op = the proxy's."
    )
    emit("")
    emit(
        "| workload | metric | direct | twemproxy | HAProxy | lockgate | lockgate ×2 "
        "| lockgate shared | lg/direct | lg/twemproxy | lg/HAProxy | lg×2/HAProxy "
        "| lgS/direct | lgS/twemproxy | lgS/lg |"
    )
    emit("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")

    def side_table(workloads, targets, pairs, metrics):
        """Rows per workload and metric for `targets`, then one ratio
        column per (numerator, denominator) pair of targets."""
        for w, label in workloads:
            for key, name, fmt in metrics:
                m = {t: med(vals(w, t, key)) for t in targets}
                cells = [fmt(m[t]) + (spread(vals(w, t, key)) if fmt is kfmt else "") for t in targets]
                rs = [f"{ratio(m[a], m[b]):.2f}×" for a, b in pairs]
                emit(f"| {label if key == metrics[0][0] else ''} | {name} | " + " | ".join(cells + rs) + " |")
        emit("")

    def ratios(w, key):
        lg = med(vals(w, "lockgate", key))
        rs = [f"{ratio(lg, med(vals(w, t, key))):.2f}×" for t in TARGETS[:3]]
        rs.append(f"{ratio(med(vals(w, 'lockgate_t2', key)), med(vals(w, 'haproxy', key))):.2f}×")
        shared = med(vals(w, "lockgate_shared", key))
        return rs + [
            f"{ratio(shared, med(vals(w, t, key))):.2f}×" for t in ("direct", "twemproxy", "lockgate")
        ]

    for w, label in THROUGHPUT:
        for key, name in (("rps", "ops/s"), ("ops_cpu", "ops/CPU-s")):
            cells = [kfmt(med(vals(w, t, key))) + spread(vals(w, t, key)) for t in TARGETS]
            emit(f"| {label if key == 'rps' else ''} | {name} | " + " | ".join(cells + ratios(w, key)) + " |")
        for key, name in (("redis_us", "Redis µs/op"), ("proxy_us", "proxy µs/op")):
            cells = [usfmt(med(vals(w, t, key))) for t in TARGETS]
            rs = ratios(w, key)
            if key == "proxy_us":
                cells[0], rs[0], rs[4] = "", "", ""
            emit(f"|  | {name} | " + " | ".join(cells + rs) + " |")
        cells = [
            f"{med(vals(w, t, 'p50_ms')):.3f} / {med(vals(w, t, 'p99_ms')):.3f}" for t in TARGETS
        ]
        emit("|  | p50 / p99 ms | " + " | ".join(cells) + " | | | | | | | |")
        cells = [f"{med(vals(w, t, 'conns')):.0f}" for t in TARGETS]
        emit("|  | conns to Redis | " + " | ".join(cells) + " | | | | | | | |")
    emit("")

    # -c1: latency each proxy adds over direct, paired within a round.
    def added(w, t, key):
        direct = {r["round"]: r[key] for r in runs.get((w, "direct"), [])}
        diffs = [
            (r[key] - direct[r["round"]]) * 1000
            for r in runs.get((w, t), [])
            if r["round"] in direct
        ]
        return med(diffs)

    keys = ("avg_ms", "p50_ms", "p99_ms")
    emit("| µs, avg / p50 / p99 | direct | " + " | ".join(
        f"{LABEL[t]} adds" for t in TARGETS[1:]) + " |")
    emit("|---|--:|" + "--:|" * (len(TARGETS) - 1))
    for w, label in LATENCY:
        d = " / ".join(f"{med(vals(w, 'direct', k)) * 1000:.0f}" for k in keys)
        cells = [" / ".join(f"{added(w, t, k):+.0f}" for k in keys) for t in TARGETS[1:]]
        emit(f"| {label} | {d} | " + " | ".join(cells) + " |")
    emit("")
    emit(
        "Added = median over rounds of (proxy − direct) within a round. redis-benchmark's "
        "histogram has 8 µs buckets below 16 ms (lowest value 10 µs), so p50/p99 move in "
        "8 µs steps; avg is finer."
    )
    emit("")

    # TLS rows (TLS=1): what TLS costs, client side and upstream side.
    if runs.get(("set_p1", "lockgate_tls")):
        emit(
            "TLS (same runs, alternating with the rows above): direct TLS = redis-benchmark "
            "--tls to Redis's TLS port; lg TLS = --tls to lockgate's TLS listener, plain to "
            "Redis; lg up-TLS = plain to lockgate, TLS from lockgate to Redis."
        )
        emit("")
        emit(
            "| workload | metric | direct TLS | lockgate | lg TLS | lg up-TLS "
            "| lg TLS/lockgate | lg up-TLS/lockgate | lg TLS/direct TLS |"
        )
        emit("|---|---|--:|--:|--:|--:|--:|--:|--:|")
        side_table(
            THROUGHPUT + LATENCY,
            ["direct_tls", "lockgate", "lockgate_tls", "lockgate_up_tls"],
            [("lockgate_tls", "lockgate"), ("lockgate_up_tls", "lockgate"), ("lockgate_tls", "direct_tls")],
            [("rps", "ops/s", kfmt), ("ops_cpu", "ops/CPU-s", kfmt)],
        )

    # The reference row (TOKIO_COPY=1): a tokio proxy that only copies.
    if runs.get(("set_p1", "tokio_copy")):
        emit(
            "Reference: tokio copy = examples/tokio_copy.rs, `copy_bidirectional` on one "
            "current-thread runtime, no parsing (the least a tokio proxy does). What lockgate "
            "costs over it is lockgate's own work; what it costs over HAProxy is the runtime's."
        )
        emit("")
        emit(
            "| workload | metric | HAProxy | tokio copy | lockgate "
            "| copy/HAProxy | lg/copy | lg/HAProxy |"
        )
        emit("|---|---|--:|--:|--:|--:|--:|--:|")
        side_table(
            THROUGHPUT,
            ["haproxy", "tokio_copy", "lockgate"],
            [("tokio_copy", "haproxy"), ("lockgate", "tokio_copy"), ("lockgate", "haproxy")],
            [("rps", "ops/s", kfmt), ("ops_cpu", "ops/CPU-s", kfmt), ("proxy_us", "proxy µs/op", usfmt)],
        )

    # Locks: SETNX on fresh lock keys, which lockgate turns into its
    # acquisition script; compared with lockgate's own plain SET.
    if runs.get(("setnx_p1", "lockgate")):
        emit(
            "Locks: SETNX on fresh lock keys (-c50 -P1, random from "
            f"{meta.get('lock_keyspace', '?')} keys); through lockgate each is an acquisition "
            "(atomic lease + owner record), directly and through HAProxy a plain SETNX."
        )
        emit("")
        emit(
            "| SETNX lock:… -c50 -P1 | direct | HAProxy | lockgate | lockgate ×2 | lockgate shared "
            "| lg SETNX / lg SET | shared SETNX / shared SET |"
        )
        emit("|---|--:|--:|--:|--:|--:|--:|--:|")
        lt = ["direct", "haproxy", "lockgate", "lockgate_t2", "lockgate_shared"]
        for key, name, fmt in (
            ("rps", "ops/s", kfmt),
            ("ops_cpu", "ops/CPU-s", kfmt),
            ("redis_us", "Redis µs/op", usfmt),
            ("proxy_us", "proxy µs/op", usfmt),
        ):
            cells = [fmt(med(vals("setnx_p1", t, key))) for t in lt]
            if key == "proxy_us":
                cells[0] = ""
            rs = [
                ratio(med(vals("setnx_p1", lg, key)), med(vals("set_p1", lg, key)))
                for lg in ("lockgate", "lockgate_shared")
            ]
            emit(f"| {name} | " + " | ".join(cells) + "".join(f" | {r:.2f}×" for r in rs) + " |")
        emit("")

    # Targets: each holds only if it holds for SET and for GET.
    def lg_ratio(w, other, key, lg="lockgate"):
        return ratio(med(vals(w, lg, key)), med(vals(w, other, key)))

    checks = [
        ("-P1 ops/s ≥ 1.0× HAProxy", ["set_p1", "get_p1"], lambda w, lg: lg_ratio(w, "haproxy", "rps", lg), 1.0, "×", True),
        ("-P1 ops/CPU-s ≥ 1.0× HAProxy", ["set_p1", "get_p1"], lambda w, lg: lg_ratio(w, "haproxy", "ops_cpu", lg), 1.0, "×", True),
        ("-P1 Redis µs/op ≤ 1.1× HAProxy", ["set_p1", "get_p1"], lambda w, lg: lg_ratio(w, "haproxy", "redis_us", lg), 1.1, "×", False),
        ("-P16 ops/s ≥ 1.0× HAProxy", ["set_p16", "get_p16"], lambda w, lg: lg_ratio(w, "haproxy", "rps", lg), 1.0, "×", True),
        ("-P16 ops/CPU-s ≥ 1.0× HAProxy", ["set_p16", "get_p16"], lambda w, lg: lg_ratio(w, "haproxy", "ops_cpu", lg), 1.0, "×", True),
        ("-P16 Redis µs/op ≤ 1.1× HAProxy", ["set_p16", "get_p16"], lambda w, lg: lg_ratio(w, "haproxy", "redis_us", lg), 1.1, "×", False),
        ("-c1 added p50 ≤ 10 µs", ["set_c1", "get_c1"], lambda w, lg: added(w, lg, "p50_ms"), 10, " µs", False),
        ("-c1 added p99 ≤ 50 µs", ["set_c1", "get_c1"], lambda w, lg: added(w, lg, "p99_ms"), 50, " µs", False),
    ]
    emit("| target | lockgate SET | GET | verdict | lockgate ×2 SET | GET | verdict |")
    emit("|---|--:|--:|---|--:|--:|---|")
    for name, ws, fn, goal, unit, at_least in checks:
        row = f"| {name} "
        for lg in ("lockgate", "lockgate_t2"):
            got = [fn(w, lg) for w in ws]
            ok = all((v >= goal) if at_least else (v <= goal) for v in got)
            fmt = [(f"{v:.2f}" if unit == "×" else f"{v:+.0f}") + unit for v in got]
            row += f"| {fmt[0]} | {fmt[1]} | {'PASS' if ok else 'MISS'} "
        emit(row + "|")
    if runs.get(("setnx_p1", "lockgate")):
        row = "| SETNX on fresh lock keys ≥ 0.8× own SET (lockgate, ×2; shared below) "
        for lg in ("lockgate", "lockgate_t2"):
            r = ratio(med(vals("setnx_p1", lg, "rps")), med(vals("set_p1", lg, "rps")))
            row += f"| {r:.2f}× | | {'PASS' if r >= 0.8 else 'MISS'} "
        emit(row + "|")
        r = ratio(med(vals("setnx_p1", "lockgate_shared", "rps")), med(vals("set_p1", "lockgate_shared", "rps")))
        emit(f"| SETNX on fresh lock keys ≥ 0.8× own SET, shared | {r:.2f}× | | {'PASS' if r >= 0.8 else 'MISS'} | | | |")

    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    with open(out, "w") as f:
        f.write(text)


def main(argv):
    if len(argv) == 3 and argv[1] == "ports":
        ports(int(argv[2]))
    elif len(argv) == 3 and argv[1] == "csvrow":
        csvrow(argv[2])
    elif len(argv) == 5 and argv[1] == "report":
        report(argv[2], argv[3], argv[4])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
