"""A stop signal (Ctrl-C, SIGTERM) while a command runs the model ends the process right after
its message (``util.native_work``), not through interpreter shutdown, which stopped XLA's
threads inside native code: `moelab generate` and `moelab drops` ended with a segmentation
fault (exit 139) instead of 130. No model runs here: the stop comes as loading begins. And a
stop is never lost where a garbage collector's callback runs."""

from __future__ import annotations

import gc
import signal
import time

import pytest

import moelab.config.cli as config_cli
from moelab import generate, util
from moelab.cli import build_parser
from moelab.ops import drops_cli
from test_cli import run_main


def stop(*_args, **_kw):
    raise KeyboardInterrupt


@pytest.fixture
def abandoned(monkeypatch) -> list:
    """What a stop inside native work marks (the CLI then ends the process at once)."""
    monkeypatch.setattr(util, "_abandoned", [])
    return util._abandoned


def test_a_stop_while_generating_ends_the_process_at_once(abandoned):
    args = build_parser().parse_args(["generate", "somewhere", "--prompt", "Holmes"])
    with pytest.raises(KeyboardInterrupt):
        generate.cmd_generate(args, load_run=stop)
    assert abandoned


def test_a_stop_while_forecasting_drops_ends_the_process_at_once(abandoned, monkeypatch):
    monkeypatch.setattr(drops_cli, "load_run_for_drops", stop)
    args = build_parser().parse_args(["drops", "somewhere", "--seq-len", "64"])
    with pytest.raises(KeyboardInterrupt):
        drops_cli.cmd_drops(args)
    assert abandoned


def test_a_ctrl_c_that_lands_in_a_gc_callback_still_stops_the_command(abandoned, monkeypatch,
                                                                       capsys):
    """JAX frees XLA's buffers in a garbage collector's callback, and Python drops what such a
    callback raises (printed as "Exception ignored ... KeyboardInterrupt"): a Ctrl-C handled
    there was lost, and the command (a branch being made, a sample) went on to its end."""
    fired = []

    def callback(_phase, _info):  # Python's handler raises where the signal is handled
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt

    def command(_args):
        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
        for _ in range(100):  # the rest of the command: ten seconds, unless stopped
            time.sleep(0.1)
        return 0

    monkeypatch.setattr(config_cli, "cmd_presets", command)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored in background
    try:
        rc, _, err = run_main(["presets"], capsys)
    finally:
        signal.signal(signal.SIGINT, before)
    assert fired and (rc, err) == (130, "\nmoelab: aborted\n")


def test_a_stop_while_a_native_worker_starts_ends_the_process_at_once(abandoned, monkeypatch):
    """A signal that lands while ``Thread.start`` waits for the worker to begin (a busy
    machine) left the worker running unmarked: the interpreter's shutdown then stopped the
    BPE trainer's threads inside native code (an abort, not exit 130)."""
    import threading

    release = threading.Event()
    started = threading.Thread.start

    def start_then_stop(self):
        started(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_stop)
    try:
        with pytest.raises(KeyboardInterrupt):
            util.in_worker_thread(release.wait)
    finally:
        release.set()
    assert abandoned
