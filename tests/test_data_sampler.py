"""Which sampler a run draws with: a new run records ``data.sampler: epoch``; a run started before
the field existed resumes with the random windows it started with (a run never changes its data
order silently), and asking it for epochs is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from helpers import SHARED_RUN_TRAIN, micro_config, shared_run
from moelab.config import ConfigError
from moelab.run.checkpoint import MANIFEST_FILE, META_FILE, Checkpointer
from moelab.train.resume import resolve_run_config
from moelab.train.setup import setup_run
from moelab.util import sha256_file


def _without_sampler(run_dir) -> None:
    """The run as an older moelab left it: no data.sampler in config.yaml nor in any
    checkpoint's meta.json (whose manifest entry is rewritten to match)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    del cfg["data"]["sampler"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    ckpt = Checkpointer(run_dir / "checkpoints")
    for step in ckpt.steps():
        folder = ckpt.step_dir(step)
        meta = json.loads((folder / META_FILE).read_text())
        del meta["config"]["data"]["sampler"]
        (folder / META_FILE).write_text(json.dumps(meta))
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        manifest["files"][META_FILE] = {"size": (folder / META_FILE).stat().st_size,
                                        "sha256": sha256_file(folder / META_FILE)}
        (folder / MANIFEST_FILE).write_text(json.dumps(manifest))


def _sampler_kinds(run_dir, cfg) -> list[str]:
    setup, _ = setup_run(cfg, run_dir, verbose=False)  # no step is taken
    setup.trackers.close()
    setup.ckpt.close()
    return [s["sampler"] for s in setup.sampler.state()["segments"]]


def test_a_run_started_before_epochs_resumes_with_random_windows(tmp_path_factory, data_dir,
                                                                 tmp_path):  # noqa: F811
    src = shared_run(tmp_path_factory, data_dir)[0]
    assert yaml.safe_load((src / "config.yaml").read_text())["data"]["sampler"] == "epoch"
    legacy = shutil.copytree(src, tmp_path / "legacy")
    _without_sampler(legacy)
    cfg = micro_config(data_dir, train=SHARED_RUN_TRAIN)  # the command it was started with
    assert cfg.data.sampler == "" and cfg.data.sampler_kind == "epoch"
    assert resolve_run_config(cfg, tmp_path / "new").data.sampler == "epoch"  # a new run
    assert resolve_run_config(cfg, legacy).data.sampler == "random"
    assert _sampler_kinds(legacy, cfg) == ["random"]
    assert yaml.safe_load((legacy / "config.yaml").read_text())["data"]["sampler"] == "random"
    # config.yaml now says random, the old checkpoints' meta.json nothing: the same run
    assert _sampler_kinds(legacy, cfg) == ["random"]
    epoch = micro_config(data_dir, train=SHARED_RUN_TRAIN, data={"sampler": "epoch"})
    with pytest.raises(ConfigError, match="data.sampler: .* was started with 'random', now "
                                          "'epoch'"):
        resolve_run_config(epoch, legacy)
    with pytest.raises(ConfigError, match="data.sampler: .* was started with 'epoch', now "
                                          "'random'"):
        resolve_run_config(micro_config(data_dir, train=SHARED_RUN_TRAIN,
                                        data={"sampler": "random"}), src)
