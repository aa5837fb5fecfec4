"""The ladder folder: one place holding the plan, the rung runs and what the fit derives.

    LADDER/
      ladder.json        the plan: target config and stats, the rule, each rung's config and stats
      configs/*.yaml     each rung's (and the target's) config, trainable with `moelab train`
      rungs/<name>/      the rungs' run folders (ordinary moelab runs)
      target/            the target's run folder, when `moelab ladder run --target` trains it
      fit.json           fitted laws, coefficients, bootstrap intervals (`moelab ladder fit`)
      prediction.json    the target's predicted trajectories and bands
      plots/*.png        rungs, fits, predicted vs observed
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from moelab.config import RunConfig, config_from_dict, save_config
from moelab.config.errors import require_folder
from moelab.ladder.plan import LadderRule, Rung, run_stats
from moelab.util import atomic_write_json


@dataclass(frozen=True)
class Ladder:
    root: Path
    target_name: str
    target: RunConfig
    rungs: list[Rung]

    def run_dir(self, name: str) -> Path:
        return self.root / "rungs" / name

    @property
    def target_dir(self) -> Path:
        return self.root / "target"

    def config_path(self, name: str) -> Path:
        return self.root / "configs" / f"{name}.yaml"


def write_ladder(root: Path | str, target_name: str, target: RunConfig, rule: LadderRule,
                 rungs: list[Rung]) -> Ladder:
    root = Path(root)
    lad = Ladder(root, target_name, target, rungs)
    check_same_ladder(root, target, rungs)
    old = root / "ladder.json"
    for r in rungs:
        save_config(r.cfg, lad.config_path(r.name))
    save_config(target, lad.config_path("target"))
    atomic_write_json(old, {
        "target": {"name": target_name, "config": target.to_dict(), "stats": run_stats(target)},
        "rule": dataclasses.asdict(rule),
        "rungs": [{"name": r.name, "config": r.cfg.to_dict(), "stats": r.stats} for r in rungs]})
    return lad


def check_same_ladder(root: Path, target: RunConfig, rungs: list[Rung]) -> None:
    """Refuse to plan into a folder holding another ladder (its runs would mix with these)."""
    if not (root / "ladder.json").exists():
        return
    prev = load_ladder(root)
    # every rung's config, not only its name: a rule that changes no name (the LR exponent,
    # the warmup) would otherwise mix runs of the old plan into the new one
    if prev.target.hash() != target.hash() or [(r.name, r.cfg.hash()) for r in prev.rungs] \
            != [(r.name, r.cfg.hash()) for r in rungs]:
        runs = " and its rungs' runs, which stay as they are" if any(
            (root / d).is_dir() for d in ("rungs", "target")) else ""
        raise ValueError(f"{root}: holds a different ladder (other target, rungs or rung "
                         f"configs){runs}; plan this one into a new --out folder")


def check_out(root: Path | str | None) -> None:
    """``ladder plan --out`` (None: not given), refused before the plan when a file is in the
    way."""
    if root:
        require_folder(root, f"--out {root}", "give a new folder, or a ladder folder to plan "
                       "again")


def _not_a_ladder(root: Path) -> str:
    """Why ``root`` holds no ladder.json, and the fix: planning a ladder into a file or a run
    folder is no fix."""
    if root.exists() and not root.is_dir():
        return (f"{root}: a file, not a ladder folder; give the folder `moelab ladder plan "
                "--out` wrote")
    if (root / "config.yaml").is_file() or (root / "metrics.jsonl").is_file():
        return (f"{root}: a run folder, not a ladder folder (no ladder.json); give the folder "
                "`moelab ladder plan --out` wrote, the one holding rungs/ and target/")
    return (f"{root / 'ladder.json'}: no ladder here; create one with "
            f"`moelab ladder plan TARGET --out {root}`")


def load_ladder(root: Path | str) -> Ladder:
    root = Path(root)
    path = root / "ladder.json"
    if not path.is_file():
        raise FileNotFoundError(_not_a_ladder(root))
    try:
        d = json.loads(path.read_text())
        rungs = [Rung(r["name"], config_from_dict(r["config"]), r["stats"]) for r in d["rungs"]]
        return Ladder(root, d["target"]["name"], config_from_dict(d["target"]["config"]), rungs)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a valid ladder plan ({e}); re-create it with "
                         "`moelab ladder plan`") from None
