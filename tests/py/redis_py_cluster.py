"""redis-py's cluster client, unmodified, through lockgate in front of a
Redis Cluster: usage: redis_py_cluster.py HOST PORT.

RedisCluster asks lockgate for the cluster's layout, is told of one node
(lockgate) serving every slot, and sends everything there; lockgate routes
each command to the node that serves it. Exits 0 and prints
"redis-py cluster OK" when every step worked. Every socket has a timeout.
"""

import sys

import redis
from redis.cluster import RedisCluster

HOST = sys.argv[1]
PORT = int(sys.argv[2])
T = 5  # seconds, for every socket operation

rc = RedisCluster(
    host=HOST,
    port=PORT,
    socket_timeout=T,
    socket_connect_timeout=T,
    decode_responses=True,
)
nodes = rc.get_nodes()
assert len(nodes) == 1, nodes
assert nodes[0].port == PORT, nodes

# Keys spread over every slot range of the cluster behind.
for i in range(200):
    assert rc.set(f"py:c:{i}", i)
assert [rc.get(f"py:c:{i}") for i in range(0, 200, 20)] == [str(i) for i in range(0, 200, 20)]
assert rc.mget_nonatomic([f"py:c:{i}" for i in range(5)]) == [str(i) for i in range(5)]
assert rc.delete("py:c:0", "py:c:1", "nope") == 2

# A pipeline (redis-py groups it per node: here all to lockgate).
pipe = rc.pipeline()
for i in range(50):
    pipe.incr(f"py:n:{i}")
assert pipe.execute() == [1] * 50

# Hash-tagged keys in one slot: a transaction-free multi-key command.
assert rc.mset({"{t}a": "1", "{t}b": "2"})
assert rc.mget("{t}a", "{t}b") == ["1", "2"]

# redis-py's own lock (SET NX PX, released by a Lua script on its key):
# through lockgate's lock room, on the node that serves the key.
lock = rc.lock("py:lock:order:1", timeout=10)
assert lock.acquire(blocking=False)
assert not rc.lock("py:lock:order:1", timeout=10).acquire(blocking=False)
lock.release()
assert rc.exists("py:lock:order:1") == 0

print("redis-py cluster OK")
