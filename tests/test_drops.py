"""``moelab drops``: the drop forecast at longer contexts on the session's trained run."""

from __future__ import annotations

import json

import pytest
from helpers import data_dir, shared_run  # noqa: F401  (session fixture)

from moelab.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):  # noqa: F811
    return shared_run(tmp_path_factory, data_dir)[0]


def test_forecast_keeps_tokens_and_budget_drops_across_contexts(trained, tmp_path, capsys):
    """Every context sees the same tokens; pooled_global's budget decision depends only on the
    EP group's per-expert totals, so its receiver drops cannot change with placement, while
    the placement-bound pooled_wave limits may."""
    out = tmp_path / "drops.json"
    rc = main(["drops", str(trained), "parallel.receiver_cf=0.8", "parallel.sender_cf=0.9",
               "parallel.waves=1", "--seq-len", "64", "128", "--ranks", "2",
               "--transport", "pooled_wave", "pooled_global", "--tokens-per-rank", "128",
               "--batches", "2", "--json", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "pooled_global" in text.out and "seq len" in text.out
    rows = json.loads(out.read_text())["rows"]
    assert [r["seq_len"] for r in rows] == [32, 64, 128]
    n = {r["pooled_wave"]["assignments"] for r in rows} | {r["pooled_global"]["assignments"]
                                                           for r in rows}
    assert len(n) == 1 and n.pop() == 2 * 2 * 128 * 2 * 2  # batches, ranks, tokens, k, layers
    budget = {r["pooled_global"]["receiver"] for r in rows}
    assert len(budget) == 1 and budget.pop() > 0
    assert all(r["pooled_wave"]["drop"] > 0 for r in rows)


def test_forecast_refuses_bad_lengths_and_fields(trained, capsys):
    for argv, phrase in ((["parallel.waves=1", "--seq-len", "48"], "--seq-len: 48"),
                         (["parallel.waves=1", "--seq-len", "64", "--ranks", "3"], "--ranks: 3"),
                         (["--seq-len", "64"], "parallel.waves"),
                         (["model.d_model=8", "--seq-len", "64"], "only parallel.* fields")):
        rc = main(["drops", str(trained), *argv])
        err = capsys.readouterr().err
        assert rc == 2 and phrase in err, err
