"""The `moelab` command line (help, errors, generate, data build) and the metric trackers."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import shared_run, subprocess_env
from moelab.cli import main
from moelab.config import ConfigError, load_config
from moelab.data.prepare import given_tokenizer, with_tokenizer_vocab
from moelab.data.store import TokenStore
from moelab.run.logs import JsonlTracker, read_metrics
from moelab.train.tracker import Trackers

MOELAB = Path(sys.executable).parent / "moelab"  # the installed console script


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse's SystemExit counts as a return."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------------------------------------
# help


def test_console_script_help():
    assert MOELAB.is_file(), f"{MOELAB} missing: is moelab installed in this environment?"
    p = subprocess.run([str(MOELAB), "--help"], capture_output=True, text=True, timeout=120,
                       env=subprocess_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: moelab")
    for cmd in ("train", "generate", "data", "plan", "presets"):
        assert cmd in p.stdout


def test_python_dash_m_moelab_is_the_command_and_says_its_version():
    import sys
    from importlib.metadata import version

    p = subprocess.run([sys.executable, "-m", "moelab", "--version"], capture_output=True,
                       text=True, timeout=120, env=subprocess_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"moelab {version('moelab')}"


def test_distributed_outside_a_cluster_is_one_line_naming_the_fix(tmp_path):
    """`--distributed` where JAX detects no cluster: one line naming the option and what to give
    instead, not JAX's bare "coordinator_address should be defined." (a child process: the
    runtime is joined before JAX starts, which it has in this one)."""
    env = {k: v for k, v in subprocess_env().items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR"))}
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "moelab", "train", "tiny", "--distributed",
                        "--run-dir", str(run)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("moelab: error: --distributed: JAX detected no cluster to join"), last
    assert "--coordinator HOST:PORT" in last and not run.exists()


def test_train_help(capsys):
    rc, out, _ = run_main(["train", "--help"], capsys)
    assert rc == 0
    assert out.startswith("usage: moelab train")
    assert "--run-dir" in out and "SECTION.FIELD=VALUE" in out
    assert "resumes" in out


@pytest.mark.parametrize("argv", [["generate", "--help"], ["data", "build", "--help"],
                                  ["plan", "--help"]])
def test_subcommand_help(argv, capsys):
    rc, out, _ = run_main(argv, capsys)
    assert rc == 0 and out.startswith("usage: moelab " + " ".join(argv[:-1]))


def test_no_command_is_a_usage_error(capsys):
    rc, _, err = run_main([], capsys)
    assert rc == 2 and "usage: moelab" in err


@pytest.mark.parametrize("argv, prefix, meant", [
    (["trian"], "moelab: error: argument COMMAND", "train"),
    (["ladder", "fti"], "moelab ladder: error: argument SUBCOMMAND", "fit"),
    (["data", "biuld"], "moelab data: error: argument SUBCOMMAND", "build"),
    (["plan", "tiny", "--attention", "fussed"], "moelab plan: error: argument --attention",
     "fused"),
])
def test_a_mistyped_command_suggests_the_one_meant(argv, prefix, meant, capsys):
    rc, _, err = run_main(argv, capsys)
    assert rc == 2
    assert err.splitlines()[-1].startswith(f"{prefix}: invalid choice: {argv[-1]!r}; did you "
                                           f"mean {meant!r}? (choose from "), err
    rc, _, err = run_main(["zzzz"], capsys)  # nothing close: the choices alone
    # the choices are quoted up to Python 3.11, not in newer argparse
    assert rc == 2 and re.search(r"invalid choice: 'zzzz' \(choose from '?train'?, ", err)


def test_presets_and_plan(capsys):
    rc, out, _ = run_main(["presets"], capsys)
    names = [line.split()[0] for line in out.splitlines()[:-1]]
    assert rc == 0 and names == ["tiny", "small", "d768", "d1024", "d1536", "d2048", "535b-a23b"]
    lines = dict(line.split(maxsplit=1) for line in out.splitlines()[:-1])
    assert lines["tiny"].startswith("The default") and "rung d768" in lines["d768"]
    rc, out, _ = run_main(["plan", "tiny", "model.n_experts=16"], capsys)
    assert rc == 0 and out.startswith("tiny: total ")
    rc2, out2, _ = run_main(["plan", "model.n_experts=16"], capsys)  # config name defaults to tiny
    assert rc2 == 0 and out2 == out


# ---------------------------------------------------------------------------------------------
# config errors on the command line


@pytest.mark.parametrize("argv, field", [
    (["train", "tiny", "model.top_k=99"], "model.top_k"),
    (["train", "model.top_k=99"], "model.top_k"),  # no config: tiny is implied
    (["train", "tiny", "model.d_modle=3"], "model.d_modle"),
    (["train", "tiny", "model.d_model=abc"], "model.d_model"),
    (["train", "tiny", "train.steps"], "override 'train.steps'"),
    (["train", "tiny", "--arm", "b"], "--arm b: names the run in an experiment record: give "
                                      "--record too"),  # not ignored
])
def test_train_config_errors_are_one_clear_line(argv, field, capsys, tmp_path):
    rc, out, err = run_main(argv + ["--run-dir", str(tmp_path / "r")], capsys)
    assert rc == 2
    assert err.startswith(f"moelab: error: {field}"), err
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "r").exists()  # nothing was started


def test_a_config_from_a_pipe_needs_a_run_dir(capsys, tmp_path):
    """`moelab train <(...)` would train into runs/63 (the pipe's descriptor): refused before
    the pipe is read, naming the option."""
    import os

    os.mkfifo(tmp_path / "63")
    rc, _, err = run_main(["train", str(tmp_path / "63")], capsys)
    assert rc == 2 and err.startswith(f"moelab: error: config {tmp_path / '63'}: is a pipe")
    assert "give --run-dir" in err


def test_train_missing_config_file(capsys, tmp_path):
    rc, _, err = run_main(["train", str(tmp_path / "missing.yaml")], capsys)
    assert rc == 2 and err.startswith("moelab: error: config file") and "not found" in err


def test_train_error_message_mentions_the_limit(capsys, tmp_path):
    rc, _, err = run_main(["train", "tiny", "model.top_k=99", "--run-dir", str(tmp_path)], capsys)
    assert rc == 2
    assert "model.top_k: must be <= n_experts=8" in err


# ---------------------------------------------------------------------------------------------
# generate


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):  # noqa: F811
    return shared_run(tmp_path_factory, data_dir)[0]


def test_generate_prints_the_prompt_and_a_continuation(trained, capsys):
    argv = ["generate", str(trained), "--prompt", "The red cat", "--max-tokens", "12",
            "--seed", "3"]
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    assert out.startswith("The red cat")
    assert len(out.rstrip("\n")) > len("The red cat")
    rc2, out2, _ = run_main(argv, capsys)  # the same seed gives the same text
    assert rc2 == 0 and out2 == out


def test_generate_shows_the_sample_as_it_is_drawn(trained, capsys, monkeypatch):
    """Each new token's text goes out as it comes (flushed), not the whole sample at its end;
    the pieces together are the text returned, and the command prints what it printed before
    (the prompt, the sample, a newline)."""
    from moelab.run.load import load_run

    run = load_run(trained)
    pieces: list[str] = []
    text = run.generate("The red cat", 12, seed=3, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == text
    assert text == run.generate("The red cat", 12, seed=3)  # streaming changes nothing drawn
    flushes = []
    monkeypatch.setattr(sys.stdout, "flush", lambda: flushes.append(True), raising=False)
    rc, out, err = run_main(["generate", str(trained), "--prompt", "The red cat",
                             "--max-tokens", "12", "--seed", "3"], capsys)
    assert rc == 0 and out == "The red cat" + text + "\n", err
    assert len(flushes) >= len(pieces) + 1  # the prompt, then each piece


def test_a_streamed_sample_holds_back_a_character_still_incomplete():
    """Each byte a token of its own (a byte-level BPE with no merges): é's first byte shows
    nothing, its second shows é; an invalid byte shows with the text after it, as decoded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moelab.data.tokenizer import decode, decode_stream

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([], trainers.BpeTrainer(
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), vocab_size=300,
        show_progress=False))

    def pieces(ids: list[int]) -> list[str]:
        got: list[str] = []
        step = decode_stream(tok, got.append)
        for i in ids:
            step(i)
        return got

    ids = tok.encode("café!").ids
    assert len(ids) == 6 and pieces(ids) == ["c", "a", "f", "é", "!"]
    bad = [*tok.encode("a").ids, tok.encode("é").ids[1], *tok.encode("b").ids]
    assert pieces(bad) == ["a", "\ufffdb"] and "".join(pieces(bad)) == decode(tok, bad)


def test_generate_greedy_from_an_older_checkpoint(trained, capsys):
    base = ["generate", str(trained), "--prompt", "def get_", "--max-tokens", "8",
            "--temperature", "0"]
    rc, out10, err = run_main(base + ["--step", "10"], capsys)
    assert rc == 0, err
    assert f"{trained}: sampling from the checkpoint of step 10" in err  # on stderr: the text
    _, _, newest = run_main(base, capsys)  # stays clean on stdout
    assert f"{trained}: sampling from the checkpoint of step 30" in newest
    assert "the prompt has" not in newest
    rc, _, err = run_main(["generate", str(trained), "--prompt", "the cat " * 200,
                           "--max-tokens", "2"], capsys)
    assert rc == 0 and "tokens; the model sees its last " in err  # a prompt over the context
    assert out10.startswith("def get_") and len(out10.rstrip("\n")) > len("def get_")
    rc, out10b, _ = run_main(base + ["--step", "10", "--seed", "99"], capsys)
    assert rc == 0 and out10b == out10  # greedy ignores the seed
    rc, out30, _ = run_main(base, capsys)  # newest checkpoint (step 30): another model
    assert rc == 0 and out30.startswith("def get_")
    rc, _, err = run_main(base + ["--step", "7"], capsys)
    assert rc == 2 and "no checkpoint at step 7" in err and "[10, 20, 30]" in err


def test_generate_top_k_and_a_prompt_file(trained, tmp_path, capsys, monkeypatch):
    """--top-k 1 samples the greedy text; --top-k past the vocabulary names the option and the
    size; --prompt-file continues each non-blank line as --prompt LINE does, '-' from stdin."""
    import io

    base = ["generate", str(trained), "--max-tokens", "6", "--seed", "4"]
    greedy = run_main([*base, "--prompt", "The cat", "--temperature", "0"], capsys)[1]
    rc, out, err = run_main([*base, "--prompt", "The cat", "--top-k", "1"], capsys)
    assert rc == 0 and out == greedy, err
    vocab = load_config(trained / "config.yaml").model.vocab_size
    rc, _, err = run_main([*base, "--top-k", str(vocab + 1)], capsys)
    assert rc == 2 and f"--top-k {vocab + 1}: must be <= {vocab:,}, the vocabulary" in err
    one = [run_main([*base, "--prompt", p], capsys)[1] for p in ("The cat", " def get_")]
    (tmp_path / "prompts.txt").write_text("The cat\r\n\n  \n def get_\n")
    rc, out, err = run_main([*base, "--prompt-file", str(tmp_path / "prompts.txt")], capsys)
    assert rc == 0 and out == one[0] + "\n" + one[1], err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"The cat\n")))
    rc, out, err = run_main([*base, "--prompt-file", "-"], capsys)
    assert rc == 0 and out == one[0], err


def test_generate_on_a_non_run_folder_fails_clearly(tmp_path, capsys):
    rc, out, err = run_main(["generate", str(tmp_path)], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("moelab: error:") and "not a run folder" in err
    assert "Traceback" not in err


def test_generate_on_a_run_without_checkpoints(tmp_path, capsys, trained):
    (tmp_path / "config.yaml").write_text((trained / "config.yaml").read_text())
    rc, _, err = run_main(["generate", str(tmp_path)], capsys)
    assert rc == 2 and "no checkpoint yet" in err


# ---------------------------------------------------------------------------------------------
# data build with user inputs


def _user_inputs(root: Path) -> Path:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rng = np.random.default_rng(0)
    for domain in ("notes", "logs"):
        (root / domain).mkdir(parents=True)
        for i in range(12):
            text = "\n".join(" ".join(rng.choice(words, 12)) for _ in range(20))
            (root / domain / f"f{i:02d}.txt").write_text(f"{domain} {i}\n{text}\n")
    (root / "notes" / "binary.bin").write_bytes(b"abc\x00\x01\x02def")
    (root / "notes" / "empty.txt").write_text("   \n")
    (root / "logs" / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (root / "logs" / "records.jsonl").write_text(
        '{"text": "a good record", "domain": "logs"}\n{"text": 5}\nnot json\n')
    return root


def test_data_build_with_user_inputs_reports_skipped(tmp_path, capsys):
    src = _user_inputs(tmp_path / "src")
    out_dir = tmp_path / "built"
    rc, out, err = run_main(["data", "build", str(src / "notes"), str(src / "logs"),
                             "--out", str(out_dir), "--vocab", "300", "--heldout", "0.2"],
                            capsys)
    assert rc == 0, err
    on_disk = json.loads((out_dir / "corpus" / "manifest.json").read_text())
    assert sorted(on_disk["domains"]) == ["logs", "notes"] and on_disk["kind"] == "user"
    # a short summary, not the manifest: what was built, its documents and tokens per domain
    lines = out.splitlines()
    kb = sum(on_disk["total"][s]["bytes"] for s in ("train", "heldout")) / 1e3
    assert lines[0] == f"built {out_dir} from 2 inputs: 25 documents ({kb:.1f} kB of text) in " \
        "2 domains"  # 24 files + 1 good JSONL record
    assert "{" not in out and len(lines) <= 12, out  # the manifest alone was 40 lines
    store = TokenStore(next(out_dir.glob("tokens-*")))
    for d in ("logs", "notes", "all"):
        names = ["logs", "notes"] if d == "all" else [d]
        want = [d] + [f"{n:,}" for s in ("train", "heldout") for n in (
            sum(on_disk["domains"][x][s]["docs"] for x in names),
            sum(store.n_tokens(s, x) for x in names))]
        assert [line.split() for line in lines[2:5]].count(want) == 1, (want, out)
    assert f"corpus: {out_dir / 'corpus'} (its manifest.json records" in out
    # the skipped inputs are reported on stderr, by name and reason
    assert "skipped 5 inputs" in err
    for needle in ("binary.bin", "empty.txt", "latin1.txt", "records.jsonl line 2",
                   "records.jsonl line 3"):
        assert needle in err, needle
    assert on_disk["skipped"]["count"] == 5
    assert (out_dir / "tokenizer-300.json").is_file()
    stores = list(out_dir.glob("tokens-*"))
    assert len(stores) == 1 and str(stores[0]) in out
    assert "train on it with: moelab train tiny" in out


def test_a_build_of_many_domains_is_summed_up_in_a_few_lines():
    from moelab.data.cli import SHOWN_DOMAINS, build_summary

    class Store:  # every domain 10 tokens per document; "d00" holds nothing out
        def domains(self, split):
            return [f"d{i:02d}" for i in range(20) if i or split == "train"]

        def n_tokens(self, split, domain):
            return 10 * manifest["domains"][domain][split]["docs"]

    manifest = {"kind": "builtin", "domains": {
        f"d{i:02d}": {"train": {"docs": 3, "bytes": 9}, "heldout": {"docs": int(i > 0),
                                                                    "bytes": 1}}
        for i in range(20)}, "total": {"train": {"docs": 60, "bytes": 180_000},
                                       "heldout": {"docs": 19, "bytes": 20_000}}}
    lines = build_summary(Path("data/x"), manifest, Store())
    assert lines[0] == ("built data/x from the built-in corpus: 79 documents (200.0 kB of text) "
                        "in 20 domains")
    assert len(lines) == 2 + SHOWN_DOMAINS + 2
    assert lines[2].split() == ["d00", "3", "30", "0", "0"]
    assert lines[-2].split() == ["(8", "more)", "24", "240", "8", "80"]
    assert lines[-1].split() == ["all", "60", "600", "19", "190"]


def _hint(out: str) -> tuple[list[str], str]:
    """The printed `moelab train ...` command of a build's output: (CONFIG and overrides, its
    --run-dir), split as a shell would."""
    hint = next(line for line in out.splitlines() if line.startswith("train on it with:"))
    argv = shlex.split(hint.split("moelab train ", 1)[1])
    at = argv.index("--run-dir")
    return argv[:at] + argv[at + 2:], argv[at + 1]


def test_data_build_hint_uses_the_built_tokenizer(tmp_path, capsys):
    """The printed `moelab train ...` command must train on what was just built (the folder's
    own tokenizer.json); the tiny preset's vocab_size alone (2048) is refused, never trained
    as a second tokenizer."""
    src = _user_inputs(tmp_path / "src")
    out_dir = tmp_path / "built"
    rc, out, err = run_main(["data", "build", str(src), "--out", str(out_dir), "--vocab", "300"],
                            capsys)
    assert rc == 0, err
    argv, run_dir = _hint(out)
    cfg = with_tokenizer_vocab(load_config(argv[0], argv[1:]))
    assert Path(cfg.data.data_dir) == out_dir
    # a run folder of its own: the default, runs/tiny, is the built-in corpus's run and refuses
    # this data and tokenizer
    assert run_dir == "runs/built"
    assert f"tokenizer: {out_dir / 'tokenizer.json'}" in out.splitlines()  # the one runs read
    assert given_tokenizer(cfg.data) == out_dir / "tokenizer.json"
    assert (out_dir / "tokenizer.json").read_bytes() == (out_dir / "tokenizer-300.json").read_bytes()
    with pytest.raises(ConfigError, match=f"model.vocab_size=2048 disagrees .*tokenizer.json .*"
                       f"set model.vocab_size={cfg.model.vocab_size}, or 0"):
        with_tokenizer_vocab(load_config("tiny", [f"data.data_dir={out_dir}"]))


def test_data_build_hint_quotes_a_folder_with_spaces(tmp_path, capsys):
    """The printed command pastes into a shell as is: a folder with spaces stays one argument
    (unquoted, the shell split it and train refused the second half as an override)."""
    src = _user_inputs(tmp_path / "my src")
    out_dir = tmp_path / "my data" / "built it"
    rc, out, err = run_main(["data", "build", str(src), "--out", str(out_dir), "--vocab", "300"],
                            capsys)
    assert rc == 0, err
    argv, run_dir = _hint(out)
    cfg = with_tokenizer_vocab(load_config(argv[0], argv[1:]))
    assert Path(cfg.data.data_dir) == out_dir and cfg.model.vocab_size > 256, argv
    assert run_dir == "runs/built it"


def test_data_build_hint_fits_the_shortest_held_out_text(tmp_path, capsys):
    """A corpus whose held-out text is shorter than the tiny preset's context: the printed
    command sets a data.seq_len every domain can evaluate (tiny's 256 is refused at start)."""
    for name in ("a", "b"):
        for i in range(3):
            (tmp_path / "src" / name).mkdir(parents=True, exist_ok=True)
            (tmp_path / "src" / name / f"{i}.txt").write_text(f"{name} text {i} " * (60 + i))
    out_dir = tmp_path / "built"
    rc, out, err = run_main(["data", "build", str(tmp_path / "src"), "--out", str(out_dir),
                             "--vocab", "300", "--workers", "1"], capsys)
    assert rc == 0, err
    argv, _ = _hint(out)
    cfg = load_config(argv[0], argv[1:])
    store = TokenStore(next(out_dir.glob("tokens-*")))
    held = [store.n_tokens("heldout", d) for d in store.domains("heldout")]
    assert min(held) < 257 and cfg.data.seq_len < min(held) <= 2 * cfg.data.seq_len, argv


def test_data_build_with_nothing_usable_fails_clearly(tmp_path, capsys, monkeypatch):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    rc, _, err = run_main(["data", "build", str(tmp_path / "in"), "--out", str(tmp_path / "o")],
                          capsys)
    assert rc == 2 and err.startswith("moelab: error:") and "no usable documents" in err
    rc, _, err = run_main(["data", "build", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
                          capsys)
    assert rc == 2 and "not found" in err
    # each kind of skip comes with its fix; a folder with nothing to read says so; a failed
    # first build leaves no output folder behind
    (tmp_path / "in" / "recs.jsonl").write_text('{"content": "a text", "id": 1}\n')
    (tmp_path / "in" / "utf16.txt").write_bytes("a text".encode("utf-16"))
    (tmp_path / "none" / ".git").mkdir(parents=True)
    (tmp_path / "none" / ".git" / "HEAD").write_text("ref")
    for src, said in [("in", "recs.jsonl line 1: missing field 'text' (fields: content, id); "),
                      ("in", "utf16.txt: UTF-16 text (not UTF-8); "),
                      ("in", "; --text-field (data.text_field) names the field holding the text"),
                      ("in", "; convert such files to UTF-8 (e.g. iconv -f latin1 -t utf-8, or "),
                      ("none", "no usable documents in none: no files there to read (hidden")]:
        monkeypatch.chdir(tmp_path)
        rc, _, err = run_main(["data", "build", src, "--out", str(tmp_path / "o")], capsys)
        assert rc == 2 and said in err, err
        assert not (tmp_path / "o").exists()
    # nor the folders above it that it made; a folder that was there (empty) stays
    (tmp_path / "mine").mkdir()
    for out in ("o/new/data", "mine/new/data", "mine"):
        assert run_main(["data", "build", "in", "--out", out], capsys)[0] == 2
    assert not (tmp_path / "o").exists() and not (tmp_path / "mine" / "new").exists()
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())  # as given


# ---------------------------------------------------------------------------------------------
# trackers


def test_jsonl_tracker_writes_whole_json_lines(tmp_path):
    import jax.numpy as jnp

    path = tmp_path / "sub" / "metrics.jsonl"
    t = JsonlTracker(path)
    t.log(1, {"train/loss": 2.5, "np": np.float32(1.5), "jax": jnp.float32(0.25),
              "bad": float("nan"), "inf": float("inf"), "n": np.int64(7)})
    t.event("start", 0, config_hash="abc", note="multi\nline")
    t.log(2, {"train/loss": 2.0})
    t.close()
    t.close()  # idempotent
    raw = path.read_text()
    assert raw.endswith("\n")
    lines = raw.split("\n")[:-1]
    assert len(lines) == 3
    recs = [json.loads(line) for line in lines]  # every line is a complete JSON object
    assert recs[0]["step"] == 1 and recs[0]["train/loss"] == 2.5
    assert recs[0]["np"] == 1.5 and recs[0]["jax"] == 0.25 and recs[0]["n"] == 7
    assert recs[0]["bad"] == "nan" and recs[0]["inf"] == "inf"  # JSON has no NaN/inf
    assert isinstance(recs[0]["time"], float)
    assert recs[1]["event"] == "start" and recs[1]["note"] == "multi\nline"
    # appending: a second tracker on the same file adds lines, never truncates
    t2 = JsonlTracker(path)
    t2.log(3, {"train/loss": 1.0})
    t2.close()
    assert len(path.read_text().splitlines()) == 4


def test_read_metrics_merges_per_step_and_ignores_a_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    t = Trackers(JsonlTracker(path), None)
    t.event("start", 0)
    t.log(1, {"train/loss": 3.0, "train/lr": 0.1})
    t.log(2, {"train/loss": 2.0})
    t.log(2, {"eval/a/loss": 2.2})  # the same step: merged into one record
    t.event("interrupted", 2, signal="SIGTERM")
    t.log(2, {"train/loss": 1.9})  # logged again after a resume: the newest value wins
    t.close()
    with open(path, "a") as f:
        f.write('{"step": 3, "train/loss": 1.')  # a crash mid-write
    recs, evs = read_metrics(path)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["train/loss"] == 3.0 and recs[0]["train/lr"] == 0.1
    assert recs[1]["train/loss"] == 1.9 and recs[1]["eval/a/loss"] == 2.2
    assert [(e["event"], e["step"]) for e in evs] == [("start", 0), ("interrupted", 2)]
    assert evs[1]["signal"] == "SIGTERM"
    assert read_metrics(tmp_path / "absent.jsonl") == ([], [])
    with open(path, "a") as f:  # a later start ends the cut line; text no run wrote is named
        f.write('\n{"step": 4, "train/loss": 1.8}\nhello\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 9: not a metrics record"):
        read_metrics(path)


def test_records_after_a_truncated_line_are_not_lost(tmp_path):
    """After a crash left a partial last line, the resumed run appends to the same file: its
    first record must not be glued onto the partial line (and lost with it)."""
    path = tmp_path / "metrics.jsonl"
    t = JsonlTracker(path)
    t.log(1, {"train/loss": 3.0})
    t.close()
    with open(path, "a") as f:
        f.write('{"step": 2, "train/loss": 2.')
    t = JsonlTracker(path)
    t.event("resume", 1)
    t.log(2, {"train/loss": 2.5})
    t.close()
    recs, evs = read_metrics(path)
    assert [(e["event"], e["step"]) for e in evs] == [("resume", 1)]
    assert [r["step"] for r in recs] == [1, 2] and recs[1]["train/loss"] == 2.5


def test_nan_loss_is_logged_as_a_string_and_read_back(tmp_path):
    path = tmp_path / "m.jsonl"
    t = JsonlTracker(path)
    t.log(5, {"train/loss": float("nan")})
    t.close()
    (rec,), _ = read_metrics(path)
    assert rec["train/loss"] == "nan" and math.isnan(float(rec["train/loss"]))


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`moelab ... | head`: the reader goes away; moelab ends with a shell's SIGPIPE status and
    no error line (it said "moelab: error: [Errno 32] Broken pipe", exit 2). A real pipe: the
    child writes a megabyte to stdout after its reader closed it."""
    import subprocess
    import sys

    code = ("import moelab.config.cli as c\n"
            "c.cmd_presets = lambda _a: print('x' * 2**20) or 0\n"
            "from moelab.cli import main\nraise SystemExit(main(['presets']))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    from moelab.config import cli as config_cli

    def broken(_args):
        raise BrokenPipeError(32, "Broken pipe")  # a socket, say: stdout is fine

    monkeypatch.setattr(config_cli, "cmd_presets", broken)
    assert main(["presets"]) == 2
    assert "moelab: error: [Errno 32] Broken pipe" in capsys.readouterr().err


def test_a_finished_run_resumed_on_other_data_is_told_so(trained, tmp_path, capsys):
    """A finished run resumed with a data folder whose tokenizer has another size: the data
    check names the change (it said 'set model.vocab_size=N', which the run then refused)."""
    import shutil

    run = Path(shutil.copytree(trained, tmp_path / "run"))
    src = tmp_path / "src" / "prose"
    src.mkdir(parents=True)
    for i in range(4):
        (src / f"d{i}.txt").write_text("the dog ran to the park. " * 40)
    other = tmp_path / "other"
    assert main(["data", "build", str(src), "--out", str(other), "--vocab", "300"]) == 0
    rc, _, err = run_main(["resume", str(run), f"data.data_dir={other}", 'data.tokenizer=""'],
                          capsys)  # the folder's own tokenizer, as a run of its own data has
    assert rc == 2 and "is not what this run trained on" in err and "vocab_size" not in err, err


def test_the_nul_bytes_a_machine_crash_leaves_in_a_log_are_skipped_as_a_cut_record(tmp_path):
    """After a power loss a file may keep its new length with zeros where the data was due; the
    next start ends that line, and the log still reads (text no run wrote is still named)."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "train/loss": 3.0}\n' + b"\x00" * 40)
    t = JsonlTracker(path)
    t.log(2, {"train/loss": 2.0})
    t.close()
    assert [r["step"] for r in read_metrics(path)[0]] == [1, 2]
    with open(path, "ab") as f:
        f.write(b"\x00hello\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 4: not a metrics record"):
        read_metrics(path)


@pytest.mark.parametrize("command", ["train", "config", "plan"])
def test_each_command_s_help_gives_its_own_override_example(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"e.g. `moelab {command} tiny train.steps=100 model.n_experts=16`" in out
