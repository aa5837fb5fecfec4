"""Several processes, one program: JAX's multi-controller runtime.

Every process runs the same ``moelab train``; the mesh spans the devices of all of them and the
jitted step's collectives cross process boundaries (NCCL on GPU, gloo on CPU). Each process
computes the same global batch on the host and hands each of its local devices only its own
shard. Process 0 alone writes the run folder (config, metrics, summary); checkpoints are written
by all of them together through orbax.
"""

from __future__ import annotations

import socket
import time

import jax
import numpy as np

from moelab.util import info

COORDINATOR_TIMEOUT_S = 300  # jax.distributed.initialize's own initialization_timeout


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout: float | None = None) -> None:
    """Join the multi-controller runtime. With no arguments JAX detects the cluster (SLURM,
    Open MPI, Kubernetes, Cloud TPU); otherwise give all three. Must run before any JAX
    computation. A process other than 0 first waits up to ``timeout`` seconds for the
    coordinator to answer (JAX would abort natively when it never does); None: 300 s."""
    timeout = COORDINATOR_TIMEOUT_S if timeout is None else timeout
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError("--coordinator, --num-processes and --process-id go together: give all "
                         "three (or none, to let JAX detect the cluster)")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id}: must be in [0, {num_processes})")
    if coordinator is not None:
        check_coordinator(coordinator)
        if process_id != 0:  # process 0 starts the coordinator inside initialize
            wait_for_coordinator(coordinator, timeout)
    # CPU collectives across processes need gloo; the setting is ignored by GPU/TPU backends.
    collectives = jax.config.jax_cpu_collectives_implementation
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:  # a longer wait lengthens JAX's own; a shorter one never cuts process 0's wait
        wait = max(COORDINATOR_TIMEOUT_S, round(timeout))
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=wait)
    except ValueError as e:  # JAX found no cluster: "coordinator_address should be defined."
        jax.config.update("jax_cpu_collectives_implementation", collectives)
        if coordinator is not None:
            raise
        raise ValueError("--distributed: JAX detected no cluster to join (SLURM, Open MPI, "
                         f"Kubernetes, Cloud TPU) and says: {str(e).rstrip('.')}; elsewhere give "
                         "--coordinator HOST:PORT of process 0 with --num-processes and "
                         "--process-id") from e


def split_address(address: str) -> tuple[str, int | None]:
    """(host, port) of HOST:PORT or [IPv6]:PORT; port None when it is not a number."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return (host if sep else ""), (int(port) if port.isdigit() else None)


def check_coordinator(address: str) -> None:
    """Refuse a coordinator that is not HOST:PORT, with a port in 1-65535 and a host this
    machine resolves: JAX would wait minutes for it, then crash in native code."""
    host, port = split_address(address)
    fix = "give HOST:PORT of process 0, e.g. 10.0.0.1:8476"
    if not host or port is None or not 1 <= port <= 65535:
        raise ValueError(f"--coordinator {address}: not HOST:PORT with a port in 1-65535; {fix}")
    try:
        socket.getaddrinfo(host, port)
    except OSError as e:
        raise ValueError(f"--coordinator {address}: host {host!r} not found ({e.strerror}); "
                         f"{fix}") from None


def wait_for_coordinator(address: str, timeout: float, poll: float = 0.5) -> None:
    """Return once a TCP connection to the coordinator succeeds; refuse after ``timeout``
    seconds without one."""
    host, port = split_address(address)
    info(f"waiting up to {timeout:g} s for the coordinator {address} (process 0) to answer")
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))):
                return
        except OSError:
            if left <= poll:
                break
            time.sleep(poll)
    raise ValueError(f"--coordinator {address}: no answer within {timeout:g} s; start process 0 "
                     "(--process-id 0) with the same --coordinator, check HOST:PORT and that "
                     "the port is open to this host, or wait longer with --coordinator-timeout")


def is_main() -> bool:
    """The process that writes logs and files."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches this point (a no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def agree_any(flag: bool) -> bool:
    """True on every process if it is true on any (e.g. a stop signal seen by one of them)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))


def broadcast_str(text: str, length: int = 32) -> str:
    """Process 0's ``text`` (ASCII, at most ``length`` characters) on every process."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    buf = np.zeros(length, np.uint8)
    raw = text.encode("ascii")[:length]
    buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(out[out > 0].astype(np.uint8)).decode("ascii")
