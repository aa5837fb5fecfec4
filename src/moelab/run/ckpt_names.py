"""Checkpoint folder names (``step_00000120``) and the orbax options that read them: a plain
``ocp.CheckpointManager(ckpt_dir, orbax_manager_options())`` lists and restores moelab's
checkpoints (item ``state``, without checking the manifest), read-only.

Why moelab saves without orbax's ``CheckpointManager``: it has no place for a manifest of a
step's files between writing and committing it, and prunes without read leases; moelab's
``Checkpointer`` commits the state with ``meta.json`` and the manifest written last in one
rename, and pruning skips a checkpoint being read.

Beside the step folders, a checkpoint folder may hold what interrupted work left: ``.tmp-*`` (a
save being built), ``.trash-*`` (a checkpoint being deleted), ``.replaced-*`` (a complete
checkpoint moved aside while its step is re-saved) and orbax's own ``*.orbax-checkpoint-tmp*``;
``leftovers`` sorts them."""

from __future__ import annotations

import re
from pathlib import Path

import orbax.checkpoint as ocp

STEP_PREFIX, STEP_DIGITS = "step", 8  # folder step_00000120: orbax's step_prefix, fixed length
_STEP_RE = re.compile(rf"{STEP_PREFIX}_(\d+)")
TMP_PREFIX = ".tmp-"  # a save in progress / crash leftover
TRASH_PREFIX = ".trash-"  # a checkpoint being deleted (pruned, or replaced once committed)
REPLACED_PREFIX = ".replaced-"  # a complete checkpoint moved aside while its step is re-saved
ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's own save in progress (``step_3.orbax-...-tmp-N``)


def step_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"{STEP_PREFIX}_{step:0{STEP_DIGITS}d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint folder name stands for (None: not a checkpoint folder)."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m and name == step_name(int(m.group(1))) else None


def orbax_manager_options() -> ocp.CheckpointManagerOptions:
    """Options with which a plain ``ocp.CheckpointManager(ckpt_dir, options)`` reads these
    checkpoints: the step folders' names, and read-only, since saving and pruning must go
    through ``Checkpointer`` (manifest, leases). The default options list no steps: they expect
    folders named by the bare step."""
    return ocp.CheckpointManagerOptions(step_prefix=STEP_PREFIX,
                                        step_format_fixed_length=STEP_DIGITS, read_only=True)


def leftovers(folder: Path) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """What interrupted saves and deletions left in ``folder``: (the checkpoints a re-save of
    their step moved aside and never replaced, each with the step folder it goes back to; the
    rest, to remove). Of several moved aside for one missing step, one goes back."""
    back: dict[Path, Path] = {}
    gone = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else ():
        final = folder / p.name.removeprefix(REPLACED_PREFIX).rsplit(".", 1)[0]
        if p.name.startswith(REPLACED_PREFIX) and not final.exists() and final not in back:
            back[final] = p
        elif p.name.startswith((TMP_PREFIX, TRASH_PREFIX, REPLACED_PREFIX)) or ORBAX_TMP in p.name:
            gone.append(p)
    return [(p, final) for final, p in back.items()], gone
