"""A local multi-process run listens on the loopback address only; a run over several machines says on
stderr what it exposes (docs/decisions.md item 113). Read from the process's own listening sockets
(/proc/net/tcp, tcp6), with the engine started as `attnkit train --processes` starts it (world of one)."""

import ipaddress
import os
import socket
import subprocess
import sys

import keras
import pytest

BACKEND = keras.backend.backend()
SCRIPT = r"""
import os, socket, sys
from attnkit.distributed.engines import start_engine

def listening():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    if width == 4:
                        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                    else:
                        host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                    found.append(f"{host} {int(port, 16)}")
    return found

host, port = sys.argv[1], int(sys.argv[2])
engine = start_engine(os.environ["KERAS_BACKEND"], 0, 1, host, port, 30)
print("\n".join(listening()), flush=True)
engine.close()
"""


def _loopback(host):
    address = ipaddress.ip_address(host)
    return address.is_loopback or (address.version == 6 and address.ipv4_mapped is not None
                                   and address.ipv4_mapped.is_loopback)  # ::ffff:127.0.0.1


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(host):
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = dict(os.environ, KERAS_BACKEND=BACKEND, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    env.pop("TF_CONFIG", None)
    port = _free_port()
    run = subprocess.run([sys.executable, "-c", SCRIPT, host, str(port)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return port, [line.split() for line in run.stdout.splitlines()], run.stderr


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the sockets from /proc/net")
def test_a_local_run_listens_on_loopback_only():
    port, sockets, stderr = _start("127.0.0.1")
    if BACKEND == "tensorflow":
        # tensorflow's gRPC server has no bind-address setting: it says what it exposes.
        assert f"attnkit: tensorflow's gRPC server (worker 0) listens on *:{port}, unauthenticated" in stderr
        return
    assert [host for host, p in sockets if int(p) == port], sockets  # the coordinator is among them
    assert all(_loopback(host) for host, _ in sockets), sockets
    assert "listens on" not in stderr


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the sockets from /proc/net")
def test_a_run_over_machines_says_what_it_exposes():
    port, sockets, stderr = _start(socket.gethostname())
    assert f"listens on *:{port}, unauthenticated: any machine that reaches this one can connect" in stderr
