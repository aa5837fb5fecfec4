"""A ``jax.profiler`` trace of chosen training steps (``train.profile_steps=START:END``).

The trace goes to ``<run folder>/profile`` (``profile/process_<i>`` for each process of a
multi-process run): ``plugins/profile/<time>/<host>.xplane.pb``, which TensorBoard's profile
plugin reads (``tensorboard --logdir RUN/profile``), and ``perfetto_trace.json.gz`` beside it,
which ui.perfetto.dev opens. The device finishes the steps before START before the trace
starts, and steps up to END - 1 before it stops, so it holds the chosen steps whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax

from moelab.config.run import step_range

PROFILE_DIR = "profile"


def profile_dir(run_dir: Path) -> Path:
    """Where this process writes its trace."""
    folder = run_dir / PROFILE_DIR
    return folder / f"process_{jax.process_index()}" if jax.process_count() > 1 else folder


class StepTracer:
    """Starts the trace before step START runs and stops it once step END - 1 has run (or when
    the loop ends first). ``before``/``after`` take the number of the step about to run / just
    run, and the train state (waited on, so the trace holds only the chosen steps)."""

    def __init__(self, steps: str, run_dir: Path, say: Callable[[str], None]):
        self.range = step_range(steps, "train.profile_steps")
        self.folder = profile_dir(run_dir)
        self.say = say
        self.active = False

    def starts_at(self, step: int) -> bool:
        """Whether ``before(step)`` starts the trace (waiting for the steps before it)."""
        return bool(self.range) and not self.active and self.range[0] <= step < self.range[1]

    def stops_at(self, step: int) -> bool:
        """Whether ``after(step)`` stops the trace (waiting for the traced steps)."""
        return self.active and step >= self.range[1] - 1

    def before(self, step: int, state: Any) -> None:
        if self.starts_at(step):
            jax.block_until_ready(state)
            self.folder.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self.active, self.first, self.last = True, step, None

    def after(self, step: int, state: Any) -> None:
        if self.active:
            self.last = step
            if self.stops_at(step):
                self.close(state)

    def close(self, state: Any = None) -> None:
        """Stop the trace if it runs (at the loop's end too: a stop signal or an error)."""
        if not self.active:
            return
        self.active = False
        try:
            if state is not None:
                jax.block_until_ready(state)
        finally:
            jax.profiler.stop_trace()
        if self.last is not None:
            self.say(f"profile: steps {self.first}-{self.last} traced into {self.folder} "
                     "(tensorboard --logdir, or perfetto_trace.json.gz in ui.perfetto.dev)")
