"""Run operations: the plan of a run is not a fixed spec.

- ``schedule``: operation arguments (token counts, mixtures, RoPE reach). The ``Change``
  itself (new end with a re-timed decay, mixture, context), applied to a config at a step, and
  the resume rules that keep a run's past fixed are in ``moelab.train.changes`` and
  ``moelab.train.resume``: a resume applies them.
- ``replan``: `moelab replan` (a pending plan applied at the next resume).
- ``branch``: `moelab branch` (a cooldown fork of a checkpoint; the parent is untouched).
- ``record``: the operations log, lineage, history and the per-context-stage drop report.
- ``plot``: the figures; ``cli``: ``register(subparsers)`` adds the commands.
"""
