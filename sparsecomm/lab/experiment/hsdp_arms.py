"""The lab's HSDP runs (``parallelism="hsdp:RxS"``): the task's model sharded as torchtitan
shards a transformer (each block, then the root, over the mesh's shard dimension), and each
arm on the cross-replica reduction, metered as :class:`~sparsecomm.lab.experiment.arms.HookMeter`
meters DDP's hooks.

FSDP calls an all-reduce hook per module after its reduce-scatter and waits for it, so the
time inside these hooks (encoding included) is counted as communication: there is no
collective still in flight after the last hook returns, as there is under DDP.
"""
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sparsecomm.averaging import SparseDeltaAverager
from sparsecomm.fsdp import register_hsdp_hook
from sparsecomm.fsdp.fsdp_modules import sharded_modules
from sparsecomm.lab.experiment.arm_spec import topk_state_kwargs
from sparsecomm.lab.experiment.arms import ArmHook, averager_description, topk_description, wire_label
from sparsecomm.lab.experiment.config import ExperimentConfig

MESH_DIMS = ("replicate", "shard")


def build_mesh(config: ExperimentConfig, device_type: str = "cpu"):
    return init_device_mesh(device_type, config.hsdp_shape, mesh_dim_names=MESH_DIMS)


def shard_model(model: nn.Module, mesh) -> None:
    """``fully_shard`` over ``mesh["shard"]``: every element with parameters of the model's
    block list (the model itself if it is an ``nn.Sequential``/``nn.ModuleList``, else each
    such direct child), then the root, which keeps everything else (embeddings, a tied head)."""
    containers = (nn.Sequential, nn.ModuleList)
    lists = [model] if isinstance(model, containers) else [c for c in model.children() if isinstance(c, containers)]
    for block_list in lists:
        for block in block_list:
            if any(True for _ in block.parameters()):
                fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])


class HSDPMeter:
    """Wraps every module's all-reduce hook: time inside it, bytes sent, dense bytes."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.exchange_seconds = 0.0
        self.buckets = 0
        self.bytes_sent = 0
        self.bytes_dense = 0

    def wrap(self, sent_bytes):
        """A ``wrap(hook, name)`` for register_hsdp_hook; ``sent_bytes(buffer, before)`` counts a
        call's bytes, ``sent_bytes.snapshot()`` what it compares against."""
        def wrapped(hook, name):
            def metered(reduce_output: torch.Tensor) -> None:
                before = sent_bytes.snapshot()
                self.buckets += 1
                self.bytes_dense += reduce_output.numel() * reduce_output.element_size()
                started = time.perf_counter()
                hook(reduce_output)
                self.exchange_seconds += time.perf_counter() - started
                self.bytes_sent += sent_bytes(reduce_output, before)
            return metered
        return wrapped

    def take_step(self) -> dict:
        """This step's figures (the keys of HookMeter.take_step, plus the hooks' time); resets."""
        figures = {"hook_seconds": 0.0, "exchange_seconds": self.exchange_seconds, "buckets": self.buckets,
                   "bytes_sent": self.bytes_sent,
                   "bytes_dense": self.bytes_dense, "last_hook_return": None}
        self._reset()
        return figures


class _Counted:
    """Bytes a plain hook sends per call: the whole buffer (dense) or nothing."""

    def __init__(self, whole: bool):
        self.whole = whole

    def snapshot(self):
        return None

    def __call__(self, buffer: torch.Tensor, before) -> int:
        return buffer.numel() * buffer.element_size() if self.whole else 0


class _TopKBytes:
    def __init__(self):
        self.state = None  # set once register_hsdp_hook returns

    def snapshot(self) -> int:
        return self.state.stats()["bytes_sent"]

    def __call__(self, buffer: torch.Tensor, before: int) -> int:
        return self.state.stats()["bytes_sent"] - before


def _install(model: nn.Module, mesh, meter: HSDPMeter, hook_of, sent_bytes) -> None:
    """A plain hook on every FSDP module (after the HSDP hook's own layout checks)."""
    wrap = meter.wrap(sent_bytes)
    for found in sharded_modules(model, mesh, *MESH_DIMS):
        found.module.set_all_reduce_hook(wrap(hook_of(), found.name))


def hsdp_arm(arm: str, config: ExperimentConfig, model: nn.Module, mesh, seed: int) -> tuple[ArmHook, HSDPMeter]:
    """The arm ``arm`` on a sharded model: its hooks installed, and the meter that times them."""
    spec = config.arm(arm)
    replicas = mesh.get_group("replicate")
    meter = HSDPMeter()
    shape = "x".join(str(n) for n in config.hsdp_shape)
    where = f" across the replicas of HSDP {shape}"
    if spec.reducer == "allreduce":
        def plain_allreduce():
            def hook(reduce_output: torch.Tensor) -> None:
                reduce_output.div_(dist.get_world_size(replicas))  # then sum: the replicas' mean
                dist.all_reduce(reduce_output, group=replicas)
            return hook
        _install(model, mesh, meter, plain_allreduce, _Counted(whole=True))
        return ArmHook("all_reduce (plain, as torchtitan's custom HSDP)" + where, None, None, None), meter
    if spec.reducer in ("local", "sparse-delta"):
        averager = SparseDeltaAverager(model, mesh=mesh, **spec.options) if spec.reducer == "sparse-delta" else None
        _install(model, mesh, meter, lambda: (lambda reduce_output: None), _Counted(whole=False))
        if averager is None:
            return ArmHook("nothing reduced across replicas (the no-communication floor)" + where, None, None,
                           None), meter
        return ArmHook(averager_description(spec, averager) + where, None, None, None,
                       stats=lambda state: averager.stats(), averager=averager), meter
    counted = _TopKBytes()
    state = register_hsdp_hook(model, mesh, seed=seed, wrap=meter.wrap(counted), **topk_state_kwargs(spec.options))
    counted.state = state
    return ArmHook(topk_description(spec, state, wire_label(config, " ")) + where, state, None, None,
                   stats=lambda s: s.stats()), meter
