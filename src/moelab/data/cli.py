"""``moelab data build``: a corpus (built-in, or your own files), a tokenizer trained on it
(or one you give) and the token store, in one folder; ``moelab data verify``: that folder's
files against the checksums recorded when it was built."""

from __future__ import annotations

import shlex
from pathlib import Path

from moelab.config import DataConfig
from moelab.config.data import DATA_FORMATS
from moelab.config.errors import require
from moelab.data import build, corpus
from moelab.data.corpus import SPLITS
from moelab.data.encode import MAX_DEFAULT_WORKERS
from moelab.data.errors import DataError
from moelab.data.prepare import prepare_data, vocab_needed
from moelab.data.store import TokenStore
from moelab.data.tokenizer import load_tokenizer, vocab_problem
from moelab.util import atomic_write_bytes, first_missing, sha256_file


def cmd_data_build(args) -> int:
    out = build.output_folder(args.inputs, args.out)
    require(not out.exists() or out.is_dir(), f"--out {out}", "a file is in the way; give a folder")
    require(args.tokenizer or not vocab_problem(args.vocab), f"--vocab {args.vocab}",
            str(vocab_problem(args.vocab)))
    require(0 < args.heldout < 1, f"--heldout {args.heldout}",
            "a fraction of the documents in (0, 1), e.g. 0.02; every domain keeps held-out "
            "text (training evaluates on it and refuses a corpus without it)")
    require(args.workers is None or args.workers >= 1, f"--workers {args.workers}",
            "tokenizer processes: give 1 or more")
    vocab = args.vocab
    if args.tokenizer:
        if not Path(args.tokenizer).exists():
            raise FileNotFoundError(f"--tokenizer {args.tokenizer}: not found; give an existing "
                                    "tokenizer.json or omit --tokenizer to train one")
        vocab = vocab_needed(load_tokenizer(args.tokenizer))
    require(args.inputs or (args.format, args.text_field, args.split) == ("files", "text", ""),
            "--format/--text-field/--split", "read your INPUT paths; give them")
    build.check_inputs(args.inputs, out)
    if args.inputs:  # paths, types and extras before the folder (and its lock) is made
        corpus.check_user_inputs(args.inputs, args.format, args.text_field, args.split)
    made = first_missing(out)  # the folders this build makes (None: out exists)
    was_empty = made is None and out.is_dir() and not any(out.iterdir())
    # SIGTERM unwinds like Ctrl-C (moelab.cli): temp files go and the lock is released
    command = shlex.join(getattr(args, "argv", ["moelab"]))
    with build.data_lock(out, command):
        build.remove_stale_temps(out)
        try:
            return _build(args, out, vocab, command)
        except BaseException:
            if made is not None or was_empty:  # a first build that failed before writing
                build.remove_if_unused(out, made, keep=was_empty)  # leaves no folder it made
            raise


def _build(args, out: Path, vocab: int, command: str) -> int:
    """The build itself, under the folder's lock."""
    request = build.build_request(args.inputs, args.format, args.text_field, args.split,
                                  args.heldout)
    old = build.check_rebuild(out, request, args.force)
    build.check_own_tokenizer(out, *_new_own_tokenizer(args, out, vocab), args.force)
    keep_own = bool(args.inputs or args.tokenizer)
    if keep_own:  # until its tokenizer is written, runs refuse the folder (check_finished)
        build.mark_unfinished(out, command)
    if args.inputs:  # strings: Path() would mangle gs://, memory:// URLs
        manifest = corpus.build_user_corpus(args.inputs, out / "corpus",
                                            heldout_fraction=args.heldout, fmt=args.format,
                                            text_field=args.text_field, split=args.split)
    else:
        manifest = corpus.build_builtin_corpus(out / "corpus", heldout_fraction=args.heldout)
    if args.force or manifest["fingerprint"] != old:
        build.discard_derived(out, "--force" if args.force else "the corpus changed",
                              keep=Path(args.tokenizer) if args.tokenizer else None)
    own = out / build.OWN_TOKENIZER
    # the folder's own tokenizer (training uses it) is written as soon as it is known, before
    # tokenizing; one still here is the one this build uses (check_own_tokenizer, else
    # discard_derived removed it), so an interrupted rebuild never leaves the folder without it
    prep = prepare_data(DataConfig(data_dir=str(out), tokenizer=args.tokenizer or ""), vocab,
                        progress=not args.no_progress, lock=False,  # held above
                        workers=args.workers,
                        on_tokenizer=(lambda tok: _write_own(own, tok)) if keep_own else None)
    store = TokenStore(prep.store_dir)
    print("\n".join(build_summary(out, manifest, store)))
    # the folder's own tokenizer.json is the one runs read (its tokenizer-<V>.json is the same)
    print(f"corpus: {prep.corpus_dir} (its manifest.json records the inputs, every count and "
          f"the checksums)\ntokenizer: {own if keep_own else prep.tokenizer_path}\n"
          f"token store: {prep.store_dir}")
    for note in short_heldout_notes(store):
        print(note)
    if keep_own:
        print(train_hint(out, vocab_needed(load_tokenizer(own))) + _fitting_seq_len(store))
    return 0


def train_hint(out: Path, vocab: int) -> str:
    """The command that trains on a built folder, quoted as a shell needs it (a folder with
    spaces is one argument when pasted), in a run folder of its own: the default, runs/tiny,
    is the built-in corpus's run, which refuses another corpus and tokenizer."""
    return "train on it with: moelab train tiny " + shlex.join([
        "--run-dir", f"runs/{Path(out).resolve().name}", f"data.data_dir={out}",
        f"model.vocab_size={vocab}"])


# a build may hold up to 256 domains: past this many, the summary counts the rest
SHOWN_DOMAINS = 12


def build_summary(out: Path, manifest: dict, store: TokenStore) -> list[str]:
    """What a build made, in a few lines: its documents and tokens per domain and split (the
    corpus's manifest.json holds every count, the inputs and the checksums)."""
    n_in = len(manifest.get("sources", []))
    origin = ("the built-in corpus" if manifest.get("kind") == "builtin"
              else f"{n_in} input{'s' * (n_in != 1)}")
    total, domains = manifest["total"], sorted(manifest["domains"])
    head = (f"built {out} from {origin}: {sum(total[s]['docs'] for s in SPLITS):,} documents "
            f"({_text_size(sum(total[s]['bytes'] for s in SPLITS))} of text) in "
            f"{len(domains)} domain{'s' * (len(domains) != 1)}")
    stored = {s: set(store.domains(s)) for s in SPLITS}  # a domain may hold out nothing

    def row(name: str, names: list[str]) -> list[str]:
        return [name] + [f"{n:,}" for s in SPLITS for n in (
            sum(manifest["domains"][d][s]["docs"] for d in names),
            sum(store.n_tokens(s, d) for d in names if d in stored[s]))]

    rows = [["domain", "train docs", "tokens", "held-out docs", "tokens"]]
    rows += [row(d, [d]) for d in domains[:SHOWN_DOMAINS]]
    if len(domains) > SHOWN_DOMAINS:
        rows.append(row(f"({len(domains) - SHOWN_DOMAINS} more)", domains[SHOWN_DOMAINS:]))
    if len(domains) > 1:
        rows.append(row("all", domains))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [head] + ["  " + "  ".join([r[0].ljust(width[0])] + [c.rjust(w) for c, w in
                                                                 zip(r[1:], width[1:])])
                     for r in rows]


def _text_size(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e6 else f"{n_bytes / 1e3:.1f} kB"


def _fitting_seq_len(store: TokenStore) -> str:
    """`` data.seq_len=N`` (a power of two) when the tiny preset's context is longer than the
    shortest domain's held-out text can evaluate (such a run is refused); else ""."""
    from moelab.config import load_config

    held = [store.n_tokens("heldout", d) for d in store.domains("heldout")]
    if not held or min(held) > load_config("tiny").data.seq_len:
        return ""
    return f" data.seq_len={1 << max(0, (min(held) - 1).bit_length() - 1)}"


def _write_own(own: Path, tok: Path) -> None:
    """Make ``tok`` the data folder's own tokenizer (``own``), unless it is already."""
    data = tok.read_bytes()
    if not own.is_file() or own.read_bytes() != data:
        atomic_write_bytes(own, data)
    (own.parent / build.UNFINISHED).unlink(missing_ok=True)  # runs may use the folder now


# data.seq_len + 1 of the longest preset: a domain holding out fewer tokens is refused by such
# runs (moelab.train.heldout.check_heldout), so the build says so before anyone trains
LONGEST_WINDOW = 4097


def short_heldout_notes(store: TokenStore) -> list[str]:
    """A note for each domain whose held-out tokens are fewer than ``LONGEST_WINDOW``."""
    notes = []
    for d in store.domains("heldout"):
        n = store.n_tokens("heldout", d)
        if n < LONGEST_WINDOW:
            notes.append(f"note: domain {d!r} holds out {n:,} tokens: a run with data.seq_len "
                         f">= {n:,} cannot evaluate it and refuses this folder (evaluation reads "
                         "windows of seq_len + 1 tokens); a larger --heldout or more text in "
                         "that domain gives it more")
    return notes


def _new_own_tokenizer(args, out: Path, vocab: int) -> tuple[Path | None, str]:
    """(the tokenizer this build makes the folder's own, None for none; the option asking)."""
    if args.tokenizer:
        return Path(args.tokenizer), f"--tokenizer {args.tokenizer}"
    if args.inputs:
        return out / f"tokenizer-{vocab}.json", f"--vocab {vocab}"
    return None, "a build of the built-in corpus without --tokenizer"


def cmd_data_verify(args) -> int:
    """Check a data folder's corpus and every token store in it (or one store) in full."""
    root = Path(args.data_dir)
    if not root.is_dir():
        raise DataError(f"{root}: {'a file, not a' if root.exists() else 'no such'} folder; give "
                        "a folder written by `moelab data build` (or one of its tokens-* folders)")
    stores = [root] if (root / "index.json").is_file() else sorted(root.glob("tokens-*"))
    manifest = root / "corpus" / "manifest.json"
    if not stores and not manifest.is_file():
        raise DataError(f"{root}: no corpus or token store here; give a folder written by "
                        "`moelab data build` (or one of its tokens-* folders)")
    lines = []
    if manifest.is_file():
        files = corpus.load_manifest(root / "corpus").get("files", {})
        for name, want in sorted(files.items()):
            if sha256_file(root / "corpus" / name) != want:
                raise DataError(f"{root / 'corpus' / name}: contents differ from the sha256 in "
                                f"{manifest}; {corpus.REBUILD}")
        lines.append(f"ok: {root / 'corpus'} ({len(files)} files)")
    for s in stores:
        st = TokenStore(s)
        n = st.verify()
        lines.append(f"ok: {s} ({sum(1 for _ in s.rglob('*.bin'))} arrays, {n / 1e6:.1f} MB, "
                     f"ids up to {st.max_id()})")
    print("\n".join(lines))
    return 0


def register(sub) -> None:
    d = sub.add_parser("data", help="corpus, tokenizer and token store")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    b = dsub.add_parser("build", help="build a corpus (built-in, or your own files), train a "
                        "tokenizer and tokenize", description="Without INPUT paths: the built-in "
                        "corpus from installed packages. With paths: your text files (.txt, .md, "
                        "source code ...), .jsonl/.json (field 'text', optional 'domain') and "
                        ".parquet (column 'text'), or "
                        "Hugging Face datasets (--format). Paths may be gs://, s3://, memory:// "
                        "or file:// URLs (read through fsspec). Each document belongs to a "
                        "domain: its record's 'domain' field, else the name of the folder "
                        "holding its file. Every domain holds out part of its text and is "
                        "evaluated on its own (eval/<domain>/loss); names keep ASCII letters, "
                        "digits, _ . - (other names get a hash suffix; at most 256 domains).")
    b.add_argument("inputs", nargs="*", help="your own files or folders (or URLs)")
    b.add_argument("--format", default="files", choices=DATA_FORMATS,
                   help="files: moelab's readers (default); hf-disk: folders written by "
                   "datasets' save_to_disk; hf-files: .json/.jsonl/.csv/.parquet/.txt through "
                   "datasets' builders; hf-stream: the same, streamed")
    b.add_argument("--text-field", default="text",
                   help="the field/column holding each document's text (default: text)")
    b.add_argument("--split", default="", help="datasets split to read (hf-*; default: train, "
                   "or the only one)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.add_argument("--out", help=f"output folder (required with INPUT paths; without them "
                   f"{build.BUILTIN_OUT}, the built-in corpus)")
    b.add_argument("--force", action="store_true", help="replace a corpus the folder holds from "
                   "other inputs or options; its tokenizers and token stores are retrained")
    b.add_argument("--vocab", type=int, default=4096,
                   help="BPE vocabulary size to train (258 to 16,777,216)")
    b.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    b.add_argument("--heldout", type=float, default=0.02,
                   help="held-out fraction of documents, in (0, 1); each domain holds out at "
                   "least one document (a lone document, its end)")
    b.add_argument("--workers", type=int, help="tokenizer processes (default: half the usable "
                   f"cores, at most {MAX_DEFAULT_WORKERS}; 1 tokenizes in this process); the "
                   "token store is the same for any number")
    b.set_defaults(fn=cmd_data_build)
    v = dsub.add_parser("verify", help="check a data folder's files against their checksums",
                        description="Hash the corpus files and every token array in full and "
                        "compare with the checksums recorded at build. Exit 0 when all match; "
                        "exit 2 naming the first damaged file.")
    v.add_argument("data_dir", metavar="DATA_DIR", help="a folder written by `moelab data "
                   "build`, or one of its tokens-* folders")
    v.set_defaults(fn=cmd_data_verify)
