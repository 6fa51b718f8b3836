"""torchtitan's ``Trainer`` with sparsecomm's top-k hook on the replica dimension.

A torchtitan job with ``--parallelism.data_parallel_replicate_degree R`` and
``--parallelism.data_parallel_shard_degree S`` shards every block over the 2-D (replicate,
shard) mesh: native HSDP, whose all-reduce across replicas is the traffic between nodes. With
``--sparsecomm.enable`` the blocks are sharded over the shard dimension alone, and each
module's all-reduce across replicas goes through :func:`sparsecomm.register_hsdp_hook`
("custom HSDP", the plug point torchtitan's own torchft experiment uses for its replica
all-reduce): the same reduce-scatter inside a replica, then top-k + error feedback across
replicas. torchtitan divides no gradient in FSDP (its loss is divided by the global token
count), so the hook hands FSDP the sum over replicas, as native HSDP does.

Where it plugs in, all through torchtitan's own extension points:

- the model spec's ``parallelize_fn`` is called with a view of ``parallel_dims`` that has no
  replicate dimension, so it shards over ``fsdp`` alone (llama3 and the decoders sharing
  ``apply_fsdp_to_decoder``; a parallelize function that shards over the 2-D mesh anyway is
  refused by name when the hook registers);
- the hook registers once the trainer has built the model and its optimizer, before the first
  step, and takes over AdamW's momentum (``--sparsecomm.momentum auto``);
- its memories join ``checkpointer.states`` (:mod:`.checkpoint`), so torchtitan's DCP checkpoints
  hold every rank's residuals and a resumed job continues bit for bit;
- its figures (:class:`sparsecomm.metrics.CommFigures`) go to torchtitan's metrics logger
  (TensorBoard, W&B) at its ``--metrics.log_freq``, under ``sparsecomm/``, and to its console log.

Supported: one micro-batch per step (no gradient accumulation: torchtitan reduces every
micro-batch), the loss without ``ChunkedLossWrapper`` (:func:`to_sparsecomm` unwraps it), data
parallelism only (no TP, PP, CP or EP yet: each is refused when the config is
built), ``--parallelism.spmd_backend partial_dtensor`` (the classic FSDP path; the others shard
over the whole SPMD mesh), one model part and one optimizer.
"""
import dataclasses

import torch.distributed as dist
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from sparsecomm.integrations.torchtitan.checkpoint import STATES_KEY, HookCheckpoint
from sparsecomm.integrations.torchtitan.options import SparseCommOptions

REPLICATE_DIM, SHARD_DIM = "dp_replicate", "fsdp"


class WithoutReplicas:
    """``parallel_dims`` as the parallelize function sees it under the hook: no replicate
    dimension, so FSDP shards over ``fsdp`` alone and leaves the replicas to the hook."""

    def __init__(self, parallel_dims):
        object.__setattr__(self, "_dims", parallel_dims)

    @property
    def dp_replicate_enabled(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._dims, name)


def shard_only(parallelize_fn):
    def parallelize_without_replicas(model, *, parallel_dims, **kwargs):
        return parallelize_fn(model, parallel_dims=WithoutReplicas(parallel_dims), **kwargs)

    parallelize_without_replicas.__wrapped__ = parallelize_fn
    return parallelize_without_replicas


def check_config(config) -> None:
    """With the hook on, a ValueError naming every flag of ``config`` it cannot take (when the
    config is built, and again when the trainer starts: a config may change in between)."""
    if config.sparsecomm.enable:
        problems = _refusals(config)
        if problems:
            raise ValueError("--sparsecomm.enable: " + "; ".join(problems))


def _refusals(config) -> list[str]:
    """What the hook cannot take in ``config``: (--flag, why) as messages."""
    parallelism = config.parallelism
    problems = []
    if parallelism.data_parallel_replicate_degree <= 1:
        problems.append(f"--parallelism.data_parallel_replicate_degree must be > 1 (got "
                        f"{parallelism.data_parallel_replicate_degree}): the hook reduces across replicas, and "
                        "pure FSDP has none")
    if parallelism.spmd_backend != "partial_dtensor":
        problems.append(f"--parallelism.spmd_backend must be 'partial_dtensor' (got {parallelism.spmd_backend!r}): "
                        "the other backends shard over the whole SPMD mesh, replicas included")
    from torchtitan.components.loss import ChunkedLossWrapper

    if isinstance(config.loss, ChunkedLossWrapper.Config):
        problems.append("--loss must not be ChunkedLossWrapper: it reduces the output layer's FSDP group in two "
                        "parts per step (the output layer's gradient, then the final norm's), and the hook keys "
                        "each FSDP module's memories by its whole shard; use its inner loss (to_sparsecomm does)")
    for flag in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                 "expert_parallel_degree"):
        degree = getattr(parallelism, flag, 1)
        if degree != 1:
            problems.append(f"--parallelism.{flag} must be 1 (got {degree}): the hook is built for data "
                            "parallelism only in this version")
    return problems


class SparseCommTrainer(Trainer):
    """torchtitan's Trainer; with ``--sparsecomm.enable``, gradients cross replicas through the
    top-k hook (module docstring). Disabled, it is torchtitan's Trainer unchanged."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sparsecomm: SparseCommOptions = dataclasses.field(default_factory=SparseCommOptions)

        def __post_init__(self):
            Trainer.Config.__post_init__(self)  # (slots dataclasses do not support a bare super())
            check_config(self)

    def __init__(self, config: Config):
        self.sparsecomm_state = None
        self._figures = None
        options = config.sparsecomm
        check_config(config)
        if options.enable:
            spec = config.model_spec
            config.model_spec = dataclasses.replace(spec, parallelize_fn=shard_only(spec.parallelize_fn))
        super().__init__(config)
        if options.enable:
            if self.gradient_accumulation_steps > 1:
                # torchtitan lets FSDP reduce at every micro-batch: the hook would take each one for a
                # step (its warm-up, momentum and budget count steps).
                raise ValueError(
                    f"--sparsecomm.enable: --training.global_batch_size {config.training.global_batch_size} means "
                    f"{self.gradient_accumulation_steps} micro-batches per step, each reduced across replicas by "
                    "FSDP; the hook needs one reduction per step: set it to local_batch_size x the data-parallel "
                    "degree (or -1)")
            self._register_hook(options)

    def _register_hook(self, options: SparseCommOptions) -> None:
        from sparsecomm.fsdp.hsdp_hook import register_hsdp_hook

        if len(self.model_parts) != 1 or len(self.optimizers.optimizers) != 1:
            raise ValueError(f"--sparsecomm.enable needs one model part and one optimizer, got "
                             f"{len(self.model_parts)} and {len(self.optimizers.optimizers)}")
        mesh = self.parallel_dims.get_mesh([REPLICATE_DIM, SHARD_DIM])
        state_options = options.state_options()
        optimizer = self.optimizers.optimizers[0]
        try:
            self.sparsecomm_state = register_hsdp_hook(self.model_parts[0], mesh, replicate_dim=REPLICATE_DIM,
                                                       shard_dim=SHARD_DIM, optimizer=optimizer, **state_options)
        except ValueError as error:
            raise ValueError(f"--sparsecomm.enable: {error} (the model's parallelize function must shard over "
                             f"{SHARD_DIM!r} alone when parallel_dims.dp_replicate_enabled is False)") from None
        if getattr(self.checkpointer, "enable", False):
            self.checkpointer.states[STATES_KEY] = HookCheckpoint(self.sparsecomm_state, strict=options.strict_load)

    def train_step(self, data_iterator):
        if self.sparsecomm_state is not None and self._figures is None:
            from sparsecomm.metrics import CommFigures

            # Built at the first step, after train() has loaded any checkpoint: the first window
            # starts at the resumed step.
            self._figures = CommFigures(self.sparsecomm_state)
        super().train_step(data_iterator)
        if self._figures is not None and self.metrics_processor.should_log(self.step):
            self._log_figures()

    def _log_figures(self) -> None:
        figures = self._figures.read()
        self.metrics_processor.logger.log({f"sparsecomm/{name}": value for name, value in figures.items()},
                                          self.step)
        if dist.get_rank() == 0:
            sent, dense = figures.get("bytes_sent_per_step"), figures.get("bytes_dense_per_step")
            said = []
            if sent is not None:  # (a window without a step has no per-step figures)
                share = f" ({sent / dense:.1%} of dense)" if dense else ""
                said.append(f"sent {sent:,.0f} B/step across replicas{share}")
            said.append(f"density {figures.get('effective_density', figures['density']):.4f}")
            if "residual_norm" in figures:
                said.append(f"residual norm {figures['residual_norm']:.4g}")
            logger.info(f"sparsecomm: step {self.step}: " + ", ".join(said))
