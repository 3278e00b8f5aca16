#!/usr/bin/env python3
"""Helper for bench/storm.sh (python3 stdlib only).

Subcommands:
  record OUT GEN CMDSTATS LGSTATS0 LGSTATS1 key=value...
                       append one run to OUT (JSON lines): the load
                       generator's JSON line (GEN), Redis's INFO commandstats
                       after the run (CMDSTATS; CONFIG RESETSTAT came just
                       before it), lockgate's LOCKGATE STATS before and after
                       (redis-cli output; empty files for other targets) and
                       the shell's measurements (key=value, numbers)
  report RUNS META OUT turn the runs into the markdown summary: print it and
                       write it to OUT; storm.sh keeps the last run's inputs, so
                       python3 bench/storm_report.py report \\
                         bench/results/storm-latest.jsonl \\
                         bench/results/storm-latest.meta.tsv /dev/null
                       prints its summary again
"""

import json
import math
import statistics
import sys

TARGETS = ["direct", "twemproxy", "lockgate"]
WORKLOADS = ["poll", "spin"]
# The try-lock workload (c): its own table, the generator's --try-every-ms mode.
TRY = "try"
# Commands the benchmark itself sends to Redis around a run, not counted.
OWN_COMMANDS = {"config|resetstat", "info", "flushall", "config"}


def parse_commandstats(path):
    """{command: calls} from `INFO commandstats` output."""
    calls = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("cmdstat_"):
                continue
            name, _, rest = line[len("cmdstat_"):].partition(":")
            for field in rest.split(","):
                k, _, v = field.partition("=")
                if k == "calls":
                    calls[name] = int(v)
    return {k: v for k, v in calls.items() if k not in OWN_COMMANDS}


def parse_lgstats(path):
    """{counter: value} from `redis-cli LOCKGATE STATS` (name, value lines)."""
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip()]
    return {lines[i]: int(lines[i + 1]) for i in range(0, len(lines) - 1, 2)}


def record(out, gen_path, cmdstats_path, lg0_path, lg1_path, pairs):
    with open(gen_path) as f:
        text = f.read().strip()
    try:
        gen = json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):
        sys.exit(f"storm_report: no JSON line from the load generator in {gen_path}: {text!r}")
    run = {}
    for pair in pairs:
        k, _, v = pair.partition("=")
        try:
            run[k] = int(v)
        except ValueError:
            try:
                run[k] = float(v)
            except ValueError:
                run[k] = v
    run["gen"] = gen
    run["commands"] = parse_commandstats(cmdstats_path)
    lg0, lg1 = parse_lgstats(lg0_path), parse_lgstats(lg1_path)
    run["lockgate"] = {k: v - lg0.get(k, 0) for k, v in lg1.items() if k.startswith("lock_")}
    with open(out, "a") as f:
        f.write(json.dumps(run, sort_keys=True) + "\n")


def fifo_ideal_waits(clients, hold_s, duration_s):
    """The waits a perfect FIFO lock would give in the same window: everyone
    starts at 0, handoffs cost nothing, a holder queues again right after its
    release. Only waits that end inside the window count, as in the runs."""
    queue = [(i, 0.0) for i in range(clients)]  # (client, joined at)
    waits = []
    k = 0
    while k * hold_s < duration_s:
        t = k * hold_s
        client, joined = queue.pop(0)
        waits.append(t - joined)
        queue.append((client, t + hold_s))
        k += 1
    return waits


def nearest_rank(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s), max(1, math.ceil(q * len(s)))) - 1]


def med(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def kfmt(v):
    if v != v:
        return "n/a"
    if v >= 10000:
        return f"{v / 1000:.1f}k"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def derive(run, meta):
    """The figures of one run."""
    g = run["gen"]
    # Rates are per second of load: the generator's window from the moment
    # every client is connected to the last one stopping. The counters were
    # read around the whole process (start-up included), so a slow start-up
    # only makes the rates higher.
    wall = g["elapsed_s"]
    startup = g["connect_ms"] / 1000 if "connect_ms" in g else run["wall_s"] - g["elapsed_s"]
    acq = g["acquisitions"]
    total = sum(run["commands"].values())
    scripts = sum(run["commands"].get(c, 0) for c in ("eval", "evalsha", "evalsha_ro", "eval_ro"))
    cpu_s = run["redis_ns"] / 1e9
    idle_rate = meta["idle"][run["target"]]  # Redis CPU s per s, idle
    per_client = g["per_client"]
    return {
        "cmds_s": total / wall,
        "cmds_acq": total / acq if acq else float("inf"),
        "scripts_acq": scripts / acq if acq else float("inf"),
        # What the proxy sent: lockgate turns the generator's SETNX and DEL
        # into scripts, so its own commands are the scripts; the other
        # targets pass the generator's commands as they are.
        "sent_acq": (scripts if run["target"] == "lockgate" else total) / acq if acq else float("inf"),
        "by_command": {c: n / wall for c, n in run["commands"].items()},
        "by_command_acq": {c: (n / acq if acq else float("inf")) for c, n in run["commands"].items()},
        "cpu_pct": run["redis_ticks"] / meta["clk_tck"] / wall * 100,
        "proxy_cpu_pct": run["proxy_ticks"] / meta["clk_tck"] / wall * 100 if run["target"] != "direct" else float("nan"),
        "cpu_ms_acq": cpu_s * 1000 / acq if acq else float("inf"),
        "cpu_ms_acq_net": max(0.0, cpu_s - idle_rate * run["wall_s"]) * 1000 / acq if acq else float("inf"),
        "acq_s": acq / g["duration_s"],
        "startup_s": startup,
        "attempts_s": g["attempts"] / g["duration_s"],
        "wait_p50": g["wait_ms"]["p50"] / 1000,
        "wait_p99": g["wait_ms"]["p99"] / 1000,
        "wait_max": g["wait_ms"]["max"] / 1000,
        "handoff_p50": g["handoff_ms"]["p50"],
        "handoff_p99": g["handoff_ms"]["p99"],
        "unfinished": g["unfinished"],
        "waiting_at_end": g["waiting_at_end"],
        "oldest_open": g["oldest_open_wait_ms"] / 1000,
        "acq_min": min(per_client),
        "acq_max": max(per_client),
        "distinct": g["distinct_acquirers"],
        "clients": g["clients"],
        "acq": acq,
        "hold_s": g["hold_ms"] / 1000,
        "duration_s": g["duration_s"],
        "overlaps": g["overlaps"],
        "errors": g["errors"],
        "first_error": g.get("first_error"),
        "del_missed": g["del_missed"],
        "lockgate": run.get("lockgate", {}),
    }


def derive_try(run):
    """The figures of one try-lock run (the generator's --try-every-ms mode)."""
    g = run["gen"]
    total = sum(run["commands"].values())
    lg = run.get("lockgate", {})
    return {
        "cmds_s": total / g["elapsed_s"],
        "cmds_try": total / g["attempts"] if g["attempts"] else float("nan"),
        "attempts": g["attempts"],
        "acquired": g["acquired"],
        "lat_p50": g["latency_ms"]["p50"],
        "lat_p99": g["latency_ms"]["p99"],
        "lat_max": g["latency_ms"]["max"],
        "min_gap": g["min_gap_ms"] if g["min_gap_ms"] is not None else float("nan"),
        "holder_released": g["holder_released"],
        "parked": lg.get("lock_parked", float("nan")),
        "park_timeouts": lg.get("lock_park_timeouts", float("nan")),
        "handoffs": lg.get("lock_handoffs", float("nan")),
        "absorbed": lg.get("lock_absorbed", float("nan")),
        "errors": g["errors"],
        "first_error": g.get("first_error"),
        "clients": g["clients"],
        "every_ms": g["try_every_ms"],
        "lockgate": lg,
    }


def report(runs_path, meta_path, out):
    meta = {"idle": {}}
    with open(meta_path) as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition("\t")
            if k.startswith("idle_"):
                meta["idle"][k[len("idle_"):]] = float(v)
            else:
                meta[k] = v
    meta["clk_tck"] = float(meta.get("clk_tck", 100))
    runs = {}
    try_runs = {}
    with open(runs_path) as f:
        for line in f:
            run = json.loads(line)
            if run["workload"] == TRY:
                try_runs.setdefault(run["target"], []).append(derive_try(run))
            else:
                runs.setdefault((run["workload"], run["target"]), []).append(derive(run, meta))

    cols = [(w, t) for w in WORKLOADS for t in TARGETS]

    def val(w, t, key):
        return med([r[key] for r in runs.get((w, t), [])])

    def first(w, t):
        return runs.get((w, t), [{}])[0]

    lines = []
    emit = lines.append
    n_rounds = int(meta.get("rounds", "1"))
    emit(f"### lockgate retry-storm benchmark, {meta.get('date', '?')}")
    emit("")
    emit(
        f"lockgate {meta.get('lockgate', '?')} (default config: probe_interval_ms "
        f"{meta.get('probe_interval_ms', '?')}, park_ms {meta.get('park_ms', '?')}) · "
        f"redis {meta.get('redis', '?')} · nutcracker {meta.get('nutcracker', '?')} · "
        f"{meta.get('cpus', '?')} CPUs, load avg {meta.get('load', '?')} at start · "
        f"{meta.get('duration', '?')} s per run, hold {meta.get('hold_ms', '?')} ms, "
        f"{n_rounds} round{'s' if n_rounds > 1 else ''}"
        + (" (medians)" if n_rounds > 1 else "")
        + " · each target has its own redis-server, FLUSHALL + CONFIG RESETSTAT before each run"
        + (" · **QUICK smoke run, not a measurement**" if meta.get("quick") == "1" else "")
    )
    emit("")
    emit(
        f"a = {meta.get('poll_clients', '?')} clients, `SETNX lock:storm <id>` then sleep "
        f"{int(meta.get('poll_sleep_us', '0')) / 1000:g} ms until acquired (the 'Redis in Action' loop); "
        f"b = {meta.get('spin_clients', '?')} clients spinning with no sleep. "
        "A winner holds the lock, DELs it through the same target and tries again."
    )
    emit("")
    emit("| metric | a direct | a twemproxy | a lockgate | b direct | b twemproxy | b lockgate |")
    emit("|---|--:|--:|--:|--:|--:|--:|")

    def row(label, fn):
        emit(f"| {label} | " + " | ".join(fn(w, t) for w, t in cols) + " |")

    row("upstream cmds/s (commandstats)", lambda w, t: kfmt(val(w, t, "cmds_s")))
    row("upstream cmds / acquisition (Redis's count, with the calls inside scripts)", lambda w, t: kfmt(val(w, t, "cmds_acq")))
    row("… sent by the proxy (EVAL/EVALSHA for lockgate)", lambda w, t: kfmt(val(w, t, "sent_acq")))
    row("Redis CPU % (/proc/PID/stat)", lambda w, t: f"{val(w, t, 'cpu_pct'):.1f}")
    row(
        "Redis CPU ms / acquisition (all · above idle)",
        lambda w, t: f"{val(w, t, 'cpu_ms_acq'):.3g} · {val(w, t, 'cpu_ms_acq_net'):.3g}",
    )
    row("proxy CPU %", lambda w, t: "–" if t == "direct" else f"{val(w, t, 'proxy_cpu_pct'):.1f}")
    row("client attempts/s", lambda w, t: kfmt(val(w, t, "attempts_s")))
    row("connecting the clients, s", lambda w, t: f"{val(w, t, 'startup_s'):.2f}")
    row("acquisitions/s", lambda w, t: f"{val(w, t, 'acq_s'):.2f}")
    row(
        "wait p50 / p99 / max, s",
        lambda w, t: f"{val(w, t, 'wait_p50'):.2f} / {val(w, t, 'wait_p99'):.2f} / {val(w, t, 'wait_max'):.2f}",
    )
    row("handoff p50 / p99, ms", lambda w, t: f"{val(w, t, 'handoff_p50'):.1f} / {val(w, t, 'handoff_p99'):.1f}")
    row(
        "unfinished waits at end: never acquired · all open · oldest s",
        lambda w, t: f"{val(w, t, 'unfinished'):.0f} · {val(w, t, 'waiting_at_end'):.0f} · {val(w, t, 'oldest_open'):.1f}",
    )
    row(
        "acquisitions per client min / max · clients that acquired",
        lambda w, t: f"{val(w, t, 'acq_min'):.0f} / {val(w, t, 'acq_max'):.0f} · {val(w, t, 'distinct'):.0f} of {val(w, t, 'clients'):.0f}",
    )
    row(
        "overlaps · errors · DEL found no lock",
        lambda w, t: f"{val(w, t, 'overlaps'):.0f} · {val(w, t, 'errors'):.0f} · {val(w, t, 'del_missed'):.0f}",
    )
    emit("")

    # Per command: calls/s (per acquisition).
    commands = sorted({c for rs in runs.values() for r in rs for c in r["by_command"]})
    emit("Upstream commands by name, calls/s (per acquisition); commandstats also counts the calls a Lua script makes:")
    emit("")
    emit("| command | a direct | a twemproxy | a lockgate | b direct | b twemproxy | b lockgate |")
    emit("|---|--:|--:|--:|--:|--:|--:|")
    for c in commands:
        def cell(w, t, c=c):
            rs = runs.get((w, t), [])
            per_s = med([r["by_command"].get(c, 0) for r in rs])
            per_acq = med([r["by_command_acq"].get(c, 0) for r in rs])
            return "" if not per_s else f"{kfmt(per_s)} ({kfmt(per_acq)})"
        row(c, cell)
    emit("")

    lg = {w: first(w, "lockgate").get("lockgate", {}) for w in WORKLOADS}
    lg[TRY] = try_runs.get("lockgate", [{}])[0].get("lockgate", {})
    if any(lg.values()):
        keys = ["lock_attempts", "lock_absorbed", "lock_parked", "lock_handoffs", "lock_park_timeouts", "lock_acquired", "lock_smoothed"]
        emit(
            "lockgate's own counters over the run (LOCKGATE STATS after minus before, round 1): "
            + "; ".join(
                f"{name}: " + ", ".join(f"{k[len('lock_'):]} {lg[w].get(k, 0)}" for k in keys if k in lg[w])
                for w, name in (("poll", "a"), ("spin", "b"), (TRY, "c"))
                if lg[w]
            )
            + "."
        )
        emit("")
    idle = meta["idle"]
    emit(
        "Redis CPU ms / acquisition is from /proc/PID/task/*/schedstat (ns; /proc/PID/stat counts "
        f"{1000 / meta['clk_tck']:.0f} ms ticks, too coarse for a few dozen acquisitions); "
        "above idle subtracts each Redis's own idle rate, measured before the runs with the proxies "
        "connected: "
        + ", ".join(f"{t} {idle.get(t, float('nan')) * 1000:.2f} ms/s" for t in TARGETS)
        + ". Rates are per second of load, from all clients connected to the last one stopping. "
        "Waits run from a client's first attempt of a round to the reply that acquired; a handoff "
        "from the holder's DEL to the next acquiring reply."
    )
    if meta.get("floor_ms"):
        emit("")
        emit(
            f"The floor: one lone round trip (PING at 5/s, the runs' acquisition rate) costs the idle "
            f"direct Redis {float(meta['floor_ms']):.3f} ms of CPU on this box (waking an idle "
            "process is the cost). Any acquisition through a proxy needs at least one round trip "
            "to Redis, so Redis CPU per acquisition cannot go below that here."
        )
    emit("")

    # Targets, for lockgate.
    emit("| target (lockgate) | a | b |")
    emit("|---|---|---|")

    def verdict(ok):
        return "PASS" if ok else "MISS"

    def check(name, fn):
        emit(f"| {name} | " + " | ".join(fn(w) for w in WORKLOADS) + " |")

    def cmds(w):
        v = val(w, "lockgate", "cmds_acq")
        s = val(w, "lockgate", "sent_acq")
        return (
            f"{verdict(s <= 3)} {s:.2f} sent (EVAL); Redis's commandstats, which also counts "
            f"the calls a script makes: {v:.1f} ({verdict(v <= 3)} on that count)"
        )

    def cpu(w):
        v, raw = val(w, "lockgate", "cpu_ms_acq_net"), val(w, "lockgate", "cpu_ms_acq")
        d = val(w, "direct", "cpu_ms_acq")
        floor = meta.get("floor_ms")
        note = f"; one lone PING: {float(floor):.3f}" if floor else ""
        return f"{verdict(v <= 0.1)} {v:.3f} ms above idle ({raw:.3f} with idle; direct {d:.2f}{note})"

    def acq(w):
        v, d = val(w, "lockgate", "acq_s"), val(w, "direct", "acq_s")
        return f"{verdict(v >= d)} {v:.2f} vs {d:.2f}"

    def everyone(w):
        # A FIFO lock gives a turn to min(clients, holds that fit) clients.
        rs = runs.get((w, "lockgate"), [])
        if not rs:
            return "n/a"
        need = [min(r["clients"], len(fifo_ideal_waits(r["clients"], r["hold_s"], r["duration_s"]))) for r in rs]
        ok = all(r["distinct"] >= n for r, n in zip(rs, need))
        r = rs[0]
        note = (
            f" (the window fits {need[0]} holds for {r['clients']} clients)"
            if need[0] < r["clients"]
            else ""
        )
        return (
            f"{verdict(ok)} {r['distinct']} of {need[0]} clients{note}; "
            f"{r['acq']} acquisitions, at most {r['acq_max']} per client"
        )

    def fifo(w):
        rs = runs.get((w, "lockgate"), [])
        if not rs:
            return "n/a"
        r = rs[0]
        ideal = nearest_rank(fifo_ideal_waits(r["clients"], r["hold_s"], r["duration_s"]), 0.99)
        v = val(w, "lockgate", "wait_p99")
        dev = (v - ideal) / ideal * 100 if ideal else float("nan")
        steady = r["clients"] * r["hold_s"]
        return (
            f"{verdict(abs(dev) <= 10)} p99 {v:.2f} s vs {ideal:.2f} s ({dev:+.0f} %; "
            f"steady state {r['clients']} × {r['hold_s'] * 1000:.0f} ms = {steady:.0f} s)"
        )

    check("≤ 3 upstream cmds per acquisition", cmds)
    check("Redis CPU per acquisition ≤ 0.1 ms", cpu)
    check("acquisitions/s ≥ direct", acq)
    check("every client acquires", everyone)
    check("wait p99 within 10 % of the FIFO ideal", fifo)
    emit("")
    emit(
        "FIFO ideal: the waits a perfect FIFO lock gives in the same window (everyone starts at 0, "
        "handoffs cost nothing, a holder queues again after its release; only waits that end inside "
        "the window count, as in the runs). \"Every client acquires\" asks as many clients to acquire as that "
        "ideal lets: all of them when clients × hold fits in the run, otherwise one per hold that fits."
    )
    if try_runs:
        try_table(try_runs, meta, emit)

    bad = [
        f"{w}/{t}: {r['errors']} errors ({r['first_error']})"
        for (w, t), rs in sorted(runs.items())
        for r in rs
        if r["errors"]
    ] + [
        f"{TRY}/{t}: {r['errors']} errors ({r['first_error']})"
        for t, rs in sorted(try_runs.items())
        for r in rs
        if r["errors"]
    ] + [
        f"{TRY}/{t}: {r['acquired']} try-locks acquired the held lock"
        for t, rs in sorted(try_runs.items())
        for r in rs
        if r["acquired"] or not r["holder_released"]
    ] + [
        f"{w}/{t}: {r['overlaps']} overlapping acquisitions"
        for (w, t), rs in sorted(runs.items())
        for r in rs
        if r["overlaps"]
    ]
    if bad:
        emit("")
        emit("**Invalid runs:** " + "; ".join(bad))

    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    with open(out, "w") as f:
        f.write(text)


def try_table(try_runs, meta, emit):
    """Workload c: try-locks on a lock held for the whole run."""
    targets = [t for t in TARGETS if t in try_runs]

    def val(t, key):
        return med([r[key] for r in try_runs.get(t, [])])

    r0 = try_runs[targets[0]][0]
    park_ms = meta.get("park_ms", "?")
    emit("")
    emit(
        f"c = try-lock: a holder keeps `lock:storm` for the whole run while {r0['clients']} clients "
        f"each send one `SETNX lock:storm <id>` every {r0['every_ms']} ms (staggered; longer than "
        f"lockgate's spin window, {meta.get('spin_window_ms', '?')} ms, so never spinning), as cron "
        "de-duplication does. Every reply must be 0. lockgate should answer them at once, as Redis "
        f"does; before it had a spin window it parked each one for park_ms ({park_ms} ms)."
    )
    emit("")
    emit("| metric | " + " | ".join(f"c {t}" for t in targets) + " |")
    emit("|---|" + "--:|" * len(targets))

    def row(label, fn):
        emit(f"| {label} | " + " | ".join(fn(t) for t in targets) + " |")

    def lgonly(fn):
        return lambda t: fn(t) if t == "lockgate" else "–"

    row(
        "try-lock reply p50 / p99 / max, ms",
        lambda t: f"{val(t, 'lat_p50'):.2f} / {val(t, 'lat_p99'):.2f} / {val(t, 'lat_max'):.2f}",
    )
    row("try-locks · acquired (must be 0)", lambda t: f"{val(t, 'attempts'):.0f} · {val(t, 'acquired'):.0f}")
    row("shortest gap between a client's two tries, ms", lambda t: f"{val(t, 'min_gap'):.0f}")
    row("upstream cmds/s (commandstats)", lambda t: kfmt(val(t, "cmds_s")))
    row("upstream cmds / try-lock", lambda t: kfmt(val(t, "cmds_try")))
    row(
        "lockgate: parked · park timeouts · handoffs",
        lgonly(lambda t: f"{val(t, 'parked'):.0f} · {val(t, 'park_timeouts'):.0f} · {val(t, 'handoffs'):.0f}"),
    )
    row("lockgate: answered without asking Redis (absorbed)", lgonly(lambda t: f"{val(t, 'absorbed'):.0f}"))
    emit("")
    if "lockgate" in try_runs:
        parked, p99 = val("lockgate", "parked"), val("lockgate", "lat_p99")
        d99 = val("direct", "lat_p99") if "direct" in try_runs else float("nan")
        try:
            limit = float(park_ms)
        except ValueError:
            limit = float("nan")
        ok = parked == 0 and p99 < limit
        emit("| target (lockgate) | c |")
        emit("|---|---|")
        emit(
            f"| a try-lock is answered at once, not parked | {'PASS' if ok else 'MISS'} {parked:.0f} parked, "
            f"reply p99 {p99:.2f} ms < park_ms {park_ms} ms (direct p99 {d99:.2f} ms) |"
        )


def main(argv):
    if len(argv) >= 7 and argv[1] == "record":
        record(argv[2], argv[3], argv[4], argv[5], argv[6], argv[7:])
    elif len(argv) == 5 and argv[1] == "report":
        report(argv[2], argv[3], argv[4])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
