"""Several processes, one program: JAX's multi-controller runtime.

Every process runs the same ``moelab train``; the mesh spans the devices of all of them and the
jitted step's collectives cross process boundaries (NCCL on GPU, gloo on CPU). Each process
computes the same global batch on the host and hands each of its local devices only its own
shard. Process 0 alone writes the run folder (config, metrics, summary); checkpoints are written
by all of them together through orbax. Before any work they check that they share the run folder
and were given the same config (``check_same_run``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import jax
import numpy as np

from moelab.util import first_missing, in_worker_thread, info, remove_made_parents

COORDINATOR_TIMEOUT_S = 300  # jax.distributed.initialize's own initialization_timeout
_options: dict = {}  # this process's --num-processes, compared with process 0's (check_same_run)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout: float | None = None) -> None:
    """Join the multi-controller runtime. With no arguments JAX detects the cluster (SLURM,
    Open MPI, Kubernetes, Cloud TPU); otherwise give all three. Must run before any JAX
    computation. A process other than 0 first waits up to ``timeout`` seconds for the
    coordinator to answer (JAX would abort natively when it never does); None: 300 s. Every
    process then waits at least 300 s for all to join, and ends with one line if they do not.
    Once joined, a collective that fails on an uncaught error (another process is gone) ends
    this process at once (``lost_peer``)."""
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
    # a longer wait lengthens JAX's own; a shorter one never cuts process 0's wait
    wait = max(COORDINATOR_TIMEOUT_S, round(timeout))
    if process_id == 0:
        info(f"waiting up to {wait} s for the other {num_processes - 1} process(es) to join at "
             f"{coordinator}")
    # JAX ends a process whose peers never join with a native crash: say why first and end
    watchdog = threading.Timer(wait, abandon, (_never_joined(coordinator, num_processes, wait),))
    watchdog.daemon = True
    watchdog.start()
    try:  # in a thread: the wait is native, and would hold Ctrl-C and SIGTERM until it ends
        in_worker_thread(lambda: jax.distributed.initialize(
            coordinator, num_processes=num_processes, process_id=process_id,
            initialization_timeout=wait + 30))
    except ValueError as e:  # JAX found no cluster: "coordinator_address should be defined."
        jax.config.update("jax_cpu_collectives_implementation", collectives)
        if coordinator is not None:
            raise
        raise ValueError("--distributed: JAX detected no cluster to join (SLURM, Open MPI, "
                         f"Kubernetes, Cloud TPU) and says: {str(e).rstrip('.')}; elsewhere give "
                         "--coordinator HOST:PORT of process 0 with --num-processes and "
                         "--process-id") from e
    finally:
        watchdog.cancel()
    _options["--num-processes"] = num_processes  # JAX keeps process 0's count: compared later
    sys.excepthook = functools.partial(_uncaught, sys.excepthook)


_LOST = re.compile(r"(?i)connection|peer|socket|unavailable|gloo|nccl")  # not, e.g., an OOM


def lost_peer_error(error: BaseException) -> BaseException | None:
    """The failed collective behind ``error`` (itself, or one it was raised from) when it
    failed because another process of several is gone; None otherwise."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen and jax.process_count() > 1:
        seen.add(id(error))
        if isinstance(error, jax.errors.JaxRuntimeError) and _LOST.search(str(error)):
            return error
        error = error.__cause__ or error.__context__
    return None


def _uncaught(previous, kind, error, trace) -> None:
    """A collective that failed because another process is gone: ``lost_peer``."""
    lost = lost_peer_error(error) if isinstance(error, BaseException) else None
    if lost is not None:
        lost_peer(lost)
    previous(kind, error, trace)


def _never_joined(coordinator: str | None, num_processes: int | None, wait: int) -> str:
    if coordinator is None:
        return f"the processes of this cluster did not all join within {wait} s"
    return (f"--coordinator {coordinator}: not all {num_processes} processes joined within "
            f"{wait} s; start each of --process-id 0..{num_processes - 1} once (a second "
            "process with one id ends the first), all with the same --coordinator and "
            "--num-processes, or wait longer with --coordinator-timeout")


def abandon(message: str, code: int = 2) -> None:
    """Say ``message`` (``moelab: error: ...``) and end this process now, without JAX's exit
    handlers: their shutdown barrier would wait minutes for a process that is gone, then crash
    natively."""
    try:
        print(f"moelab: error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
    except (OSError, ValueError):  # a console gone
        pass
    os._exit(code)


def lost_peer(error: Exception) -> None:
    """End a process of several whose collective with the others failed (another process died,
    was killed or became unreachable): one line instead of a traceback, then JAX's exit
    handlers' minutes of waiting for the lost process and their crash."""
    why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    abandon(f"process {jax.process_index()}: lost contact with another process of this run "
            f"({why}); see the other processes' output for why it stopped, then start every "
            "process again with the same command: the run resumes from its newest checkpoint", 1)


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
    return bool(processes_where(flag))


def broadcast_str(text: str, length: int = 32) -> str:
    """Process 0's ``text`` (ASCII, at most ``length`` characters) on every process."""
    return broadcast_bytes(text.encode("ascii")[:length]).decode("ascii")


def processes_where(flag: bool) -> list[int]:
    """The indices of the processes where ``flag`` is true, the same list on every process."""
    if jax.process_count() == 1:
        return [0] if flag else []
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.int32(bool(flag))))
    return [int(i) for i in np.flatnonzero(flags)]


def agree_signal(name: str | None) -> str | None:
    """The stop signal some process received (the lowest-numbered such process's), on every
    process; None when none did. A process stopped by another's signal reports that one."""
    if jax.process_count() == 1:
        return name
    from jax.experimental import multihost_utils

    code = signal.Signals[name].value if name else 0
    codes = np.asarray(multihost_utils.process_allgather(np.int32(code)))
    first = next((int(c) for c in codes.ravel() if c), 0)
    return signal.Signals(first).name if first else None


def broadcast_bytes(data: bytes) -> bytes:
    """Process 0's ``data``, of any length, on every process."""
    if jax.process_count() == 1:
        return data
    from jax.experimental import multihost_utils

    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(len(data)))))
    buf = np.zeros(max(size, 1), np.uint8)
    if is_main():
        buf[:size] = np.frombuffer(data, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf))[:size].astype(np.uint8).tobytes()


def check_same_run(settings: dict, run_dir: Path | str | None) -> None:
    """Refuse, on every process at once, processes that do not share the run folder
    ``run_dir`` (None: not checked), or that were given other ``settings`` (a flat
    ``{field: value}`` of the config) or another --num-processes than process 0: they would
    hang in their first checkpoint, or train apart."""
    if jax.process_count() == 1:
        return
    check_device_counts([d.process_index for d in jax.devices()])
    if run_dir is not None:
        _check_shared_folder(Path(run_dir))
    norm = json.loads(json.dumps({**settings, **_options}, sort_keys=True, default=str))
    first = json.loads(broadcast_bytes(json.dumps(norm, sort_keys=True).encode()))
    diff = [f"{k} {norm.get(k)!r} here, {first.get(k)!r} on process 0"
            for k in sorted(set(norm) | set(first)) if norm.get(k) != first.get(k)]
    others = processes_where(bool(diff))
    fix = "start every process with the same config, overrides and --num-processes"
    if diff:
        more = f" (and {len(diff) - 4} more)" if len(diff) > 4 else ""
        raise ValueError(f"process {jax.process_index()} was started with other settings than "
                         f"process 0: {'; '.join(diff[:4])}{more}; {fix}")
    if others:
        raise ValueError(f"process(es) {', '.join(map(str, others))} were started with other "
                         f"settings than process 0 (each names them); {fix}")


def check_device_counts(owners: list[int]) -> None:
    """Refuse processes that own different numbers of devices (``owners``: each device's
    process index): JAX's collectives between processes (``processes_where``...) need as
    many on each, and fail with a bare reshape error otherwise. Every process sees all
    devices, so all refuse together."""
    counts = Counter(owners)
    first = counts[0]
    other = [f"process {i}: {n}" for i, n in sorted(counts.items()) if n != first]
    if other:
        more = f" (and {len(other) - 4} more)" if len(other) > 4 else ""
        raise ValueError(f"the processes own different numbers of devices (process 0: {first}; "
                         f"{', '.join(other[:4])}{more}); give each process as many (the same "
                         "count of visible GPUs on every host; on a CPU the same "
                         "--xla_force_host_platform_device_count in XLA_FLAGS)")


def _check_shared_folder(run_dir: Path) -> None:
    """Process 0 leaves a file in ``run_dir``; every process must see it there."""
    probe = run_dir / broadcast_str(f".shared-{uuid.uuid4().hex[:16]}")
    made = None
    if is_main():
        made = first_missing(run_dir)  # the folders this makes: gone again below
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.touch()
    barrier("run-folder-probe")
    unseen = processes_where(not probe.exists())
    barrier("run-folder-probed")
    if is_main():
        probe.unlink(missing_ok=True)
        if made is not None:  # a refused start leaves no folder behind
            try:
                run_dir.rmdir()
                remove_made_parents(run_dir, made)
            except OSError:  # something else appeared there meanwhile: keep it
                pass
    fix = "give every process the same --run-dir, on a filesystem every host sees"
    if jax.process_index() in unseen:
        raise ValueError(f"--run-dir {run_dir}: process {jax.process_index()} does not see "
                         f"the run folder process 0 writes (a file it put there is missing); "
                         f"{fix}")
    if unseen:
        raise ValueError(f"--run-dir {run_dir}: process(es) {', '.join(map(str, unseen))} do "
                         f"not see this run folder (each says so); {fix}")
