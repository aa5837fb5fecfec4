"""The transports run unchanged as 2 processes x 4 CPU devices through JAX's multi-controller
runtime (jax.distributed + gloo collectives), matching the dense reference; and the memory
check before a run's first step takes the fullest device of any process on every process. One pair of
processes checks every transport (starting them costs more than a transport); each test reads
its transport's verdict."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import multiprocess_env

WORKER = Path(__file__).with_name("mp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KINDS = ("pooled_wave", "pooled_global", "ragged", "preflight")


@pytest.fixture(scope="module")
def outputs() -> list[tuple[int, str]]:
    """Each process's (exit status, output) of one run of every transport."""
    port = str(free_port())
    env = multiprocess_env(4)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), "2", port, ",".join(KINDS)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process run timed out")
        outs.append((p.returncode, out))
    return outs


@pytest.mark.parametrize("kind", KINDS)
def test_transport_across_two_processes(kind, outputs):
    for i, (status, out) in enumerate(outputs):
        assert status == 0, f"process {i} failed:\n{out[-3000:]}"
        line = f"process {i} {kind}: devices 8 local 4 "
        verdict = [x for x in out.splitlines() if x.startswith(line)]
        assert verdict and verdict[0].endswith(" ok"), f"process {i}, {kind}:\n{out[-3000:]}"
