"""PyTorch Lightning: register the top-k hook on the model Lightning wraps in DDP.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only when the root
device is CUDA; on CPU (gloo) it silently trains dense. :class:`SparseCommCallback`
registers :func:`~sparsecomm.topk_hook` on any device and keeps the hook state in
Lightning checkpoints::

    from sparsecomm.integrations import SparseCommCallback

    trainer = Trainer(strategy="ddp", callbacks=[SparseCommCallback(density=0.01)])

By default (``momentum="auto"``) the hook takes over the momentum of the LightningModule's
optimizer (AdamW ``betas[0]``, SGD ``momentum``): momentum correction, the setting that
holds quality (:mod:`sparsecomm.hooks.momentum_handover`).

When: ``DDPStrategy.setup()`` wraps the LightningModule in DDP, and ``Trainer._run``
calls the callbacks' ``on_fit_start`` right after it, before the first batch: the only
hook point that sees the DDP model and precedes any backward pass. ``setup()``, which
runs earlier, checks the strategy so that a wrong one fails before DDP is built.

Checkpoints: every rank's residuals differ, but Lightning's DDP strategy writes the
checkpoint on global rank 0 only. :meth:`SparseCommCallback.state_dict` (called on every
rank while Lightning assembles a checkpoint) therefore gathers all ranks' hook states to
rank 0, which stores them together under rank-qualified keys; on resume every rank reads
the same file and :meth:`TopKState.load_state_dict` takes its own entries. Gathering
keeps the checkpoint one self-contained file, so whatever Lightning does with it
(``ModelCheckpoint`` retention, remote ``CheckpointIO``, copying it elsewhere) keeps the
residuals with the weights; a side file per rank would need a shared file system and
would outlive deleted checkpoints. The cost: rank 0 holds and writes world_size copies of
the residual (one float per parameter per rank, plus velocities with momentum).

Figures: by default (``log_every="auto"``) the hook's figures (:mod:`sparsecomm.metrics`:
bytes per step, compression, density, residual norm, ...) go to the Trainer's own loggers
(``trainer.loggers``: TensorBoardLogger, WandbLogger, CSVLogger, ...) as ``sparsecomm/<name>``,
every ``Trainer(log_every_n_steps=...)`` optimizer steps, at the step Lightning gives that
batch's ``self.log`` values; ``logger=False`` logs nothing (docs/metrics.md).
"""
import torch

from sparsecomm.hooks.register import register_topk_hook
from sparsecomm.hooks.state.settings import check_bool
from sparsecomm.hooks.topk import TopKState
from sparsecomm.integrations.common import AUTO_LOG, check_log_every, check_state_options, gather_state_dicts
from sparsecomm.integrations.common import import_framework
from sparsecomm.hooks.momentum_handover import AUTO, announce, plan_handover
from sparsecomm.metrics import CallableSink, MetricsLogger

pl = import_framework("lightning.pytorch", "lightning", "lightning")
strategies = import_framework("lightning.pytorch.strategies", "lightning", "lightning")


class SparseCommCallback(pl.Callback):
    """Top-k + error-feedback gradient reduction for a Lightning DDP run.

    Args:
        density: fraction of each bucket sent (see :class:`~sparsecomm.TopKState`).
        momentum: "auto" (default): at ``on_fit_start`` the hook's momentum correction takes
            over the optimizers' own momentum (AdamW/Adam ``betas[0]`` -> 0, SGD
            ``momentum`` -> 0, said in an
            :class:`~sparsecomm.hooks.momentum_handover.OptimizerChangedWarning` on rank 0); an
            optimizer other than torch SGD/Adam/AdamW is refused (ValueError). A number:
            that momentum correction (the optimizers' own momentum turned off the same way);
            0: plain error feedback, optimizers left as they are.
        strict_load: passed to :meth:`TopKState.load_state_dict` on resume. False resets
            the residuals with a warning instead of refusing a checkpoint from another
            world size or hook configuration.
        log_every: the hook's figures (``sparsecomm/<name>``, rank 0's) to every logger in
            ``trainer.loggers`` every that many optimizer steps: "auto" (default) at the
            Trainer's ``log_every_n_steps`` (so with ``logger=False``, or
            ``log_every_n_steps=0``, nothing), an integer >= 1, or None (off).
        **state_options: any other :class:`~sparsecomm.TopKState` keyword argument
            (``error_feedback``, ``momentum``, ``warmup_steps``, ``selector``, ...), checked
            here; ``module`` and ``process_group`` come from the DDP model.

    Attributes:
        state: the :class:`~sparsecomm.TopKState` once ``fit`` has started (None before);
            ``callback.state.stats()`` reports what this rank sent.
        metrics: the :class:`~sparsecomm.metrics.MetricsLogger` writing the figures to the
            Trainer's loggers once ``fit`` has started (None when nothing is logged).

    Raises (when ``fit`` starts, on every rank, before the first step):
        TypeError: the strategy is not a ``DDPStrategy``, or did not wrap the model in
            ``torch.nn.parallel.DistributedDataParallel``.
        ValueError: ``DDPStrategy(ddp_comm_hook=...)`` is set, or the DDP model already
            has a communication hook (DDP allows one).
    """

    def __init__(self, density: float = 0.01, *, momentum: float | str = AUTO, strict_load: bool = True,
                 log_every: int | str | None = AUTO_LOG, **state_options):
        self.strict_load = check_bool("strict_load", strict_load)
        self.log_every = check_log_every("SparseCommCallback", log_every, allow_auto=True)
        self.metrics: MetricsLogger | None = None
        self._options = check_state_options("SparseCommCallback",
                                            {"density": density, "momentum": momentum, **state_options})
        self.state: TopKState | None = None
        # A checkpoint's hook state arrives (load_state_dict) before the strategy builds
        # DDP and on_fit_start creates the state; it waits here until then.
        self._state_to_load: dict | None = None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, strategies.DDPStrategy):
            raise TypeError(
                f"SparseCommCallback needs trainer strategy DDPStrategy (strategy='ddp', 'ddp_spawn', "
                f"'ddp_notebook' or DDPStrategy(...)), got {type(strategy).__name__}"
            )
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError(
                f"DDPStrategy(ddp_comm_hook={strategy._ddp_comm_hook!r}) is set and SparseCommCallback "
                "registers its own hook; DDP allows one: remove ddp_comm_hook (on CPU Lightning would "
                "ignore it anyway)"
            )

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        ddp_model = trainer.strategy.model
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"SparseCommCallback: {type(trainer.strategy).__name__} wrapped the model in "
                f"{type(ddp_model).__name__}, not torch.nn.parallel.DistributedDataParallel; the top-k "
                "hook is a DDP communication hook (use strategy='ddp')"
            )
        # DDP keeps (hook, state) pairs in _comm_hooks (see sparsecomm.hooks.register).
        registered = getattr(ddp_model, "_comm_hooks", [])
        if registered:
            names = ", ".join(getattr(hook, "__qualname__", repr(hook)) for hook, _ in registered)
            raise ValueError(
                f"SparseCommCallback: the DDP model already has a communication hook ({names}); DDP allows "
                "one per model: remove the other hook or this callback"
            )
        handover = plan_handover("SparseCommCallback", trainer.optimizers, self._options)
        if self.state is None:
            self.state = TopKState(ddp_model.process_group, module=ddp_model, **handover.hook_options(self._options))
        register_topk_hook(ddp_model, self.state)
        announce("SparseCommCallback", handover.apply(), trainer.global_rank)
        if self._state_to_load is not None:
            self.state.load_state_dict(self._state_to_load, strict=self.strict_load)
            self._state_to_load = None
        self.metrics = self._metrics_logger(trainer)  # after the load: its first window starts here

    def _metrics_logger(self, trainer: "pl.Trainer") -> MetricsLogger | None:
        every = trainer.log_every_n_steps if self.log_every == AUTO_LOG else self.log_every
        if not every or not trainer.loggers:
            return None
        loggers = list(trainer.loggers)

        def to_loggers(figures: dict, step: int) -> None:
            # Lightning logs the k-th optimizer step's batch at step k - 1 (its self.log values
            # go out before it counts the batch): the figures join that batch's row.
            for logger in loggers:
                logger.log_metrics(figures, step=step - 1)

        return MetricsLogger(self.state, every=every, sinks=[CallableSink(to_loggers)])

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs, batch,
                           batch_idx: int) -> None:
        if self.metrics is not None:  # a batch that only accumulated gradients leaves global_step as it was
            self.metrics.step(trainer.global_step)

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def state_dict(self) -> dict:
        """Every rank's hook state on rank 0 (collective: Lightning calls it on all ranks)."""
        if self.state is None:
            return {}
        return gather_state_dicts(self.state)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore this rank's entries, now or (before ``fit`` has built DDP) in on_fit_start."""
        if self.state is None:
            self._state_to_load = state_dict
        else:
            self.state.load_state_dict(state_dict, strict=self.strict_load)
