"""``moelab eval``: score a trained run on lm-evaluation-harness tasks (``evaluate``)."""

from __future__ import annotations

from pathlib import Path

from moelab.config.errors import require
from moelab.util import check_writable, info, is_url, native_work, stop_said


def cmd_eval(args) -> int:
    from moelab.harness.evaluate import (
        default_output,
        evaluate_run,
        format_results,
        save_results,
        split_tasks,
    )

    tasks = split_tasks(args.tasks)
    check_output(args.run, args.output)
    try:
        # XLA's threads may still run when a stop signal arrives: after its message the
        # process ends at once, not through interpreter shutdown (a segmentation fault)
        with native_work():
            results = evaluate_run(args.run if is_url(args.run) else Path(args.run), tasks,
                                   limit=args.limit, batch_size=args.batch_size,
                                   num_fewshot=args.num_fewshot, step=args.step,
                                   include_paths=[Path(p) for p in args.include_path])
    except KeyboardInterrupt as e:  # the CLI prints the message and exits 128 + the signal
        e.args = (f"{stop_said(e)} during the evaluation; nothing was saved (the results are "
                  "written once every task has run): run the same command again",)
        raise
    rel = default_output(Path(), tasks, results["moelab"]["step"], args.limit, args.num_fewshot)
    # saved before the table is printed: a Ctrl-C or a closed pipe there loses nothing
    if is_url(args.run) and not args.output:
        out = _save_to_run_url(args.run, results, rel)
    else:
        out = Path(args.output) if args.output else Path(args.run) / rel
        save_results(results, out)
    print(format_results(results))
    print(f"results: {out}")
    if not args.output:  # the model card reads RUN/eval/ when it is written, not after
        print(f"the model card of `moelab export {args.run} --step {results['moelab']['step']}"
              " --to hf OUT` shows these scores; an export written before this evaluation "
              "does not: export again")
    return 0


def _save_to_run_url(url: str, results: dict, rel: Path) -> str:
    """Save the results in the run at ``url`` (URL/eval/...); where the upload fails, in the
    current folder instead, so an evaluation is never lost at its end."""
    from moelab.harness.evaluate import results_json, save_results
    from moelab.run.load import run_name
    from moelab.run.remote import Mirror, staging_dir

    try:
        mirror = Mirror(url, staging_dir(url, ".read"))
        mirror.write(rel.as_posix(), results_json(results).encode())
        return f"{mirror.url}/{rel.as_posix()}"
    except Exception as e:  # noqa: BLE001 -- any failure of the store: keep the results here
        local = Path(f"{run_name(url)}-{rel.name}")
        save_results(results, local)
        info(f"moelab: saving the results in {url} failed ({type(e).__name__}: {e}); saved here "
             "instead")
        return str(local)


def check_output(run: str, output: str | None) -> None:
    """Refuse, before the model is loaded or any task runs, results that could not be saved
    (a read-only run folder would lose the whole evaluation at the end)."""
    if output:
        require(not Path(output).is_dir(), f"--output {output}", "a folder; name a file")
        check_writable(Path(output).parent, f"--output {output}", "name a file in a folder "
                       "you can write")
    elif not is_url(run):
        # else a file or a missing folder would be refused as an unwritable eval/ folder
        require(Path(run).is_dir(), run, "not a run folder; give the folder `moelab train` "
                "wrote (e.g. runs/tiny) or a run URL")
        folder = Path(run) / "eval"
        check_writable(folder, f"{folder} (where results are saved)",
                       "give --output FILE in a folder you can write")


def register(sub) -> None:
    e = sub.add_parser("eval", help="score a trained run on lm-evaluation-harness tasks",
                       description="Run lm-evaluation-harness tasks on a run's checkpoint: "
                       "moelab's local tasks (group moelab_local, no network needed), task "
                       "YAML folders given with --include-path, or harness built-ins (their "
                       "datasets are downloaded into the Hugging Face cache on first use; "
                       "with HF_DATASETS_OFFLINE=1 only the cache is read). Prints the "
                       "results table and saves the JSON in RUN/eval/ (a run URL's too). "
                       "Needs the eval extra: pip install -e '.[eval]'.")
    e.add_argument("run", help="run folder (e.g. runs/tiny) or run URL")
    e.add_argument("--tasks", required=True, help="comma-separated task or group names, "
                   "e.g. moelab_local or moelab_choice,moelab_heldout")
    e.add_argument("--limit", type=int, default=None, help="at most N examples per task")
    e.add_argument("--batch-size", type=int, default=8, help="requests per forward pass")
    e.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples in each prompt (default: each task's own)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    e.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a folder of extra task YAML files (repeatable)")
    e.add_argument("--output", help="results JSON (default: "
                   "RUN/eval/<tasks>-step<N>.json; -limit<L> and -<K>shot added when given)")
    e.set_defaults(fn=cmd_eval)
