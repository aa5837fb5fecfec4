"""Planning arithmetic for a run: parameters, tokens, FLOPs, time on a cluster, memory per
device, and the estimates against XLA's compiled memory analysis. Formulas: docs/plan.md.

Everything about the model is read from the model's own code, so it cannot drift from what
trains. Modules (each imported on first use of one of its names, so ``import moelab.planner``
and ``moelab.planner.counts`` stay cheap for the train loop):

- ``counts``: parameter tree, breakdown and counts, tokens trained, FLOPs per token;
- ``cluster``: accelerators and time on a cluster;
- ``memory``: weights, optimizer state, activations and transport buffers per device;
- ``xla``: the estimates next to XLA's memory analysis of compiled programs;
- ``report``: ``build_plan`` / ``format_plan``, what ``moelab plan`` prints.

The planner imports only moelab.config, moelab.util, moelab.model and moelab.parallel (train
imports it for MFU; ``xla.compare_with_xla`` is handed the train step instead).
"""

from __future__ import annotations

import importlib

_MODULES = {
    "counts": ("PUBLISHED_ACTIVE", "COMPONENT_ORDER", "ROUTED", "component", "param_tree",
               "param_leaves", "active_size", "param_breakdown", "param_counts", "run_tokens",
               "attention_context", "kv_used_fraction", "matmul_params_per_token",
               "attention_flops_per_token", "train_flops_per_token", "flops_report"),
    "cluster": ("GiB", "Accelerator", "ACCELERATORS", "accelerator", "cluster_estimate"),
    "memory": ("Layout", "state_memory", "residual_bytes", "KERNELS", "kernel_residuals",
               "activation_memory", "transport_memory", "CAPACITY_FIELDS", "transport_options",
               "with_transport", "memory_report"),
    "xla": ("scaled_config", "xla_memory", "compare_with_xla", "compare_sharded_with_xla",
            "compare_transport_with_xla"),
    "report": ("build_plan", "format_plan"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    """Load the submodule that holds ``name`` on first access (PEP 562)."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
