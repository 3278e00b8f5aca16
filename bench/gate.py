#!/usr/bin/env python3
"""The performance gate: figures per operation that a noisy box cannot move,
checked against a committed baseline.

    python3 bench/gate.py --lockgate BIN                   measure, compare with
                                                           bench/gate-baseline.txt
    python3 bench/gate.py --lockgate BIN --update          measure, rewrite the
                                                           baseline's values

Two kinds of figure, both counts, not times:

* Instructions lockgate runs per request, in user space (valgrind's
  callgrind; the kernel's share is not counted, bench/passthrough.sh
  measures that). lockgate runs under callgrind; before each phase the
  counters are zeroed (callgrind_control -z) and after it they are dumped
  (-d), so a phase's count holds only that phase (and whatever lockgate's
  timers did meanwhile, a small share). Phases:
    passthrough_set_p16   redis-benchmark SET -c 1 -P 16, random keys,
                          lockgate's default config (dedicated upstream):
                          one client, so each read is one whole pipeline
                          however busy the box (with -c 50 how requests
                          fall into reads moved the count 2-3 % under load)
    setnx_acquire         SETNX on a fresh lock key, one connection, each
                          reply awaited (a legacy app's acquisition)
    release               DEL of a lock that connection holds
    redis_cycle           Redis's own instructions (redis-server under
                          callgrind) per SETNX + DEL cycle through lockgate,
                          pipelined 100 deep on one connection; printed
                          beside a bare cycle straight on Redis and the
                          floor (SET NX PX + SET PX, GET + DEL of both:
                          what a lock with a lease and an owner record in
                          a key of its own costs with no check at all)
    redis_cycle_expire    the same for SETNX + EXPIRE + DEL
    redis_library_cycle   a lock library's cycle: SET NX PX, then its own
                          compare-and-delete script (and lockgate's
                          reconciliation of the owner record after it),
                          one command at a time
    valkey_cycle…         the same three on Valkey 9.1 (--valkey), where
                          lockgate acquires with MSETEX, no script
    guarded_write         SET on a key a [[locks.guards]] entry covers
                          (report mode, unlocked writers allowed)
    quorum_acquire        SETNX on a fresh lock key, [locks.quorum] of 5
    quorum_release        DEL of it
* Redis commands per lock operation, from INFO commandstats of the Redis
  that holds the locks (calls inside scripts counted with the script call):
    cycle_commands        SETNX + DEL
    cycle_expire_commands SETNX + EXPIRE + DEL
    storm_commands        per acquisition of one lock key that STORM_CLIENTS
                          connections spin on (SETNX, 1 ms sleep, again;
                          the winner holds it 5 ms and DELs it)

A figure fails the gate when it is worse (higher) than its baseline by more
than its tolerance (a percent, in the baseline file). A figure better by
more than its tolerance is reported, so the baseline can be lowered (a
baseline left high would let a later change grow back into it unseen).
The instruction counts move by up to 2 % between runs of one binary (a
timer tick more or less; the quorum's five masters answer in any order);
the storm's count depends on how the spinning clients
interleave, hence its wider tolerance.

Changing the baseline: run with --update and commit the file in the same
commit as the change that moved the figure, with the reason in the message
(bench/gate.sh checks that every commit touching the baseline says
`Baseline:` in its message).
"""

import argparse
import glob
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import redis

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE = os.path.join(HERE, "gate-baseline.txt")

# How many operations each phase runs. Enough that the per-operation
# figure is steady to well under a percent; few enough that the whole gate,
# under callgrind's 30-50x slowdown, takes a few minutes.
N_P16 = 32000
N_SEQ = 2000
N_CYCLES = 500
STORM_CLIENTS = 12
STORM_ACQUISITIONS = 150


def log(msg):
    print(f"==> [gate] {msg}", file=sys.stderr, flush=True)


def free_port():
    """A loopback port free a moment ago (20000 up to the ephemeral range)."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise SystemExit("gate: no free loopback port")


class Procs:
    """Every process the gate started, stopped (TERM, then KILL) at exit."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = []

    def start(self, name, argv):
        out = open(os.path.join(self.tmp, name + ".log"), "wb")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.tmp)
        self.procs.append((name, p))
        return p

    def stop(self, p, grace_s=30):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self):
        for _, p in reversed(self.procs):
            self.stop(p, 10)

    def log_of(self, name):
        try:
            with open(os.path.join(self.tmp, name + ".log"), "rb") as f:
                return f.read()[-4000:].decode(errors="replace")
        except OSError:
            return ""


def wait_ping(procs, name, p, port, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"gate: {name} exited at start:\n{procs.log_of(name)}")
        try:
            if redis.Redis(port=port, socket_timeout=2).ping():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"gate: {name} not answering PING on {port}:\n{procs.log_of(name)}")


def start_redis(procs, name, callgrind=False, server="redis-server"):
    """A redis-server (or `server`) on a free port: its port, or (under
    callgrind) it."""
    port = free_port()
    argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no"]
    out = None
    if callgrind:
        out = os.path.join(procs.tmp, name + ".cg")
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + argv
    p = procs.start(name, argv)
    wait_ping(procs, name, p, port, timeout_s=120)
    return Counted(name, p, port, out) if callgrind else port


def start_lockgate(procs, args, name, upstream, config="", callgrind=True, cluster=False):
    """lockgate (under callgrind unless told) in front of 127.0.0.1:upstream
    (with `cluster`, the Redis Cluster that node is a seed of)."""
    port = free_port()
    conf = os.path.join(procs.tmp, name + ".toml")
    with open(conf, "w") as f:
        f.write(config)
    to = "--upstream-cluster" if cluster else "--upstream"
    argv = [args.lockgate, "--config", conf, "--listen", f"127.0.0.1:{port}",
            to, f"127.0.0.1:{upstream}", "--admin-listen", ""]
    out = None
    if callgrind:
        out = os.path.join(procs.tmp, name + ".cg")
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + argv
    env = dict(os.environ, RUST_LOG="warn")
    logf = open(os.path.join(procs.tmp, name + ".log"), "wb")
    p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, cwd=procs.tmp, env=env)
    procs.procs.append((name, p))
    wait_ping(procs, name, p, port, timeout_s=120)
    return Counted(name, p, port, out)


class Counted:
    """A process under callgrind (or not: `out` None), counted by phase."""

    def __init__(self, name, proc, port, out):
        self.name, self.proc, self.port, self.out = name, proc, port, out
        self.dumps = 0

    def zero(self):
        run(["callgrind_control", "-z", str(self.proc.pid)])

    def dump(self):
        """Dumps the counters since the last zero; their total."""
        before = set(glob.glob(self.out + ".*"))
        run(["callgrind_control", "-d", str(self.proc.pid)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(glob.glob(self.out + ".*")) - before
            if new:
                path = new.pop()
                total = program_total(path)
                if total is not None:
                    return total
            time.sleep(0.1)
        raise SystemExit(f"gate: callgrind wrote no dump for {self.name}")

    def phase(self, fn, n):
        """Instructions per request of fn(), which sends n requests."""
        self.zero()
        fn()
        return self.dump() / n


def run(argv):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"gate: {' '.join(argv)} failed: {r.stdout}{r.stderr}")
    return r.stdout


def program_total(path):
    """The dump's total instruction count, once the file is whole."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("totals:") or line.startswith("summary:"):
            return int(line.split()[1])
    return None


def commands(r):
    """Commands Redis ran so far, calls inside scripts counted too."""
    return sum(int(v["calls"]) for v in r.info("commandstats").values())


def sequential(port, cmds):
    """Sends each command on one connection, each reply awaited."""
    c = redis.Redis(port=port, socket_timeout=60)

    def go():
        for cmd in cmds:
            c.execute_command(*cmd)

    return go


def benchmark_p16(port):
    def go():
        run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set", "-c", "1",
             "-P", "16", "-n", str(N_P16), "-r", "100000", "-d", "3", "-q"])

    return go


def measure_instructions(procs, args, figures):
    r1 = start_redis(procs, "redis")
    lg = start_lockgate(procs, args, "plain", r1)
    log("instructions: pass-through SET -c 50 -P 16")
    figures["passthrough_set_p16"] = lg.phase(benchmark_p16(lg.port), N_P16)
    keys = [f"lock:gate:a:{i}" for i in range(N_SEQ)]
    # A first round on other keys, unmeasured: connections, script loads.
    sequential(lg.port, [("SETNX", "lock:gate:warm", "v"), ("DEL", "lock:gate:warm")])()
    log("instructions: SETNX acquisition, release")
    c = redis.Redis(port=lg.port, socket_timeout=60)
    figures["setnx_acquire"] = lg.phase(lambda: [c.execute_command("SETNX", k, "v") for k in keys], N_SEQ)
    figures["release"] = lg.phase(lambda: [c.execute_command("DEL", k) for k in keys], N_SEQ)
    procs.stop(lg.proc)

    guard = ('[[locks.guards]]\nlock = "lock:order:{id}"\ndata = ["order:{id}", "order:{id}:*"]\n'
             'mode = "report"\nunlocked_writers = "allow"\n')
    lg = start_lockgate(procs, args, "guard", r1, guard)
    sequential(lg.port, [("SET", "order:warm", "v")])()
    log("instructions: guarded write")
    c = redis.Redis(port=lg.port, socket_timeout=60)
    figures["guarded_write"] = lg.phase(
        lambda: [c.execute_command("SET", f"order:{i}", "v") for i in range(N_SEQ)], N_SEQ)
    procs.stop(lg.proc)

    masters = [start_redis(procs, f"master{i}") for i in range(5)]
    # rejoin_delay_ms: a fresh lockgate sits the masters out for a while
    # (docs/quorum.md); the gate has no locks from before to protect.
    quorum = ('[locks]\ninstance_id = "gate-q5"\n[locks.quorum]\nmasters = ['
              + ", ".join(f'"127.0.0.1:{m}"' for m in masters) + "]\nrejoin_delay_ms = 100\n")
    lg = start_lockgate(procs, args, "quorum", r1, quorum)
    c = redis.Redis(port=lg.port, socket_timeout=60)
    # Every master reached before the count starts.
    deadline = time.monotonic() + 60
    while True:
        try:
            if c.execute_command("SETNX", "lock:gate:warm", "v") == 1:
                break
        except redis.ResponseError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("gate: the quorum lockgate grants no lock")
        time.sleep(0.2)
    c.execute_command("DEL", "lock:gate:warm")
    keys = [f"lock:gate:q:{i}" for i in range(N_SEQ // 2)]
    log("instructions: quorum of 5 acquisition, release")
    figures["quorum_acquire"] = lg.phase(lambda: [c.execute_command("SETNX", k, "v") for k in keys], len(keys))
    figures["quorum_release"] = lg.phase(lambda: [c.execute_command("DEL", k) for k in keys], len(keys))
    procs.stop(lg.proc)


def storm(port, direct):
    """Acquisitions of one key that STORM_CLIENTS connections spin on."""
    got = [0]
    stop = threading.Event()
    lock = threading.Lock()
    errors = []

    def client(i):
        c = redis.Redis(port=port, socket_timeout=30)
        me = f"gate-{i}"
        try:
            while not stop.is_set():
                if c.execute_command("SETNX", "lock:gate:storm", me) == 1:
                    time.sleep(0.005)
                    c.execute_command("DEL", "lock:gate:storm")
                    with lock:
                        got[0] += 1
                        if got[0] >= STORM_ACQUISITIONS:
                            stop.set()
                else:
                    time.sleep(0.001)
        except redis.RedisError as e:
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(STORM_CLIENTS)]
    before = commands(direct)
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise SystemExit(f"gate: storm client failed: {errors[0]}")
    return (commands(direct) - before) / got[0]


# The compare-and-delete release lock libraries send (redis-py's Lock).
COMPARE_AND_DELETE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
                      "return redis.call('del', KEYS[1]) else return 0 end")


def pipeline(c, cmds, depth=100):
    """Sends cmds on the client c's connection, `depth` at a time."""
    for s in range(0, len(cmds), depth):
        p = c.pipeline(transaction=False)
        for cmd in cmds[s:s + depth]:
            p.execute_command(*cmd)
        p.execute()


def pipelined(port, cmds, depth=100):
    """Sends cmds on one connection to port, `depth` at a time (when called)."""
    c = redis.Redis(port=port, socket_timeout=60)
    return lambda: pipeline(c, cmds, depth)


def measure_redis(procs, args, figures, notes, server="redis-server", name="redis"):
    """The server's own instructions per lock cycle through lockgate (the
    server under callgrind), with a bare cycle and the floor measured
    alongside; the figures named `name`_cycle…"""
    rd = start_redis(procs, f"{name}-counted", callgrind=True, server=server)
    lg = start_lockgate(procs, args, "front", rd.port, callgrind=False)
    n = N_CYCLES
    pipelined(lg.port, [("SETNX", "lock:gate:warm", "v"), ("DEL", "lock:gate:warm")])()
    log(f"{name} instructions: lock cycles through lockgate, a bare cycle, the floor")

    def cycle(port, prefix, extra=()):
        cmds = [("SETNX", f"{prefix}:{i}", "v") for i in range(n)]
        for cmd in extra:
            cmds += [(cmd[0], f"{prefix}:{i}", *cmd[1:]) for i in range(n)]
        return pipelined(port, cmds + [("DEL", f"{prefix}:{i}") for i in range(n)])

    bare = rd.phase(cycle(rd.port, "plain:gate:a"), n)
    bare_expire = rd.phase(cycle(rd.port, "plain:gate:b", [("EXPIRE", 30)]), n)
    floor = rd.phase(pipelined(rd.port, [c for i in range(n) for c in (
        ("SET", f"plain:gate:f:{i}", "v", "NX", "PX", "30000"),
        ("SET", f"plain:gate:o:{i}", "t", "PX", "30000"))]
        + [c for i in range(n) for c in (
            ("GET", f"plain:gate:o:{i}"), ("DEL", f"plain:gate:f:{i}", f"plain:gate:o:{i}"))]), n)
    # A lock library's cycle (redis-py's Lock): SET NX PX, then its own
    # compare-and-delete script, after which lockgate reconciles the owner
    # record on its own connection. The phase ends once the last key's
    # record is gone (reconciliations run in order on that connection).
    sha = redis.Redis(port=lg.port).script_load(COMPARE_AND_DELETE)
    direct = redis.Redis(port=rd.port)

    def library():
        # One command at a time, as the library sends them: pipelined, how
        # the reconciliations fell between the client's commands moved the
        # count by 6 %.
        sequential(lg.port, [c for i in range(n) for c in (
            ("SET", f"lock:gate:l:{i}", "t", "NX", "PX", "30000"),
            ("EVALSHA", sha, 1, f"lock:gate:l:{i}", "t"))])()
        deadline = time.monotonic() + 60
        while direct.exists(f"lockgate:owner:{{lock:gate:l:{n - 1}}}"):
            if time.monotonic() > deadline:
                raise SystemExit("gate: the library cycle's owner records were not reconciled")
            time.sleep(0.01)

    figures[f"{name}_library_cycle"] = rd.phase(library, n)
    cyc = figures[f"{name}_cycle"] = rd.phase(cycle(lg.port, "lock:gate:c"), n)
    exp = figures[f"{name}_cycle_expire"] = rd.phase(
        cycle(lg.port, "lock:gate:e", [("EXPIRE", 30)]), n)
    notes.append(f"{name} instructions per cycle: bare SETNX+DEL {bare:.0f}, with EXPIRE "
                 f"{bare_expire:.0f}; the floor (SET NX PX + SET PX, GET + DEL of both, no "
                 f"atomicity) {floor:.0f} = {floor / bare:.2f}x bare; through lockgate "
                 f"{cyc:.0f} = {cyc / bare:.2f}x bare, with EXPIRE {exp:.0f} = "
                 f"{exp / bare_expire:.2f}x its bare cycle")
    procs.stop(lg.proc)
    procs.stop(rd.proc)


def measure_commands(procs, args, figures):
    r = start_redis(procs, "redis-cmds")
    direct = redis.Redis(port=r)
    lg = start_lockgate(procs, args, "cmds", r, callgrind=False)
    c = redis.Redis(port=lg.port, socket_timeout=30)
    c.execute_command("SETNX", "lock:gate:warm", "v")
    c.execute_command("DEL", "lock:gate:warm")
    log("Redis commands: lock cycles, storm")
    for name, extra in (("cycle_commands", []), ("cycle_expire_commands", [("EXPIRE", 30)])):
        before = commands(direct)
        for i in range(N_CYCLES):
            k = f"lock:gate:{name}:{i}"
            c.execute_command("SETNX", k, "v")
            for cmd in extra:
                c.execute_command(cmd[0], k, *cmd[1:])
            c.execute_command("DEL", k)
        # INFO itself is one command, the one reading "before" is counted.
        figures[name] = (commands(direct) - before - 1) / N_CYCLES
    figures["storm_commands"] = storm(lg.port, direct)
    procs.stop(lg.proc)


def read_baseline(path):
    """{figure: (value, tolerance %)} and the file's lines, kept for --update."""
    base, lines = {}, []
    with open(path) as f:
        for line in f:
            lines.append(line.rstrip("\n"))
            words = line.split("#", 1)[0].split()
            if words:
                base[words[0]] = (float(words[1]), float(words[2]))
    return base, lines


def compare(base, figures):
    """Lines of the report; whether every figure is within its tolerance."""
    ok, out = True, []
    out.append(f"| figure | baseline | now | change | tolerance | |")
    out.append("|---|--:|--:|--:|--:|---|")
    for name, now in figures.items():
        if name not in base:
            out.append(f"| {name} | - | {now:.1f} | | | not in the baseline |")
            ok = False
            continue
        value, tol = base[name]
        change = (now - value) / value * 100 if value else 0.0
        verdict = "ok"
        if change > tol:
            verdict, ok = "WORSE", False
        elif change < -tol:
            verdict = "better: lower the baseline (--update)"
        out.append(f"| {name} | {value:.1f} | {now:.1f} | {change:+.1f} % | {tol:g} % | {verdict} |")
    for name in base:
        if name not in figures:
            out.append(f"| {name} | {base[name][0]:.1f} | - | | | not measured |")
            ok = False
    return ok, out


def write_baseline(path, lines, figures):
    out = []
    for line in lines:
        words = line.split("#", 1)[0].split()
        if words and words[0] in figures:
            comment = line[line.index("#"):] if "#" in line else ""
            line = f"{words[0]} {figures[words[0]]:.1f} {words[2]}"
            line += f"  {comment}" if comment else ""
        out.append(line)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def self_test():
    """The gate's own rules, checked before it measures: a gate that cannot
    fail is no gate."""
    base = {"a": (100.0, 3.0), "b": (10.0, 1.0)}
    assert compare(base, {"a": 102.9, "b": 10.0})[0], "within tolerance passes"
    assert not compare(base, {"a": 103.1, "b": 10.0})[0], "past tolerance fails"
    assert compare(base, {"a": 50.0, "b": 10.0})[0], "better passes"
    assert "lower the baseline" in "".join(compare(base, {"a": 50.0, "b": 10.0})[1])
    assert not compare(base, {"a": 100.0})[0], "a figure not measured fails"
    assert not compare(base, {"a": 100.0, "b": 10.0, "c": 1.0})[0], "a figure with no baseline fails"
    with tempfile.NamedTemporaryFile("w+", suffix=".txt") as f:
        f.write("# head\na 100.0 3  # why\nb 10.0 1\n")
        f.flush()
        _, lines = read_baseline(f.name)
        write_baseline(f.name, lines, {"a": 90.0, "b": 11.0})
        f.seek(0)
        assert f.read() == "# head\na 90.0 3  # why\nb 11.0 1\n", "update keeps tolerances and comments"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lockgate", required=True, help="the lockgate binary (a release build)")
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--valkey", required=True,
                    help="a valkey-server 9.1 (lockgate takes its native MSETEX there)")
    ap.add_argument("--update", action="store_true", help="rewrite the baseline's values")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--keep", action="store_true",
                    help="keep the temp dir: logs and each phase's profile (callgrind_annotate)")
    args = ap.parse_args()
    self_test()
    random.seed(args.seed)
    for tool in ("valgrind", "callgrind_control", "redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            raise SystemExit(f"gate: {tool} not found")
    base, lines = read_baseline(args.baseline)
    tmp = tempfile.mkdtemp(prefix="lockgate-gate.")
    procs = Procs(tmp)
    figures, notes = {}, []
    started = time.monotonic()
    try:
        measure_instructions(procs, args, figures)
        measure_redis(procs, args, figures, notes)
        measure_redis(procs, args, figures, notes, args.valkey, "valkey")
        measure_commands(procs, args, figures)
    finally:
        procs.stop_all()
        if args.keep:
            log(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    ok, report = compare(base, figures)
    print("\n".join(report + notes))
    print(f"(gate: {time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.2f})")
    if args.update:
        write_baseline(args.baseline, lines, figures)
        log(f"baseline written: {args.baseline} (commit it with a 'Baseline:' reason)")
        return 0
    if not ok:
        log("a figure is worse than the baseline by more than its tolerance; if the change "
            "is meant, run bench/gate.sh --update and commit the baseline with the reason "
            "in a 'Baseline:' line of the message")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
