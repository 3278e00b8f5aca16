#!/usr/bin/env python3
"""Helper for bench/shapes.sh (python3 stdlib only).

  record RUNS PREFIX k=v...   one run's files (PREFIX.json from the driver,
                              .cmdstats, .lg0/.lg1 LOCKGATE STATS) as a JSON
                              line appended to RUNS
  report RUNS META OUT        the markdown summary (medians over rounds),
                              printed and written to OUT
"""

import json
import statistics
import sys

# The storm's own commands at the top level: the client's SETNX and DEL
# straight on Redis; through lockgate the scripts (and native commands) it
# sends in their place, whose time includes the commands they run.
STORM_TOP = ("setnx", "del", "eval", "evalsha", "script|load", "msetex")


def cmdstats(path):
    out = {}
    for line in open(path):
        if not line.startswith("cmdstat_"):
            continue
        name, _, rest = line.strip()[len("cmdstat_"):].partition(":")
        fields = dict(kv.split("=") for kv in rest.split(","))
        out[name] = (int(fields["calls"]), int(fields["usec"]))
    return out


def stats(path):
    """LOCKGATE STATS of one or more lockgates, one after another: summed."""
    lines = [l.strip() for l in open(path) if l.strip()]
    out = {}
    for i in range(0, len(lines) - 1, 2):
        if lines[i + 1].lstrip("-").isdigit():
            out[lines[i]] = out.get(lines[i], 0) + int(lines[i + 1])
    return out


def merge(gens):
    """The drivers' reports of several pods as one: counts summed, workers
    listed together, percentiles the worst pod's (the median's median)."""
    if len(gens) == 1:
        return gens[0]
    out = dict(gens[0])
    for k in ("acquisitions", "attempts", "errors", "overlaps"):
        out[k] = sum(g.get(k, 0) for g in gens)
    out["per_worker"] = [w for g in gens for w in g["per_worker"]]
    for field in ("gap_ms", "reader_ms"):
        parts = [g.get(field) or {} for g in gens]
        p50 = [x["p50"] for x in parts if x.get("p50") is not None]
        p99 = [x["p99"] for x in parts if x.get("p99") is not None]
        mx = [x["max"] for x in parts if x.get("max") is not None]
        out[field] = {"p50": statistics.median(p50) if p50 else None,
                      "p99": max(p99) if p99 else None,
                      "max": max(mx) if mx else None,
                      "n": sum(x.get("n", 0) for x in parts)}
    return out


def record(runs, prefix, pairs):
    row = dict(p.split("=", 1) for p in pairs)
    for k in ("redis_ns", "wall_ns", "round", "pods"):
        row[k] = int(row.get(k, 1))
    gens = [json.loads(open(f"{prefix}.{i}.json").read().strip().splitlines()[-1])
            for i in range(row["pods"])]
    gen = merge(gens)
    cs = cmdstats(prefix + ".cmdstats")
    row["gen"] = gen
    row["storm_usec"] = sum(cs.get(c, (0, 0))[1] for c in STORM_TOP)
    # Every command Redis ran (those inside scripts too), but the bench's
    # own (INFO, CONFIG) and the driver's data key (its SET, the reader's
    # GETs, the gone holder's SET).
    calls = sum(c for n, (c, _) in cs.items() if n != "info" and not n.startswith("config"))
    gone = 1 if gen.get("gone") or gen.get("shape") == "mux-gone" else 0
    calls -= row["pods"] * (1 + gone) + (gen.get("reader_ms") or {}).get("n", 0)
    row["commands"] = max(calls, 0)
    row["cmdstats"] = {n: [c, u] for n, (c, u) in cs.items()}
    lg0, lg1 = stats(prefix + ".lg0"), stats(prefix + ".lg1")
    row["lg"] = {k: lg1[k] - lg0.get(k, 0) for k in lg1
                 if k.startswith("lock_") and isinstance(lg1[k], int)}
    with open(runs, "a") as f:
        f.write(json.dumps(row) + "\n")
    acq = gen["acquisitions"]
    lg = row["lg"]
    sent = lg.get("lock_attempts_sent", gen["attempts"]) if row["target"] == "lockgate" else gen["attempts"]
    rd = gen.get("reader_ms") or {}
    reader = f"  reader p50 {rd['p50']:.2f} p99 {rd['p99']:.2f} ms" if rd.get("n") else ""
    print(f"[shapes] round {row['round']} {row['pods']:>2} pod(s) {row['shape']:<8} {row['target']:<8} "
          f"{acq:>3} acq  {gen['attempts']:>6} attempts, {sent:>6} to Redis  "
          f"storm {row['storm_usec'] / 1000:7.2f} ms  {row['commands']:>6} cmds  "
          f"cpu {row['redis_ns'] / 1e6:7.1f} ms{reader}  errors {gen['errors']}",
          file=sys.stderr)


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def report(runs_path, meta_path, out):
    runs = [json.loads(l) for l in open(runs_path) if l.strip()]
    meta = dict(l.rstrip("\n").split("\t", 1) for l in open(meta_path) if "\t" in l)
    shapes = []
    for r in runs:
        if (r.get("pods", 1), r["shape"]) not in shapes:
            shapes.append((r.get("pods", 1), r["shape"]))
    lines = [
        f"# Storm by connection shape ({meta.get('date', '')})",
        "",
        f"lockgate {meta.get('lockgate', '')}; Redis {meta.get('redis', '')}; "
        f"load average {meta.get('load', '')}; {meta.get('setup', '')}. Medians over rounds; "
        "Redis time is INFO commandstats µs of the storm's top-level commands (through lockgate "
        "its scripts, whose time includes the commands they run); commands count those inside "
        "scripts too.",
        "",
        "| pods | shape | target | acquisitions | attempts | sent to Redis | Redis time ms | per acq µs | "
        "× direct (per acq) | Redis cmds | per acq | per sent | Redis CPU ms | handoff gap p50 / p99 ms | "
        "reader p50 / p99 ms | per worker min–max |",
        "|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    summary = {}
    for pods, shape in shapes:
        per_target = {}
        for target in ("direct", "lockgate"):
            rs = [r for r in runs if r["shape"] == shape and r["target"] == target
                  and r.get("pods", 1) == pods]
            if not rs:
                continue
            acq = med([r["gen"]["acquisitions"] for r in rs])
            att = med([r["gen"]["attempts"] for r in rs])
            sent = med([r["lg"].get("lock_attempts_sent") if target == "lockgate"
                        else r["gen"]["attempts"] for r in rs])
            usec = med([r["storm_usec"] for r in rs])
            per_acq = med([r["storm_usec"] / max(r["gen"]["acquisitions"], 1) for r in rs])
            cmds = med([r["commands"] for r in rs])
            cmds_acq = med([r["commands"] / max(r["gen"]["acquisitions"], 1) for r in rs])
            sent_v = [r["lg"].get("lock_attempts_sent") if target == "lockgate"
                      else r["gen"]["attempts"] for r in rs]
            cmds_sent = med([r["commands"] / s for r, s in zip(rs, sent_v) if s])
            cpu = med([r["redis_ns"] / 1e6 for r in rs])
            gap50 = med([r["gen"]["gap_ms"]["p50"] for r in rs])
            gap99 = med([r["gen"]["gap_ms"]["p99"] for r in rs])
            rd = [r["gen"].get("reader_ms") or {} for r in rs]
            r50 = med([x.get("p50") for x in rd])
            r99 = med([x.get("p99") for x in rd])
            mins = min(min(r["gen"]["per_worker"]) for r in rs)
            maxs = max(max(r["gen"]["per_worker"]) for r in rs)
            per_target[target] = dict(acq=acq, per_acq=per_acq, r99=r99, cmds_sent=cmds_sent)
            ratio = ""
            if target == "lockgate" and "direct" in per_target:
                d = per_target["direct"]["per_acq"]
                ratio = fmt(per_acq / d if d else None, ".3f")
            lines.append(
                f"| {pods} | {shape} | {target} | {fmt(acq, '.0f')} | {fmt(att, '.0f')} | {fmt(sent, '.0f')} | "
                f"{fmt(usec / 1000 if usec is not None else None, '.2f')} | {fmt(per_acq, '.0f')} | "
                f"{ratio} | {fmt(cmds, '.0f')} | {fmt(cmds_acq, '.1f')} | {fmt(cmds_sent, '.2f')} | "
                f"{fmt(cpu, '.1f')} | {fmt(gap50, '.1f')} / {fmt(gap99, '.1f')} | "
                f"{fmt(r50, '.2f')} / {fmt(r99, '.2f')} | {mins}–{maxs} |")
        summary[(pods, shape)] = per_target
    lines.append("")
    text = "\n".join(lines)
    print(text)
    with open(out, "w") as f:
        f.write(text + "\n")


def main():
    cmd = sys.argv[1]
    if cmd == "record":
        record(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif cmd == "report":
        report(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown subcommand {cmd}")


if __name__ == "__main__":
    main()
