#!/usr/bin/env python3
"""Records the seed corpus of the fuzz targets from real traffic.

    python3 fuzz/seed/record.py OUT_DIR

Starts a private redis-server on a unix socket, puts a relay in front of it
that writes down every byte each side sends, and drives it with
redis-benchmark (multibulk, pipelined), redis-cli, inline commands and a
raw RESP2/RESP3 session (HELLO 3, maps, sets, pushes from SUBSCRIBE,
attributes when the server sends them, big numbers, doubles, verbatim
strings). What clients sent lands in OUT_DIR/request, router and lock_ops;
what Redis answered in OUT_DIR/reply. Each file is one short conversation,
prefixed by one selector byte (see the targets). scripts/fuzz-corpus.sh
runs this and replaces fuzz/corpus.
"""

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

MAX_FILE = 8 * 1024


def wait_for(path, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(path):
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                s.close()
                return
            except OSError:
                pass
        time.sleep(0.05)
    sys.exit(f"record.py: nothing listens on {path}")


class Relay:
    """Accepts clients on `listen`, connects each to `upstream`, and keeps
    what went each way, per connection."""

    def __init__(self, listen, upstream):
        self.upstream = upstream
        self.conversations = []
        self.lock = threading.Lock()
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(listen)
        self.server.listen(64)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            up = socket.socket(socket.AF_UNIX)
            up.connect(self.upstream)
            conv = {"sent": bytearray(), "replied": bytearray()}
            with self.lock:
                self.conversations.append(conv)
            for src, dst, key in ((client, up, "sent"), (up, client, "replied")):
                threading.Thread(target=self.pump, args=(src, dst, conv[key]), daemon=True).start()

    @staticmethod
    def pump(src, dst, log):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            log.extend(data)
            try:
                dst.sendall(data)
            except OSError:
                return


def raw_session(path, payload, settle=0.3):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(payload)
    time.sleep(settle)
    s.close()


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    for tool in ("redis-server", "redis-cli", "redis-benchmark"):
        if shutil.which(tool) is None:
            sys.exit(f"record.py: {tool} not found")
    tmp = tempfile.mkdtemp(prefix="lockgate-corpus-")
    redis_sock = os.path.join(tmp, "redis.sock")
    relay_sock = os.path.join(tmp, "relay.sock")
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", redis_sock, "--save", "",
         "--appendonly", "no", "--dir", tmp, "--enable-debug-command", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(redis_sock)
        relay = Relay(relay_sock, redis_sock)
        cli = ["redis-cli", "-s", relay_sock]
        subprocess.run(["redis-benchmark", "-s", relay_sock, "-t", "set,get,lpush,mset",
                        "-n", "50", "-P", "4", "-c", "2", "-q"],
                       stdout=subprocess.DEVNULL, check=True)
        for args in (["SET", "lock:a", "token-1", "NX", "PX", "30000"],
                     ["SETNX", "lock:b", "1"], ["GET", "lock:a"], ["PTTL", "lock:a"],
                     ["EXPIRE", "lock:b", "10"], ["GETSET", "lock:b", "2"],
                     ["DEL", "lock:a", "user:1"], ["SET", "user:1", "x", "EX", "5", "GET"],
                     ["HSET", "h", "f", "v"], ["SADD", "s", "a", "b"], ["ZADD", "z", "1.5", "m"],
                     ["EVAL", "return {1,'two',3.5}", "0"], ["MULTI"], ["INCRBYFLOAT", "f", "1.25"],
                     ["CLIENT", "REPLY", "ON"], ["LOCKGATE", "UNMATCHED"], ["PERSIST", "lock:b"]):
            subprocess.run(cli + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Inline commands, as telnet and redis-cli's raw mode send them.
        raw_session(relay_sock, b"PING\r\nSET lock:c \"a b\\x41\" NX PX 100\r\n"
                                b"GET 'it\\'s'\r\n  \r\nSETNX lock:d 1\nDEL lock:c lock:d\r\n")
        # RESP3: maps, sets, doubles, big numbers, verbatim strings, nulls,
        # booleans, attributes (DEBUG PROTOCOL), pushes from SUBSCRIBE.
        resp3 = [b"HELLO 3", b"HGETALL h", b"SMEMBERS s", b"ZSCORE z m", b"CONFIG GET maxmemory*",
                 b"DEBUG PROTOCOL bignum", b"DEBUG PROTOCOL double", b"DEBUG PROTOCOL verbatim",
                 b"DEBUG PROTOCOL null", b"DEBUG PROTOCOL true", b"DEBUG PROTOCOL false",
                 b"DEBUG PROTOCOL map", b"DEBUG PROTOCOL set", b"DEBUG PROTOCOL attrib",
                 b"DEBUG PROTOCOL push", b"CLIENT TRACKING on", b"GET user:1", b"SET user:1 y",
                 b"SUBSCRIBE ch1 ch2", b"PING", b"UNSUBSCRIBE", b"RESET"]
        resp2 = [b"DEBUG PROTOCOL bignum", b"DEBUG PROTOCOL map", b"DEBUG PROTOCOL attrib",
                 b"GET nokey", b"LRANGE mylist 0 3", b"SUBSCRIBE ch1", b"PSUBSCRIBE p*", b"PING"]
        for hello, cmds in ((b"HELLO 3\r\n", resp3), (b"", resp2)):
            for cmd in cmds:
                raw_session(relay_sock, hello + cmd + b"\r\n", settle=0.05)
            raw_session(relay_sock, b"".join(c + b"\r\n" for c in cmds), settle=0.5)
        # A publish to the subscribers of a session still open.
        sub = socket.socket(socket.AF_UNIX)
        sub.connect(relay_sock)
        sub.sendall(b"HELLO 3\r\nSUBSCRIBE news\r\n")
        time.sleep(0.2)
        subprocess.run(cli + ["PUBLISH", "news", "hello\r\nworld"], stdout=subprocess.DEVNULL)
        time.sleep(0.3)
        sub.close()
        time.sleep(0.3)
    finally:
        server.terminate()
        server.wait()
    for target in ("request", "reply", "router", "lock_ops"):
        os.makedirs(os.path.join(out, target), exist_ok=True)
    written = 0
    with relay.lock:
        conversations = list(relay.conversations)
    for conv in conversations:
        for key, targets in (("sent", ("request", "router", "lock_ops")), ("replied", ("reply",))):
            data = bytes(conv[key])[:MAX_FILE]
            if not data:
                continue
            for target in targets:
                # Selector bytes: request 0 (small limits) and 1 (defaults);
                # reply 0 (RESP2 decoder) and 1 (RESP3); router 0 (a plain
                # session) and a second view byte; lock_ops takes no selector.
                variants = {"request": [b"\x00", b"\x01"], "reply": [b"\x00", b"\x01"],
                            "router": [b"\x00\x00", b"\x40\x00"], "lock_ops": [b""]}[target]
                for prefix in variants:
                    body = prefix + data
                    name = hashlib.sha1(body).hexdigest()
                    with open(os.path.join(out, target, name), "wb") as f:
                        f.write(body)
                    written += 1
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"record.py: {written} files from {len(conversations)} connections in {out}")


if __name__ == "__main__":
    main()
