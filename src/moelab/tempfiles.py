"""The temp files an atomic write leaves when its process is killed: ``.NAME.<token>.tmp``
beside the file NAME (``util.open_atomic``; the corpus builder's ``tempfile.mkstemp`` names its
own so). The data build and a run's start remove them in the folders they write."""

from __future__ import annotations

from pathlib import Path


def remove_temp_files(folder: Path | str, names: tuple[str, ...] | None = None) -> int:
    """Remove the temp files of writes to ``names`` in ``folder`` (None: of any file there);
    how many. Only where no write is under way: under the folder's lock."""
    patterns = [".*.tmp"] if names is None else [f".{n}.*.tmp" for n in names]
    stale = {p for pattern in patterns for p in Path(folder).glob(pattern) if p.is_file()}
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)
