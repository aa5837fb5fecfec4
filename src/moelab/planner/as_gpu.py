"""Tracing moelab on a machine without a GPU as a GPU would run it: what a CPU can check of the
GPU path before a GPU runs it (the FLOP audit's GPU form, the CUDA lowering of the benchmark's
rows and of the Triton kernels)."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax


@contextlib.contextmanager
def traced_as_gpu():
    """Trace moelab as a GPU runs it: ``jax.default_backend()`` (which picks cuDNN attention
    and allows the Hopper expert kernels) and cuDNN's version check answer as on a GPU (cuDNN
    9.10); the device queries answer as an H200's: moelab's (compute capability 9.0, which
    makes ``moe_impl=auto`` the gmm kernel), from JAX 0.11 the Triton lowering's (the same; it
    fails on a machine without a GPU), and the Hopper weight-gradient kernel's SM count. For
    tracing and lowering only: nothing compiles or runs. On a GPU it changes nothing."""
    if jax.default_backend() == "gpu":
        yield
        return
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from moelab.model import experts

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(jax, "default_backend", lambda: "gpu"))
        stack.enter_context(mock.patch.object(experts, "cuda_capability", lambda: 9.0))
        stack.enter_context(mock.patch.object(cudnn, "check_cudnn_version", lambda: 91000))
        try:
            from jax._src.pallas.triton import gpu_info  # JAX >= 0.11
        except ImportError:
            pass
        else:
            h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
            stack.enter_context(mock.patch.object(gpu_info, "get_gpu_info", lambda: h200))
        try:  # JAX's example kernels, not its API: the mgpu path alone needs them
            from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as hopper_wgrad
        except ImportError:
            pass
        else:
            stack.enter_context(mock.patch.object(hopper_wgrad, "jax", _WithH200Devices()))
        yield


class _WithH200Devices:
    """``jax`` as JAX's Hopper weight-gradient kernel sees it: ``jax.devices()[0].core_count``
    (read while tracing, to size its grid; a CPU device has none) is an H200's 132 SMs."""

    def __getattr__(self, name):
        return getattr(jax, name)

    def devices(self, *args, **kwargs):
        return [_H200(d) for d in jax.devices(*args, **kwargs)]


class _H200:
    core_count = 132

    def __init__(self, device):
        self._device = device

    def __getattr__(self, name):
        return getattr(self._device, name)
