#!/usr/bin/env python3
"""Adds traffic from Redis's own tcl test suite to the fuzz targets' seed corpus.

    python3 fuzz/seed/record_suite.py SUITE_SRC OUT_DIR [UNIT...]

SUITE_SRC is an unpacked Redis source tree (its `runtest` and `tests/`;
scripts/redis-suite.sh --fetch leaves the installed version's in
target/redis-suite/redis-VERSION). Its runtest and tests/ are copied to a
scratch directory (the suite writes into tests/tmp), a private redis-server
is started on a free loopback TCP port (external mode needs TCP) behind a
relay on another free loopback port that writes down every byte each side
sends, and each unit runs through the relay in external mode
(`runtest --host --port --singledb`, without the tags scripts/redis-suite.sh
denies, and without its long loops), one client at a time, each unit
within UNIT_TIMEOUT seconds. A unit that fails or times out still leaves
what it sent.

Both streams of every connection are cut at frame boundaries into slices of
at most SLICE_FRAMES frames and MAX_FILE bytes (a longer frame is cut short:
a torn frame is an input too). What clients sent seeds request, router and
lock_ops; what Redis answered seeds reply. To keep the corpus small and
varied, one slice is kept per (first command name, inline or not, size
bucket) for clients and per (sequence of frame types, size bucket) for
Redis, taken round-robin over command names (type sequences), smallest
first, until MAX_FILES files or MAX_BYTES bytes per target. Each slice is written once
per target, prefixed by one of that target's selectors (record.py's, picked
by the slice's hash; RESP3 replies get the RESP3 decoder), named by the
SHA-1 of the file like record.py's. OUT_DIR/suite-files lists what was
written, as target/name lines.
"""

import hashlib
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

MAX_FILE = 8 * 1024
SLICE_FRAMES = 4
MAX_FILES = 300
MAX_BYTES = 340 * 1024
UNIT_TIMEOUT = 240

UNITS = ["unit/protocol", "unit/keyspace", "unit/scan", "unit/type/incr",
         "unit/type/string", "unit/type/list", "unit/type/hash", "unit/type/set",
         "unit/type/zset", "unit/type/stream", "unit/sort", "unit/expire",
         "unit/multi", "unit/pubsub", "unit/scripting", "unit/functions",
         "unit/bitops", "unit/geo", "unit/hyperloglog", "unit/tracking"]

# As scripts/redis-suite.sh: what cannot pass against a server the suite did
# not start, or takes long.
DENY_TAGS = ["needs:repl", "needs:debug", "needs:pfdebug", "needs:save",
             "needs:config-maxmemory", "needs:config-resetstat", "needs:latency",
             "needs:local-process", "large-memory", "slow"]

# As scripts/redis-suite.sh: loops of thousands of round trips, for time.
SKIP_TESTS = ["/^Fuzzing dense/sparse encoding", "/^Stress tester for #3343-alike bugs",
              "/^GEOSEARCH fuzzy test", "XRANGE fuzzing", "SCAN regression test for issue #4906"]

# record.py's selectors: request 0 (small limits) and 1 (defaults); reply 0
# (RESP2 decoder) and 1 (RESP3); router a session-view byte (0x40: quorum
# mode) and a db byte; lock_ops none.
SELECTORS = {"request": [b"\x00", b"\x01"], "reply": [b"\x00", b"\x01"],
             "router": [b"\x00\x00", b"\x40\x00"], "lock_ops": [b""]}
# A line starting with a type only RESP3 has (possibly inside a bulk string:
# then the RESP3 decoder reads RESP2, which it also does).
RESP3_LINE = re.compile(rb"(?:^|\r\n)[%~_,#(=>|!]")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, proc, timeout=15.0):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit("record_suite.py: redis-server exited during startup")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    sys.exit(f"record_suite.py: nothing listens on 127.0.0.1:{port}")


class Relay:
    """record.py's relay over TCP: accepts clients on a loopback port,
    connects each to `upstream`, keeps what went each way per connection."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.conversations = []
        self.lock = threading.Lock()
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.server.listen(128)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            conv = {"sent": bytearray(), "replied": bytearray()}
            with self.lock:
                self.conversations.append(conv)
            for src, dst, key in ((client, up, "sent"), (up, client, "replied")):
                threading.Thread(target=self.pump, args=(src, dst, conv[key], self.lock),
                                 daemon=True).start()

    @staticmethod
    def pump(src, dst, log, lock):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                    try:
                        sock.shutdown(how)
                    except OSError:
                        pass
                return
            with lock:
                log.extend(data)
            try:
                dst.sendall(data)
            except OSError:
                # The other side is gone: reset this one too, so that a
                # client still writing (the protocol unit's desync test)
                # sees its writes fail, as it would talking to Redis.
                for sock in (dst, src):
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                src.close()
                return


# --- frames --------------------------------------------------------------


def line_end(buf, i):
    j = buf.find(b"\r\n", i)
    return -1 if j < 0 else j + 2


def reply_frame(buf, i, depth=0):
    """End of the reply frame at i, or -1 when incomplete or not RESP."""
    if i >= len(buf) or depth > 64:
        return -1
    t = buf[i]
    e = line_end(buf, i)
    if e < 0:
        return -1
    if t in b"+-:_,#(":
        return e
    try:
        n = int(buf[i + 1:e - 2])
    except ValueError:
        return -1
    if t in b"$=!":
        if n < 0:
            return e
        end = e + n + 2
        return end if end <= len(buf) else -1
    if t in b"*~%>|":
        if n < 0:
            return e
        if t in b"%|":
            n *= 2
        j = e
        for _ in range(n):
            j = reply_frame(buf, j, depth + 1)
            if j < 0:
                return -1
        # An attribute annotates the frame after it: one frame together.
        return reply_frame(buf, j, depth + 1) if t == ord("|") else j
    return -1


def request_frame(buf, i):
    """(end, command name, inline) of the request at i; end -1 when
    incomplete or malformed."""
    if buf[i] != ord("*"):
        j = buf.find(b"\n", i)
        if j < 0:
            return -1, b"", True
        words = buf[i:j].split()
        return j + 1, (words[0].upper() if words else b""), True
    e = line_end(buf, i)
    if e < 0:
        return -1, b"", False
    try:
        n = int(buf[i + 1:e - 2])
    except ValueError:
        return -1, b"", False
    j, name = e, b""
    for k in range(max(n, 0)):
        if j >= len(buf) or buf[j] != ord("$"):
            return -1, b"", False
        le = line_end(buf, j)
        try:
            size = int(buf[j + 1:le - 2]) if le > 0 else -1
        except ValueError:
            size = -1
        if size < 0 or le + size + 2 > len(buf):
            return -1, b"", False
        if k == 0:
            name = bytes(buf[le:le + size]).upper()
        j = le + size + 2
    return j, name, False


def slices(buf, frame):
    """Cuts buf into slices of whole frames: (bytes, [frame infos])."""
    out, i, start, infos = [], 0, 0, []
    while i < len(buf):
        end, info = frame(buf, i)
        if end < 0:
            break
        if infos and (len(infos) == SLICE_FRAMES or end - start > MAX_FILE - 2):
            out.append((bytes(buf[start:i]), infos))
            start, infos = i, []
        infos.append(info)
        i = end
        if end - start > MAX_FILE - 2:
            # One frame longer than a file: cut short.
            out.append((bytes(buf[start:start + MAX_FILE - 2]), infos))
            start, infos = i, []
    if infos:
        out.append((bytes(buf[start:i]), infos))
    if i < len(buf) and len(buf) - i <= MAX_FILE - 2:
        # The unparsed tail (a torn or malformed frame) as it came.
        out.append((bytes(buf[i:]), [None]))
    return out


def req_info(buf, i):
    end, name, inline = request_frame(buf, i)
    return end, (name[:32], inline)


def rep_info(buf, i):
    return reply_frame(buf, i), buf[i]


def pick(cands, group):
    """One slice per key (the first seen), then round-robin over groups,
    smallest first, within the budget."""
    by_key = {}
    for body, key in cands.items():
        by_key.setdefault(key, body)
    by_group = {}
    for key, body in sorted(by_key.items(), key=lambda kv: (len(kv[1]), kv[1])):
        by_group.setdefault(group(key), []).append(body)
    chosen, size, rnd = [], 0, 0
    while len(chosen) < MAX_FILES:
        added = False
        for g in sorted(by_group):
            bodies = by_group[g]
            if rnd < len(bodies) and len(chosen) < MAX_FILES \
                    and size + len(bodies[rnd]) + 2 <= MAX_BYTES:
                chosen.append(bodies[rnd])
                size += len(bodies[rnd]) + 2
                added = True
        if not added and all(rnd >= len(b) for b in by_group.values()):
            break
        rnd += 1
    return chosen


def bucket(n):
    return n.bit_length()


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    src, out, units = sys.argv[1], sys.argv[2], sys.argv[3:] or UNITS
    if not os.path.isfile(os.path.join(src, "tests", "test_helper.tcl")):
        sys.exit(f"record_suite.py: no Redis test suite in {src}")
    for tool in ("redis-server", "tclsh"):
        if shutil.which(tool) is None:
            sys.exit(f"record_suite.py: {tool} not found")
    tmp = tempfile.mkdtemp(prefix="lockgate-suite-corpus-")
    suite = os.path.join(tmp, "suite")
    os.makedirs(suite)
    shutil.copy2(os.path.join(src, "runtest"), suite)
    shutil.copytree(os.path.join(src, "tests"), os.path.join(suite, "tests"),
                    ignore=shutil.ignore_patterns("tmp"))
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no", "--dir", tmp, "--logfile", os.path.join(tmp, "redis.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, server)
        relay = Relay(port)
        tags = " ".join("-" + t for t in DENY_TAGS)
        for unit in units:
            t0 = time.time()
            log = os.path.join(tmp, unit.replace("/", "_") + ".log")
            with open(log, "wb") as f:
                run = subprocess.Popen(
                    ["./runtest", "--host", "127.0.0.1", "--port", str(relay.port),
                     "--singledb", "--single", unit, "--tags", tags, "--timeout", "30",
                     "--clients", "1", "--baseport", str(random.randrange(24000, 29800)),
                     "--portcount", "200"]
                    + [arg for t in SKIP_TESTS for arg in ("--skiptest", t)],
                    cwd=suite, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                    start_new_session=True)
                try:
                    run.wait(timeout=UNIT_TIMEOUT)
                    how = "passed" if run.returncode == 0 else f"exit {run.returncode}"
                except subprocess.TimeoutExpired:
                    os.killpg(run.pid, 15)
                    run.wait()
                    how = f"stopped after {UNIT_TIMEOUT}s"
                except BaseException:
                    # Interrupted: runtest and its test clients go too.
                    os.killpg(run.pid, 15)
                    raise
            with open(log, "rb") as f:
                text = re.sub(rb"\x1b\[[0-9;]*m", b"", f.read())
            lines = text.splitlines()
            if run.returncode != 0:
                shown = list(dict.fromkeys(
                    line for line in lines
                    if line.startswith((b"[err]", b"[exception]", b"[TIMEOUT]"))))
                sys.stderr.buffer.write(b"".join(
                    b"    " + line + b"\n" for line in shown or lines[-3:]))
            ok = sum(line.startswith(b"[ok]: ") for line in lines)
            # A failed test is named twice: when it fails and at the end.
            err = len({line for line in lines if line.startswith(b"[err]: ")})
            print(f"record_suite.py: {unit}: {ok} ok, {err} err, {how}, "
                  f"{time.time() - t0:.0f}s", file=sys.stderr)
        time.sleep(0.5)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    with relay.lock:
        conversations = [(bytes(c["sent"]), bytes(c["replied"])) for c in relay.conversations]

    requests, replies = {}, {}
    for sent, replied in conversations:
        for body, infos in slices(sent, req_info):
            first = infos[0] or (b"?", False)
            requests.setdefault(body, (first[0], first[1], bucket(len(body))))
        for body, infos in slices(replied, rep_info):
            types = bytes(t for t in infos if t is not None) or b"?"
            replies.setdefault(body, (types, bucket(len(body))))
    chosen = {
        "request": pick(requests, lambda k: k[0]),
        "reply": pick(replies, lambda k: k[0]),
    }
    chosen["router"] = chosen["lock_ops"] = chosen["request"]
    listing = []
    for target, bodies in chosen.items():
        os.makedirs(os.path.join(out, target), exist_ok=True)
        size = 0
        for body in bodies:
            h = hashlib.sha1(body).digest()[0]
            variants = SELECTORS[target]
            if target == "reply" and RESP3_LINE.search(body):
                prefix = b"\x01"
            else:
                prefix = variants[h % len(variants)]
            data = prefix + body
            name = hashlib.sha1(data).hexdigest()
            with open(os.path.join(out, target, name), "wb") as f:
                f.write(data)
            listing.append(f"{target}/{name}")
            size += len(data)
        print(f"record_suite.py: {target}: {len(bodies)} files, {size} bytes "
              f"(from {len(requests if target != 'reply' else replies)} distinct slices)",
              file=sys.stderr)
    with open(os.path.join(out, "suite-files"), "w") as f:
        f.write("".join(sorted(line + "\n" for line in listing)))
    print(f"record_suite.py: {len(listing)} files from {len(conversations)} connections "
          f"and {len(units)} units in {out}")


if __name__ == "__main__":
    main()
