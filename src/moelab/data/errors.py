"""What every reader of the data path shares: its error and the list of skipped inputs.

Kept apart from ``corpus`` so the document readers (``builtin_docs``, ``user_docs``,
``hf_docs``) can use them while ``corpus`` imports the readers.
"""

from __future__ import annotations

Skips = list[tuple[str, str]]  # bad inputs as (where, reason)


class DataError(ValueError):
    """Bad data input or missing data artifact; the message names the file and the fix."""
