"""What every reader of the data path shares: its error and the list of skipped inputs.

Kept apart from ``corpus`` so the document readers (``builtin_docs``, ``user_docs``,
``hf_docs``) can use them while ``corpus`` imports the readers.
"""

from __future__ import annotations

import json
import re
from collections import Counter
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


# the fix for each kind of skipped input (the starts of its reasons), said once after the list
SKIP_FIXES: dict[str | tuple[str, ...], str] = {
    ("missing field", "no '"): "--text-field (data.text_field) names the field holding the "
                                "text",  # a JSON record's field, a Parquet file's column
    ("not valid UTF-8", "UTF-16 text"): "convert such files to UTF-8 (e.g. iconv -f latin1 -t "
                                        "utf-8, or -f utf-16)",
    "unknown file type": "rename a text file to .txt (read .csv with --format hf-files, "
                         "data.format=hf-files)",
    "a folder datasets' save_to_disk wrote": "read a folder datasets' save_to_disk wrote with "
                                             "--format hf-disk (data.format=hf-disk)",
}


# a place inside a file: "FILE line N", "FILE row N", "FILE record N"
_IN_FILE = re.compile(r"(.*) ((?:line|row|record) \d+)")


def _places(wheres: list[str], show: int = 3) -> str:
    """The first ``show`` places of one reason, a file named once ("a.jsonl line 1, line 2"),
    and a count of the rest."""
    out, last = [], None
    for w in wheres[:show]:
        m = _IN_FILE.fullmatch(w)
        out.append(m[2] if m and m[1] == last else w)
        last = m[1] if m else None
    more = f" and {len(wheres) - show} more" if len(wheres) > show else ""
    return ", ".join(out) + more


def skip_summary(skipped: Skips, prefix: str = "", show: int = 8) -> str:
    """The skipped inputs in one line: each reason once with its first places (300 records
    without the text field are one item, not 300), the first ``show`` reasons, a count of the
    rest and the fix for each kind there is (``SKIP_FIXES``)."""
    if not skipped:
        return ""
    by_reason: dict[str, list[str]] = {}
    for where, reason in skipped:
        by_reason.setdefault(reason, []).append(where)
    shown = list(by_reason.items())[:show]
    items = "; ".join(f"{_places(ws)}: {r}" for r, ws in shown)
    rest = len(skipped) - sum(len(ws) for _, ws in shown)
    more = f"; ... and {rest} more" if rest else ""
    fixes = [fix for kind, fix in SKIP_FIXES.items() if any(r.startswith(kind) for _, r in skipped)]
    return (f"{prefix}skipped {len(skipped)} input{'s' * (len(skipped) != 1)}: {items}{more}"
            + "".join(f"; {fix}" for fix in fixes))


def skip_record(skipped: Skips, keep: int = 200) -> dict:
    """The skipped inputs as a manifest records them: counts by reason, the first ``keep``."""
    return {"count": len(skipped),
            # counted by reason without details: "unreadable file (...)" -> "unreadable file"
            "by_reason": dict(sorted(Counter(r.split(" (")[0] for _, r in skipped).items())),
            "items": [f"{where}: {reason}" for where, reason in skipped[:keep]]}
