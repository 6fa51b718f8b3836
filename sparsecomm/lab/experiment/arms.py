"""The arms of a comparison: how each one reduces gradients, and how many bytes it sends.

Every arm registers a comm hook, dense included (torch's ``allreduce_hook`` is the
Python twin of DDP's built-in allreduce), so one meter times all of them the same way.
The presets that resolve from the experiment's fields (an arm defined as data resolves to
its reducer the same way: :mod:`sparsecomm.lab.experiment.arm_spec`):

| arm        | hook                                                         |
|------------|--------------------------------------------------------------|
| dense      | torch ``allreduce_hook``                                      |
| dense-bf16 | torch ``bf16_compress_hook`` on NCCL; ``fp16_compress_hook`` on gloo, which DDP refuses bf16 on |
| powersgd   | torch ``powerSGD_hook`` (error feedback, warm start)          |
| topk-ef    | sparsecomm ``topk_hook``, error feedback                      |
| topk-noef  | sparsecomm ``topk_hook`` without error feedback (ablation)    |
| topk-dgc   | sparsecomm ``topk_hook``, error feedback + DGC momentum correction; the optimizer runs without momentum of its own |

The presets with options of their own (``arm_spec.FIXED_PRESETS``): ``sparseloco`` and
``sparseloco-overlap``, ``sparse-delta`` arms, train locally and sync the weights every
``period`` steps through :class:`sparsecomm.SparseDeltaAverager` (their comm hook reduces
nothing); ``topk-sign`` is the sign mode, a ``topk_hook`` with 1-bit values under sign-SGD;
``scape`` and ``scape-10pc`` are ``topk_hook`` arms on the shared-mask exchange (SCAPE's reducer,
linked to the run's AdamS by the worker). A ``local``
arm (only as data) reduces nothing at all: the no-communication floor of the step time.
"""
import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from sparsecomm.lab.experiment.arm_spec import ArmSpec, topk_state_kwargs
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.hooks import TopKState, topk_hook


@dataclass
class ArmHook:
    """A hook, its state, and how to count the bytes one call sends from this rank."""

    description: str
    state: object
    hook: Callable
    # (state, bucket, snapshot taken before the call) -> bytes this rank contributed
    call_bytes: Callable
    snapshot: Callable = lambda state: None
    stats: Callable = lambda state: None
    averager: object = None
    """A SparseDeltaAverager (reducer sparse-delta): stepped after every optimizer step
    (:func:`after_optimizer_step`), checkpointed, and evaluated on its consensus weights."""

    @property
    def checkpoint_state(self):
        """What the checkpoint manager saves per rank beside the model (None: nothing)."""
        return self.averager if self.averager is not None else (
            self.state if isinstance(self.state, TopKState) else None)

    def evaluation(self):
        """Where to evaluate: the replicas' consensus (the last sync) for an averager, else the model as it is."""
        return self.averager.consensus_weights() if self.averager is not None else contextlib.nullcontext()


NOTHING_AFTER = {"bytes_sent": 0, "compress_seconds": 0.0, "comm_seconds": 0.0}
"""What :func:`after_optimizer_step` adds when nothing follows the optimizer step."""


def after_optimizer_step(arm_hook: ArmHook) -> dict:
    """Run what follows an optimizer step (an averager's step, perhaps a sync); the figures
    it adds to the step: bytes sent, host time encoding/decoding, time in the exchange."""
    averager = arm_hook.averager
    if averager is None:
        return dict(NOTHING_AFTER)
    before = averager.stats()
    averager.step()
    after = averager.stats()

    def grew(key):
        return after[key] - before[key]

    return {"bytes_sent": grew("bytes_sent"), "compress_seconds": grew("seconds_encode") + grew("seconds_decode"),
            "comm_seconds": grew("seconds_exchange")}


def _buffer_bytes(state, bucket, before) -> int:
    return bucket.buffer().numel() * bucket.buffer().element_size()


def _half_bytes(state, bucket, before) -> int:
    return bucket.buffer().numel() * 2


def _powersgd_bytes(state, bucket, before) -> int:
    # PowerSGD counts elements of P, Q and uncompressed tensors; none during warm-up.
    sent = state.total_numel_after_compression - before
    element = bucket.buffer().element_size()
    return sent * element if sent else bucket.buffer().numel() * element


def _topk_bytes(state, bucket, before) -> int:
    return state.stats()["bytes_sent"] - before


def wire_label(config: ExperimentConfig, prefix: str = "") -> str:
    """How the top-k arms select and encode, e.g. "chunk 4096 rice/int4" ("" for the default wire)."""
    exchange = "" if config.exchange == "allgather" else f" via {config.exchange}"
    if config.selector == "exact" and config.value_codec is None and config.index_codec == "int32":
        return f"{prefix}{exchange.strip()}" if exchange else ""
    selection = f"chunk {config.chunk_size}" if config.selector == "chunk" else config.selector
    return f"{prefix}{selection} {config.index_codec}/{config.value_codec or 'bucket dtype'}{exchange}"


def make_arm_hook(arm: str, config: ExperimentConfig, ddp_model, seed: int) -> ArmHook:
    """The hook of the arm called ``arm`` (a preset or a defined arm of ``config``); not yet registered."""
    return hook_for_spec(config.arm(arm), ddp_model, seed, wire=wire_label(config, " "), process_group=None)


def hook_for_spec(spec: ArmSpec, ddp_model, seed: int, *, wire: str = "", process_group=None) -> ArmHook:
    """The hook of a resolved arm, on ``process_group`` (None: the default group)."""
    if spec.reducer == "allreduce":
        return ArmHook("torch allreduce_hook", process_group, default_hooks.allreduce_hook, _buffer_bytes)
    if spec.reducer in ("fp16", "bf16"):
        if spec.reducer == "bf16" and dist.get_backend(process_group) == "nccl":
            return ArmHook("torch bf16_compress_hook", process_group, default_hooks.bf16_compress_hook, _half_bytes)
        why = " (bf16 needs NCCL)" if spec.reducer == "bf16" else ""
        return ArmHook(f"torch fp16_compress_hook{why}", process_group, default_hooks.fp16_compress_hook, _half_bytes)
    if spec.reducer == "local":
        from sparsecomm.hooks.local_gradient import local_gradient_hook

        return ArmHook("sparsecomm local_gradient_hook: nothing sent (the no-communication floor; replicas diverge)",
                       None, local_gradient_hook, lambda state, bucket, before: 0)
    if spec.reducer == "sparse-delta":
        from sparsecomm.averaging import SparseDeltaAverager
        from sparsecomm.hooks.local_gradient import local_gradient_hook

        averager = SparseDeltaAverager(ddp_model, process_group=process_group, register_hook=False, **spec.options)
        return ArmHook(averager_description(spec, averager), None, local_gradient_hook,
                       lambda state, bucket, before: 0, stats=lambda state: averager.stats(), averager=averager)
    if spec.reducer == "powersgd":
        options = spec.options
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=options["rank"],
            start_powerSGD_iter=options["start_iter"],
            use_error_feedback=options["use_error_feedback"],
            warm_start=options["warm_start"],
            random_seed=seed,
        )
        return ArmHook(
            f"torch powerSGD_hook rank {options['rank']}",
            state,
            _one_bucket_on_gloo(powerSGD_hook.powerSGD_hook, process_group),
            _powersgd_bytes,
            snapshot=lambda s: s.total_numel_after_compression,
        )
    state = TopKState(process_group, seed=seed, module=ddp_model, **topk_state_kwargs(spec.options))
    return ArmHook(
        topk_description(spec, state, wire),
        state,
        topk_hook,
        _topk_bytes,
        snapshot=lambda s: s.stats()["bytes_sent"],
        stats=lambda s: s.stats(),
    )


def _one_bucket_on_gloo(hook: Callable, process_group) -> Callable:
    """``hook`` (torch's PowerSGD), refusing a second bucket on gloo before it can hang.

    PowerSGD issues its collectives from Future callbacks, which run on other threads in
    any order: with several buckets in flight the ranks can issue them in different orders,
    and gloo then hangs or fails (NCCL orders them by stream). Its first steps are plain
    allreduces, so a second bucket is seen, and refused, before the first compressed step.
    """
    def guarded(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() > 0 and dist.get_backend(process_group) == "gloo":
            raise RuntimeError(
                "torch's powerSGD_hook on gloo with several DDP buckets can hang (it issues collectives from "
                "Future callbacks, in an order that differs between ranks): run it with one bucket (the config's "
                "bucket_cap_mb at least the model's gradient size in MiB) or on NCCL")
        return hook(state, bucket)

    return guarded


def topk_description(spec: ArmSpec, state: TopKState, wire: str) -> str:
    """How a top-k arm reduces, in the run's record, e.g. "sparsecomm topk_hook density 0.01"."""
    if spec.name in ("topk-ef", "topk-noef", "topk-dgc"):
        detail = {"topk-ef": "", "topk-noef": " without error feedback",
                  "topk-dgc": f" with momentum correction {spec.momentum_correction:g}"}[spec.name]
        return f"sparsecomm topk_hook density {state.density:g}{wire}{detail}"
    return f"sparsecomm topk_hook {spec.describe().split(';')[0].removeprefix('topk ')}"


def averager_description(spec: ArmSpec, averager) -> str:
    """How an averager arm syncs, in the run's record."""
    options = spec.options
    return (f"sparsecomm SparseDeltaAverager period {options['period']} density {options['density']:g} "
            f"{options['selector']} {options['index_codec']}/{options['value_codec']} outer_lr {options['outer_lr']:g} "
            f"ef_decay {options['ef_decay']:g} via {averager.exchange}"
            + (" (auto)" if averager.exchange_setting == "auto" else ""))


class HookMeter:
    """Wraps an arm's hook: host time inside the hook, bytes sent, when the last bucket left.

    The time from the last bucket's hook returning to the end of ``backward()`` is time
    spent waiting for collectives that computation could no longer hide.
    """

    def __init__(self, arm_hook: ArmHook):
        self.arm_hook = arm_hook
        self._fail_next = False
        self._reset()

    def fail_next_call(self, armed: bool = True) -> None:
        """Fault injection: the next hook call raises before issuing its collective."""
        self._fail_next = armed

    def _reset(self):
        self.hook_seconds = 0.0
        self.buckets = 0
        self.bytes_sent = 0
        self.bytes_dense = 0
        self.last_hook_return = None

    def register(self, ddp_model) -> None:
        arm_hook = self.arm_hook

        def metered_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            if self._fail_next:
                self._fail_next = False
                raise RuntimeError(f"injected fault: comm hook error in bucket {bucket.index()}")
            before = arm_hook.snapshot(state)
            self.buckets += 1
            self.bytes_dense += _buffer_bytes(state, bucket, None)
            started = time.perf_counter()
            fut = arm_hook.hook(state, bucket)
            ended = time.perf_counter()
            self.hook_seconds += ended - started
            self.bytes_sent += arm_hook.call_bytes(state, bucket, before)
            if bucket.is_last():
                self.last_hook_return = ended
            return fut

        ddp_model.register_comm_hook(arm_hook.state, metered_hook)

    def take_step(self) -> dict:
        """This step's figures; resets the counters."""
        figures = {
            "hook_seconds": self.hook_seconds,
            "buckets": self.buckets,
            "bytes_sent": self.bytes_sent,
            "bytes_dense": self.bytes_dense,
            "last_hook_return": self.last_hook_return,
        }
        self._reset()
        return figures
