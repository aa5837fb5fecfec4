"""``moelab data build``: a corpus (built-in, or your own files), a tokenizer trained on it
(or one you give) and the token store, in one folder."""

from __future__ import annotations

import json
from pathlib import Path

from moelab.config import DataConfig
from moelab.config.data import DATA_FORMATS
from moelab.config.errors import require
from moelab.data import corpus
from moelab.data.prepare import OWN_TOKENIZER, prepare_data, vocab_needed
from moelab.data.tokenizer import MIN_VOCAB, load_tokenizer
from moelab.util import atomic_write_bytes


def cmd_data_build(args) -> int:
    out = Path(args.out)
    require(not out.exists() or out.is_dir(), f"--out {out}", "a file is in the way; give a folder")
    require(args.tokenizer or args.vocab >= MIN_VOCAB, f"--vocab {args.vocab}",
            f"must be >= {MIN_VOCAB} (256 byte tokens, <|endoftext|> and at least one merge)")
    require(0 <= args.heldout < 1, f"--heldout {args.heldout}",
            "a fraction of the documents in [0, 1), e.g. 0.02")
    vocab = args.vocab
    if args.tokenizer:
        if not Path(args.tokenizer).exists():
            raise FileNotFoundError(f"--tokenizer {args.tokenizer}: not found; give an existing "
                                    "tokenizer.json or omit --tokenizer to train one")
        vocab = vocab_needed(load_tokenizer(args.tokenizer))
    require(args.inputs or (args.format, args.text_field, args.split) == ("files", "text", ""),
            "--format/--text-field/--split", "read your INPUT paths; give them")
    if args.inputs:  # strings: Path() would mangle gs://, memory:// URLs
        manifest = corpus.build_user_corpus(args.inputs, out / "corpus",
                                            heldout_fraction=args.heldout, fmt=args.format,
                                            text_field=args.text_field, split=args.split)
    else:
        manifest = corpus.build_builtin_corpus(out / "corpus", heldout_fraction=args.heldout)
    print(json.dumps({k: v for k, v in manifest.items() if k != "skipped"}, indent=2))
    own = out / OWN_TOKENIZER
    own.unlink(missing_ok=True)  # a rebuild chooses its tokenizer again
    prep = prepare_data(DataConfig(data_dir=str(out), tokenizer=args.tokenizer or ""), vocab,
                        progress=not args.no_progress)
    print(f"corpus: {prep.corpus_dir}\ntokenizer: {prep.tokenizer_path}\n"
          f"token store: {prep.store_dir}")
    if args.inputs or args.tokenizer:  # the folder's own tokenizer: training uses it
        atomic_write_bytes(own, prep.tokenizer_path.read_bytes())
        vocab = vocab_needed(load_tokenizer(own))
        print(f"train on it with: moelab train tiny data.data_dir={out} model.vocab_size={vocab}")
    return 0


def register(sub) -> None:
    d = sub.add_parser("data", help="corpus, tokenizer and token store")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    b = dsub.add_parser("build", help="build a corpus (built-in, or your own files), train a "
                        "tokenizer and tokenize", description="Without INPUT paths: the built-in "
                        "corpus from installed packages. With paths: your .txt/.md files, .jsonl "
                        "(field 'text', optional 'domain') and .parquet (column 'text'), or "
                        "Hugging Face datasets (--format). Paths may be gs://, s3://, memory:// "
                        "or file:// URLs (read through fsspec).")
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
    b.add_argument("--out", default="data/builtin", help="output folder (default: data/builtin)")
    b.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size to train")
    b.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    b.add_argument("--heldout", type=float, default=0.02, help="held-out fraction of documents")
    b.set_defaults(fn=cmd_data_build)
