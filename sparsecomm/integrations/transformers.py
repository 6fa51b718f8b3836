"""Hugging Face ``Trainer``: register the top-k hook on the model the Trainer wraps in DDP.

``TrainingArguments`` has no option for a DDP communication hook, and a callback never
receives the wrapped model (its ``model`` argument is the unwrapped one).
:class:`SparseCommTrainerCallback` still needs nothing but the usual callback list::

    from sparsecomm.integrations import SparseCommTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[SparseCommTrainerCallback()])

When: ``Trainer._inner_training_loop`` wraps the model (``accelerator.prepare``), creates
the optimizer and loads a resumed checkpoint's weights, optimizer and scheduler, and only
then calls ``on_train_begin``. There the callback checks the set-up (DeepSpeed, FSDP,
XLA, SageMaker and hyperparameter search are refused; a single process warns once and
registers nothing), decides which momentum the hook takes over from the optimizer (by
default the optimizer's own: :mod:`sparsecomm.hooks.momentum_handover`; an optimizer
it cannot adapt is refused here), reads a resumed checkpoint's hook state and puts a
forward pre-hook on the model. DDP runs the model's forward inside
``DistributedDataParallel._inside_ddp_forward``, which publishes the running wrapper as
``DistributedDataParallel._active_ddp_module``; the first forward that DDP runs therefore
hands the callback exactly the wrapper the Trainer trains, which is not otherwise reachable
from a callback. The pre-hook registers the sparsecomm hook there (before the first
backward), turns the optimizer's own momentum off, restores the resumed state, and removes
itself. A training forward of the model outside DDP (e.g. a model sharded at load time) is
refused with a TypeError, before any backward.

Checkpoints: every rank's residuals differ and the Trainer's files cover one model, so in
``on_save`` (right after the Trainer wrote ``<output_dir>/checkpoint-<global_step>``)
every rank writes its own ``sparsecomm_rank<r>.pt`` there, atomically (temporary file,
then ``os.replace``), next to the Trainer's per-rank ``rng_state_<r>.pth``: a shared
directory, or a per-node one on each node. Checkpoint rotation (``save_total_limit``)
removes them with their checkpoint.

Resume: the Trainer gives callbacks no checkpoint path, but a resumed run starts with the
checkpoint's ``TrainerState`` (``global_step > 0``; a run that is not resumed starts at 0).
The callback takes the first of ``TrainingArguments.resume_from_checkpoint`` (when set) and
``<output_dir>/checkpoint-<global_step>`` whose ``trainer_state.json`` is at that global
step, which is what ``train(resume_from_checkpoint=True)`` picks; for a checkpoint outside
``output_dir``, set ``TrainingArguments(resume_from_checkpoint=path)`` too. Every rank checks
its file (present, same rank, same world size, same step) and the ranks exchange verdicts
(one small all-gather), so a missing file or another world size raises the same error on
every rank before the first step, naming the files; ``strict_load=False`` warns and
starts the hook afresh (dense warm-up included) on every rank instead. A state saved with
another hook configuration is refused by :meth:`TopKState.load_state_dict` at the first
forward (ValueError naming the file).

The lab: :meth:`SparseCommTrainerCallback.for_lab_run` lets a ``sparsecomm.lab.init()``
run register its experiment arm (``run.apply``) and record every evaluation's loss.

Figures (``log_every``): the hook's figures (:mod:`sparsecomm.metrics`) are added to the
Trainer's own training logs, so that its ``report_to`` integrations (TensorBoardCallback,
WandbCallback, ...) and ``state.log_history`` carry them, as ``sparsecomm/<name>`` (which those
integrations write as ``train/sparsecomm/<name>``). The Trainer hands every log to its callbacks
in their order, and puts the ``report_to`` ones before the user's: a callback that adds to the
logs in ``on_log`` after them adds nothing they write. The Trainer gives callbacks no handle on
that order, so at ``on_train_begin`` the callback finds the ``CallbackHandler`` that calls it
(the caller's frame) and moves itself before the first callback that reads logs; a Trainer whose
handler it cannot find is warned about, once.
"""
import inspect
import json
import os
import warnings
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from sparsecomm.hooks.register import register_topk_hook
from sparsecomm.hooks.topk import TopKState
from sparsecomm.hooks.state.settings import check_bool
from sparsecomm.integrations.common import AUTO_LOG, check_log_every, check_state_options, import_framework, to_cpu
from sparsecomm.hooks.momentum_handover import AUTO, announce, plan_handover, unwrap
from sparsecomm.metrics import CallableSink, MetricsLogger

transformers = import_framework("transformers", "transformers", "transformers")
trainer_module = import_framework("transformers.trainer", "transformers", "transformers")
trainer_utils = import_framework("transformers.trainer_utils", "transformers", "transformers")
trainer_callback = import_framework("transformers.trainer_callback", "transformers", "transformers")

STATE_FILE_FORMAT = 1
# Measured on the Trainer example (experiments/examples/README.md, "Defaults that hold
# quality"): within 0.1 of dense's final training loss at every seed, with a margin; 0.01 is
# not within it, 0.02 only just.
DEFAULT_DENSITY = 0.03
# Accelerate's names for set-ups whose model is not a torch DDP model.
_NOT_DDP_TYPES = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "XLA": "XLA", "MEGATRON_LM": "Megatron-LM"}


class NotDistributedWarning(UserWarning):
    """The Trainer runs one process: there is no gradient reduction to sparsify."""


def hook_state_path(checkpoint_dir, rank: int) -> Path:
    """Where rank ``rank`` keeps its hook state in a Trainer checkpoint directory."""
    return Path(checkpoint_dir) / f"sparsecomm_rank{rank}.pt"


class SparseCommTrainerCallback(transformers.TrainerCallback):
    """Top-k + error-feedback gradient reduction for a Hugging Face ``Trainer`` DDP run.

    Args:
        density: fraction of each bucket sent (see :class:`~sparsecomm.TopKState`);
            default 0.03, measured to hold quality: the Trainer example (a tiny GPT-2,
            the Trainer's AdamW and gradient clipping, 200 steps, 2 ranks) ends within 0.1
            of dense's final training loss at each of 3 seeds (+0.041 to +0.064), sending
            6.9% of dense's bytes; at 0.01 it ends 0.13-0.17 behind, learning slower from
            its first steps (experiments/examples/README.md, "Defaults that hold quality").
        momentum: "auto" (default): the hook's momentum correction takes over the Trainer
            optimizer's own momentum (AdamW/Adam ``betas[0]``, SGD ``momentum`` and
            ``nesterov``, Adafactor ``beta1``), which is turned off in place before its
            first step, said in an
            :class:`~sparsecomm.hooks.momentum_handover.OptimizerChangedWarning` on
            rank 0. The Trainer's default AdamW thus runs with ``betas=(0, 0.999)`` and the
            hook with ``momentum=0.9``: the ``topk-dgc`` setting. An optimizer of another
            class is refused (ValueError at ``on_train_begin``). A number: that momentum
            correction, the optimizer's own turned off the same way; 0: plain error
            feedback, the optimizer left as it is.
        hook_factory: instead of ``density`` and TopKState options: a callable
            ``hook_factory(ddp_model, optimizer) -> hook_state`` that registers a hook of
            its own on the DDP model (called once, at the first forward, with the
            Trainer's torch optimizer, which it may change in place but not replace). The
            returned object's ``state_dict()`` is saved with checkpoints and its
            ``load_state_dict()`` restores it; None saves no state.
        on_metrics: ``on_metrics(metrics, step)``, called with every evaluation's metrics
            (from ``on_evaluate``, and from ``on_log`` for logs carrying ``eval_*`` keys;
            each evaluation once) and the global step, on every rank (the Trainer gathers
            the evaluation over all ranks, so the values agree).
        strict_load: False: a resumed checkpoint whose hook state is missing, from another
            world size or (TopKState) another configuration restarts the hook with a
            warning instead of raising.
        log_every: the hook's figures (rank 0's ``sparsecomm/<name>``: bytes per step,
            compression, density, residual norm, ...) in the Trainer's training logs, which
            its ``report_to`` integrations write: None (default): none; "auto": in every
            training log (``logging_steps``), each covering the steps since the last; an
            integer N >= 1: every N optimizer steps (the callback asks the Trainer to log at
            those steps, its loss included). With ``hook_factory``, its state must be a
            TopKState or a SparseDeltaAverager (anything else is warned about, and not logged).
        **state_options: any other :class:`~sparsecomm.TopKState` keyword argument
            (``warmup_steps``, ``selector``, ...), checked here; ``module`` and
            ``process_group`` come from the DDP model.

    Attributes:
        state: the registered :class:`~sparsecomm.TopKState` (or what ``hook_factory``
            returned) once the first training forward ran; None before, and in a
            single-process run. ``callback.state.stats()`` reports what this rank sent.
            (``hook_state``: its former name, deprecated.)
        metrics: the :class:`~sparsecomm.metrics.MetricsLogger` adding the figures to the
            logs (``log_every``), once the hook is registered; None otherwise.

    Raises (at construction): ValueError/TypeError for bad TopKState options (naming the
    option), for both ``hook_factory`` and TopKState options, or for a ``hook_factory`` /
    ``on_metrics`` that is not callable.

    Raises (at ``on_train_begin``, before the first step): ValueError for DeepSpeed, FSDP,
    XLA/TPU, SageMaker or hyperparameter search, or an optimizer whose momentum the hook
    cannot take over; FileNotFoundError/ValueError for a resumed checkpoint without this
    rank's hook state or saved by another world size. At the first
    forward: ValueError if the DDP model already has a communication hook (DDP allows
    one); TypeError if the Trainer trains the model without DDP.
    """

    def __init__(self, density: float | None = None, *, momentum: float | str = AUTO, hook_factory=None,
                 on_metrics=None, strict_load: bool = True, log_every: int | str | None = None, **state_options):
        self.strict_load = check_bool("strict_load", strict_load)
        self.log_every = check_log_every("SparseCommTrainerCallback", log_every, allow_auto=True)
        self.metrics = None
        self._logs = None  # the training log the figures are being added to (inside on_log)
        if hook_factory is not None:
            if momentum != AUTO:
                state_options = {"momentum": momentum, **state_options}
            if density is not None or state_options:
                given = (["density"] if density is not None else []) + sorted(state_options)
                raise TypeError(
                    f"SparseCommTrainerCallback: pass either hook_factory or TopKState options, not both "
                    f"(got hook_factory and {', '.join(given)}); the factory builds its own hook"
                )
            _check_callable("hook_factory", hook_factory)
            self._options = None
        else:
            density = DEFAULT_DENSITY if density is None else density
            self._options = check_state_options("SparseCommTrainerCallback",
                                                {"density": density, "momentum": momentum, **state_options})
        if on_metrics is not None:
            _check_callable("on_metrics", on_metrics)
        self.hook_factory = hook_factory
        self.on_metrics = on_metrics
        self.state = None
        self._ddp = None  # weakref to the DDP model the hook is registered on
        self._optimizer = None  # the Trainer's torch optimizer, for hook_factory
        self._handover = None  # the momentum the hook takes over from it, decided at on_train_begin
        self._rank = None  # this process's global rank: it says what changed in the optimizer on rank 0
        self._pre_hook = None  # handle of the forward pre-hook waiting for the first DDP forward
        self._state_to_load = None  # hook state read from a resumed checkpoint, until the hook exists
        self._warned_single_process = False
        self._last_reported = None  # (step, eval items) last handed to on_metrics

    @property
    def hook_state(self):
        """Deprecated name of :attr:`state` (the name every integration uses)."""
        warnings.warn("SparseCommTrainerCallback.hook_state is deprecated: use .state", DeprecationWarning,
                      stacklevel=2)
        return self.state

    @classmethod
    def for_lab_run(cls, run, metric: str = "eval_loss", as_name: str = "val_loss") -> "SparseCommTrainerCallback":
        """The callback for a ``sparsecomm.lab.init()`` run: ``run.apply`` registers the
        experiment arm's hook, ``run.hook_state`` is saved with checkpoints, and every
        evaluation's ``metrics[metric]`` is recorded as ``run.log({as_name: value}, step=step)``.

        ``run.apply`` must change the Trainer's optimizer in place (the Trainer keeps its
        own); an evaluation without ``metric`` warns once, naming the keys it has.
        """
        missing_warned = []

        def register_arm(ddp_model, optimizer):
            returned = run.apply(ddp_model, optimizer)
            if returned is not None and returned is not optimizer:
                raise TypeError(
                    f"run.apply returned a new {type(returned).__name__}; the Trainer keeps stepping its own "
                    "optimizer, so the arm must change that one in place"
                )
            return run.hook_state

        def log_metric(metrics, step):
            if metric in metrics:
                run.log({as_name: metrics[metric]}, step=step)
            elif not missing_warned:
                missing_warned.append(True)
                warnings.warn(
                    f"SparseCommTrainerCallback.for_lab_run: no {metric!r} in the evaluation metrics "
                    f"({', '.join(sorted(metrics))}), so nothing was logged to the lab run; pass metric= one of them",
                    stacklevel=2,
                )

        return cls(hook_factory=register_arm, on_metrics=log_metric)

    # ----- Trainer events ----------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        _refuse_unsupported_setup(args, state)
        if args.world_size <= 1:
            self._warn_single_process(args)
            return
        self._optimizer = unwrap(optimizer)  # Accelerate's AcceleratedOptimizer wraps torch's
        self._rank = args.process_index
        if self._options is not None:  # raises before the first step for an optimizer it cannot adapt
            self._handover = plan_handover("SparseCommTrainerCallback", [self._optimizer], self._options)
        if state.global_step > 0:  # the Trainer resumed: a fresh TrainerState starts at 0
            self._state_to_load = self._read_resumed_state(args, state)
        if self._pre_hook is None:
            self._pre_hook = model.register_forward_pre_hook(self._on_forward)
        if self.log_every is not None and not _run_before_log_readers(self):
            warnings.warn(
                "SparseCommTrainerCallback(log_every=...): the Trainer's CallbackHandler was not found, so the callback "
                "could not move ahead of the report_to integrations: the figures reach only the callbacks after it "
                "(and the printed logs)", stacklevel=2)

    def on_save(self, args, state, control, **kwargs):
        if self._ddp is None:  # single process, or no training forward yet: nothing registered
            return
        checkpoint_dir = Path(args.output_dir) / f"{trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        path = hook_state_path(checkpoint_dir, args.process_index)
        payload = {"format": STATE_FILE_FORMAT, "rank": args.process_index, "world_size": args.world_size,
                   "global_step": state.global_step, "hook_state": self._hook_state_dict()}
        path.parent.mkdir(parents=True, exist_ok=True)  # rank 0 may not have created it yet
        tmp = path.with_name(path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)  # never a half-written file under the final name

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._report_metrics(metrics or {}, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if isinstance(self.log_every, int) and self.metrics is not None and state.global_step % self.log_every == 0:
            control.should_log = True  # the Trainer then logs this step, and on_log adds the figures
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and any(key.startswith("eval_") for key in logs):
            self._report_metrics(logs, state.global_step)
        if self.metrics is not None and logs is not None and "loss" in logs:  # a training log
            self._logs = logs
            try:
                self.metrics.step(state.global_step)
            finally:
                self._logs = None

    # ----- registering at the first DDP forward ------------------------------------------

    def _on_forward(self, module, inputs):
        ddp = torch.nn.parallel.DistributedDataParallel._active_ddp_module
        if ddp is None or ddp.module is not module:
            if module.training and torch.is_grad_enabled():
                raise TypeError(
                    f"SparseCommTrainerCallback: the Trainer runs a training forward of {type(module).__name__} "
                    "that torch.nn.parallel.DistributedDataParallel does not wrap (a model sharded or "
                    "tensor-parallel at load time, or DDP's compiled-autograd python reducer); the top-k hook is "
                    "a DDP communication hook: remove the callback or let the Trainer wrap the model in DDP"
                )
            return  # an evaluation forward before training: wait for the DDP one
        self._pre_hook.remove()
        self._pre_hook = None
        self._attach(ddp)

    def _attach(self, ddp) -> None:
        """Register the hook on ``ddp`` (once per DDP model) and restore a resumed state."""
        if self._ddp is None or self._ddp() is not ddp:
            registered = getattr(ddp, "_comm_hooks", [])  # DDP keeps (hook, state) pairs here
            if registered:
                names = ", ".join(getattr(hook, "__qualname__", repr(hook)) for hook, _ in registered)
                raise ValueError(
                    f"SparseCommTrainerCallback: the Trainer's DDP model already has a communication hook ({names}); "
                    "DDP allows one per model: remove the other hook or this callback (one callback per Trainer)"
                )
            if self.hook_factory is not None:
                self.state = self.hook_factory(ddp, self._optimizer)
                self._check_factory_state()
            else:
                self.state = register_topk_hook(ddp, **self._handover.hook_options(self._options))
                announce("SparseCommTrainerCallback", self._handover.apply(), self._rank)
            self._ddp = weakref.ref(ddp)
        if self._state_to_load is not None:
            path, state_dict = self._state_to_load
            self._state_to_load = None
            self._load_hook_state(path, state_dict)
        if self.log_every is not None:
            self.metrics = self._metrics_logger()  # after the load: its first window starts here

    def _metrics_logger(self) -> MetricsLogger | None:
        every = 1 if self.log_every == AUTO_LOG else self.log_every  # "auto": at every training log
        try:
            return MetricsLogger(self.state, every=every, sinks=[CallableSink(self._add_to_logs)])
        except TypeError:  # a hook_factory's state of its own (or None: the lab's dense arm)
            warnings.warn(f"SparseCommTrainerCallback(log_every=...): the hook state is a {type(self.state).__name__}, "
                          "whose figures sparsecomm.metrics cannot read (a TopKState or a SparseDeltaAverager): none "
                          "are logged", stacklevel=3)
            return None

    def _add_to_logs(self, figures: dict, step: int) -> None:
        self._logs.update(figures)

    def _check_factory_state(self) -> None:
        if self.state is not None and not callable(getattr(self.state, "state_dict", None)):
            warnings.warn(
                f"SparseCommTrainerCallback: hook_factory returned a {type(self.state).__name__} without "
                "state_dict(): checkpoints will not hold the hook's state, and a resume restarts it",
                stacklevel=3,
            )

    # ----- checkpoint contents -------------------------------------------------------------

    def _hook_state_dict(self):
        if not callable(getattr(self.state, "state_dict", None)):
            return None
        state_dict = self.state.state_dict()
        return to_cpu(state_dict) if isinstance(self.state, TopKState) else state_dict

    def _load_hook_state(self, path: Path, state_dict) -> None:
        if state_dict is None or not callable(getattr(self.state, "load_state_dict", None)):
            return
        try:
            if isinstance(self.state, TopKState):
                self.state.load_state_dict(state_dict, strict=self.strict_load)
            else:
                self.state.load_state_dict(state_dict)
        except ValueError as error:  # e.g. saved with another density: name the file
            raise ValueError(f"cannot restore the sparsecomm hook state from {path}: {error}") from error

    def _read_resumed_state(self, args, state):
        """(file, this rank's saved hook state) after every rank has checked its own file
        (collective); None when strict_load=False let a problem pass."""
        checkpoint_dir = _resumed_checkpoint_dir(args, state)
        path = hook_state_path(checkpoint_dir, args.process_index)
        saved, problem = _read_state_file(path, args, state)
        verdicts = [None] * args.world_size
        dist.all_gather_object(verdicts, (not path.is_file(), problem))  # every rank raises (or warns) alike
        problems = [message for _, message in verdicts if message is not None]
        if not problems:
            return path, saved
        explanation = (
            f"cannot resume the sparsecomm hook state at global step {state.global_step} from {checkpoint_dir}: "
            + "; ".join(problems)
            + ". Each rank's sparsecomm_rank<r>.pt is written by SparseCommTrainerCallback.on_save, so a checkpoint "
            "saved without the callback or by another number of processes has none (or not this rank's); for a "
            "checkpoint outside output_dir, set TrainingArguments(resume_from_checkpoint=path) as well"
        )
        if self.strict_load:
            missing = any(file_missing for file_missing, _ in verdicts)
            raise (FileNotFoundError if missing else ValueError)(explanation + "; strict_load=False restarts the hook")
        warnings.warn(explanation + "; strict_load=False: the hook restarts with fresh residuals on every rank",
                      stacklevel=3)
        return None

    # ----- single process, metrics ----------------------------------------------------------

    def _warn_single_process(self, args) -> None:
        if self._warned_single_process:
            return
        self._warned_single_process = True
        warnings.warn(
            f"SparseCommTrainerCallback: the Trainer runs one process (world_size={args.world_size}, "
            f"parallel_mode={args.parallel_mode.value}), so there is no DDP gradient reduction to sparsify and no "
            "hook is registered; launch with torchrun --nproc-per-node N (or accelerate launch) to use it",
            NotDistributedWarning,
            stacklevel=3,
        )

    def _report_metrics(self, metrics: dict, step: int) -> None:
        if self.on_metrics is None:
            return
        # evaluate() logs its metrics (on_log) and then announces them (on_evaluate): report once.
        key = (step, tuple(sorted((k, v) for k, v in metrics.items() if k.startswith("eval_"))))
        if key == self._last_reported:
            return
        self._last_reported = key
        self.on_metrics(metrics, step)


def _run_before_log_readers(callback) -> bool:
    """Move ``callback`` before the first callback of its Trainer that reads logs (overrides
    ``on_log``: the ``report_to`` integrations, which the Trainer puts before the user's), so
    that what it adds to a log in ``on_log`` reaches them. The handler is the ``self`` of the
    frame that called the event (``CallbackHandler.call_event``); False when none is found.
    Called from inside the handler's loop over its callbacks: moving one element to a lower
    index leaves every element after the old index where it was, so none is called twice or
    skipped."""
    frame = inspect.currentframe()
    try:
        for _ in range(6):
            frame = frame.f_back
            if frame is None:
                return False
            handler = frame.f_locals.get("self")
            if isinstance(handler, trainer_callback.CallbackHandler) and any(c is callback for c in handler.callbacks):
                break
        else:
            return False
    finally:
        del frame  # a frame held here would keep the Trainer's locals alive
    callbacks = handler.callbacks
    mine = next(i for i, c in enumerate(callbacks) if c is callback)
    first_reader = next(i for i, c in enumerate(callbacks)
                        if c is callback or type(c).on_log is not transformers.TrainerCallback.on_log)
    if first_reader < mine:
        callbacks.insert(first_reader, callbacks.pop(mine))
    return True


def _check_callable(name: str, value) -> None:
    if not callable(value):
        raise TypeError(f"SparseCommTrainerCallback: {name} must be callable, got {type(value).__name__}")


def _refuse_unsupported_setup(args, state) -> None:
    """ValueError for Trainer set-ups whose model is not a torch DDP model (or whose
    checkpoints the callback cannot find)."""
    reason = None
    if getattr(args, "deepspeed", None):
        reason = "DeepSpeed (TrainingArguments(deepspeed=...))"
    elif getattr(args, "fsdp", None):
        reason = "FSDP (TrainingArguments(fsdp=...))"
    else:
        names = {getattr(kind, "name", None) for kind in _distributed_types(args)}
        not_ddp = sorted(names & set(_NOT_DDP_TYPES))
        if not_ddp:
            reason = f"{_NOT_DDP_TYPES[not_ddp[0]]} (accelerate distributed_type={not_ddp[0]})"
        elif args.parallel_mode.name in ("TPU", "SAGEMAKER_MODEL_PARALLEL", "SAGEMAKER_DATA_PARALLEL"):
            reason = f"parallel_mode={args.parallel_mode.value}"
    if reason is not None:
        raise ValueError(
            f"SparseCommTrainerCallback needs the Trainer to wrap the model in torch.nn.parallel."
            f"DistributedDataParallel (torchrun/accelerate launch with several processes, no DeepSpeed/FSDP), "
            f"but this Trainer uses {reason}, which does not run DDP communication hooks: remove the callback"
        )
    if getattr(state, "is_hyper_param_search", False):
        raise ValueError(
            "SparseCommTrainerCallback does not support hyperparameter search: its trials save checkpoints in "
            "run-<trial> directories the callback is not told about"
        )


def _distributed_types(args) -> list:
    """Accelerate's view of the run: TrainingArguments' PartialState, and the Trainer's
    AcceleratorState (where an ``accelerate launch`` config turns on DeepSpeed or FSDP)."""
    kinds = [getattr(getattr(args, "distributed_state", None), "distributed_type", None)]
    try:
        from accelerate.state import AcceleratorState, is_initialized
    except ImportError:  # the Trainer itself requires accelerate; be lenient anyway
        return kinds
    if is_initialized():
        kinds.append(AcceleratorState().distributed_type)
    return kinds


def _resumed_checkpoint_dir(args, state) -> Path:
    """The checkpoint the Trainer resumed from: the first candidate at this global step."""
    default = Path(args.output_dir) / f"{trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    candidates = ([Path(args.resume_from_checkpoint)] if args.resume_from_checkpoint else []) + [default]
    for candidate in candidates:
        if _trainer_state_step(candidate) == state.global_step:
            return candidate
    return candidates[0]


def _trainer_state_step(checkpoint_dir: Path) -> int | None:
    try:
        with open(checkpoint_dir / trainer_module.TRAINER_STATE_NAME, encoding="utf-8") as f:
            return json.load(f).get("global_step")
    except (OSError, ValueError):
        return None


def _read_state_file(path: Path, args, state) -> tuple[object, str | None]:
    """(the saved hook state, None) or (None, what is wrong with this rank's file)."""
    rank = args.process_index
    if not path.is_file():
        return None, f"rank {rank}: {path} not found"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - reported to every rank, with the file
        return None, f"rank {rank}: {path} could not be read ({type(error).__name__}: {error})"
    expected = {"format": STATE_FILE_FORMAT, "rank": rank, "world_size": args.world_size,
                "global_step": state.global_step}
    if not isinstance(payload, dict):
        return None, f"rank {rank}: {path} holds a {type(payload).__name__}, not a sparsecomm hook state file"
    wrong = [f"{key} {payload.get(key)!r} (this run: {value!r})" for key, value in expected.items()
             if payload.get(key) != value]
    if wrong:
        return None, f"rank {rank}: {path} was saved with " + ", ".join(wrong)
    return payload["hook_state"], None
