"""What torchtitan 0.3.0 needs to train on a machine without an accelerator (CPU, gloo), and
on a torch without ``torch.distributed.set_timeout``.

torchtitan assumes an accelerator in four places; each is settled here, and only where it
would otherwise fail:

1. ``torchtitan.tools.utils`` picks ``device_type = "cuda"`` and ``device_module = torch.cuda``
   when no accelerator is found, and several of its modules copy both at import.
   :func:`settle_device` sets ``"cpu"`` and a CPU device module (:class:`CpuDeviceModule`:
   torch.cpu plus the memory and device queries torchtitan's metrics make) in every
   torchtitan module loaded so far, and in ``tools.utils`` for those loaded later. Importing
   :mod:`sparsecomm.integrations.torchtitan` calls it.
2. Its language models attend with FlexAttention (or varlen, flash), and FlexAttention has no
   backward on CPU. :func:`runnable_on_cpu` swaps them for torchtitan's own
   ``ScaledDotProductAttention`` (causal over the whole sequence: a document may attend to the
   one before it in the same window, where FlexAttention's block-causal mask would stop it).
3. Its FSDP modules divide by a factor of 1.0, which FSDP2 sends as ``ReduceOp.PREMUL_SUM``,
   and gloo has no PREMUL_SUM. :func:`runnable_on_cpu` has its parallelize function also call
   ``set_force_sum_reduction_for_comms(True)`` on every FSDP module: plain sums, then a
   division by 1.0. Multiplying by 1.0 before the sum, or dividing by it after, changes no bit.
4. After its first step it calls ``torch.distributed.set_timeout``, which torch 2.13 lacks
   (on any device). :func:`settle_device` points torchtitan's ``set_pg_timeouts`` at torch's
   ``_set_pg_timeout`` there, the same per-group setting.
"""
import dataclasses
import os
import platform
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def has_accelerator() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


class CpuDeviceModule:
    """``torch.cpu`` with what torchtitan asks of a device module besides: its name, memory
    size and (empty) memory statistics, one device."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def set_device(self, device) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device=None) -> str:
        return f"cpu ({platform.processor() or platform.machine()})"

    def get_device_properties(self, device=None):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return type("CpuProperties", (), {"total_memory": memory, "name": self.get_device_name()})()

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, device=None) -> dict:
        return {}  # torchtitan reports -1 bytes (its "unknown") for every peak


def settle_device() -> None:
    """Settle torchtitan's device where it has none (1.) and its timeouts where torch lacks
    ``set_timeout`` (4.); idempotent."""
    from torchtitan.tools import utils

    if not has_accelerator() and utils.device_type == "cuda":
        cpu = CpuDeviceModule()
        for name, module in list(sys.modules.items()):
            if name.startswith("torchtitan") and module is not None:
                if getattr(module, "device_type", None) == "cuda":
                    module.device_type = "cpu"
                if getattr(module, "device_module", None) is torch.cuda:
                    module.device_module = cpu
    if not hasattr(dist, "set_timeout"):
        from torchtitan.distributed import utils as dist_utils

        dist_utils.set_pg_timeouts = _set_pg_timeouts


def _set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
    """torchtitan's ``set_pg_timeouts`` with torch's per-group ``_set_pg_timeout``."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.barrier()  # as torchtitan's: no rank starts under the short timeout while another is slow
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        _set_pg_timeout(timeout, group)


def sum_reductions(parallelize_fn):
    """``parallelize_fn`` followed by plain sums on FSDP's wires (3.)."""
    def parallelize_summing(model, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    parallelize_summing.__wrapped__ = parallelize_fn
    return parallelize_summing


def runnable_on_cpu(config):
    """``config`` (a torchtitan ``Trainer.Config``) changed so it trains on CPU with gloo: causal
    SDPA attention (2.), sums on FSDP's wires (3.), no CUDA graphs, the classic FSDP path
    (``spmd_backend="partial_dtensor"``). Returns it (changed in place)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    spec = config.model_spec
    for attention in (FlexAttention.Config, VarlenAttention.Config):
        for _, _, parent, field_name in list(spec.model.traverse(attention)):
            if isinstance(parent, list):
                parent[field_name] = ScaledDotProductAttention.Config()
            else:
                setattr(parent, field_name, ScaledDotProductAttention.Config())
    config.model_spec = dataclasses.replace(spec, parallelize_fn=sum_reductions(spec.parallelize_fn))
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"
    return config
