"""The run folder: what training writes and every reader of a run needs.

``checkpoint`` (orbax checkpoints: atomic, verified, asynchronous) with ``ckpt_target`` (a
checkpoint against its restore target), ``lock`` (one writer per folder), ``remote`` (run
folders on fsspec URLs, mirrored), ``logs`` (``metrics.jsonl`` and ``ops.jsonl``; no JAX),
``provenance`` (``provenance.json``) and ``load`` (a run folder or URL loaded for inference).

Nothing is imported here: ``moelab.run.logs`` stays readable without loading JAX.
"""
