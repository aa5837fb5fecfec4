"""`moelab eval`: the lm-evaluation-harness model against moelab's own forward (log-likelihood,
greedy flags, batching, rolling windows, stop strings) and the command on a small trained run."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lm_eval.api.instance import Instance  # a missing harness fails here, as it should

from helpers import shared_run
from moelab.data.tokenizer import decode, encode_batch, eos_id
from moelab.generate import padded, prefill_bucket
from moelab.harness.evaluate import split_tasks
from moelab.harness.lm import MoelabLM, cut_at_stop, gen_options
from moelab.harness.registry import local_task_names
from moelab.model import transformer as tr
from moelab.run.load import load_run
from test_cli import run_main

LOCAL_TASKS = ["moelab_choice", "moelab_complete", "moelab_heldout"]
TEXT = ("The red cat sees the old dog. The quiet king finds the bright ship. The small fox "
        "likes the green tree. The happy child watches the dark river near the stone house. "
        "The tall queen carries the cold lamp. The lazy bird hears the swift road. The old "
        "garden keeps the red stone, and the green ship paints the quiet child.")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):  # noqa: F811
    return shared_run(tmp_path_factory, data_dir)[0]


@pytest.fixture(scope="module")
def run(trained):
    return load_run(trained)


@pytest.fixture(scope="module")
def lm(run):
    return MoelabLM(run, batch_size=4)


def _ids(run, text: str) -> list[int]:
    return encode_batch(run.tokenizer, [text])[0]


_FORWARD = {}


def _logits(run, tokens: list[int]):
    """moelab's forward on one sequence: logits [len(tokens), V]. Jitted once (eager runs take
    seconds) for a window of seq_len; the zeros after the tokens change nothing (causal)."""
    if "fn" not in _FORWARD:
        _FORWARD["fn"] = jax.jit(lambda p, s, t: tr.forward(p, s, t, run.cfg.model)[0])
    window = padded(tokens, run.cfg.data.seq_len)
    return _FORWARD["fn"](run.params, run.model_state, window)[:, : len(tokens)]


def _direct(run, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Summed log-softmax of the continuation from one forward of the last seq_len + 1 tokens,
    and whether every continuation token is the argmax."""
    full = (context + continuation)[-(run.cfg.data.seq_len + 1):]
    logits = _logits(run, full[:-1])
    logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    pos = range(len(full) - 1 - len(continuation), len(full) - 1)
    return (float(sum(logp[p, full[p + 1]] for p in pos)),
            all(int(np.argmax(logp[p])) == full[p + 1] for p in pos))


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


PAIRS = [("The red cat", " sees the old dog."), ("", "The king"), ("  ", "The fox"),
         ("def get_cat_1(x, y):\n    if x >", " 3:"), (TEXT, " The end."),  # TEXT > seq_len
         ("2024-03-01 12:00:00 INFO user1", " finds item 7")]


def test_loglikelihood_matches_a_direct_forward(run, lm):
    L = run.cfg.data.seq_len
    assert len(_ids(run, TEXT)) > L  # the long context is cut from the left
    got = lm.loglikelihood(_requests("loglikelihood", PAIRS))
    for (context, cont), (logp, greedy) in zip(PAIRS, got):
        stripped = context.rstrip()  # trailing spaces belong to the continuation
        ctx = _ids(run, stripped) if stripped else [eos_id(run.tokenizer)]
        cont_ids = _ids(run, context + cont)[len(ctx):] if stripped else _ids(run, context + cont)
        want, want_greedy = _direct(run, ctx, cont_ids)
        assert logp == pytest.approx(want, rel=1e-4, abs=1e-3), (context, cont)
        assert greedy == want_greedy
        assert logp < 0


def test_is_greedy_for_the_models_own_continuation(run, lm):
    ctx = _ids(run, "The quiet king")
    greedy = []
    for _ in range(5):  # argmax decoding with the direct forward
        logits = _logits(run, ctx + greedy)
        greedy.append(int(jnp.argmax(logits[0, -1])))
    other = greedy[:-1] + [(greedy[-1] + 1) % run.cfg.model.vocab_size]
    (lp_g, is_g), (lp_o, is_o) = lm.loglikelihood_tokens([(ctx, greedy), (ctx, other)])
    assert is_g and not is_o
    assert lp_g > lp_o
    assert lp_g == pytest.approx(_direct(run, ctx, greedy)[0], rel=1e-4, abs=1e-3)


def test_batch_sizes_agree(run, lm):
    reqs = _requests("loglikelihood", PAIRS + [(TEXT[:40], " x"), ("A", "B")])
    one = MoelabLM(run, batch_size=1).loglikelihood(reqs)
    four = lm.loglikelihood(reqs)
    np.testing.assert_allclose([x for x, _ in one], [x for x, _ in four], rtol=1e-5, atol=1e-4)
    assert [g for _, g in one] == [g for _, g in four]
    # the padded lengths the windows share (generate's prefill buckets)
    assert {prefill_bucket(n, 32) for n in range(1, 33)} == {16, 32}
    assert {prefill_bucket(n, 100) for n in range(1, 101)} == {16, 32, 64, 100}


def test_rolling_loglikelihood_is_the_sum_over_the_whole_text(run, lm):
    L = run.cfg.data.seq_len
    ids = _ids(run, TEXT)
    assert len(ids) > 2 * L
    # every token scored once, after the end-of-text token and as much preceding text as fits
    # in a window that ends with the last token of its chunk of L
    padded = [eos_id(run.tokenizer)] + ids
    want = 0.0
    for start in range(0, len(ids), L):
        end = min(start + L, len(ids))
        lo = max(0, end - L)
        window_ctx = padded[lo: start + 1]
        want += _direct(run, window_ctx, ids[start:end])[0]
    (got,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(TEXT,)]))
    assert got == pytest.approx(want, rel=1e-4)
    short = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [("The cat",)]))[0]
    assert short == pytest.approx(_direct(run, [padded[0]], _ids(run, "The cat"))[0], rel=1e-4)


def test_generate_until_stops_at_the_first_stop_string(run, lm):
    prompt = "The red cat"
    n = 40  # more than one sampling chunk
    full = lm.generate(prompt, until=[], max_gen_toks=n, temperature=0.0, top_p=1.0)
    tokens = lm._sample(run.params, run.model_state, _ids(run, prompt), n, temperature=0.0,
                        top_p=1.0, stop_id=eos_id(run.tokenizer))
    assert full == decode(run.tokenizer, tokens)  # greedy, as one uncut sampling call
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), full
    (got,) = lm.generate_until(_requests("generate_until",
                                         [(prompt, {"until": stop, "max_gen_toks": n})]))
    assert got == full[: full.find(stop)]
    assert stop not in got
    assert cut_at_stop("abc.def\n", ["\n", "."]) == 3 and cut_at_stop("abc", ["x"]) is None


def test_a_tasks_top_k_reaches_the_sampler(lm):
    greedy = lm.generate("The red cat", until=[], max_gen_toks=8, temperature=0.0, top_p=1.0)
    hot = dict(until=[], max_gen_toks=8, temperature=50.0, top_p=1.0)
    assert lm.generate("The red cat", top_k=1, **hot) == greedy  # the most likely token only
    assert lm.generate("The red cat", top_k=10**9, **hot) == lm.generate("The red cat", **hot)
    assert lm.generate("The red cat", **hot) != greedy  # so hot it would not be greedy


def test_generation_options():
    opts = gen_options({"until": ["\n"], "max_gen_toks": 5, "temperature": 0.7}, 256, "<e>")
    assert opts == {"until": ["\n", "<e>"], "max_gen_toks": 5, "temperature": 0.0,
                    "top_p": 1.0, "top_k": 0, "seed": 0}  # greedy unless do_sample
    opts = gen_options({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5}, 256,
                       "<e>")
    assert opts["temperature"] == 0.7 and opts["top_p"] == 0.9 and opts["max_gen_toks"] == 256
    assert opts["top_k"] == 5 and gen_options({"do_sample": True, "top_k": None}, 9, "")[
        "top_k"] == 0  # none, as 0 in transformers: every token
    with pytest.raises(ValueError, match="max_gen_toks"):
        gen_options({"max_gen_toks": 0}, 256, "<e>")


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt fails at once: the tests never wait on a network, and behave
    alike on machines with one or without."""
    import socket

    def refuse(*_args, **_kw):
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _hf_offline(monkeypatch, on: bool) -> None:
    """The offline setting as the environment would give it; datasets and huggingface_hub read
    it when first imported, so their config modules are set too."""
    import datasets.config
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if on:
            monkeypatch.setenv(var, "1")
        else:
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", on)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", on)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", on)


def test_eval_is_offline_only_when_the_environment_says_so(trained, tmp_path, capsys,
                                                           monkeypatch, no_network):
    """Online by default (the harness's built-in tasks may download their datasets); moelab's
    local tasks still run with no network at all."""
    import datasets.config
    import huggingface_hub.constants
    import lm_eval

    _hf_offline(monkeypatch, False)
    seen = []
    real = lm_eval.simple_evaluate

    def spy(*args, **kw):
        seen.append((datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE,
                     os.environ.get("HF_HUB_OFFLINE"), os.environ.get("HF_DATASETS_OFFLINE")))
        return real(*args, **kw)

    monkeypatch.setattr(lm_eval, "simple_evaluate", spy)
    rc, _, err = run_main(["eval", str(trained), "--tasks", "moelab_choice", "--limit", "2",
                           "--output", str(tmp_path / "r.json")], capsys)
    assert rc == 0, err
    assert seen == [(False, False, None, None)]  # not forced offline, and yet no network used


HUB_TASK = """task: hub_probe
dataset_path: moelab-test/not-cached
output_type: loglikelihood
test_split: test
doc_to_text: "{{text}}"
doc_to_target: " x"
"""


def test_an_uncached_dataset_says_how_to_pre_cache_it(trained, tmp_path, capsys, monkeypatch,
                                                     no_network):
    from moelab.harness.evaluate import unreachable_dataset

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub_probe.yaml").write_text(HUB_TASK)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _hf_offline(monkeypatch, True)
    import moelab.run.load

    monkeypatch.setattr(moelab.run.load, "load_run", _never)  # said before the checkpoint loads
    rc, _, err = run_main(["eval", str(trained), "--tasks", "hub_probe", "--include-path",
                           str(tmp_path / "tasks"), "--output", str(tmp_path / "r.json")], capsys)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("moelab: error: --tasks hub_probe: dataset 'moelab-test/not-cached' "
                           "is not in the Hugging Face cache"), err
    assert "offline by the environment (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set)" in line
    assert "`moelab eval ANY_RUN --tasks hub_probe --limit 1` once on a machine with network" \
        in line and "same HF_HOME" in line and "set HF_DATASETS_OFFLINE=1" in line
    _hf_offline(monkeypatch, False)  # online, but no network: the same advice
    msg = str(unreachable_dataset(ConnectionError("Couldn't reach 'a/b' on the Hub (x)"), ["t"]))
    assert "dataset 'a/b'" in msg and "(no network?:" in msg and "HF_DATASETS_OFFLINE=1" in msg


def test_eval_command_runs_the_local_tasks(trained, tmp_path, capfd, monkeypatch, no_network):
    assert local_task_names() == sorted(LOCAL_TASKS + ["moelab_local"])
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    monkeypatch.chdir(tmp_path)  # no git repository: git says nothing on stderr (capfd sees it)
    from lm_eval.tasks import TaskManager

    builds, build = [], TaskManager.load
    monkeypatch.setattr(TaskManager, "load", lambda self, names: builds.append(names)
                        or build(self, names))
    rc, out, err = run_main(["eval", str(run_dir), "--tasks", "moelab_local", "--limit", "3",
                             "--batch-size", "4"], capfd)
    assert rc == 0, err
    assert builds == [["moelab_local"]]  # built once, before the checkpoint loads
    assert "fatal:" not in err, err
    table = "\n".join(line for line in out.splitlines() if line.startswith("|"))
    for name in LOCAL_TASKS + ["acc_norm", "word_perplexity", "bits_per_byte", "exact_match"]:
        assert name in table, out
    saved = run_dir / "eval" / "moelab_local-step30-limit3.json"  # never a full run's file
    assert f"results: {saved}" in out
    # the card shows them only from an export written after this
    assert f"the model card of `moelab export {run_dir} --step 30 --to hf OUT` shows" in out
    res = json.loads(saved.read_text())
    assert res["moelab"]["step"] == 30
    from moelab.run.provenance import code_version  # the code that scored, as a run records it
    assert {k: res["moelab"][k] for k in code_version()} == code_version()
    assert 0 <= res["results"]["moelab_choice"]["acc,none"] <= 1
    assert res["results"]["moelab_heldout"]["word_perplexity,none"] > 1
    assert res["results"]["moelab_complete"]["exact_match,none"] >= 0
    assert set(res["n-samples"]["moelab_choice"].values()) >= {3}


def test_a_run_url_s_results_land_in_its_eval_folder_or_here_if_the_upload_fails(
        trained, tmp_path, capsys, monkeypatch, no_network):
    from moelab.run.remote import Mirror

    shutil.copytree(trained, tmp_path / "remote")
    monkeypatch.setenv("MOELAB_RUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    url = f"file://{tmp_path}/remote"
    args = ["eval", url, "--tasks", "moelab_choice", "--limit", "2"]
    rc, out, err = run_main(args, capsys)
    assert rc == 0, err
    assert f"results: {url}/eval/moelab_choice-step30-limit2.json" in out
    saved = json.loads((tmp_path / "remote" / "eval" / "moelab_choice-step30-limit2.json")
                       .read_text())
    assert saved["moelab"]["step"] == 30 and "moelab_choice" in saved["results"]

    def unreachable(self, rel, data):
        raise PermissionError("read-only bucket")

    monkeypatch.setattr(Mirror, "write", unreachable)
    rc, out, err = run_main(args, capsys)
    assert rc == 0, err
    assert "saving the results in" in err and "read-only bucket" in err
    kept = tmp_path / "remote-moelab_choice-step30-limit2.json"
    assert f"results: {kept.name}" in out
    assert json.loads(kept.read_text())["results"] == saved["results"]


def test_a_smoke_or_few_shot_evaluation_never_replaces_a_full_one_s_file(tmp_path):
    """The default results file names --limit and --num-fewshot: `--limit 5` after a full
    evaluation wrote beside it, not over it (the model card picks each task's fullest)."""
    from moelab.harness.evaluate import default_output

    names = {default_output(tmp_path, ["moelab_local"], 30, *opts).name
             for opts in [(), (5,), (None, 0), (None, 5), (5, 5)]}
    assert names == {"moelab_local-step30.json", "moelab_local-step30-limit5.json",
                     "moelab_local-step30-0shot.json", "moelab_local-step30-5shot.json",
                     "moelab_local-step30-limit5-5shot.json"}


@pytest.mark.parametrize("extra, message", [
    (["--limit", "0"], "--limit 0: must be >= 1"),
    (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
    (["--include-path", "no/such/dir"], "--include-path no/such/dir: not a folder"),
])
def test_eval_bad_options_are_clear(trained, extra, message, capsys):
    rc, _, err = run_main(["eval", str(trained), "--tasks", "moelab_local", *extra], capsys)
    assert rc == 2 and message in err, err


def test_eval_unknown_task_says_where_tasks_come_from(trained, capsys, monkeypatch):
    import lm_eval.tasks

    class LocalOnly(lm_eval.tasks.TaskManager):  # the ~15k built-in files take ~10 s to scan
        def __init__(self, include_path=None, include_defaults=True, **kw):
            seen.append(include_defaults)
            super().__init__(include_path=include_path, include_defaults=False, **kw)

    seen = []
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalOnly)
    rc, _, err = run_main(["eval", str(trained), "--tasks", "moelab_choise"], capsys)
    assert rc == 2
    assert "--tasks moelab_choise: unknown task (did you mean moelab_choice" in err
    assert "moelab_local" in err and "--include-path" in err and "Hugging Face cache" in err
    assert seen == [False, True]  # built-in tasks are searched only for a name not found


@pytest.mark.parametrize("stop, code, said", [(KeyboardInterrupt, 130, "aborted"),
                                              ("Terminated", 143, "terminated (SIGTERM)")])
def test_a_stop_during_evaluation_says_nothing_was_saved(stop, code, said, tmp_path, capsys,
                                                         monkeypatch):
    import moelab.harness.evaluate as ev
    from moelab import util

    def stopped(*args, **kwargs):
        raise getattr(util, stop) if isinstance(stop, str) else stop

    monkeypatch.setattr(ev, "evaluate_run", stopped)
    monkeypatch.setattr(util, "_abandoned", [])
    ended = []  # the CLI's os._exit: XLA's threads may still run, shutdown could crash in them
    monkeypatch.setattr(util, "exit_if_abandoned", lambda c: ended.append(util._abandoned and c))
    (tmp_path / "run").mkdir()
    rc, out, err = run_main(["eval", str(tmp_path / "run"), "--tasks", "moelab_local"], capsys)
    assert rc == code and ended == [code]
    assert (f"moelab: {said} during the evaluation; nothing was saved (the results are written "
            "once every task has run): run the same command again") in err, err
    assert not (tmp_path / "run" / "eval").exists()


def test_results_are_saved_before_the_table_is_printed(tmp_path, capsys, monkeypatch):
    """A Ctrl-C (or a closed pipe) while the table prints loses no evaluation."""
    import moelab.harness.evaluate as ev

    def table(results):
        raise KeyboardInterrupt

    monkeypatch.setattr(ev, "evaluate_run", lambda *a, **k: {"results": {"t": {"acc,none": 1}},
                                                             "moelab": {"step": 7}})
    monkeypatch.setattr(ev, "format_results", table)
    (tmp_path / "run").mkdir()
    rc, _, _ = run_main(["eval", str(tmp_path / "run"), "--tasks", "t"], capsys)
    assert rc == 130
    saved = json.loads((tmp_path / "run" / "eval" / "t-step7.json").read_text())
    assert saved["results"] == {"t": {"acc,none": 1}}


@pytest.mark.parametrize("name", ["config.yaml", "missing"])
def test_eval_of_what_is_no_run_folder_says_so(name, tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("model: {}\n")
    rc, _, err = run_main(["eval", str(tmp_path / name), "--tasks", "moelab_local"], capsys)
    assert rc == 2
    assert f"moelab: error: {tmp_path / name}: not a run folder; give the folder" in err, err
    assert "not writable" not in err


@pytest.mark.parametrize("where", ["--output", "eval"])
def test_a_file_where_results_would_go_is_named_not_called_unwritable(where, tmp_path, capsys):
    run, block = tmp_path / "run", tmp_path / "afile"
    run.mkdir()
    argv = ["--output", str(block / "r.json")] if where == "--output" else []
    if where == "eval":
        block = run / "eval"
    block.write_text("x")
    rc, _, err = run_main(["eval", str(run), "--tasks", "moelab_local", *argv], capsys)
    assert rc == 2 and f"{block} is a file, not a folder" in err, err
    assert "not writable" not in err


def test_tasks_given_twice_run_once_and_a_group_beside_its_own_task_is_one_line(
        tmp_path, capsys, monkeypatch):
    import lm_eval

    import moelab.harness.lm
    import moelab.run.load

    assert split_tasks("moelab_choice, moelab_choice,,moelab_heldout") == ["moelab_choice",
                                                                          "moelab_heldout"]
    # refused before the checkpoint loads: the tasks are built first
    monkeypatch.setattr(moelab.run.load, "load_run", _never)
    monkeypatch.setattr(moelab.harness.lm, "MoelabLM", _never)
    monkeypatch.setattr(lm_eval, "simple_evaluate", _never)
    _committed(tmp_path / "run", 1)  # a run without a checkpoint is refused before the tasks
    rc, _, err = run_main(["eval", str(tmp_path / "run"), "--tasks", "moelab_local,moelab_choice"],
                          capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "moelab: error: --tasks moelab_local,moelab_choice: Duplicate task 'moelab_choice'" in err
    assert "give each task once" in err


def _never(*args, **kwargs):
    raise AssertionError("the checkpoint was loaded or the evaluation ran")


def _committed(run, step: int) -> None:
    """A checkpoint folder as the checkpointer lists it (its manifest; no contents)."""
    from moelab.run.checkpoint import MANIFEST_FILE, step_name

    (run / "checkpoints" / step_name(step)).mkdir(parents=True)
    (run / "checkpoints" / step_name(step) / MANIFEST_FILE).write_text("{}")


@pytest.mark.parametrize("step", [None, 7])
def test_a_run_without_the_checkpoint_is_said_before_the_tasks_load(step, tmp_path, capsys,
                                                                   monkeypatch):
    """A run with no checkpoint (or none at --step) was said only after every task's dataset
    had loaded (downloaded, for the harness's built-ins), or failed to."""
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(TaskManager, "load", _never)
    from moelab.config import load_config, save_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    save_config(load_config("tiny"), run / "config.yaml")  # a start stopped before its first
    if step is not None:
        _committed(run, 5)
    rc, _, err = run_main(["eval", str(run), "--tasks", "moelab_local",
                           *(["--step", str(step)] if step is not None else [])], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip() == ("moelab: error: " + (f"{run}/checkpoints: no checkpoint yet; train "
                                                "first" if step is None else
                                                f"{run}: no checkpoint at step 7; available: [5]"))


@pytest.mark.parametrize("made", [False, True])
def test_a_folder_that_holds_no_run_is_named_so_before_the_tasks_load(made, tmp_path, capsys,
                                                                      monkeypatch):
    """A mistyped run folder (or one holding no run) was said to have "no checkpoint yet;
    train first", as if a run were there."""
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(TaskManager, "load", _never)
    run = tmp_path / "typo"
    if made:  # a folder of something else
        run.mkdir()
    rc, _, err = run_main(["eval", str(run), "--tasks", "moelab_local", "--output",
                           str(tmp_path / "r.json")], capsys)
    assert rc == 2 and err.strip() == (f"moelab: error: {run}: not a run folder (no "
                                       "config.yaml); train one with `moelab train` first"), err


def test_a_group_s_yaml_file_named_by_its_path_says_to_name_the_group(tmp_path, capsys,
                                                                      monkeypatch):
    """The harness takes a group file's task list for its name and fails with a traceback
    (TypeError: unhashable type: 'list'); moelab says how to name the group instead, before
    the checkpoint loads. A task's file, harness tags and all, is still taken by its path."""
    import moelab.run.load
    from moelab.harness.registry import _group_file

    monkeypatch.setattr(moelab.run.load, "load_run", _never)
    (tmp_path / "g").mkdir()
    group = tmp_path / "g" / "mine.yaml"
    group.write_text("group: mine\ntask:\n  - moelab_choice\n  - moelab_heldout\n")
    (tmp_path / "run").mkdir()
    rc, _, err = run_main(["eval", str(tmp_path / "run"), "--tasks", str(group)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--include-path {tmp_path / 'g'} --tasks mine" in err
    task = tmp_path / "g" / "t.yaml"
    task.write_text("task: t\ndataset_path: json\nprocess_docs: !function utils.docs\n")
    assert _group_file(str(task)) is None and _group_file(str(group)) == "mine"
