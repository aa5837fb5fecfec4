"""``moelab drops``: the drop forecast at longer contexts on the session's trained run; the
routings it and the benchmarks read (``moelab.parallel.routing``)."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from helpers import ALL_OPTIONS, random_train_state, shared_run
from moelab.cli import main
from moelab.config import ModelConfig, RunConfig
from moelab.model.transformer import forward
from moelab.parallel.routing import layer_routings


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
                         (["parallel.waves=1", "--seq-len", "64", "--ranks", "3"],
                          "--ranks 3: must divide model.n_experts=4"),
                         # waves set by the user and unfit for the typed EP degree
                         (["parallel.waves=3", "--seq-len", "64", "--ranks", "2"],
                          "--ranks 2: parallel.waves"),
                         (["parallel.waves=1", "--seq-len", "64", "--tokens-per-rank", "96"],
                          "--tokens-per-rank 96: must be a multiple of every length forecast, "
                          "64 included"),
                         # a length the run's own batch per rank does not hold: that default is
                         # named, not the option it stands for
                         (["parallel.waves=1", "--seq-len", "65536"], "--seq-len 65536: the "
                          "forecast's batch per rank is by default the run's"),
                         (["model.d_model=8", "--seq-len", "64"], "only parallel.* fields"),
                         # blocks that cannot cut a rank's tokens: refused before any routing
                         (["parallel.fair_blocks=6", "--transport", "pooled_global",
                           "--seq-len", "64", "--ranks", "2", "--tokens-per-rank", "128"],
                          "parallel.fair_blocks=6: its 3 blocks per rank (of 2 expert-parallel "
                          "ranks) must divide the 128 tokens a rank holds in a micro-step "
                          "(--tokens-per-rank 128); nearest valid: 4 or 8")):
        rc = main(["drops", str(trained), *argv])
        err = capsys.readouterr().err
        assert rc == 2 and phrase in err, err


def test_the_readme_example_runs_on_a_run_trained_without_expert_parallelism(trained, capsys):
    """`moelab drops RUN --seq-len L` with every default: the run trained at EP 1, so its
    pooled_wave waves (3) never applied; the forecast at EP 4 (1 local expert) fits them to
    1 and says so, instead of failing on parallel.waves."""
    rc = main(["drops", str(trained), "--seq-len", "64", "--batches", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "parallel.waves 3 -> 1 for 1 local expert(s)" in out and "drop forecast at EP 4" in out


def test_place_from_fits_the_placement_on_an_earlier_checkpoint(trained, tmp_path, capsys,
                                                                monkeypatch):
    """``--place --place-from STEP``: the placed column is the forecast with the placement
    fitted on the routing of the checkpoint at STEP (the router's drift included), computed
    here again with the library; a step that is not an earlier checkpoint, the option without
    --place, and a re-placement in between are refused."""
    import moelab.parallel.forecast as fc
    from moelab.ops.drops_cli import load_run_for_drops
    from moelab.parallel.forecast import forecast

    fits = []  # the model each forecast fits its placement on: on this small run the steps-20
    # and -30 placements forecast the same drops, so the drops alone cannot tell them apart
    monkeypatch.setattr(fc, "forecast", lambda *a, **kw: fits.append(kw["fit_model"]) or
                        forecast(*a, **kw))
    argv = ["drops", str(trained), "parallel.waves=1", "--seq-len", "64", "--ranks", "2",
            "--transport", "pooled_global", "--tokens-per-rank", "128", "--batches", "1"]
    out = tmp_path / "drops.json"
    assert main([*argv, "--place", "--place-from", "20", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    cfg, now, pars = load_run_for_drops(trained, ["parallel.waves=1"], ["pooled_global"], 2)
    old = load_run_for_drops(trained, [], None, 2, step=20)[1]
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(  # noqa: E731
        jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    (fit,) = fits
    assert same(fit[0], old.params) and not same(fit[0], now.params), "not fitted at step 20"
    again = forecast(cfg, now.params, now.model_state, [64], pars, 2, 128, 1, 0, place=True,
                     fit_model=(old.params, old.model_state))
    assert [r["pooled_global placed"] for r in rows] == [r["pooled_global placed"]
                                                         for r in again]
    capsys.readouterr()
    for extra, phrase in ((["--place", "--place-from", "25"], "--place-from 25: must be a "
                           "checkpoint of the run before step 30; it has 10, 20, 30"),
                          (["--place", "--place-from", "30"], "--place-from 30: must be"),
                          (["--place-from", "20"], "--place-from 20: belongs to --place")):
        assert main([*argv, *extra]) == 2
        assert phrase in capsys.readouterr().err
    moved = tmp_path / "moved"
    (moved / "checkpoints").mkdir(parents=True)
    (moved / "metrics.jsonl").write_text(json.dumps(
        {"event": "replace_experts", "step": 25, "moved": 3, "time": 0.0}) + "\n")
    with pytest.raises(Exception, match="re-placed its experts at step 25"):
        from moelab.ops.drops import check_place_from
        check_place_from(moved, cfg, 20, 30, [10, 20, 30])


def test_layer_routings_run_the_models_own_blocks():
    """The layer-by-layer pass the transport benchmarks read routes as the model's forward
    does with every model option on (GatedNorm, short convolutions, embed_norm, global
    layers): the same experts and combine weights per layer, latent inputs [N, H]."""
    cfg = RunConfig(model=ModelConfig(**ALL_OPTIONS)).model
    state = random_train_state(RunConfig(model=cfg), 5)
    params, model_state = state["params"], state["model_state"]
    tokens = np.random.default_rng(1).integers(cfg.vocab_size, size=(2, 16)).astype(np.int32)
    got = jax.jit(functools.partial(layer_routings, cfg=cfg))(params, model_state, tokens)
    _, r = forward(params, model_state, tokens, cfg)
    assert len(got) == cfg.n_layers
    for layer, (z, expert, weight) in enumerate(got):
        assert z.shape == (2 * 16, cfg.latent_dim)
        np.testing.assert_array_equal(np.asarray(expert), np.asarray(r.expert_NK[layer]))
        np.testing.assert_allclose(np.asarray(weight), np.asarray(r.weight_NK[layer]),
                                   atol=1e-6)



def test_default_tokens_per_rank_of_a_run_on_every_visible_device():
    """parallel.devices=0 trained on every visible device: the forecast's default batch per
    rank divides by that count, not by 1 (which forecast the whole batch on one rank)."""
    from moelab.config import DataConfig, ParallelConfig
    from moelab.ops.drops import run_tokens_per_rank

    def cfg(devices, expert):
        return RunConfig(data=DataConfig(seq_len=256, batch_size=32),
                         parallel=ParallelConfig(devices=devices, expert=expert))

    assert run_tokens_per_rank(cfg(8, 4), visible=1) == 1024
    assert run_tokens_per_rank(cfg(0, 4), visible=8) == 1024
    assert run_tokens_per_rank(cfg(1, 1), visible=8) == 8192  # a single-device run


def test_a_forecast_says_when_the_held_out_text_holds_fewer_batches(trained, tmp_path,
                                                                    capsys):
    """--batches asks for more batches than the held-out text holds: the forecast ran on fewer
    without a word (--batches 10 on tiny's built-in text ran 2); it says how many, in the text
    and the JSON."""
    from moelab.ops.drops_cli import load_run_for_drops
    from moelab.parallel.routing import heldout_spans

    cfg = load_run_for_drops(trained, ["parallel.waves=1"], None, 2)[0]
    spans = len(heldout_spans(cfg, 64))
    per_rank = 64 * max(1, spans // 4)  # two or three batches of 2 ranks
    held = spans // (2 * per_rank // 64)
    out = tmp_path / "drops.json"
    assert main(["drops", str(trained), "parallel.waves=1", "--seq-len", "64", "--ranks", "2",
                 "--tokens-per-rank", str(per_rank), "--batches", "50", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["batches"] for r in rows} == {held} and held < 50
    assert (f"note: {held} of the 50 batches asked for (--batches): the held-out text holds no "
            f"more of 2 ranks x {per_rank:,} tokens") in capsys.readouterr().out
