"""The release scripts of the installed lock libraries, exactly as they send
them (tests/it/locks_library_release.rs checks that lockgate recognises
each): one JSON object, library name -> script body.

Usage: library_release_bodies.py
"""

import json

import redis
from pottery import Redlock
from redis.lock import Lock

# pottery registers its scripts on its first lock's master; no connection
# is made.
Redlock(key="bodies", masters={redis.Redis()})
print(json.dumps({
    "redis-py": Lock.LUA_RELEASE_SCRIPT,
    "pottery": Redlock._release_script.script,
}))
