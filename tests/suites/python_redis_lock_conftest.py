"""python-redis-lock's own tests, through lockgate (scripts/library-suites.sh).

Installed as the suite's tests/conftest.py in place of its own for the runs
through lockgate; the direct run keeps the suite's own. The suite's fixture
starts one redis-server per test, listening only on a unix socket
(`redis_socket`), which every test and its helper processes connect to. Here
the same server listens on a free loopback port instead, lockgate (the binary
in $LOCKGATE_BIN, config in $LOCKGATE_CONFIG) stands in front of it on a port
of its own choosing, and socat relays the unix socket the tests connect to
into lockgate's port: lockgate listens on TCP only, and socat moves bytes
without reading them. Everything else the tests do is theirs.
"""

import os
import re
import socket
import subprocess
import time

import pytest
from process_tests import TestProcess
from process_tests import wait_for_strings

BOUND = re.compile(r"lockgate ready.*?listen=(\d+\.\d+\.\d+\.\d+:\d+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _await(what, check, seconds=15.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.02)
    raise RuntimeError(f"{what} not ready within {seconds} s")


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def redis_socket(tmp_path):
    return str(tmp_path.joinpath('redis.sock'))


@pytest.fixture
def redis_server(tmp_path, redis_socket):
    port = _free_port()
    with TestProcess(
        'redis-server', '--bind', '127.0.0.1', '--port', str(port), '--save', '', '--appendonly', 'yes',
        '--dir', tmp_path,
    ) as redis_server:
        wait_for_strings(redis_server.read, 2, 'Ready to accept connections')
        log = open(tmp_path / 'lockgate.log', 'w+b')
        lockgate = subprocess.Popen(
            [os.environ['LOCKGATE_BIN'], '--config', os.environ['LOCKGATE_CONFIG'], '--listen', '127.0.0.1:0',
             '--upstream', f'127.0.0.1:{port}', '--admin-listen', ''],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        relay = None
        try:
            def bound():
                if lockgate.poll() is not None:
                    raise RuntimeError(f'lockgate exited: {(tmp_path / "lockgate.log").read_text()}')
                found = BOUND.search(ANSI.sub('', (tmp_path / 'lockgate.log').read_text()))
                return found and found.group(1)

            listen = _await('lockgate', bound)
            relay = subprocess.Popen(
                ['socat', f'UNIX-LISTEN:{redis_socket},fork,unlink-early', f'TCP:{listen}'],
                stdin=subprocess.DEVNULL,
            )
            _await('socat', lambda: os.path.exists(redis_socket))
            yield redis_server
        finally:
            if relay is not None:
                _stop(relay)
            _stop(lockgate)
            log.close()
