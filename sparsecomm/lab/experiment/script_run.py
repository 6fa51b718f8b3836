"""Your own training script as one run of a paired experiment: ``sparsecomm.lab.init()``.

``sparsecomm compare --script train.py`` launches ``train.py`` once per (arm, seed) under
torchrun and tells it, through the environment, which arm and seed it is and where its run
directory is. Three lines connect the script::

    run = sparsecomm.lab.init()                  # arm, seed, run directory from the runner
    torch.manual_seed(run.seed)                  # same initial weights and data order in every arm
    ...
    optimizer = run.apply(ddp_model, optimizer)  # registers the arm's hook; fixes the optimizer if the arm needs it
    ...
    run.log({"val_loss": v}, step=s)             # the metric the experiment compares (--metric)

Under ``parallelism="hsdp:RxS"`` (FSDP2 hybrid sharding) the script shards its model over
``run.mesh()["shard"]`` (``fully_shard`` on each block, then on the model) instead of wrapping it
in DDP, and passes the sharded model to ``run.apply``: the arm then acts on the cross-replica
reduction (``run.parallelism`` says which; it is "ddp" outside the lab).

The run directory then holds what a built-in run holds (``steps.jsonl``, the summary), so
``sparsecomm ledger``, ``check``, ``plot`` and ``frontier`` read it. A train row is written at
every ``optimizer.step()`` (a post-step hook): the step time, the time inside the comm hook,
the time waiting for the last bucket's collective (from its hook's return to the step) and
the bytes the hook sent. The script may log ``train_loss`` too; it is put on the next row.
The run ends with :meth:`Run.finish`, or when the script ends if it forgot it. Under the
runner each rank runs the script through :mod:`sparsecomm.lab.experiment.script_rank`, which
records how the script ended when that is not a finished run (an exception, ``sys.exit``
with a message, no ``init()``), in words that say what the script did.

Run outside the runner (plain ``torchrun train.py``), ``init()`` returns a standalone run:
the dense arm, seed ``SPARSECOMM_SEED`` or 0, nothing registered, nothing written.
"""
import json
import numbers
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sparsecomm.lab.experiment.process_tree import LAUNCH_ENV

RUN_CONFIG_ENV = "SPARSECOMM_LAB_RUN_CONFIG"
"""Path of the run's ``run-config.json`` (config, arm, seed, hash), set by the runner."""
LAUNCH_TIME_ENV = "SPARSECOMM_LAB_LAUNCH_TIME"
"""Wall clock (``time.time()``) when the runner launched the run: the start of setup."""
STANDALONE_SEED_ENV = "SPARSECOMM_SEED"

_ACTIVE = []  # the run of this process, once init() made it


class Run:
    """One arm x seed of an experiment, as the training script sees it."""

    def __init__(self, *, arm: str, seed: int, config=None, run_dir: Path | None = None, config_hash: str | None = None,
                 launch_time: float | None = None):
        self.arm, self.seed, self.config, self.run_dir = arm, seed, config, run_dir
        self.config_hash = config_hash
        self.in_lab = config is not None
        self.steps = config.steps if config is not None else None
        """The experiment's step budget (None standalone): the script may train for it."""
        self.metric = config.metric if config is not None else "val_loss"
        self.spec = config.arm(arm) if config is not None else None
        self.parallelism = config.parallelism if config is not None else "ddp"
        """"ddp", or "hsdp:RxS": then the script shards its model over :meth:`mesh` ``["shard"]``."""
        self._mesh = None
        self.hook_state = None
        """The registered hook's state after :meth:`apply` (a TopKState for top-k arms; None for dense)."""
        self._started = time.time()
        self._setup_seconds = self._started - launch_time if launch_time is not None else 0.0
        self._ddp = self._meter = self._description = None
        self._rows, self._evals, self._train_loss = [], [], None
        self._step = 0
        self._last_step_end = self._step_started = None
        self._writer = None
        self._rank = self._world_size = None  # of the process group at apply(): finish() needs no group
        self.finished = False
        """Whether :meth:`finish` was called."""

    # -- connecting the script ---------------------------------------------------------------

    def mesh(self, device_type: str = "cpu"):
        """The experiment's (replicate, shard) DeviceMesh under ``parallelism="hsdp:RxS"`` (R x S,
        dims named "replicate" and "shard"), made once, after the process group: shard the model
        over ``run.mesh()["shard"]``. Raises ValueError for a "ddp" experiment (and standalone)."""
        if self.parallelism == "ddp":
            raise ValueError('run.mesh: the experiment\'s parallelism is "ddp" (a mesh exists only under '
                             'parallelism "hsdp:RxS"); wrap the model in DDP instead')
        if self._mesh is None:
            from sparsecomm.lab.experiment import hsdp_arms

            self._mesh = hsdp_arms.build_mesh(self.config, device_type)
        return self._mesh

    def apply(self, ddp_model, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register the arm's comm hook on ``ddp_model`` and return the optimizer the arm needs.

        The optimizer is changed in place when the arm asks for it: a hook with momentum
        correction (topk-dgc) needs an optimizer without momentum of its own (AdamW/Adam
        ``betas[0] = 0``, SGD ``momentum = 0``), and an arm's ``optimizer`` settings (lr,
        momentum, weight_decay, beta2) are written into every parameter group. Call it once, after
        wrapping the model in DDP and before the first backward. Under ``parallelism="hsdp:RxS"``
        ``ddp_model`` is the model ``fully_shard``-ed over ``run.mesh()["shard"]``.
        """
        from torch.nn.parallel import DistributedDataParallel

        from sparsecomm.fsdp.fsdp_modules import is_fsdp_module

        if self.parallelism == "ddp" and not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"run.apply: ddp_model must be a torch DistributedDataParallel model, got "
                            f"{type(ddp_model).__name__}")
        if self.parallelism != "ddp" and not is_fsdp_module(ddp_model):
            raise TypeError(f"run.apply: with parallelism {self.parallelism!r} ddp_model must be the model "
                            f"fully_shard-ed over run.mesh()['shard'], got {type(ddp_model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"run.apply: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if self._ddp is not None:
            raise RuntimeError("run.apply was already called: one model per run")
        self._ddp = ddp_model
        if not self.in_lab:
            return optimizer  # standalone: DDP's own allreduce, the dense arm
        if dist.get_world_size() != self.config.world_size:
            raise ValueError(f"run.apply: the process group has {dist.get_world_size()} ranks but the experiment's "
                             f"world_size is {self.config.world_size}")
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        from sparsecomm.lab.experiment.arms import HookMeter, hook_for_spec

        if self.parallelism == "ddp":
            arm_hook = hook_for_spec(self.spec, ddp_model, self.seed)
            meter = HookMeter(arm_hook)
            meter.register(ddp_model)
        else:
            from sparsecomm.lab.experiment import hsdp_arms

            arm_hook, meter = hsdp_arms.hsdp_arm(self.arm, self.config, ddp_model, self.mesh(), self.seed)
        self._description = arm_hook.description
        self._arm_hook = arm_hook
        self.hook_state = arm_hook.checkpoint_state if self.spec.reducer != "powersgd" else arm_hook.state
        self._meter = meter
        adapt_optimizer(optimizer, self.spec)
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)
        if self._rank == 0:
            from sparsecomm.lab.experiment.steps_log import StepLog

            self._writer = StepLog(self.run_dir, append=False)
        self._last_step_end = time.perf_counter()
        return optimizer

    def evaluating(self):
        """Evaluate inside this: for an arm that trains locally between syncs (sparse-delta),
        the model then holds the weights every rank agrees on (the last sync's); for other
        arms, and standalone, it changes nothing."""
        import contextlib

        return self._arm_hook.evaluation() if self._meter is not None else contextlib.nullcontext()

    def log(self, metrics: dict, step: int | None = None) -> None:
        """Record metrics at ``step`` (default: the optimizer steps taken so far).

        The experiment's metric (``val_loss`` unless ``--metric`` names another) becomes an
        evaluation point of the run; ``train_loss`` goes on the next train row; others are
        ignored. Call it on every rank with the same values (rank 0 writes). A value is a real
        number or a one-element tensor (refused here otherwise); NaN and infinities are recorded
        as they are: a run that diverged is a measured result (its verdict is inconclusive).
        """
        if not isinstance(metrics, dict):
            raise TypeError(f"run.log: metrics must be a dict of name -> number, got {type(metrics).__name__}")
        step = self._step if step is None else step
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            raise ValueError(f"run.log: step must be an integer >= 0, got {step!r}")
        if "train_loss" in metrics:
            self._train_loss = _number("train_loss", metrics["train_loss"])
        if self.metric in metrics:
            value = _number(self.metric, metrics[self.metric])
            elapsed = time.time() - self._started
            self._evals.append([step, elapsed, value])
            self._write({"kind": "eval", "step": step, "val_loss": value, "metric": self.metric,
                         "elapsed_seconds": elapsed})

    def finish(self) -> dict | None:
        """End the run: rank 0 writes its summary (for the runner); returns it (None standalone).
        Needs no process group (the script may have destroyed it)."""
        if self.finished:
            return None
        self.finished = True
        if not self.in_lab:
            return None
        if self._writer is not None:
            self._writer.close()
        missing = self.missing()
        if missing is not None:
            raise RuntimeError(f"run.finish: {missing}")
        summary = self._summary()
        if self._rank == 0:
            from sparsecomm.lab.experiment.files import write_json_atomically
            from sparsecomm.lab.results.layout import RESULT_FILE

            write_json_atomically(self.run_dir / RESULT_FILE, summary)
        return summary

    def missing(self) -> str | None:
        """What the script has not done that a finished run needs (None: nothing)."""
        if not self.applied:
            return "run.apply(ddp_model, optimizer) was never called, so the arm's hook was never registered"
        if not self._rows:
            return "no optimizer step was taken after run.apply"
        if not self._evals:
            return (f"run.log never recorded the experiment's metric {self.metric!r} (log it at least once, at the "
                    "end)")
        return None

    @property
    def applied(self) -> bool:
        """Whether :meth:`apply` registered the arm's hook."""
        return self._meter is not None

    @property
    def steps_taken(self) -> int:
        """Optimizer steps since :meth:`apply`."""
        return self._step

    # -- measuring ---------------------------------------------------------------------------

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._step_started = time.perf_counter()  # backward (and whatever follows it) is done

    def _after_step(self, optimizer, args, kwargs) -> None:
        from sparsecomm.lab.experiment.arms import after_optimizer_step

        after = after_optimizer_step(self._arm_hook)  # an averager's outer sync, every period steps
        now = time.perf_counter()
        measured = self._meter.take_step()
        step_seconds = now - self._last_step_end
        last_hook = measured["last_hook_return"]
        comm_wait = max(0.0, self._step_started - last_hook) if last_hook is not None else 0.0
        comm_wait += after["comm_seconds"] + measured.get("exchange_seconds", 0.0)  # HSDP: FSDP waits for its hooks
        compress = measured["hook_seconds"] + after["compress_seconds"]
        self._step += 1
        row = {
            "kind": "train",
            "step": self._step,
            "train_loss": self._train_loss,
            "step_seconds": step_seconds,
            "compute_seconds": step_seconds - compress - comm_wait,
            "compress_seconds": compress,
            "comm_wait_seconds": comm_wait,
            "bytes_sent": measured["bytes_sent"] + after["bytes_sent"],
            "bytes_dense": measured["bytes_dense"],
            "elapsed_seconds": time.time() - self._started,
        }
        self._train_loss = None
        self._rows.append(row)
        self._write(row)
        self._last_step_end = time.perf_counter()

    def _write(self, row: dict) -> None:
        if self._writer is not None:
            self._writer.write(row)

    def _summary(self) -> dict:
        from sparsecomm.lab.experiment.worker import steady_figures

        warmup = self.spec.options.get("warmup_steps", self.spec.options.get("start_iter", 0))
        return {
            "arm": self.arm,
            "seed": self.seed,
            "status": "ok",
            "config_hash": self.config_hash,
            "hook": self._description,
            "arm_spec": self.spec.to_dict(),
            "setup_seconds": self._setup_seconds,
            **steady_figures(self._rows, warmup),
            "total_seconds": self._rows[-1]["elapsed_seconds"],
            "checkpoint_seconds": None,
            "num_checkpoints": 0,
            "restore_seconds": None,
            "recovery_seconds": None,
            "lost_steps": None,
            "residual_reset": False,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "rollbacks": 0,
            "evals": self._evals,
            "metric": self.metric,
            "hook_stats": self._arm_hook.stats(self._arm_hook.state),
            "world_size": self._world_size,
            "torch_version": torch.__version__,
            "num_parameters": sum(p.numel() for p in getattr(self._ddp, "module", self._ddp).parameters()),
            "script": self.config.script,
            "steps_taken": self._step,
            "launch_id": os.environ.get(LAUNCH_ENV),
        }


def adapt_optimizer(optimizer: torch.optim.Optimizer, spec) -> None:
    """Change ``optimizer`` in place for the arm: no momentum of its own under momentum
    correction, and the arm's optimizer settings (a script's arm holds only its changes).
    Refused once the optimizer has stepped."""
    changes = spec.optimizer
    if not spec.momentum_correction and not changes:
        return
    if optimizer.state:
        raise RuntimeError(f"arm {spec.name!r} changes the optimizer, which has already stepped: call run.apply "
                           "before the first optimizer.step()")
    from sparsecomm.optim import AdamS

    if spec.momentum_correction and isinstance(optimizer, AdamS):
        # AdamS's normalizer is built from its momentum: it cannot run with beta1 = 0.
        raise ValueError(f"arm {spec.name!r} corrects momentum in the hook, so the optimizer must run without its "
                         "own; the script's AdamS builds its normalizer from its momentum and cannot: choose an arm "
                         "without momentum correction, or AdamW / SGD in the script")
    if "momentum" in changes and not all("momentum" in group for group in optimizer.param_groups):
        raise ValueError(f"arm {spec.name!r} sets the optimizer's momentum to {changes['momentum']!r}, but the "
                         f"script's {type(optimizer).__name__} has no momentum setting (SGD has): it cannot apply")
    if "beta2" in changes and not all("betas" in group for group in optimizer.param_groups):
        raise ValueError(f"arm {spec.name!r} sets the optimizer's beta2 to {changes['beta2']!r}, but the script's "
                         f"{type(optimizer).__name__} has no betas (AdamW, Adam and AdamS have): it cannot apply")
    for group in optimizer.param_groups:
        if "beta2" in changes:
            group["betas"] = (group["betas"][0], changes["beta2"])
        for key in ("lr", "weight_decay"):
            if key in changes:
                group[key] = changes[key]
        if "momentum" in changes:
            group["momentum"] = changes["momentum"]
        if spec.momentum_correction:
            if "betas" in group:
                group["betas"] = (0.0, group["betas"][1])
            elif "momentum" in group:
                group["momentum"] = 0.0
            else:
                raise ValueError(f"arm {spec.name!r} corrects momentum in the hook, so the optimizer must run without "
                                 f"its own; {type(optimizer).__name__} has neither betas nor momentum to turn off")


def _number(name: str, value) -> float:
    """A logged metric as a float: a real number (numpy's included) or a one-element tensor,
    refused here otherwise, naming the metric. NaN and infinities are kept (a diverged run
    is a measured result)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"run.log: {name} must be a number or a one-element tensor, got a tensor of shape "
                             f"{tuple(value.shape)} (log one number, e.g. loss.item())")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"run.log: {name} must be a real number or a one-element tensor, got {value!r}")
    return float(value)


def active_run() -> "Run | None":
    """The run :func:`init` made in this process, or None before it was called."""
    return _ACTIVE[0] if _ACTIVE else None


def init(seed: int | None = None) -> Run:
    """The run this process belongs to: from the runner's environment, else standalone.

    Standalone (no runner), the arm is ``dense`` and the seed is ``seed``, else
    ``SPARSECOMM_SEED``, else 0. Under the runner, ``seed`` is ignored: the runner's seed
    is the pairing. Calling it twice returns the same run.
    """
    if _ACTIVE:
        return _ACTIVE[0]
    path = os.environ.get(RUN_CONFIG_ENV)
    if path is None:
        run = Run(arm="dense", seed=int(os.environ.get(STANDALONE_SEED_ENV, 0)) if seed is None else seed)
    else:
        from sparsecomm.lab.experiment.config import ExperimentConfig

        raw = json.loads(Path(path).read_text())
        config = ExperimentConfig.of_run(raw)  # as the runner read it, whatever directory the script is in now
        launch = os.environ.get(LAUNCH_TIME_ENV)
        run = Run(arm=raw["arm"], seed=raw["seed"], config=config, run_dir=Path(path).parent,
                  config_hash=raw["config_hash"], launch_time=float(launch) if launch else None)
    _ACTIVE.append(run)
    return run
