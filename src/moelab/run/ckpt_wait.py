"""Orbax calls a Ctrl-C may interrupt, waited for so that they can be waited for again.

``Thread.join`` interrupted by KeyboardInterrupt takes the thread for ended while it runs
(CPython before 3.13), so a second join returns at once; and a Ctrl-C inside orbax's save
leaves its writer threads running. Either way a save abandoned by a second Ctrl-C would remove
its folder while orbax still writes into it (recreating parts of it, a traceback for each lost
file at exit). So each such call runs in a thread of its own, and the caller waits on an Event,
whose wait can be interrupted and entered again.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Callable

_BEGIN_S = 1.0  # a started thread begins within this; a Ctrl-C in start() may have kept it from it


class Aside:
    """``fn()`` run in a daemon thread named ``name`` once ``start`` is called; ``wait`` returns
    once it has ended, raising what it raised."""

    def __init__(self, fn: Callable[[], None], name: str):
        self._began, self._done = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=name)

    def start(self) -> Aside:
        self._thread.start()
        return self

    def _run(self, fn: Callable[[], None]) -> None:
        self._began.set()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- raised by wait(), in the caller's thread
            self._error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until ``fn`` has ended (a Ctrl-C here leaves it running: wait again), then
        raise its error, if any."""
        self._done.wait()
        if self._error is not None:
            raise self._error

    def settle(self) -> None:
        """Wait for ``fn`` to end, its error unraised (the call was abandoned); one that a
        Ctrl-C kept from starting is not waited for."""
        if self._began.wait(_BEGIN_S):
            self._done.wait()


@contextmanager
def orbax_errors_quiet():
    """Orbax logs each failed array write with a traceback from its worker threads (dozens on a
    full disk) before ``save`` raises the first; that one error is reported, once."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
