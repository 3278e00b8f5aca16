"""The fixtures pottery's own Redlock tests ask for (scripts/library-suites.sh).

pottery's source distribution ships its tests without the conftest.py that
gives them a Redis: this one does, for `tests/test_redlock.py` and
`tests/test_aioredlock.py`. `redis` and `aioredis` are clients of
$SUITE_REDIS_URL (straight on Redis, or lockgate in front of it), database 0
named in the URL (a test reads it from the connection's arguments), emptied
before and after each test as a fresh server would be.
"""

import os

import pytest
import pytest_asyncio
from redis import Redis
from redis.asyncio import Redis as AIORedis

URL = os.environ["SUITE_REDIS_URL"]


@pytest.fixture
def redis():
    client = Redis.from_url(URL, socket_timeout=10)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest_asyncio.fixture
async def aioredis():
    client = AIORedis.from_url(URL, socket_timeout=10)
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()
