"""redis-py, unmodified, through lockgate: usage: redis_py_smoke.py HOST PORT.

Exits 0 and prints "redis-py smoke OK" when every step worked; any failed
assertion or exception exits non-zero with a traceback. Every socket has a
timeout so a hang through the proxy fails instead of blocking.
"""

import sys
import time

import redis

HOST = sys.argv[1]
PORT = int(sys.argv[2])
T = 5  # seconds, for every socket operation


def client(**kw):
    return redis.Redis(
        host=HOST,
        port=PORT,
        socket_timeout=T,
        socket_connect_timeout=T,
        decode_responses=True,
        **kw,
    )


def wait_message(ps, kind):
    deadline = time.monotonic() + T
    while time.monotonic() < deadline:
        msg = ps.get_message(timeout=0.5)
        if msg is not None and msg["type"] == kind:
            return msg
    raise AssertionError(f"no {kind} message within {T} s")


def step(name):
    print(f"step: {name}", flush=True)


# redis-py 8 speaks RESP3 by default (HELLO 3 on connect); ask for RESP2
# explicitly here, RESP3 further down.
r = client(protocol=2)
step("ping/set/get")
assert r.ping() is True
assert str(r.client_info()["resp"]) == "2"
assert r.set("py:k", "v") is True
assert r.get("py:k") == "v"
assert r.get("py:missing") is None
assert r.set("py:nx", "1", nx=True, px=10_000) is True
assert r.set("py:nx", "2", nx=True) is None
assert r.delete("py:k", "py:nx") == 2

step("pipeline without transaction")
p = r.pipeline(transaction=False)
for i in range(200):
    p.set(f"py:n:{i}", i)
p.get("py:n:42")
p.incr("py:ctr")
p.lrange("py:nolist", 0, -1)
out = p.execute()
assert out[:200] == [True] * 200, out[:5]
assert out[200:] == ["42", 1, []], out[200:]

step("error inside a pipeline")
p = r.pipeline(transaction=False)
p.set("py:str", "x")
p.lpush("py:str", "y")
p.get("py:str")
out = p.execute(raise_on_error=False)
assert out[0] is True and isinstance(out[1], redis.ResponseError) and out[2] == "x", out

step("transaction with WATCH")
with r.pipeline() as p:
    p.watch("py:ctr")
    cur = int(p.get("py:ctr"))
    p.multi()
    p.set("py:ctr", cur + 10)
    p.get("py:ctr")
    assert p.execute() == [True, "11"]

step("WATCH conflict aborts the transaction")
with r.pipeline() as p:
    p.watch("py:ctr")
    client().set("py:ctr", 100)  # another connection changes the key
    p.multi()
    p.incr("py:ctr")
    try:
        p.execute()
        raise AssertionError("EXEC should have failed after the WATCHed key changed")
    except redis.WatchError:
        pass
assert r.get("py:ctr") == "100"

step("pub/sub (RESP2)")
ps = r.pubsub()
ps.subscribe("py:ch")
wait_message(ps, "subscribe")
assert r.publish("py:ch", "hello") == 1
msg = wait_message(ps, "message")
assert msg["channel"] == "py:ch" and msg["data"] == "hello", msg
ps.psubscribe("py:p*")
wait_message(ps, "psubscribe")
assert r.publish("py:pat", "x") == 1
msg = wait_message(ps, "pmessage")
assert msg["pattern"] == "py:p*" and msg["data"] == "x", msg
ps.close()

step("RESP3 client (HELLO 3)")
r3 = client(protocol=3)
assert r3.ping() is True
info = r3.client_info()
assert str(info["resp"]) == "3", info
assert r3.hset("py:h", mapping={"a": "1", "b": "2"}) == 2
assert r3.hgetall("py:h") == {"a": "1", "b": "2"}
assert r3.get("py:missing") is None
assert r3.smembers("py:noset") == set()
p = r3.pipeline()
p.hgetall("py:h")
p.incr("py:ctr")
assert p.execute() == [{"a": "1", "b": "2"}, 101]

step("pub/sub (RESP3 push frames)")
ps3 = r3.pubsub()
ps3.subscribe("py:ch3")
wait_message(ps3, "subscribe")
assert r3.publish("py:ch3", "hi") == 1
msg = wait_message(ps3, "message")
assert msg["data"] == "hi", msg
ps3.close()
assert r3.get("py:n:7") == "7"

step("blocking command")
assert r.blpop(["py:nolist"], timeout=1) is None
r.rpush("py:list", "a")
assert tuple(r.blpop(["py:list"], timeout=1)) == ("py:list", "a")

r.close()
r3.close()
print("redis-py smoke OK", redis.__version__, flush=True)
