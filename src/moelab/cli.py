"""The ``moelab`` command line: one entry point, a subcommand per job, ``--help`` everywhere.

This module only assembles: each package registers its own subcommands (``register`` in its
cli module), in the order ``moelab --help`` lists them. A command registered by a package below
a layer it needs is handed that piece here: ``train --record`` attaches through ``moelab.lab``,
``plan --xla`` compiles ``moelab.train.step``, ``generate`` loads the run through
``moelab.run.load``.
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import os
import re
import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Iterator

# Only the standard library here: a Ctrl-C while the rest loads (JAX takes a second) reaches
# main(), which ends quietly; the packages are imported where the parser is built.


def _train_step():
    """moelab.train.step, imported only when ``plan --xla`` compiles it."""
    from moelab.train import step

    return step


def _load_run(run, step=None):
    """moelab.run.load.load_run, imported only when ``generate`` runs."""
    from moelab.run.load import load_run

    return load_run(run, step=step)


class Parser(argparse.ArgumentParser):
    """argparse's parser, and a "did you mean" for a mistyped choice: a command or a subcommand
    (``moelab trian``, ``moelab ladder fti``; subparsers are made of their parent's class) or an
    option's fixed values."""

    def _check_value(self, action, value):
        choices = action.choices
        if choices is not None and isinstance(value, str) and value not in choices:
            close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)],
                                              n=1)
            if close:
                raise argparse.ArgumentError(action, f"invalid choice: {value!r}; did you mean "
                                             f"{close[0]!r}? (choose from "
                                             f"{', '.join(map(repr, choices))})")
        super()._check_value(action, value)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moelab")
    except PackageNotFoundError:  # src/ on the path, not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    from moelab import generate
    from moelab.config.cli import register_presets
    from moelab.data.cli import register as register_data
    from moelab.export.cli import register as register_export
    from moelab.harness.cli import register as register_eval
    from moelab.lab.cli import attach_from_train
    from moelab.lab.cli import register as register_lab
    from moelab.ladder.cli import register as register_ladder
    from moelab.ops.cli import register as register_ops
    from moelab.planner.cli import register as register_plan
    from moelab.train.cli import register_config, register_train

    p = Parser(prog="moelab", description="Train sparse Mixture-of-Experts language models in "
               "the open.")
    p.add_argument("--version", action="version", version=f"moelab {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_train(sub, attach_record=attach_from_train)
    register_config(sub)
    generate.register(sub, load_run=_load_run)
    register_eval(sub)
    register_data(sub)
    register_plan(sub, train_step=_train_step)
    register_presets(sub)
    register_lab(sub)
    register_ops(sub)  # replan, branch, resume, history, drops
    register_ladder(sub)
    register_export(sub)
    return p


OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")  # section.field=value


def place_overrides(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """Words given after an option (``train CFG --run-dir R train.steps=5``) join the command's
    ``overrides`` list, after those before it, where the config checks them (a stray word is
    named there wherever it stands, as newer Pythons' argparse, 3.13's for one, already places
    it); returns what is left unrecognized (options)."""
    if not hasattr(args, "overrides"):
        return extra
    args.overrides = [*args.overrides, *(a for a in extra if not a.startswith("-"))]
    return [a for a in extra if a.startswith("-")]


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command's parser that ``argv`` selects (``ladder fit`` -> its own)."""
    for tok in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        if tok in subs[0].choices:
            parser = subs[0].choices[tok]
    return parser


def split_off_overrides(parser: argparse.ArgumentParser, argv: list[str]
                        ) -> tuple[list[str], list[str]]:
    """(``argv`` without the overrides that follow a several-value option's values, those
    overrides): argparse would read ``--seq-len 64 parallel.waves=99`` as two lengths."""
    multi = [s for a in _command_parser(parser, argv)._actions
             if a.option_strings and a.nargs in ("+", "*") for s in a.option_strings]
    kept, pulled, in_multi = [], [], False
    for tok in argv:
        if tok.startswith("-"):  # an option (abbreviations too) starts or ends a run of values
            in_multi = "=" not in tok and any(m.startswith(tok) for m in multi if len(tok) > 2)
        elif in_multi and OVERRIDE.match(tok):
            pulled.append(tok)
            continue
        kept.append(tok)
    return kept, pulled


def _as_override(option: str) -> str | None:
    """``--steps`` as the config fields it may mean (``train.steps=VALUE``; ``--seed``: two),
    or None."""
    import dataclasses

    from moelab.config import RunConfig

    name, cfg = option.lstrip("-").split("=", 1)[0].replace("-", "_"), RunConfig()
    fields = [f"{sec.name}.{name}=VALUE" for sec in dataclasses.fields(cfg)
              if name in {f.name for f in dataclasses.fields(getattr(cfg, sec.name))}]
    return " or ".join(fields) or None


def unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's "unrecognized arguments" and, for a mistyped option, the closest of the
    command's own (``--stpes``: ``--steps``), or the config override it may mean where the
    command takes overrides (``moelab train --steps``: ``train.steps=VALUE``)."""
    known = [s for a in parser._actions for s in a.option_strings]
    overrides = any(a.dest == "overrides" for a in parser._actions)
    hints = []
    for tok in (t for t in extra if t.startswith("-")):
        close = difflib.get_close_matches(tok.split("=", 1)[0], known, n=1, cutoff=0.75)
        hints += close or [o for o in [overrides and _as_override(tok)] if o]
    hint = f"; did you mean {' '.join(dict.fromkeys(hints))}?" if hints else ""
    return f"unrecognized arguments: {' '.join(extra)}{hint}"


def main(argv: list[str] | None = None) -> int:
    """The ``moelab`` command: its exit status. Without ``argv`` it is the program itself (the
    console script, ``python -m moelab``): a Ctrl-C while Python still loads ends it quietly
    (130), as one during the command does, and one while the interpreter shuts down after the
    command (a second Ctrl-C after a stop saved its checkpoint) leaves the status as it is."""
    program = argv is None and threading.current_thread() is threading.main_thread()
    if program:  # registered before JAX loads, so it runs after JAX's own exit handlers
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)  # and through teardown
    try:
        code = _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt as e:  # before the command ran, or while it said why it stopped
        code = 128 + signal.Signals[getattr(e, "signal_name", "SIGINT")]
        _say(f"\nmoelab: {getattr(e, 'said', 'aborted')}")
    if program:  # until the last exit handler: end at once with the status already decided
        signal.signal(signal.SIGINT, lambda *_: _exit_now(code))
    return code


def _say(msg: str) -> None:
    """``msg`` on stderr, if the terminal is still there."""
    try:
        print(msg, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a console gone or closed
        pass


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


@contextmanager
def stops_kept() -> Iterator[None]:
    """Within: a stop raised inside a garbage collector's callback is raised again outside it.
    Python drops an exception such a callback raises (printed as "Exception ignored"), and JAX
    frees XLA's buffers in one at most collections: a Ctrl-C that landed there was lost, and
    the command went on to its end. The signal is sent to the main thread again, from another
    thread a moment later (sent from here it would be raised here, and dropped again)."""
    before = sys.unraisablehook

    def hook(unraisable) -> None:
        stop = unraisable.exc_value
        if not isinstance(stop, KeyboardInterrupt):  # Terminated and HungUp are ones too
            return before(unraisable)
        sig = signal.Signals[getattr(stop, "signal_name", "SIGINT")]
        again = threading.Timer(0.01, signal.pthread_kill, (threading.main_thread().ident, sig))
        again.daemon = True
        again.start()

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:  # else a hook chained after it within stays in place
            sys.unraisablehook = before


@contextmanager
def ignored(category: type[Warning]) -> Iterator[None]:
    """Within: ``category``'s warnings ignored. Only that filter goes after, unlike
    ``warnings.catch_warnings``, which drops those added within too: the checkpointer's, for
    the writes of a failed save that Python warns of after the command, as it collects them."""
    ours = ("ignore", None, category, None, 0)
    had = ours in warnings.filters
    warnings.simplefilter("ignore", category)
    try:
        yield
    finally:
        if not had and ours in warnings.filters:
            warnings.filters.remove(ours)  # an "ignore" leaves no registry entry to clear


def _main(argv: list[str]) -> int:
    from moelab.config import ConfigError
    from moelab.run.checkpoint import CheckpointError, CheckpointWarning
    from moelab.util import (
        Terminated,
        exit_if_abandoned,
        info,
        output_gone,
        sigterm_raises,
        stop_said,
    )

    parser = build_parser()
    kept, pulled = split_off_overrides(parser, argv)
    args, extra = parser.parse_known_args(kept)
    extra = place_overrides(args, [*extra, *pulled])
    if extra:  # what parse_args would refuse, with the command's usage
        command = _command_parser(parser, kept)
        command.error(unrecognized(command, extra))
    args.argv = ["moelab", *argv]  # recorded by operations
    try:
        # so that cleanup runs on SIGTERM and SIGHUP as on Ctrl-C; a checkpoint passed over
        # is said once, by the checkpointer's own WARNING line, not again as Python's warning
        with sigterm_raises(), stops_kept(), ignored(CheckpointWarning):
            return args.fn(args)
    except BrokenPipeError as e:
        if not output_gone(sys.stdout):  # another pipe or socket broke: an error like any other
            info(f"moelab: error: {e}")
            return 2
        # the reader of the output went away (`moelab plan ... | head`): nothing to say; the
        # interpreter's flush at exit would fail on the closed pipe and say so
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a command ended by SIGPIPE
    except (ConfigError, OSError, ValueError, CheckpointError, FloatingPointError) as e:
        info(f"moelab: error: {e}")
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP (Terminated); a message says more
        code = 128 + (signal.Signals[e.signal_name] if isinstance(e, Terminated) else signal.SIGINT)
        info(f"\nmoelab: {str(e) or stop_said(e)}")  # info: the terminal may have gone (SIGHUP)
        exit_if_abandoned(code)  # a native worker still runs: end now
        return code

if __name__ == "__main__":
    sys.exit(main())
