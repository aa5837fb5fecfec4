"""Metric trackers: one interface, the local append-only JSONL log by default, W&B and
TensorBoard event files optionally (each an extra of the install), and the live hardware stats
logged next to the training metrics; and what the console shows of a run beside them: its
notes (a data stage, an abort) and the summary ``moelab train`` prints.

The JSONL log is the run's source of truth; its writer and reader live in ``moelab.run.logs``
(no JAX, no W&B: reports read it without the training stack).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moelab.config import RunConfig
from moelab.config.errors import ConfigError, need_extra, require
from moelab.run.logs import TERMINAL, clean_value
from moelab.util import HungUp, Terminated, stop_said

if TYPE_CHECKING:  # peak imports JAX, which this module leaves to its callers
    from moelab.train.peak import Peaks

WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # wandb.Settings.mode
INIT_TIMEOUT_S = 60.0  # how long wandb.init waits for the W&B server (WANDB_INIT_TIMEOUT sets it)
TB_FLUSH_S = 30.0  # how stale a live TensorBoard's view of the event file may get
OFFLINE_FIX = "or set WANDB_MODE=offline to log locally and `wandb sync` later"


def check_trackers(cfg: RunConfig) -> None:
    """The optional trackers a config asks for are installed and set up (checked before any
    work, before the run folder is made)."""
    if cfg.train.wandb:
        need_extra("wandb", "wandb", "train.wandb=true")
        wandb_init_timeout(os.environ)
        check_wandb_login()
    if cfg.train.tensorboard:
        need_extra("tensorboardX", "tensorboard", "train.tensorboard=true")


def wandb_init_timeout(env) -> float:
    """wandb.init's timeout in seconds, after checking the W&B variables of ``env`` that wandb
    would reject only deep in its settings (a dump that names neither)."""
    mode = env.get("WANDB_MODE") or "online"
    require(mode in WANDB_MODES, f"WANDB_MODE={mode}", "not a W&B mode; set it to online, "
            "offline or disabled, or unset it")
    raw = env.get("WANDB_INIT_TIMEOUT")
    if not raw:
        return INIT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    require(seconds > 0, f"WANDB_INIT_TIMEOUT={raw}", "seconds that wandb.init waits for the "
            f"W&B server: give a number > 0, or unset it ({INIT_TIMEOUT_S:g} s)")
    return seconds


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def check_wandb_login() -> None:
    """W&B online needs an API key: without one (and no terminal to ask for it) wandb.init
    raises a UsageError once the run has started; a malformed one, an AuthenticationError.
    Offline and disabled need none."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return
    import wandb

    try:  # finds the key as wandb.init would (WANDB_API_KEY, .netrc, settings), or asks for it
        wandb.login(verify=False)
    except wandb.errors.UsageError:
        raise ConfigError("train.wandb=true: no W&B API key on this machine; run `wandb login` "
                          f"(or set WANDB_API_KEY), {OFFLINE_FIX}") from None
    except wandb.errors.Error as e:  # e.g. a key of the wrong length
        where = "WANDB_API_KEY" if os.environ.get("WANDB_API_KEY") else "W&B API key"
        raise ConfigError(f"{where}: refused by wandb ({one_line(e)}); set WANDB_API_KEY to "
                          "your key from https://wandb.ai/authorize (or unset it and run "
                          f"`wandb login --relogin`), {OFFLINE_FIX}") from None


def wandb_start_error(e: BaseException, timeout: float) -> str:
    """One line for a wandb.init that failed (no answer from the server within ``timeout``
    seconds, or a refusal)."""
    if any(w in str(e).lower() for w in ("timed out", "deadline exceeded")):
        return (f"train.wandb=true: no answer from the W&B server within {timeout:g} s "
                f"({one_line(e)}); check the network (or raise WANDB_INIT_TIMEOUT), "
                f"{OFFLINE_FIX}")
    return f"train.wandb=true: W&B did not start the run ({one_line(e)}); {OFFLINE_FIX}"


STEP_KEY = "train/step"  # W&B's x-axis: the training step of each row


def wandb_exit_code(kind: str, fields: dict) -> int:
    """The exit code W&B is told when the run's log ended with event ``kind``. W&B shows a
    run "finished" only for 0, "failed" for any other code: a run that failed, diverged or was
    stopped must not read as finished there (a resume continues it); a stop signal gives the
    shell's code, 128 + its number, as the command exits: an abort (Ctrl-C twice, or a stop
    during the setup) names it by its error's type."""
    if kind == "finished":
        return 0
    if kind == "aborted":
        kind, fields = "interrupted", {"signal": _ABORTS.get(
            str(fields.get("error")).split(":", 1)[0], "SIGINT")}
    if kind == "interrupted":
        try:
            return 128 + signal.Signals[str(fields.get("signal"))]
        except KeyError:
            return 128 + signal.SIGINT
    return 1


_ABORTS = {c.__name__: c.signal_name for c in (Terminated, HungUp)}  # else a Ctrl-C


class WandbTracker:
    """Mirrors metrics and events to Weights & Biases (``WANDB_MODE=offline`` works)."""

    def __init__(self, project: str, run_dir: Path, config: dict, name: str, where: str):
        import hashlib

        import wandb

        # The id is unique per run (``where``: its folder, or its URL), so that a resume
        # continues the same W&B run, from any machine
        run_id = f"{name}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"
        timeout = wandb_init_timeout(os.environ)
        try:
            self.run = wandb.init(project=project, dir=str(run_dir), config=config, name=name,
                                  id=run_id, resume="allow",
                                  settings=wandb.Settings(init_timeout=timeout))
        except wandb.errors.CommError as e:  # no network, or the server refused the run
            raise ConnectionError(wandb_start_error(e, timeout)) from None
        # W&B ignores a row logged at a step below one it has, and a resume logs its
        # checkpoint's step again (its event, a redone evaluation) and retrains the steps a
        # stop did not save: the training step is a metric of its own, the x-axis of every
        # chart (W&B's define_metric), and W&B's step only counts rows
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.exit_code = 0  # what finish() tells W&B: set by the event that ends the run

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({**{k: clean_value(v) for k, v in metrics.items()}, STEP_KEY: int(step)})

    def event(self, kind: str, step: int, **fields: Any) -> None:
        self.run.log({f"event/{kind}": json.dumps(fields, default=str), STEP_KEY: int(step)})
        if kind in TERMINAL:  # the events that end a run's log
            self.exit_code = wandb_exit_code(kind, fields)

    def close(self) -> None:
        self.run.finish(exit_code=self.exit_code)


class TensorBoardTracker:
    """Writes numeric metrics as TensorBoard scalars and events as text entries, in one event
    file under ``log_dir`` (tensorboardX's summaries and record writer: no TensorFlow needed).
    Written in this thread, not through SummaryWriter's queue, whose flush leaves queued
    events unwritten: ``flush`` puts everything logged so far on disk (a remote run uploads
    the file with each checkpoint)."""

    def __init__(self, log_dir: Path):
        from tensorboardX.event_file_writer import EventsWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        # its name holds the second it was made; the nanoseconds after it keep a start within
        # the same second (a quick resume) from replacing the file, in order
        self.writer = EventsWriter(str(log_dir / "events"), f".{time.time_ns() % 10**9:09d}")
        self.flushed = time.time()  # the writer has put the file's version record first

    def _write(self, event) -> None:
        event.wall_time = time.time()
        self.writer.write_event(event)
        if event.wall_time - self.flushed >= TB_FLUSH_S:  # a live TensorBoard sees it
            self.flush()

    def log(self, step: int, metrics: dict) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        for k, v in metrics.items():
            v = clean_value(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._write(Event(step=int(step), summary=scalar(k, float(v))))

    def event(self, kind: str, step: int, **fields: Any) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import text

        if kind in ("start", "resume"):
            # from the step trained next, TensorBoard hides what an earlier start logged (steps
            # that one trained past the checkpoint this start is from), as its restart rule
            # does for SummaryWriter's purge_step
            from tensorboardX.proto.event_pb2 import SessionLog

            self._write(Event(step=int(step) + 1,
                              session_log=SessionLog(status=SessionLog.START)))
        self._write(Event(step=int(step), summary=text(f"event/{kind}",
                                                       json.dumps(fields, default=str))))

    def flush(self) -> None:
        self.writer.flush()
        self.flushed = time.time()

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """Fan-out to several trackers."""

    def __init__(self, *trackers):
        self.trackers = [t for t in trackers if t is not None]

    def log(self, step: int, metrics: dict) -> None:
        for t in self.trackers:
            t.log(step, metrics)

    def event(self, kind: str, step: int, **fields: Any) -> None:
        for t in self.trackers:
            t.event(kind, step, **fields)

    def flush(self) -> None:
        """Onto disk what a tracker still buffers (TensorBoard: up to TB_FLUSH_S), so a
        checkpoint's upload to a remote run carries the curves up to it."""
        for t in self.trackers:
            if hasattr(t, "flush"):
                t.flush()

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def process_identity() -> dict:
    """Where the run's process lives; lets a reader tell a running run from a crashed one."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def parse_nvidia_smi(text: str) -> dict:
    """hw/accel_util_percent and hw/accel_mem_* from ``nvidia-smi --query-gpu=utilization.gpu,
    memory.used,memory.total --format=csv,noheader,nounits`` (one line per GPU; MiB)."""
    rows = [[float(x) for x in line.split(",")] for line in text.splitlines() if line.strip()]
    if not rows:
        return {}
    used, total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    return {"hw/accel_util_percent": sum(r[0] for r in rows) / len(rows),
            "hw/accel_mem_gb": used / 1024, "hw/accel_mem_percent": 100 * used / max(total, 1)}


def allocator_memory(device) -> tuple[int, int] | None:
    """(limit, bytes in use) of JAX's allocator on a device; None where it reports no limit
    (CPU devices report nothing)."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or not stats.get("bytes_limit"):
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def _jax_device_memory() -> dict:
    """Accelerator memory from JAX's allocator (GPU/TPU; CPU devices report nothing)."""
    jax = sys.modules.get("jax")  # never import JAX just for this
    if jax is None:
        return {}
    held = [m for m in map(allocator_memory, jax.local_devices()) if m is not None]
    limit, used = sum(m[0] for m in held), sum(m[1] for m in held)
    if not limit:
        return {}
    return {"hw/accel_mem_gb": used / 2**30, "hw/accel_mem_percent": 100 * used / limit}


class HardwareMonitor:
    """Live hardware stats, sampled at each metrics record: machine CPU and memory use, this
    process's resident memory, and accelerator memory and utilisation where available
    (nvidia-smi for NVIDIA GPUs, else JAX's allocator stats). Keys start with ``hw/``."""

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        psutil.cpu_percent(None)  # the first reading starts the measuring interval
        self._smi = shutil.which("nvidia-smi")

    def _nvidia(self) -> dict:
        try:
            out = subprocess.run([self._smi, "--query-gpu=utilization.gpu,memory.used,memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=5, check=True).stdout
            return parse_nvidia_smi(out)
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            self._smi = None  # not usable here: stop asking
            return {}

    def sample(self) -> dict:
        vm = self._psutil.virtual_memory()
        out = {"hw/cpu_percent": self._psutil.cpu_percent(None), "hw/mem_percent": vm.percent,
               "hw/process_rss_gb": self._proc.memory_info().rss / 2**30}
        out.update((self._smi and self._nvidia()) or _jax_device_memory())
        return out


# --- what the console shows: progress notes and the summary (the records are above) ---


def fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def abort_text(e: KeyboardInterrupt, step: int | None, newest: int | None) -> str:
    """What a stop that saved nothing says (``step``: where it stopped, None if before the
    first step): the newest checkpoint, where running the same command resumes."""
    said = stop_said(e) + (" before the first step" if step is None else f" at step {step}")
    if newest is None:
        return f"{said}; no checkpoint yet: running the same command starts the run over"
    if step is None or step == newest:
        return (f"{said}; nothing trained since the checkpoint at step {newest}: run the same "
                "command to resume from it")
    again = f"step {step} trains" if step == newest + 1 else f"steps {newest + 1}-{step} train"
    return (f"{said} without saving; the newest checkpoint is at step {newest}: run the same "
            f"command to resume from it ({again} again)")


def stage_text(step: int, change: dict) -> str:
    """The console line for a data stage (a context length, a mixture) that starts now."""
    text = (f"step {step}: data stage: seq_len {change['seq_len']}, batch "
            f"{change['batch_size']} ({change['seq_len'] * change['batch_size']:,} tokens/step)")
    if change.get("mixture"):
        text += ", mixture " + ", ".join(f"{d} {w:.0%}" for d, w in change["mixture"].items())
    if change.get("left_out"):
        text += (f"; not trained on from here: {', '.join(change['left_out'])} (train stream "
                 f"shorter than one {change['seq_len'] + 1:,}-token window)")
    return text


def mfu_text(metrics: dict, peak: Peaks) -> str:
    """MFU for the progress line, with the share of the measured peak beside it."""
    text = f"MFU {metrics['throughput/mfu']:.1%}"
    if peak.measured is not None and not peak.rated_is_measured:
        text += f" ({metrics['throughput/share_of_measured_peak']:.1%} of measured)"
    return text


def format_summary(s: dict) -> str:
    """The summary as `moelab train` prints it at the end."""
    from moelab.train.peak import format_flops

    lines = [f"run {s['run_dir']}: step {s['step']}/{s['steps']}"
             + (f" (stopped by {s['interrupted']}; run again to resume)" if s["interrupted"] else ""),
             f"  parameters       {s['params_total'] / 1e6:.2f}M total, "
             f"{s['params_active'] / 1e6:.2f}M active per token",
             f"  tokens trained   {s['tokens_trained']:,} in {fmt_time(s['wall_time_s'])}"
             if not s.get("start_step") else  # a resume: its own share, and the run's total
             f"  tokens trained   {s['tokens_trained']:,} in all; {s['tokens_this_start']:,} "
             f"from step {s['start_step']} in {fmt_time(s['wall_time_s'])}"]
    if s.get("data"):
        lines.append(f"  data             {s['data']}")
    if s.get("train/loss") is not None:
        lines.append(f"  train loss       {s['train/loss']:.4f} nats/token")
    if s.get("drops"):
        lines.append(f"  routes dropped   {s['drops']} at the last logged step")
    if s.get("throughput/tokens_per_s"):
        lines.append(f"  throughput       {s['throughput/tokens_per_s']:,.0f} tokens/s, "
                     f"MFU {s['throughput/mfu']:.1%} of {format_flops(s['peak_flops'])}"
                     + (f" ({s['peak_source']})" if s.get("peak_source") else ""))
        share = s.get("throughput/share_of_measured_peak")
        if share is not None and s.get("measured_peak_flops") != s["peak_flops"]:
            lines.append(f"                   {share:.1%} of the matmul peak measured at start "
                         f"({format_flops(s['measured_peak_flops'])})")
    domains = sorted({k.split("/")[1] for k in s if k.startswith("eval/")})
    for d in domains:
        lines.append(f"  held-out {d:<11} loss {s[f'eval/{d}/loss']:.4f}, "
                     f"{s[f'eval/{d}/bpb']:.3f} bits/byte")
    if "baseline/prose/gzip9_bpb" in s:
        model = s.get("eval/prose/bpb", float("nan"))
        verdict = "beats" if model < s["baseline/prose/gzip9_bpb"] else "does NOT beat"
        lines.append(f"  prose vs gzip   model {model:.3f}, gzip -9 "
                     f"{s['baseline/prose/gzip9_bpb']:.3f} bits/byte: the model {verdict} gzip")
    if s.get("sample"):  # control characters a young model draws would drive the terminal
        lines.append("  sample: " + "".join(c if c.isprintable() else " " if c in "\n\t" else
                                           "\ufffd" for c in s["sample"][:300]))
    return "\n".join(lines)
