"""What every reader of the data path shares: its error and the list of skipped inputs.

Kept apart from ``corpus`` so the document readers (``builtin_docs``, ``user_docs``,
``hf_docs``) can use them while ``corpus`` imports the readers.
"""

from __future__ import annotations

import json
from pathlib import Path

Skips = list[tuple[str, str]]  # bad inputs as (where, reason)


class DataError(ValueError):
    """Bad data input or missing data artifact; the message names the file and the fix."""


def read_json(path: Path | str, fix: str) -> object:
    """The JSON in ``path``; a DataError naming the file and ``fix`` when it is not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise DataError(f"{path}: not valid JSON ({e}); {fix}") from None
