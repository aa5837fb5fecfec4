"""Every benchmark script in bench/ imports against today's moelab and answers ``--help`` (the
scripts whose runs take minutes to hours are not run here; their options are): a renamed
function or a broken option shows here, not in the middle of a long measurement."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.append(str(BENCH))  # after everything else: bench/ holds generic names

import common  # noqa: E402

# bench/gpu_rows.py is the GPU driver's child (a JSON spec, no options: tests/test_gpu_bench.py);
# gpu_legs and gpu_profile are its modules (their --help says how they are run: below)
LIBRARIES = {"common", "gpu_legs", "gpu_profile", "gpu_rows"}
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in LIBRARIES)
OWN_EPILOG = {"gpu_mfu", "gpu_compile"}  # their help lists rows; --name says where results go


def run_script(name: str, argv: list[str], monkeypatch) -> int:
    """The exit status of bench/NAME.py run as from a shell with ``argv``, in this process."""
    env, path = dict(os.environ), list(sys.path)
    try:
        module = importlib.import_module(name)
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
        with pytest.raises(SystemExit) as e:
            common.run_main(module.main)
            raise SystemExit(0)
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
    return e.value.code


def test_every_script_is_listed():
    assert len(SCRIPTS) >= 20 and "transport" in SCRIPTS and "gpu_mfu" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help(name, capsys, monkeypatch):
    # some scripts add XLA flags for their own processes, or bench/ first on sys.path, when
    # imported: both are put back
    assert run_script(name, ["--help"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    if name not in OWN_EPILOG:
        assert "results: bench/results/" in out  # where the table's JSON lands


def test_every_moelab_name_a_script_imports_exists():
    """Imports inside functions too: they run only when the measurement gets there."""
    missing = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moelab"):
                module = importlib.import_module(node.module)
                missing += [f"{path.name}:{node.lineno} {node.module}.{a.name}"
                            for a in node.names if not hasattr(module, a.name)
                            and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing


@pytest.mark.parametrize("name, argv", [("ladder_benchmark", ["--sets", "nope"]),
                                        ("ladder_benchmark", ["--boot", "0"]),
                                        ("tokenize_speed", ["--workers", "1,x"]),
                                        ("train_throughput", ["--peak-dtype", "fp8"]),
                                        ("transport", ["--layer", "9"]),
                                        ("transport", ["--waves", "3"]),
                                        ("transport", ["--tokens-per-rank", "100"])])
def test_bad_options_are_refused_before_any_work(name, argv, capsys, monkeypatch):
    assert run_script(name, argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"{name}.py: error:" in err and argv[0] in err and "Traceback" not in err


def test_a_config_error_ends_with_its_message_not_a_traceback(capsys, monkeypatch):
    from moelab.config import ConfigError

    def main():
        raise ConfigError("config 'nope': no such preset or file")

    monkeypatch.setattr(sys, "argv", ["some_script.py"])
    with pytest.raises(SystemExit) as e:
        common.run_main(main)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "some_script.py: error: config 'nope': no such preset or file\n"


def test_skewed_drops_saves_its_table(tmp_path, capsys, monkeypatch):
    import skewed_drops

    def drops(cfgs, **_):
        return {n: {"assignments": 100, "sender_dropped": 1, "receiver_dropped": 2,
                    "dropped": 3} for n in cfgs}

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(skewed_drops, "measure_drops", drops)
    assert run_script("skewed_drops", ["--zipf", "0.2"], monkeypatch) == 0
    saved = json.loads((tmp_path / "skewed_drops.json").read_text())
    assert saved["zipf"] == 0.2 and len(saved["rows"]) == 9
    assert saved["rows"][0] == {"cf": 1.05, "transport": "pooled_wave", "sender": 0.01,
                                "receiver": 0.02, "total": 0.03}
    assert "pooled_wave" in capsys.readouterr().out


@pytest.mark.parametrize("seeds", [3, 4])
def test_transport_drop_split_adds_up_to_the_median_total(seeds):
    """bench/transport.py's tables give the median total drops over router models with its
    sender + receiver split: part-by-part medians came from different routers and did not add
    up (README: 3.08% total as 2.81 + 0.69); the split is now the median-total router's."""
    env = dict(os.environ)
    try:
        import transport as bench_transport
    finally:
        os.environ.clear()
        os.environ.update(env)
    routers = [(0.0303, 0.0281, 0.0022), (0.0362, 0.0293, 0.0069), (0.0308, 0.0229, 0.0079),
               (0.0400, 0.0100, 0.0300)][:seeds]
    per_seed = {i: [{"drop": d, "sender": s, "receiver": r}] for i, (d, s, r) in enumerate(routers)}
    row = bench_transport.merge_seeds(per_seed, ("sender", "receiver", "drop"),
                                      {"drop": ("sender", "receiver")})[0]
    assert row["sender"] + row["receiver"] == pytest.approx(row["drop"])
    if seeds == 3:  # the middle router's parts; the spread is still each part's own
        assert (row["drop"], row["sender"], row["receiver"]) == (0.0308, 0.0229, 0.0079)
        assert (row["sender_lo"], row["sender_hi"]) == (0.0229, 0.0293)


def test_a_router_model_of_other_steps_has_its_own_folder():
    """A short trial (--steps 10) is neither extended into the benchmarks' model nor reused."""
    import trained_router

    assert trained_router.router_dir() == trained_router.RUN_DIR
    assert trained_router.router_dir(steps=10) != trained_router.router_dir()
    assert trained_router.router_dir(64, 1, 10) != trained_router.router_dir(64, 1)


def test_the_gpu_row_child_answers_help(capsys, monkeypatch):
    assert run_script("gpu_rows", ["--help"], monkeypatch) == 0
    assert "SPEC_JSON RESULT_PATH" in capsys.readouterr().out
    assert run_script("gpu_rows", [], monkeypatch) == 2


@pytest.mark.parametrize("name", ["gpu_legs", "gpu_profile"])
def test_the_gpu_driver_s_modules_say_how_they_are_run(name, capsys, monkeypatch):
    """`--help` printed nothing: they are modules of bench/gpu_mfu.py, and said so nowhere."""
    assert run_script(name, ["--help"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "bench/gpu_mfu.py" in out and "bench/gpu_rows.py" in out
    if name == "gpu_profile":  # nothing of its own to run
        assert run_script(name, [], monkeypatch) == 2
        assert "nothing to run alone" in capsys.readouterr().err
        return
    argv = ["--shape", "64", "8", "8", "2", "--impls", "dense", "--budget-s", "0.01"]
    assert run_script(name, argv, monkeypatch) == 0  # alone: one kernel's legs, printed
    out = capsys.readouterr().out
    legs = [ast.literal_eval(line)["leg"] for line in out.splitlines()]
    assert legs == ["fwd", "dgrad", "wgrad"], out
    assert run_script(name, ["--impls", "nope"], monkeypatch) == 2
    assert "'nope': not one of ceiling," in capsys.readouterr().err


@pytest.mark.parametrize("text, ok", [("1", 1), ("4096", 4096), ("0", None), ("-3", None),
                                      ("2.5", None), ("x", None)])
def test_counts_are_whole_numbers_from_one(text, ok):
    if ok is None:
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            common.count(text)
    else:
        assert common.count(text) == ok


# --quick: the router-based scripts' tiny mode. Running one needs its small router model (~30 s
# of training on 2 cores) and ~30-90 s of compiles, too much for CI: tested here is what makes a
# quick run safe, its options, its file names and its labels.
QUICK_SCRIPTS = ["drops_vs_context", "fresh_placement", "placed_forecast", "router_precision",
                 "transport"]


@pytest.mark.parametrize("name", QUICK_SCRIPTS + ["trained_router"])
def test_router_scripts_offer_a_quick_mode(name, capsys, monkeypatch):
    assert run_script(name, ["--help"], monkeypatch) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--quick" in out
    if name != "trained_router":  # its quick run writes no table, only its run folder
        assert "_quick." in out and "not the reference figures" in out


def test_quick_sets_tiny_sizes_an_option_given_wins_and_the_run_says_so(capsys):
    def ap():
        p = common.parser("Measures a thing.", "thing.json")
        p.add_argument("--reps", type=common.count, default=5)
        p.add_argument("--waves", type=common.count, nargs="+", default=[4, 2, 1])
        return p

    quick = {"reps": 1, "waves": [4]}
    try:
        assert vars(common.parse_args(ap(), quick, [])) == {"reps": 5, "waves": [4, 2, 1],
                                                            "quick": False}
        assert capsys.readouterr().out == ""
        got = common.parse_args(ap(), quick, ["--quick", "--reps", "3"])
        assert (got.reps, got.waves) == (3, [4])
        assert capsys.readouterr().out.startswith("QUICK MODE (--quick)")
        with pytest.raises(SystemExit):
            common.parse_args(ap(), quick, ["--help"])
        shown = " ".join(capsys.readouterr().out.split())
        assert "--quick the same code path at tiny sizes (--reps 1, --waves 4)" in shown
    finally:
        common._quick = False


def test_a_quick_run_never_writes_the_reference_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["thing.py", "--quick"])

    def main():
        common.parse_args(common.parser("Measures a thing.", "thing.json"), {})
        common.save("thing", [{"x": 1}], device_info=False)

    common.run_main(main)
    assert [p.name for p in tmp_path.iterdir()] == ["thing_quick.json"]
    saved = json.loads((tmp_path / "thing_quick.json").read_text())
    assert saved["quick"] is True and "not the reference figures" in saved["quick_note"]
    out = capsys.readouterr().out.strip().splitlines()
    assert "not the reference figures" in out[0] and "not the reference figures" in out[-1]
    assert common.result_name("thing") == "thing"  # the mode ends with its run
    common.save("thing", [{"x": 1}], device_info=False)
    assert not json.loads((tmp_path / "thing.json").read_text()).get("quick")


def test_the_quick_router_has_its_own_folder_and_small_batches():
    import trained_router

    quick = trained_router.router_dir(quick=True)
    assert quick != trained_router.RUN_DIR and quick.name == "router_run_quick"
    assert trained_router.router_dir(seed=1, quick=True).name == "router_run_quick_s1"
    over = trained_router.run_overrides(trained_router.QUICK_STEPS, quick=True)
    assert "data.batch_size=2" in over and "data.batch_size=16" not in over
    fields = [o.split("=")[0] for o in over]
    assert len(fields) == len(set(fields))  # each field once: load_config refuses repeats


def test_help_gives_each_option_s_default(capsys):
    p = common.parser("Measures a thing.", "thing.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--waves", type=int, nargs="+", default=[4, 2, 1], help="waves to time")
    p.add_argument("--steps", type=int, default=9, help="steps (default 9; more is slower)")
    p.add_argument("--tag", default="")
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED default: 0 " in out  # 0 is a default, not "none"
    assert "waves to time (default: 4 2 1)" in out  # a list as typed
    assert "steps (default 9; more is slower) --tag TAG results:" in out  # named once; "" none


def _documented_options() -> dict[str, set[str]]:
    """{script: options} of every `bench/NAME.py --option ...` command in README.md and docs/:
    fenced blocks line by line (up to a # comment), inline code spans whole."""
    repo, found = BENCH.parent, {}
    for doc in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        text = doc.read_text()
        fenced = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
        commands = [ln.split(" #")[0] for block in fenced for ln in block.splitlines()]
        commands += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for cmd in commands:
            for name, rest in re.findall(r"bench/(\w+)\.py((?:\s+[^`]*)?)", cmd):
                found.setdefault(name, set()).update(re.findall(r"(?<![\w-])--[a-z][\w-]*", rest))
    return found


def test_every_option_the_docs_give_a_script_exists(capsys, monkeypatch):
    documented = _documented_options()
    assert {"transport", "drops_vs_context", "trained_router"} <= documented.keys()
    missing = []
    for name, options in sorted(documented.items()):
        assert run_script(name, ["--help"], monkeypatch) == 0
        out = capsys.readouterr().out
        missing += [f"bench/{name}.py {o}" for o in sorted(options) if o not in out]
    assert not missing, "documented but not an option of the script: " + ", ".join(missing)
