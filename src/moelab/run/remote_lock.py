"""The remote lock of a run folder URL (``URL/.lock``, naming its holder), written and read
back: best effort, as object stores have no atomic create-if-absent through fsspec (see
``moelab.run.remote``). A base of ``Mirror``, whose ``fs``, ``url``, ``local``, ``_r`` and
``write`` it uses."""

from __future__ import annotations

import json

from moelab.run.lock import LOCK_FILE, RunLocked, holder_record, refusal
from moelab.util import info, pid_alive


class RemoteLock:
    _lock_data: bytes | None = None  # what this process wrote into URL/.lock

    def lock(self, command: str | None = None) -> None:
        """Write ``URL/.lock`` naming this process; RunLocked if another one holds it."""
        path = self._r(LOCK_FILE)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            raw = b""
        try:
            held = json.loads(raw or b"{}")
            if not isinstance(held, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise RunLocked(f"{self.url}/{LOCK_FILE} is damaged ({e}): if no other process "
                            f"trains this run, delete {self.url}/{LOCK_FILE} and run this again"
                            ) from e
        me = {**holder_record(command), "staging": str(self.local)}
        mine = held.get("host") == me["host"] and (held.get("pid") == me["pid"]
                                                  or not pid_alive(int(held.get("pid") or 0)))
        if held and not mine:
            raise RunLocked(refusal(self.url, f"{self.url}/{LOCK_FILE}", held, me["host"]))
        data = json.dumps(me).encode()
        self.write(LOCK_FILE, data)
        if self.fs.cat_file(path) != data:  # another start wrote it at the same moment
            raise RunLocked(f"{self.url}: another process took the lock just now; run this "
                            "again once it has ended")
        self._lock_data = data

    def unlock(self) -> None:
        path = self._r(LOCK_FILE)
        try:
            if self._lock_data is not None and self.fs.cat_file(path) == self._lock_data:
                self.fs.rm(path)
        except OSError as e:
            info(f"{self.url}: could not remove {LOCK_FILE} ({e}); delete it before the next run")
        self._lock_data = None
