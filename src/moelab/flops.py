"""Parameter and FLOP counts derived from the model's own parameter tree (kept importable here;
the implementation lives in ``moelab.plan``)."""

from moelab.plan import (  # noqa: F401
    attention_context, param_breakdown, param_counts, train_flops_per_token)
