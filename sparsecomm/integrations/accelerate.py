"""Hugging Face Accelerate: register the top-k hook on the model ``accelerator.prepare`` returns.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only its built-in
hook types (fp16, bf16, PowerSGD), so the hook is registered after ``prepare``::

    from sparsecomm.integrations import register_topk_hook_accelerate

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register_topk_hook_accelerate(accelerator, model, density=0.01)

By default (``momentum="auto"``) the hook takes over the momentum of the optimizers
``accelerator.prepare`` returned for this model (AdamW ``betas[0]``, SGD ``momentum``):
momentum correction, the setting that holds quality
(:mod:`sparsecomm.hooks.momentum_handover`).

Checkpoints: ``accelerator.register_for_checkpointing(obj)`` would call
``obj.state_dict()`` on every process but write the result on the main process only
(``accelerate.utils.save``), so every rank would resume with rank 0's residuals. Instead
this module registers save/load pre-hooks on the accelerator: in ``save_state(dir)`` every
process writes its own ``dir/sparsecomm_topk_{i}_rank{r}.pt`` (i: the order in which
hooks were registered on this accelerator, r: ``accelerator.process_index``), and
``load_state(dir)`` reads it back on the same process. That is how Accelerate keeps its
own per-process RNG states (``random_states_{r}.pkl``), so the files live wherever those
do: a shared directory, or a per-node one on each node.

Figures: ``log_every=N`` sends the hook's figures (:mod:`sparsecomm.metrics`) every N
optimizer steps through ``accelerator.log(figures, step=...)``, to the trackers of
``Accelerator(log_with=...)`` once ``accelerator.init_trackers(...)`` started them. The hook
has no step point of its own in an Accelerate loop (it runs inside ``backward``), so the helper
puts one on the optimizer: ``register_step_post_hook``, which runs after every step the
optimizer really takes (not after an accumulation micro-batch, nor after a step a
``GradScaler`` skipped). The step logged is the hook's step counter, which
``accelerator.load_state`` restores. The figures' first window starts at the first training
forward, after any ``load_state`` (docs/metrics.md).
"""
import os
import warnings
import weakref
from pathlib import Path

import torch

from sparsecomm.hooks.register import register_topk_hook
from sparsecomm.hooks.state.settings import check_bool
from sparsecomm.hooks.topk import TopKState
from sparsecomm.integrations.common import check_log_every, check_state_options, import_framework
from sparsecomm.hooks.momentum_handover import AUTO, announce, plan_handover, unwrap
from sparsecomm.metrics import CallableSink, MetricsLogger

accelerate = import_framework("accelerate", "accelerate", "accelerate")
accelerate_utils = import_framework("accelerate.utils", "accelerate", "accelerate")

# accelerator -> _PerRankCheckpoint; weak, so an accelerator that is dropped is not kept alive.
_CHECKPOINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def hook_state_path(directory, index: int, process_index: int) -> Path:
    """Where ``save_state(directory)`` puts process ``process_index``'s state of hook ``index``."""
    return Path(directory) / f"sparsecomm_topk_{index}_rank{process_index}.pt"


def register_topk_hook_accelerate(accelerator, model, state: TopKState | None = None, *, optimizer=None,
                                  momentum: float | str = AUTO, strict_load: bool = True,
                                  log_every: int | None = None, **state_kwargs) -> TopKState:
    """Register :func:`~sparsecomm.topk_hook` on a model prepared by ``accelerator``.

    Call it after ``accelerator.prepare`` and before ``accelerator.load_state``. Hook
    state is then saved and restored per process by ``save_state``/``load_state``.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: what ``accelerator.prepare`` returned: a DistributedDataParallel (or a
            ``torch.compile`` wrapper of one).
        state: a ready :class:`~sparsecomm.TopKState` (registered as it is; ``optimizer``
            then only warns if both apply momentum); or pass its keyword arguments
            (``density=...``) instead.
        optimizer: the optimizer whose momentum the hook takes over; None: every
            optimizer ``accelerator.prepare`` returned that holds this model's parameters.
        momentum: "auto" (default): the hook's momentum correction takes over the
            optimizer's own momentum (AdamW/Adam ``betas[0]`` -> 0, SGD ``momentum`` -> 0,
            changed in place and said in an
            :class:`~sparsecomm.hooks.momentum_handover.OptimizerChangedWarning` on
            the main process); an optimizer other than torch SGD/Adam/AdamW is refused. A
            number: that momentum correction, the optimizer's own turned off the same way;
            0: plain error feedback, the optimizer left as it is.
        strict_load: passed to :meth:`TopKState.load_state_dict` by ``load_state``;
            False resets the residuals with a warning instead of refusing a state saved
            with another world size or configuration.
        log_every: every that many optimizer steps, the hook's figures (``sparsecomm/<name>``,
            the main process's) through ``accelerator.log`` to its trackers; None (default):
            none. Needs the optimizer (``optimizer=`` or the prepared one) for its step point.

    Returns:
        The registered state; ``state.stats()`` reports what this process sent.

    Raises:
        TypeError: ``accelerator`` is not an Accelerator, or ``model`` is not a DDP model
            (single process, DeepSpeed, FSDP, XLA, or the unprepared module).
        ValueError: ``DistributedDataParallelKwargs(comm_hook=...)`` is set or the model
            already has a hook (DDP allows one), bad TopKState arguments, an optimizer
            whose momentum the hook cannot take over, ``momentum="auto"`` or ``log_every``
            with no prepared optimizer, or a bad ``log_every``.
    """
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    check_bool("strict_load", strict_load)
    check_log_every("register_topk_hook_accelerate", log_every, allow_auto=False)
    ddp_model = _prepared_ddp(accelerator, model)
    optimizers = [unwrap(optimizer)] if optimizer is not None else _optimizers_of(accelerator, ddp_model)
    if log_every is not None and not optimizers:
        raise ValueError("register_topk_hook_accelerate: log_every logs after every optimizer step, but no optimizer "
                         "updates this model: prepare it with accelerator.prepare before calling the helper, or pass "
                         "optimizer=")
    handler = accelerator.ddp_handler
    if handler is not None and handler.comm_hook != accelerate_utils.DDPCommunicationHookType.NO:
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType."
            f"{getattr(handler.comm_hook, 'name', handler.comm_hook)}) is set, so accelerator.prepare "
            "registered that hook; DDP allows one per model: leave comm_hook at its default "
            "(DDPCommunicationHookType.NO) to use sparsecomm's hook"
        )
    if state is not None:  # the user's own state: registered as it is (momentum= would be ignored: refused)
        given = {**state_kwargs, **({"momentum": momentum} if momentum != AUTO else {})}
        state = register_topk_hook(ddp_model, state, optimizer=optimizer, **given)
    else:
        owner = "register_topk_hook_accelerate"
        options = check_state_options(owner, {"momentum": momentum, **state_kwargs})
        handover = plan_handover(owner, optimizers, options)  # raises before anything changes
        state = register_topk_hook(ddp_model, **handover.hook_options(options))
        announce(owner, handover.apply(), accelerator.process_index)
    checkpoint = _CHECKPOINTS.get(accelerator)
    if checkpoint is None:
        checkpoint = _CHECKPOINTS[accelerator] = _PerRankCheckpoint(accelerator)
    checkpoint.add(state, strict_load)
    if log_every is not None:
        _log_through_accelerator(accelerator, ddp_model, state, optimizers, log_every)
    return state


def _log_through_accelerator(accelerator, ddp_model, state: TopKState, optimizers: list, every: int) -> None:
    """Every ``every`` optimizer steps, ``state``'s figures into ``accelerator.log``. The logger
    is built at the first training forward, after any ``load_state``, so that its first window
    starts at the resumed step; each optimizer step taken then offers it the hook's step count."""
    accelerator = weakref.proxy(accelerator)  # the hooks must not keep the accelerator alive
    logging = {"metrics": None, "warned": False}

    def to_trackers(figures: dict, step: int) -> None:
        if not accelerator.trackers and not logging["warned"]:
            logging["warned"] = True
            warnings.warn("register_topk_hook_accelerate(log_every=...): the accelerator has no trackers, so the hook's "
                          "figures go nowhere: pass Accelerator(log_with=...) and call accelerator.init_trackers(...) "
                          "before training", stacklevel=2)
        accelerator.log(figures, step=step)

    def start(module, inputs) -> None:
        if logging["metrics"] is None and module.training:
            logging["metrics"] = MetricsLogger(state, every=every, sinks=[CallableSink(to_trackers)])
            pre_hook.remove()

    def after_step(optimizer, args, kwargs) -> None:
        if logging["metrics"] is not None:
            logging["metrics"].step(state.step)  # several optimizers of one model: one write per step

    pre_hook = ddp_model.register_forward_pre_hook(start)
    for torch_optimizer in optimizers:
        torch_optimizer.register_step_post_hook(after_step)


def _prepared_ddp(accelerator, model) -> torch.nn.parallel.DistributedDataParallel:
    """The DDP model inside what ``accelerator.prepare`` returned."""
    candidate = getattr(model, "_orig_mod", model)  # torch.compile (dynamo_backend) wraps the DDP model
    if isinstance(candidate, torch.nn.parallel.DistributedDataParallel):
        return candidate
    raise TypeError(
        f"model must be the DistributedDataParallel model returned by accelerator.prepare, got "
        f"{type(model).__name__} (accelerator.distributed_type={accelerator.distributed_type}, "
        f"num_processes={accelerator.num_processes}); Accelerate wraps the model in DDP only for "
        "MULTI_GPU/MULTI_CPU (and other MULTI_*) runs with more than one process (accelerate launch "
        "--num_processes N, or torchrun); DeepSpeed, FSDP and XLA do not use DDP communication hooks"
    )


def _optimizers_of(accelerator, ddp_model) -> list:
    """The optimizers ``accelerator.prepare`` returned that update ``ddp_model``'s parameters."""
    params = {id(p) for p in ddp_model.parameters()}
    return [unwrap(o) for o in accelerator._optimizers  # Accelerate's list of prepared optimizers
            if any(id(p) in params for group in unwrap(o).param_groups for p in group["params"])]


class _PerRankCheckpoint:
    """Save/load pre-hooks that write and read one file per (hook, process)."""

    def __init__(self, accelerator):
        self._accelerator = weakref.ref(accelerator)
        self._states: list[tuple[TopKState, bool]] = []
        accelerator.register_save_state_pre_hook(self._save)
        accelerator.register_load_state_pre_hook(self._load)

    def add(self, state: TopKState, strict_load: bool) -> None:
        self._states.append((state, strict_load))

    def _save(self, models, weights, output_dir) -> None:
        process_index = self._accelerator().process_index
        for index, (state, _) in enumerate(self._states):
            path = hook_state_path(output_dir, index, process_index)
            tmp = path.with_name(path.name + ".tmp")
            torch.save(state.state_dict(), tmp)
            os.replace(tmp, path)  # never a half-written file under the final name

    def _load(self, models, input_dir) -> None:
        process_index = self._accelerator().process_index
        for index, (state, strict_load) in enumerate(self._states):
            path = hook_state_path(input_dir, index, process_index)
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found: process {process_index} has no saved state for sparsecomm hook "
                    f"{index} in {input_dir} (saved with fewer processes, or before "
                    "register_topk_hook_accelerate was called for this model)"
                )
            state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=strict_load)
