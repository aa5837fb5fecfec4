"""Bad input on every command: exit code 2 and one line that names the field, file or option and
the fix; never a traceback, and no real work first (each case runs `main` in-process and fails
at once if XLA compiles, the built-in corpus is built or the live page is served)."""

from __future__ import annotations

import pytest
import yaml

from helpers import micro_dict
from moelab.lab import records as rec_mod
from moelab.run.logs import JsonlTracker
from test_cli import run_main

POINTS = [(1e6, 1e9), (3e6, 2e9), (1e7, 5e9), (3e7, 1e10), (1e8, 3e10), (3e8, 6e10),
          (1e9, 1e11)]


def _law(n: float, d: float) -> float:
    return 1.7 + 400 / n ** 0.34 + 410 / d ** 0.28


def _csv(rows, header: str = "N,D,loss") -> str:
    return header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows)


def _run_folder(path, metrics: str | bytes | None = None) -> None:
    """A run folder as `moelab train` leaves it (config and a few metrics; no checkpoints),
    or with ``metrics`` as the raw metrics.jsonl."""
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump(micro_dict(path.parent / "nodata")))
    if metrics is None:
        t = JsonlTracker(path / "metrics.jsonl")
        t.event("start", 0, host="elsewhere", pid=1)
        for s in (1, 2, 3):
            t.log(s, {"train/loss": 5.0 - s / 10, "train/tokens": 128 * s,
                      "throughput/tokens_per_s": 1000.0})
        t.close()
    else:
        (path / "metrics.jsonl").write_bytes(metrics if isinstance(metrics, bytes)
                                             else metrics.encode())


def _write_runs_and_records(d) -> None:
    _run_folder(d / "run")
    _run_folder(d / "shape", '{"step": 1, "train/loss": 3}\n[1, 2]\n')
    _run_folder(d / "nostep", '{"train/loss": 3}\n')
    _run_folder(d / "strstep", '{"step": "one", "train/loss": 3}\n')
    _run_folder(d / "latin1run", b'{"step": 1, "train/loss": 3}\n{"step": 2, "note": "caf\xe9"}\n')
    _run_folder(d / "diverged", '{"step": 1, "train/loss": 3.5}\n{"step": 2, "train/loss": "nan"}'
                '\n')
    path, _ = rec_mod.new_record(d / "lab", "Shape", "h", "g", ["train/loss last <= 9"])
    rec_mod.attach(path, d / "shape", "shape")
    (d / "lab2").mkdir()  # a record file in Latin-1
    (d / "lab2" / "0001-x.md").write_bytes("---\nid: 0001-x\ntitle: caf\xe9\n---\n"
                                           .encode("latin-1"))
    (d / "lab3").mkdir()  # a record whose criteria are given twice
    (d / "lab3" / "0001-x.md").write_text("---\nid: 0001-x\ntitle: t\nhypothesis: h\ngoal: g\n"
                                          "criteria: [train/loss last <= 9]\ncriteria: []\n---\n")


def _data_inputs(d, data_dir) -> None:
    """Inputs of `data build` and damaged data folders (corpus, store index) for DATA_CASES;
    badjsonl has the session's tokenizer, so its store is built (and fails) at once."""
    import shutil

    from moelab.data.corpus import build_user_corpus

    (d / "txt").mkdir()
    for i in range(3):
        (d / "txt" / f"a{i}.txt").write_text(f"document {i} of a few words\n")
    (d / "table.csv").write_text("text\nhello\n")
    for name, index in (("badindex", "{not json"), ("nodtype", '{"format": 2, "splits": {}}')):
        (d / name).mkdir()
        (d / name / "index.json").write_text(index)
    (d / "badmanifest" / "corpus").mkdir(parents=True)
    (d / "badmanifest" / "corpus" / "manifest.json").write_text('{"kind": "user", ')
    build_user_corpus([d / "txt"], d / "badjsonl" / "corpus")
    train = d / "badjsonl" / "corpus" / "train.jsonl"
    train.write_text(train.read_text().splitlines()[0] + '\n{"id": "x", "te\n')
    shutil.copy(data_dir / "tokenizer-512.json", d / "badjsonl" / "tokenizer-512.json")


def _identity_runs(d, data) -> None:
    """Run folders at step 30 whose checkpoint holds only its meta.json (the config it was
    trained with): what they must refuse is refused before any restore."""
    import json
    import shutil

    from moelab.config import config_from_dict

    trained = config_from_dict(micro_dict(data, train={"steps": 30})).to_dict()

    def run(name, config=trained, prov=None, text=None, tok=data / "tokenizer-512.json",
            meta=None):
        ckpt = d / name / "checkpoints" / "step_00000030"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": 30, "config": trained, **(meta or {})}))
        (ckpt / "manifest.json").write_text("{}")
        if config is not None:
            (d / name / "config.yaml").write_text(text or yaml.safe_dump(config))
        if tok:
            shutil.copyfile(tok, d / name / "tokenizer.json")
        if prov:
            (d / name / "provenance.json").write_text(json.dumps(prov))

    def changed(section, **fields):
        out = json.loads(json.dumps(trained))
        out[section].update(fields)
        return out

    run("edited", changed("model", d_model=64))
    from moelab.data.tokenizer import load_tokenizer, tokenizer_sha256

    own = tokenizer_sha256(load_tokenizer(data / "tokenizer-512.json"))
    run("rebuilt", prov={"corpus_fingerprint": "0" * 16, "tokenizer_sha256": own})  # its corpus
    run("at30")
    run("nocfg", config=None)
    run("othertok", prov={"tokenizer_sha256": "1" * 64, "tokenizer_vocab": 512})
    run("smallvocab", changed("model", vocab_size=300))
    run("badcfg", text="model: [d_model\n")
    _rebuilt_data_runs(d, data, run, changed)


def _data_folder(d, data, name, tok) -> str:
    """A data folder holding the session's corpus and ``tok`` as its own tokenizer.json."""
    import shutil

    shutil.copytree(data / "corpus", d / name / "corpus")
    shutil.copyfile(tok, d / name / "tokenizer.json")
    return str(d / name)


def _rebuilt_data_runs(d, data, run, changed) -> None:
    """Runs whose data folder was rebuilt with another tokenizer (of another size, or of the
    same size with two ids swapped), or moved away; some without provenance.json."""
    import json

    from moelab.data.tokenizer import load_tokenizer, tokenizer_sha256, train_tokenizer
    from moelab.run.identity import data_record

    train_tokenizer(data / "corpus", d / "tok300.json", vocab_size=300)
    tok = json.loads((data / "tokenizer-512.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "swapped.json").write_text(json.dumps(tok))
    tok512 = load_tokenizer(data / "tokenizer-512.json")
    own = {"tokenizer_sha256": tokenizer_sha256(tok512), "tokenizer_vocab": 512}  # meta.json's
    index = json.loads(next(data.glob("tokens-*/index.json")).read_text())
    rec = data_record(index["corpus_fingerprint"], tok512, "0" * 16, data)

    def on(folder):  # the run's config and record, its data folder ``folder``
        return changed("data", data_dir=folder), {**rec, "data_dir": folder}

    cfg, prov = on(_data_folder(d, data, "data300", d / "tok300.json"))
    run("vocab300", cfg, prov)
    cfg, prov = on(str(d / "movedaway"))
    run("moved", cfg, prov)
    run("notok", prov=rec, tok=None)
    run("swapped", tok=d / "swapped.json", meta=own)
    cfg, _ = on(_data_folder(d, data, "dataswap", d / "swapped.json"))
    run("noprov", cfg, meta=own)
    run("noprovold", cfg)


def _write_bound_files(d) -> None:
    from test_trust_signals import laughs

    (d / "laughs.yaml").write_text(laughs(5))


def _write_ops_inputs(d) -> None:
    """Runs with a damaged and with a valid pending replan; a lab folder holding a fine record
    beside a damaged one."""
    for name, pending in (("badplan", "[1, 2]"), ("planned", '{"change": {"end": 40}, '
                                                  '"requested_at_step": 3, "reason": ""}')):
        _run_folder(d / name)
        (d / name / "plan_pending.json").write_text(pending)
    rec_mod.new_record(d / "lab4", "Fine", "h", "g", ["train/loss last <= 9"])
    (d / "lab4" / "0002-broken.md").write_text("no front matter here\n")


@pytest.fixture(scope="module")
def where(tmp_path_factory, data_dir):  # noqa: F811
    """The files the cases name, by placeholder: {d} their folder, {lab} a lab folder with one
    record, {data} the session's data dir."""
    d = tmp_path_factory.mktemp("bad")
    (d / "afile").write_text("not a folder\n")
    (d / "empty.yaml").write_text("# nothing here\n")
    (d / "dup.yaml").write_text("train:\n  steps: 5\n  steps: 7\n")
    (d / "dup_section.yaml").write_text("train: {steps: 5}\nmodel: {}\ntrain: {steps: 6}\n")
    (d / "bad.yaml").write_text("train: [steps\n")
    (d / "emptydir").mkdir()
    (d / "tab.yaml").write_text("base: tiny\ntrain:\n\tsteps: 5\n")
    (d / "list.yaml").write_text("- train\n- model\n")
    (d / "cycle_a.yaml").write_text("base: cycle_b.yaml\n")
    (d / "cycle_b.yaml").write_text("base: cycle_a.yaml\ntrain: {steps: 5}\n")
    (d / "nobase.yaml").write_text("base: missing_base.yaml\n")
    (d / "latin1.yaml").write_bytes("train:\n  steps: 5 # caf\xe9\n".encode("latin-1"))
    (d / "blank.txt").write_text("\n  \n\n")
    good = [(n, dd, round(_law(n, dd), 5)) for n, dd in POINTS]
    (d / "good.csv").write_text(_csv(good))
    (d / "same.csv").write_text(_csv([(1e6, 1e9, 3.0)] * 7))
    (d / "one_n.csv").write_text(_csv([(1e6, dd, round(_law(1e6, dd), 5)) for _, dd in POINTS]))
    (d / "flat.csv").write_text(_csv([(n, dd, 3.0) for n, dd in POINTS]))
    (d / "few.csv").write_text(_csv(good[:3]))
    (d / "neg.csv").write_text(_csv(good[:6] + [(-1, 1e9, 3.0)]))
    (d / "text.csv").write_text(_csv(good[:6] + [("big", 1e9, 3.0)]))
    (d / "nocols.csv").write_text(_csv(good, "params,tokens,loss"))
    (d / "latin1.csv").write_bytes(_csv(good, "N,D,loss,caf\xe9").encode("latin-1"))
    (d / "tok.json").write_text("{not json")
    _write_runs_and_records(d)
    _data_inputs(d, data_dir)
    _identity_runs(d, data_dir)
    _write_bound_files(d)
    _write_ops_inputs(d)
    return {"d": str(d), "data": str(data_dir), "lab": str(d / "lab")}


RUN = "{d}/run"
LAB = ["--lab-dir", "{lab}"]
GEN = ["generate", RUN]
FIT = ["ladder", "fit", "--points"]
PLAN8 = ["plan", "tiny", "--devices", "8", "--mfu", "0.2"]

# (argv, expected exit code, phrase the one error line must hold)
CASES = [
    # a mistyped command or subcommand names the one meant
    (["trian", "tiny"], 2, "invalid choice: 'trian'; did you mean 'train'?"),
    (["ladder", "fti"], 2, "invalid choice: 'fti'; did you mean 'fit'?"),
    # a mistyped option names the command's closest, or the config override it may mean
    (["plan", "tiny", "--devics", "8"], 2, "unrecognized arguments: --devics; did you mean "
     "--devices?"),
    (["train", "tiny", "--steps", "5"], 2, "unrecognized arguments: --steps; did you mean "
     "train.steps=VALUE?"),
    (["train", "tiny", "--seq-len=64"], 2, "did you mean data.seq_len=VALUE?"),
    (["train", "tiny", "--nope"], 2, "unrecognized arguments: --nope"),
    (["train", "tiny", "--seed", "3"], 2, "did you mean data.seed=VALUE or train.seed=VALUE?"),
    # train: the config, its file, the run folder, the data it needs
    (["train", "tiny", "model.top_k=99"], 2, "model.top_k: must be <= n_experts=8"),
    (["train", "tiny", "model.d_modle=3"], 2, "model.d_modle: unknown field"),
    (["train", "tiny", "model.d_model=abc"], 2, "model.d_model: expected an integer"),
    (["train", "tiny", "train.steps"], 2, "override 'train.steps'"),
    (["train", "tiny", "train.steps=0"], 2, "train.steps"),
    (["train", "tiny", "optim.lr=-1"], 2, "optim.lr"),
    (["train", "tiny", "optim.lr=nan"], 2, "optim.lr"),
    (["train", "tiny", "data.seq_len=0"], 2, "data.seq_len"),
    (["train", "tiny", "data.batch_size=-2"], 2, "data.batch_size"),
    (["train", "tiny", "model.n_experts=0"], 2, "model.n_experts"),
    (["train", "tiny", "parallel.transport=carrier_pigeon"], 2, "parallel.transport"),
    (["train", "tiny", "parallel.transport=pooled-wave"], 2, "parallel.transport='pooled-wave': "
     "must be one of pooled_wave, pooled_global, expert_cells, ragged, waterfill; did you mean "
     "pooled_wave?"),
    (["train", "nopreset"], 2, "'nopreset': no such preset or file"),
    (["train", "{d}/missing.yaml"], 2, "{d}/missing.yaml: not found"),
    (["train", "{d}/empty.yaml"], 2, "{d}/empty.yaml: empty"),
    (["train", "{d}/dup.yaml"], 2, "{d}/dup.yaml: line 3: duplicate key 'steps'"),
    (["train", "{d}/dup_section.yaml"], 2, "{d}/dup_section.yaml: line 3: duplicate key 'train'"),
    (["train", "{d}/bad.yaml"], 2, "{d}/bad.yaml: invalid YAML"),
    (["train", "{d}/tab.yaml"], 2, "{d}/tab.yaml: invalid YAML: line 3, column 1: found "
     "character '\\t' that cannot start any token; indent with spaces, not tabs"),
    (["train", "{d}/cycle_a.yaml"], 2,
     "base cycle {d}/cycle_a.yaml -> {d}/cycle_b.yaml -> {d}/cycle_a.yaml; remove one"),
    (["train", "{d}/nobase.yaml"], 2,
     "config file {d}/missing_base.yaml (the base of {d}/nobase.yaml): not found"),
    (["train", "tiny", "train.wandb=maybe"], 2, "train.wandb: expected true or false"),
    (["train", "tiny", "model.vocab_size=1"], 2,
     "model.vocab_size=1: a new tokenizer needs at least 258 tokens (256 bytes, <|endoftext|> "
     "and a merge), and this data folder has no tokenizer.json of its own; give more, or 0 for "
     "the default 4096"),
    (["train", "tiny", "train.steps=5", "train.steps=6"], 2,
     "override 'train.steps=6': train.steps is already set by 'train.steps=5'"),
    (["train", "{d}/list.yaml"], 2, "top level must be a mapping"),
    (["train", "{d}/latin1.yaml"], 2, "{d}/latin1.yaml: not UTF-8"),
    (["train", "tiny", "--run-dir", "{d}/afile"], 2, "--run-dir {d}/afile: a file"),
    (["train", "tiny", "--run-dir", "{d}/afile/under"], 2,
     "--run-dir {d}/afile/under: cannot be made or written by this user"),
    (["train", "{d}/lab"], 2, "config file {d}/lab: a folder, not a file"),
    (["train", "tiny", "--record", "nope", "--run-dir", "{d}/r1"], 2, "record 'nope'"),
    (["train", "{d}/run/config.yaml", "data.seq_len=100000", "data.data_dir={data}",
      "--run-dir", "{d}/r2"], 2, "lower data.seq_len"),
    # generate: sampling options are checked before the run is loaded
    ([*GEN, "--top-p", "0"], 2, "--top-p 0.0: must be in (0, 1]"),
    ([*GEN, "--top-p", "-1"], 2, "--top-p -1.0"),
    ([*GEN, "--top-p", "1.5"], 2, "--top-p 1.5"),
    ([*GEN, "--top-p", "nan"], 2, "--top-p nan"),
    ([*GEN, "--temperature", "nan"], 2, "--temperature nan: must be a number >= 0"),
    ([*GEN, "--temperature", "-3"], 2, "--temperature -3.0"),
    ([*GEN, "--temperature", "inf"], 2, "--temperature inf"),
    ([*GEN, "--max-tokens", "-5"], 2, "--max-tokens -5: must be >= 1"),
    ([*GEN, "--max-tokens", "0"], 2, "--max-tokens 0"),
    ([*GEN, "--step", "-1"], 2, "--step -1"),
    ([*GEN, "--seed", "99999999999999999999"], 2, "--seed 99999999999999999999: must be in "
     "0..4,294,967,295"),  # JAX's key overflowed (a traceback)
    ([*GEN, "--seed", "4294967296"], 2, "--seed 4294967296"),  # would sample as seed 0
    ([*GEN, "--seed", "-1"], 2, "--seed -1"),
    ([*GEN, "--max-tokens", "many"], 2, "argument --max-tokens: invalid int value"),
    ([*GEN, "--top-k", "0"], 2, "--top-k 0: must be >= 1 (1 = greedy)"),
    ([*GEN, "--top-k", "-3"], 2, "--top-k -3"),
    ([*GEN, "--top-k", "999999"], 2, "--top-k 999999: must be <= 512, the vocabulary of "
     "this run's model"),  # its config.yaml names the vocabulary: no checkpoint read
    # a prompt file: read before the run (which has no checkpoint here) is loaded
    ([*GEN, "--prompt-file", "{d}/none.txt"], 2, "--prompt-file {d}/none.txt: cannot be read "
     "(No such file or directory); give a text file with one prompt per line"),
    ([*GEN, "--prompt-file", "{d}/lab"], 2, "--prompt-file {d}/lab: cannot be read (Is a "
     "directory)"),
    ([*GEN, "--prompt-file", "{d}/blank.txt"], 2, "--prompt-file {d}/blank.txt: holds no "
     "prompt"),
    ([*GEN, "--prompt-file", "{d}/latin1.yaml"], 2, "--prompt-file {d}/latin1.yaml: not UTF-8"),
    ([*GEN, "--prompt-file", "{d}/blank.txt", "--prompt", "x"], 2, "argument --prompt: not "
     "allowed with argument --prompt-file"),
    (["generate", "{d}/nothing"], 2, "{d}/nothing: not a run folder"),
    (["generate", "{d}/afile"], 2, "{d}/afile: a file, not a run folder; give the folder "
     "`moelab train` or `moelab branch` wrote"),
    # data build: options checked before any corpus is built
    (["data", "build", "{d}/nothing", "--out", "{d}/o1"], 2, "not found: {d}/nothing"),
    (["data", "build", "--vocab", "0", "--out", "{d}/o2"], 2, "--vocab 0"),
    (["data", "build", "--vocab", "-5", "--out", "{d}/o3"], 2, "--vocab -5"),
    (["data", "build", "--heldout", "1.5", "--out", "{d}/o4"], 2, "--heldout 1.5"),
    (["data", "build", "--heldout", "-0.1", "--out", "{d}/o5"], 2, "--heldout -0.1"),
    (["data", "build", "--heldout", "0", "--out", "{d}/o5"], 2,
     "--heldout 0.0: a fraction of the documents in (0, 1), e.g. 0.02; every domain keeps"),
    (["data", "build", "--tokenizer", "{d}/no.json", "--out", "{d}/o6"], 2,
     "--tokenizer {d}/no.json: not found"),
    (["data", "build", "--tokenizer", "{d}/tok.json", "--out", "{d}/o7"], 2,
     "tokenizer {d}/tok.json: not a valid"),
    (["data", "build", "--out", "{d}/afile"], 2, "--out {d}/afile: a file"),
    # plan
    (["plan", "tiny", "--tokens", "-5"], 2, "--tokens -5"),
    (["plan", "tiny", "parallel.sender_cf=1e12"], 2, "parallel.sender_cf: 1e+12 is past any "
     "useful size (at most 1024; n_experts=8 already keeps every row)"),
    (["plan", "tiny", "parallel.ragged_round_cf=1e30"], 2, "parallel.ragged_round_cf: 1e+30 "
     "is past any useful size (at most 1024"),
    (["plan", "tiny", "--json", "{d}/afile/p.json"], 2, "--json {d}/afile/p.json: cannot be written"),
    (["plan", "tiny", "--tokens", "nan"], 2, "--tokens nan"),
    (["plan", "{d}/empty.yaml"], 2, "{d}/empty.yaml: empty"),
    (["plan", "{d}/dup.yaml"], 2, "duplicate key 'steps'"),
    (["plan", "{d}/cycle_b.yaml"], 2, "base cycle {d}/cycle_b.yaml -> {d}/cycle_a.yaml -> "),
    (["plan", "tiny", "model.top_k=1", "model.top_k=2"], 2, "model.top_k is already set"),
    (["plan", "nopreset"], 2, "no such preset or file"),
    (["plan", "tiny", "--devices", "-3"], 2, "--devices -3: must be >= 1"),
    (["plan", "tiny", "--devices", "8", "--mfu"], 2, "argument --mfu: expected at least one"),
    (["data", "verify", "{d}/afile"], 2, "{d}/afile: a file, not a folder; give a folder written "
     "by `moelab data build`"),
    (["plan", "tiny", "--devices", "0"], 2, "--devices 0: must be >= 1 (leave --devices out"),
    ([*PLAN8, "--fsdp", "0"], 2, "--fsdp 0: must be >= 1"),
    ([*PLAN8[:4], "--mfu", "1.5"], 2, "--mfu 1.5"),
    ([*PLAN8[:4], "--mfu", "-1"], 2, "--mfu"),
    ([*PLAN8, "--tokens-per-s", "-5"], 2, "--tokens-per-s"),
    (["plan", "tiny", "--accelerator", "abacus"], 2, "--accelerator abacus: unknown"),
    (["plan", "tiny", "--accelerator", "custom"], 2, "--peak-flops: required"),
    (["plan", "tiny", "--peak-flops", "-1"], 2, "--peak-flops -1"),
    (["plan", "tiny", "--hbm-gib", "-1"], 2, "--hbm-gib -1"),
    ([*PLAN8, "--ep", "3"], 2, "--ep 3: must divide model.n_experts=8; give one of 1, 2, 4, 8 "
     "(dividing --devices 8 too)"),
    ([*PLAN8, "--ep", "4", "--fsdp", "3"], 2, "--fsdp 3: must divide --devices 8; give one of "
     "1, 2, 4, 8"),
    ([*PLAN8, "--optimizer", "sgd"], 2, "--optimizer sgd"),
    ([*PLAN8, "--cf", "0"], 2, "--cf 0"),
    ([*PLAN8, "--cf", "2000"], 2, "--cf 2000: capacity factors must be > 0 and at most 1024"),
    ([*PLAN8[:4], "--tokens-per-s", "1e12"], 2, "--tokens-per-s 1e12: implies"),
    ([*PLAN8, "--waves", "0"], 2, "--waves 0"),
    # ladder
    ([*FIT, "{d}/missing.csv"], 2, "--points {d}/missing.csv: not found"),
    ([*FIT, "{d}/good.csv", "--boot", "0"], 2, "--boot 0"),
    ([*FIT, "{d}/good.csv", "--boot", "-3"], 2, "--boot -3"),
    ([*FIT, "{d}/good.csv", "--level", "7"], 2, "--level 7"),
    ([*FIT, "{d}/good.csv", "--level", "0"], 2, "--level 0"),
    ([*FIT, "{d}/good.csv", "--level", "nan"], 2, "--level nan"),
    ([*FIT, "{d}/same.csv"], 2, "--points {d}/same.csv: column N has 1 distinct value"),
    ([*FIT, "{d}/one_n.csv"], 2, "--points {d}/one_n.csv: column N has 1 distinct value"),
    ([*FIT, "{d}/flat.csv"], 2, "--points {d}/flat.csv: column loss has 1 distinct value"),
    ([*FIT, "{d}/few.csv"], 2, "at least 6 runs"),
    ([*FIT, "{d}/neg.csv"], 2, "line 8: values must be positive"),
    ([*FIT, "{d}/text.csv"], 2, "line 8: every value of N, D, loss must be a number"),
    ([*FIT, "{d}/nocols.csv"], 2, "missing column(s) N, D"),
    ([*FIT, "{d}/latin1.csv"], 2, "--points {d}/latin1.csv: not UTF-8"),
    ([*FIT, "{d}/good.csv", "--predict", "N=7e10"], 2, "--predict 'N=7e10'"),
    ([*FIT, "{d}/good.csv", "--predict", "N=-1,D=5"], 2, "--predict 'N=-1,D=5'"),
    ([*FIT, "{d}/good.csv", "--predict", "N=1e7,D=2e8,X=3"], 2,
     "--predict 'N=1e7,D=2e8,X=3': expected N=...,D=... (those two only)"),
    (["ladder", "fit"], 2, "give a LADDER folder"),
    (["ladder", "fit", "{d}/nothing"], 2, "{d}/nothing"),
    (["ladder", "plan"], 2, "ladder plan: give the TARGET config first"),
    (["ladder", "plan", "train.steps=9"], 2, "ladder plan: give the TARGET config first"),
    (["ladder", "plan", "tiny", "--rungs", "0"], 2, "ladder.rungs: must be >= 2"),
    (["ladder", "plan", "tiny", "--spacing", "0.5"], 2, "ladder.spacing: must be > 1"),
    (["ladder", "plan", "tiny", "--top-share", "2"], 2, "ladder.top_share"),
    (["ladder", "plan", "tiny", "--widths", "abc"], 2, "argument --widths"),
    # a negative value is read as one (not as an option) and named; widths checked first
    (["ladder", "plan", "tiny", "--widths", "64,96,128", "--token-multipliers", "-1,1"], 2,
     "ladder.token_multipliers: -1: each multiplies the target's tokens per parameter; give "
     "finite numbers > 0"),
    (["ladder", "plan", "tiny", "--widths", "64,96,128", "--token-multipliers", "1,inf"], 2,
     "ladder.token_multipliers: inf: each multiplies"),
    (["ladder", "plan", "tiny", "--widths", "-64,96,128"], 2, "ladder.widths: -64: give "
     "positive integers"),
    (["ladder", "plan", "tiny", "--widths", "64,96,128", "--depths", "2,0,2"], 2,
     "ladder.depths: 0: give positive integers"),
    (["ladder", "plan", "tiny", "--widths", "30,64"], 2, "ladder.widths: 30 is not a multiple "
     "of head_dim=32 (heads = d_model / head_dim); the nearest is 32"),
    (["ladder", "plan", "tiny", "--widths", "160,192,224", "--out", "{d}/lx"], 2,
     "(each its cost against the target's: d160 3x, d192 6.6x, d224 15x), which leaves 0 "
     "run(s) of 0 width(s), and a fit needs at least 3 runs of 2 widths: give widths (and "
     "depths) below the target's (d_model=128, n_layers=4)"),
    (["ladder", "run", "{d}/nothing"], 2, "{d}/nothing"),
    (["ladder", "guard", "{d}/nothing"], 2, "{d}/nothing"),
    (["ladder", "guard", RUN, "--patience", "0"], 2, "--patience"),
    # lab
    (["lab", "report", "nope", *LAB], 2, "record 'nope': not found"),
    (["lab", "report", "1", "--out", "{d}/afile", *LAB], 2, "--out {d}/afile: a file is in the "
     "way; give a folder"),
    (["lab", "live", "{d}/norun", *LAB], 2, "or, for runs, give their folders (no folder "
     "{d}/norun here)"),
    (["lab", "report", "1", *LAB], 2, "{d}/shape/metrics.jsonl: line 2"),
    (["lab", "show", "1", *LAB], 2, "{d}/shape/metrics.jsonl: line 2"),
    (["lab", "show", "1", "--lab-dir", "{d}/lab2"], 2, "{d}/lab2/0001-x.md: not UTF-8 text"),
    (["lab", "list", "--lab-dir", "{d}/lab3"], 2, "0001-x.md: front matter: line 7: duplicate "
     "key 'criteria'"),
    (["lab", "new", " ", "--hypothesis", "h", "--goal", "g", "--criterion", "train/loss <= 1",
      *LAB], 2, "title: must not be empty"),
    (["lab", "new", "t", "--hypothesis", "", "--goal", "g", "--criterion", "train/loss <= 1",
      *LAB], 2, "--hypothesis: must not be empty"),
    (["lab", "new", "t", "--hypothesis", "h", "--goal", "g", "--criterion", "loss is low",
      *LAB], 2, "loss is low"),
    (["lab", "new", "t", "--hypothesis", "h", "--goal", "g", "--criterion", "train/loss <= 1",
      "--min-steps", "-1", *LAB], 2, "--min-steps: must be >= 0"),
    (["lab", "attach", "1", RUN, "--arm", "bad arm!", *LAB], 2, "--arm 'bad arm!'"),
    (["lab", "attach", "1", "{d}/nothing", *LAB], 2,
     "{d}/nothing: no such folder; the runs of 0001-shape: {d}/shape (arm shape) (`moelab lab "
     "show 1` lists them); give a run folder `moelab train` wrote, or to attach a run before it "
     "starts, train it with `moelab train CONFIG --record 1 --arm NAME`"),
    (["lab", "attach", "1", "{d}/lab2", *LAB], 2,
     "{d}/lab2: not a run folder (no config.yaml): attach a folder `moelab train` wrote"),
    (["lab", "live", "{d}/nothing", "{d}/run"], 2, "{d}/nothing: not a run folder or record"),
    (["lab", "live", RUN, "--refresh", "0"], 2, "--refresh"),
    (["lab", "live", RUN, "--port", "70000"], 2, "--port 70000"),
    (["lab", "live", "{d}/latin1run", "--port", "0"], 2, "{d}/latin1run/metrics.jsonl: line 2"),
    # operations
    (["history", "{d}/shape"], 2, "{d}/shape/metrics.jsonl: line 2: not a metrics record"),
    (["history", "{d}/nothing"], 2, "{d}/nothing: no such folder"),
    (["history", "{d}/nostep"], 2, "{d}/nostep/metrics.jsonl: line 1"),
    (["history", "{d}/strstep"], 2, "{d}/strstep/metrics.jsonl: line 1"),
    (["history", "{d}/latin1run"], 2, "{d}/latin1run/metrics.jsonl: line 2: not UTF-8"),
    (["history", "{d}/nothing"], 2, "{d}/nothing"),
    (["replan", "{d}/nothing", "--end-steps", "9"], 2, "{d}/nothing: no such folder"),
    (["replan", RUN], 2, "nothing to change"),
    (["replan", RUN, "--end-steps", "-5"], 2, "--end-steps -5"),
    (["replan", RUN, "--end-tokens", "lots"], 2, "--end-tokens: 'lots'"),
    (["replan", RUN, "--deadline", "soon"], 2, "--deadline soon: not '+36h'"),
    (["replan", RUN, "--mixture", "prose"], 2, "--mixture prose: 'prose' is not DOMAIN=WEIGHT"),
    (["replan", RUN, "--seq-len", "0"], 2, "--seq-len 0"),
    (["replan", RUN, "--end-steps", "20", "--floor", "2"], 2, "--floor 2"),
    (["branch", RUN, "--at", "7", "--cooldown", "1M", "--dry-run"], 2,
     "--at 7: {d}/run has no checkpoint"),
    (["branch", RUN, "--at", "7", "--cooldown", "lots"], 2, "--cooldown: 'lots'"),
    (["branch", RUN, "--at", "7", "--cooldown", "0"], 2, "--cooldown: '0': must be more than 0"),
    (["resume", "{d}/nothing"], 2, "{d}/nothing: no such folder"),
    (["history", "file://{d}/nothing"], 2, "file://{d}/nothing: not a run folder (no "
     "config.yaml)"),
    (["resume", "file://{d}/nothing"], 2, "file://{d}/nothing: not a run folder"),
    (["replan", "file://{d}/run", "--end-steps", "9"], 2, "file://{d}/run: a URL; replan and "
     "branch work on a local run folder"),
    (["resume", RUN, "model.top_k=99"], 2, "model.top_k: must be <= n_experts=4"),
    (["history", "{d}/afile"], 2, "{d}/afile"),
    (["history", "{d}/at30"], 0, "nothing logged yet (no metrics.jsonl, no ops.jsonl)"),
    # accepted: the phrase is in the output
    (["history", "{d}/diverged"], 0, "nan"),
    ([*FIT, "{d}/good.csv", "--boot", "20"], 0, "from 7 runs (central 90%"),
    (["plan", "tiny", "--tokens", "0"], 0, "tiny: total"),
]

# Trust 2 (data and config identity, bounds, messages): one list per area, joined below.
DATA_CASES = [  # data build, corpus and token store inputs
    (["data", "build", "{d}/txt"], 2, "--out: required with INPUT paths (data/builtin"),
    (["data", "build", "{d}/txt", "{d}/txt", "--out", "{d}/o8"], 2,
     "input {d}/txt: the same as input {d}/txt"),
    (["data", "build", "{d}/txt", "{d}/txt/a1.txt", "--out", "{d}/o9"], 2,
     "input {d}/txt/a1.txt: inside input {d}/txt"),
    (["data", "build", "{d}/txt/a1.txt", "{d}/txt", "--out", "{d}/o9"], 2,
     "input {d}/txt: holds input {d}/txt/a1.txt"),
    (["data", "build", "{d}/txt", "--out", "{d}/txt/out"], 2,
     "--out {d}/txt/out: inside the input {d}/txt"),
    (["data", "build", "{d}/txt", "--out", "{d}/txt"], 2, "--out {d}/txt: inside the input"),
    (["data", "build", "{d}/table.csv", "--out", "{d}/o10"], 2,
     "input {d}/table.csv: unknown file type '.csv' (known: .txt"),
    # the same input as a config's data.source: the fix names the config field too
    (["train", "tiny", "data.source={d}/table.csv", "data.data_dir={d}/o11", "--run-dir",
      "{d}/r4"], 2, "read .csv with --format hf-files (data.format=hf-files in a config)"),
    # your own text given as data.data_dir (the folder of a built corpus): data.source reads it
    (["train", "tiny", "data.data_dir={d}/table.csv", "--run-dir", "{d}/r5"], 2,
     "data.data_dir={d}/table.csv: a file; data.data_dir is where moelab keeps the corpus built "
     "from your text: to train on {d}/table.csv, give data.source={d}/table.csv "
     "data.data_dir={d}/table-data"),
    (["train", "tiny", "data.data_dir={d}/txt", "--run-dir", "{d}/r6"], 2,
     "data.data_dir={d}/txt: a folder of files, not a corpus; data.data_dir is where moelab "
     "keeps the corpus built from your text: to train on {d}/txt, give data.source={d}/txt "
     "data.data_dir={d}/txt-data (or build it first: `moelab data build {d}/txt --out "
     "{d}/txt-data`)"),
    (["data", "build", "{d}/txt", "--out", "{d}/badmanifest"], 2,
     "{d}/badmanifest/corpus/manifest.json: not valid JSON"),
    (["train", "tiny", "data.data_dir={d}/badjsonl", "model.vocab_size=512", "--run-dir",
      "{d}/r3"], 2,
     "{d}/badjsonl/corpus/train.jsonl line 2: not valid JSON"),
    (["data", "verify", "{d}/nothing"], 2, "{d}/nothing: no such folder; give a folder written"),
    (["data", "verify", "{d}/emptydir"], 2, "{d}/emptydir: no corpus or token store here"),
    (["data", "verify", "{d}/badindex"], 2, "{d}/badindex/index.json: not valid JSON"),
    (["data", "verify", "{d}/nodtype"], 2, "{d}/nodtype/index.json: missing dtype"),
    (["data", "verify", "{d}/badmanifest"], 2, "badmanifest/corpus/manifest.json: not valid"),
    (["data", "build", "{d}/txt", "--out", "{d}/badmanifest"], 2,
     "rebuild it with `moelab data build SOURCES --out {d}/badmanifest --force`"),
]

RUN_CASES = [  # a run's identity: resume, branch, eval, generate, export
    (["resume", "{d}/edited"], 2, "{d}/edited/config.yaml: differs from the config the "
     "checkpoint of step 30 was trained with (its meta.json): model.d_model (64 in config.yaml, "
     "32 in meta.json)"),
    (["resume", "{d}/rebuilt"], 2, "corpus fingerprint 0000000000000000 recorded"),
    (["train", "{d}/rebuilt/config.yaml", "--run-dir", "{d}/rebuilt"], 2,
     "add --accept-data-change"),
    (["branch", "{d}/rebuilt", "--at", "30", "--cooldown", "1M", "--dry-run"], 2,
     "corpus fingerprint 0000000000000000 recorded"),
    (["resume", "{d}/at30", "train.steps=10"], 2, "train.steps=10: {d}/at30 is at step 30 "
     "already"),
    (["resume", "{d}/at30", "train.steps=10"], 2, "(`moelab resume {d}/at30 train.steps=M`)"),
    (["train", "{d}/at30/config.yaml", "model.d_model=64", "--run-dir", "{d}/nocfg"], 2,
     "model.d_model: {d}/nocfg was started with 32, now 64"),
    (["generate", "{d}/othertok"], 2, "{d}/othertok/tokenizer.json: not the tokenizer this run "
     "trained with"),
    (["export", "{d}/othertok", "{d}/ex1", "--to", "hf"], 2, "{d}/othertok/tokenizer.json: not "
     "the tokenizer"),
    (["generate", "{d}/smallvocab"], 2, "(512 tokens) here, a model of 300 tokens"),
    (["generate", "{d}/badcfg"], 2, "{d}/badcfg/config.yaml: invalid YAML: line 2"),
    (["export", "{d}/badcfg", "{d}/ex2", "--to", "hf"], 2, "{d}/badcfg/config.yaml: invalid YAML"),
    # the data folder rebuilt with a tokenizer of another size: a tokenizer change, refused
    # with --accept-data-change too (not a vocab_size to set)
    (["train", "{d}/vocab300/config.yaml", "--run-dir", "{d}/vocab300"], 2,
     "{d}/data300 is not what this run trained on: tokenizer sha256 "),
    (["resume", "{d}/vocab300", "--accept-data-change"], 2, "The tokenizer cannot change, not "
     "even with --accept-data-change: {d}/data300/tokenizer.json (300 tokens; the run's: 512) "
     "would give the model's token ids other text. Tokenize this data with the run's own "
     "tokenizer: data.tokenizer={d}/vocab300/tokenizer.json (`moelab resume {d}/vocab300 "
     "data.tokenizer={d}/vocab300/tokenizer.json`); or train this data in a new run"),
    (["branch", "{d}/vocab300", "--at", "30", "--cooldown", "1M", "--dry-run",
      "--accept-data-change"], 2, "The tokenizer cannot change, not even with "),
    # a moved data folder: refused before the built-in corpus is built in its place
    (["resume", "{d}/moved"], 2, "data.data_dir={d}/movedaway: holds no corpus, so it is not "
     "the data {d}/moved trained on (recorded in {d}/movedaway); restore that folder, or "
     "point data.data_dir at where it moved (`moelab resume {d}/moved data.data_dir=NEW`)"),
    # a deleted tokenizer.json: the recorded one to copy back, and where it is
    (["generate", "{d}/notok"], 2, "{d}/notok/tokenizer.json: not found; copy back the "
     "tokenizer this run trained with, sha256 "),
    (["generate", "{d}/notok"], 2, "(provenance.json): {data}/tokenizer-512.json holds it"),
    # no provenance.json: the checkpoint's meta.json, else the run's tokenizer.json, records it
    (["generate", "{d}/swapped"], 2, "(512 tokens) recorded in the meta.json of step 30; copy "
     "the run's own tokenizer back: {data}/tokenizer-512.json holds it"),
    (["export", "{d}/swapped", "{d}/ex3", "--to", "hf"], 2, "{d}/swapped/tokenizer.json: not "
     "the tokenizer this run trained with"),
    (["resume", "{d}/noprov"], 2, "{d}/dataswap is not what this run trained on: tokenizer "
     "sha256 "),
    (["resume", "{d}/noprov"], 2, "(the run's record: the meta.json of step 30)"),
    (["resume", "{d}/noprovold"], 2, "(the run's record: its tokenizer.json)"),
    (["branch", "{d}/noprov", "--at", "30", "--cooldown", "1M", "--dry-run"], 2,
     "(the run's record: the meta.json of step 30)"),
]

BIG = "3000000000 is more steps than the jitted step counter holds"
BOUND_CASES = [  # int ranges, YAML aliases, coordinator, trackers
    (["train", "tiny", "train.steps=3e9"], 2, f"train.steps: {BIG}"),
    (["train", "tiny", "train.steps=.inf"], 2, "train.steps: expected an integer, got inf"),
    (["train", "tiny", "optim.schedule_steps=3000000000"], 2, f"optim.schedule_steps: {BIG}"),
    (["train", "tiny", "optim.warmup_steps=3e9"], 2, f"optim.warmup_steps: {BIG}"),
    (["train", "tiny", "train.eval_every=3e9"], 2, f"train.eval_every: {BIG}"),
    (["train", "tiny", "data.context_stages=[{{step: 3e9, seq_len: 512}}]"], 2,
     f"data.context_stages[0].step: {BIG}"),
    (["train", "tiny", "data.mixture_schedule=[{{step: 3e9, mixture: {{a: 1}}}}]"], 2,
     f"data.mixture_schedule[0].step: {BIG}"),
    (["train", "tiny", "optim.decays=[{{start: 10, end: 3e9}}]"], 2, f"optim.decays[0].end: {BIG}"),
    (["train", "tiny", "train.seed=5000000000"], 2, "train.seed: 5000000000 must be in [0, "),
    (["train", "tiny", "data.seed=-1"], 2, "data.seed: -1 must be in [0, "),
    (["resume", RUN, "train.steps=3e9"], 2, f"train.steps: {BIG}"),
    (["train", "{d}/laughs.yaml"], 2, "{d}/laughs.yaml: line 3: more than 10 aliases (*name)"),
    (["train", "tiny", f"model.d_model=[&a [1], {', '.join(['*a'] * 11)}]"], 2,
     "line 1: more than 10 aliases (*name) of a list or mapping"),
    (["train", "tiny", "--coordinator", "bogus:99999", "--num-processes", "2", "--process-id",
      "0"], 2, "--coordinator bogus:99999: not HOST:PORT with a port in 1-65535"),
    (["train", "tiny", "--coordinator", ":8476"], 2, "--coordinator :8476: not HOST:PORT"),
    (["resume", "{d}/run", "--coordinator", ":8476"], 2, "--coordinator :8476: not HOST:PORT"),
    (["train", "tiny", "--coordinator", "localhost"], 2, "--coordinator localhost: not HOST:PORT"),
    (["train", "tiny", "--coordinator", "bogus.invalid:8476"], 2,
     "--coordinator bogus.invalid:8476: host 'bogus.invalid' not found"),
    (["train", "tiny", "--run-dir", "memory://runs/x"], 2,
     "--run-dir memory://runs/x: memory:// lives only inside this process"),
    # overrides after an option join those before it (each field once, wherever it is given)
    (["train", "tiny", "--run-dir", "{d}/r6", "train.steps=3e9"], 2, f"train.steps: {BIG}"),
    (["train", "tiny", "train.steps=5", "--run-dir", "{d}/r6", "train.steps=3e9"], 2,
     "override 'train.steps=3e9': train.steps is already set by 'train.steps=5'"),
    (["resume", RUN, "--accept-data-change", "train.steps=3e9"], 2, f"train.steps: {BIG}"),
    (["plan", "tiny", "--accelerator", "h100", "model.n_experts=abc"], 2,
     "model.n_experts: expected an integer, got 'abc'"),
    (["train", "tiny", "--run-dir", "{d}/r6", "stray"], 2,  # the same on Python 3.11 and 3.13
     "override 'stray': expected section.field=value"),
    (["train", "tiny", "--run-dir", "{d}/r6", "--stray"], 2, "unrecognized arguments: --stray"),
    # ... and after a several-value option's values, not read as one more value
    (["plan", "tiny", "--cf", "1.5", "model.n_experts=abc"], 2,
     "model.n_experts: expected an integer, got 'abc'"),
    (["drops", RUN, "--seq-len", "64", "128", "model.d_model=3"], 2,
     "'model.d_model=3': only parallel.* fields change a forecast"),
]

DROPS = ["drops", RUN, "--seq-len", "64"]
OPS_CASES = [  # replan, branch, drops, lab, guard messages
    (["replan", RUN, "--end-steps", "99999999999"], 2,
     "--end-steps 99999999999: must be in 1-2,147,483,647"),
    (["replan", RUN, "--end-tokens", "1000T"], 2, "--end-tokens 1000T: ends at step"),
    (["replan", RUN, "--deadline", "+99999d"], 2, "--deadline +99999d: ends at step"),
    (["replan", RUN, "--seq-len", "7"], 2, "--seq-len 7: must divide the run's 128 tokens"),
    (["replan", "{d}/badplan", "--end-steps", "20"], 2,
     "{d}/badplan/plan_pending.json: not a replan request"),
    (["replan", "{d}/planned", "--end-steps", "20", "--apply"], 2,
     "{d}/planned/plan_pending.json: a plan is already pending (end=40, requested at step 3)"),
    (["branch", RUN, "--at", "7", "--cooldown", "99999999999999"], 2,
     "--cooldown 99,999,999,999,999 tokens: ends at step"),
    (["branch", RUN, "--at", "7", "--cooldown", "1k", "--seq-len", "7", "--dry-run"], 2,
     "--seq-len 7: must divide"),
    (["branch", RUN, "--at", "7", "--cooldown", "1k", "--out", "{d}/afile/b"], 2,
     "branch folder {d}/afile/b: {d}/afile is a file, not a folder"),
    # a run's own file for its folder: named as a file, with the folder (said "no such folder",
    # or a folder "with no config.yaml", before)
    *[([cmd, "{d}/at30/config.yaml", *rest], 2, "{d}/at30/config.yaml: a file, not a run "
       "folder; give its folder, {d}/at30") for cmd, *rest in (
        ["generate"], ["history"], ["resume"], ["replan", "--end-steps", "40"],
        ["branch", "--at", "30", "--cooldown", "1k"], ["drops", "--seq-len", "64"],
        ["export", "{d}/ex9", "--to", "hf"])],
    # --plot: checked before any work (a folder was written as FOLDER.png, said as FOLDER;
    # another format failed after the preview with matplotlib's words)
    (["replan", RUN, "--end-steps", "40", "--plot", "{d}/lab"], 2,
     "--plot {d}/lab: a folder; name a file in it, e.g. {d}/lab/replan_preview.png"),
    (["replan", RUN, "--end-steps", "40", "--plot", "{d}/lr.txt"], 2,
     "--plot {d}/lr.txt: not an image format matplotlib writes; end the name with one of "),
    (["replan", RUN, "--end-steps", "40", "--plot", "{d}/afile/lr.png"], 2,
     "--plot {d}/afile/lr.png: cannot be written"),
    # --place-experts: 0 made a branch without a placement; a count the experts do not divide
    # into was refused only after the preview (and the parent's state restored)
    (["branch", RUN, "--at", "7", "--cooldown", "1k", "--place-experts", "0"], 2,
     "--place-experts 0: must be >= 2 ranks (an EP group)"),
    (["branch", "{d}/at30", "--at", "30", "--cooldown", "1k", "--place-experts", "3",
      "--dry-run"], 2, "--place-experts: 3 ranks must be >= 2 and divide model.n_experts=4"),
    (["drops", RUN, "--seq-len", "0"], 2, "--seq-len 0: must be >= 1"),
    ([*DROPS, "--batches", "0"], 2, "--batches 0: must be >= 1"),
    ([*DROPS, "--tokens-per-rank", "0"], 2, "--tokens-per-rank 0: must be >= 1"),
    (["ladder", "plan", "tiny", "--rungs", "2"], 2, "ladder.rungs: 2 sizes x 1 token multiplier(s)"
     " x 1 seed(s) = 2 runs, and a fit needs at least 3"),
    ([*DROPS, "--seed", "-1"], 2, "--seed -1: must be >= 0"),
    ([*DROPS, "--ranks", "1"], 2, "--ranks 1: must be >= 2"),
    ([*DROPS, "--transport", "bogus"], 2, "--transport bogus: unknown"),
    ([*DROPS, "--json", "{d}/afile/x.json"], 2, "--json {d}/afile/x.json: cannot be written"),
    (["lab", "live", RUN, "--host", "999.1.1.1", "--port", "0"], 2, "--host 999.1.1.1"),
    (["lab", "show", "2", "--lab-dir", "{d}/lab4"], 2, "{d}/lab4/0002-broken.md: no front"),
    (["lab", "list", "--lab-dir", "{d}/lab4"], 2, "{d}/lab4/0002-broken.md: no front"),
    (["lab", "show", "1", "--lab-dir", "{d}/lab4"], 0, "0001-fine: Fine"),
    (["ladder", "guard", RUN, "--strict"], 2, "{d}/run/prediction.json: not found"),
    (["ladder", "guard", RUN], 0, "no band was checked"),
    (["eval", RUN, "--tasks", "moelab_local", "--output", "{d}/afile/r.json"], 2,
     "--output {d}/afile/r.json: {d}/afile is a file, not a folder"),
]

CASES += DATA_CASES + RUN_CASES + BOUND_CASES + OPS_CASES


class Reached(Exception):
    """Raised where a refused input must never get to: the case fails at once, no work done."""


@pytest.fixture
def refuse_work(monkeypatch):
    """Bad input must stop before any real work: an XLA compilation, building the built-in
    corpus or serving the live page each fail the case at once instead of running."""
    from jax._src import monitoring

    from moelab.data import corpus
    from moelab.lab import live

    def compiled(event, _duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            raise Reached("XLA compiled before the input was refused")

    def reached(what):
        def stop(*_args, **_kw):
            raise Reached(f"{what} before the input was refused")
        return stop

    monkeypatch.setattr(corpus, "build_builtin_corpus", reached("built the built-in corpus"))
    monkeypatch.setattr(live.ThreadingHTTPServer, "serve_forever", reached("served the page"))
    monitoring.register_event_duration_secs_listener(compiled)
    yield
    monitoring.unregister_event_duration_listener(compiled)


def _case_id(case) -> str:
    return " ".join(case[0])[:60]


@pytest.mark.parametrize("argv, code, phrase", CASES, ids=map(_case_id, CASES))
def test_bad_input_is_one_clear_line(argv, code, phrase, where, capsys, refuse_work):
    rc, out, err = run_main([a.format(**where) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert "Traceback" not in out + err
    assert rc == code, err
    if code == 0:
        assert phrase in out
        return
    assert lines and lines[-1].startswith("moelab") and ": error: " in lines[-1], err
    assert phrase.format(**where) in lines[-1]
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), err  # argparse's usage
    if argv[0] in ("replan", "branch"):
        assert not out, out  # refused before the preview table, not after it


@pytest.mark.parametrize("argv, phrase", [
    (["replan", "{d}/at30", "--end-steps", "40", "--mixture", "prose=1,cod=2"],
     "--mixture prose=1,cod=2: data.mixture_schedule[0].mixture: unknown domain(s) cod; "
     "available in train"),
    (["branch", "{d}/at30", "--at", "30", "--cooldown", "1k", "--mixture", "bogus=1",
      "--dry-run"],
     "--mixture bogus=1: data.mixture_schedule[0].mixture: unknown domain(s) bogus")])
def test_a_mixture_the_data_lacks_is_refused_before_the_preview(argv, phrase, where, capsys):
    """Checked against the run's data (its samplers built), which follows the plan's own
    check of its LR schedule (a small XLA compile), but comes before anything is printed."""
    rc, out, err = run_main([a.format(**where) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and not out, (out, err)
    assert lines[-1].startswith("moelab: error: ") and phrase in lines[-1], err


def test_the_table_covers_every_command():
    commands = {argv[0] for argv, _, _ in CASES}
    assert {"train", "data", "plan", "ladder", "generate", "lab", "history", "replan",
            "branch", "resume"} <= commands and len(CASES) >= 60


def test_a_context_longer_than_every_stream_names_data_seq_len(data_dir):  # noqa: F811
    from moelab.config import config_from_dict
    from moelab.data.errors import DataError
    from moelab.data.prepare import prepare_data
    from moelab.data.sampler import MixtureSampler
    from moelab.data.store import TokenStore

    data = config_from_dict(micro_dict(data_dir)).data
    store = TokenStore(prepare_data(data, 512, verbose=False).store_dir)
    with pytest.raises(DataError, match=r"data.seq_len: 100000000 needs windows of 100000001 "
                                        r"tokens, and the longest train stream has \d+"):
        MixtureSampler(store, seq_len=100_000_000, batch_size=2)


def test_a_metrics_line_cut_inside_a_character_is_skipped_like_any_cut_line(tmp_path):
    from moelab.run.logs import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "train/loss": 3}\n{"step": 2, "note": "caf\xc3')
    assert read_metrics(path) == ([{"step": 1, "train/loss": 3}], [])
