"""The top-k hook's state (:func:`sparsecomm.topk_hook`): its config, and its parts, one
file each: parameter names (``parameter_names``), per-rank memories (``memories``), where
the step is (``step_lifecycle``), the wires with their buffers (``wires``), observers
(``observers``); counters (``stats``). Checkpoints and pickles: :mod:`sparsecomm.hooks.state_persistence`."""
import warnings

import torch
import torch.distributed as dist

from sparsecomm.comm import mpi_allgatherv
from sparsecomm.hooks.pipeline.steps import MAX_BUCKET_NUMEL  # noqa: F401  (re-exported)
from sparsecomm.hooks.pipeline.steps import PlanCache
from sparsecomm.hooks.state.adams_link import AdamSLink
from sparsecomm.hooks.state.grad_scaler import ScaleTracker
from sparsecomm.hooks.state.memories import HookMemories
from sparsecomm.hooks.state.memories import ParameterNames
from sparsecomm.hooks.state.model_budget import ModelBudget
from sparsecomm.hooks.state.observers import Observers
from sparsecomm.hooks.state.rank_agreement import check_ranks_agree
from sparsecomm.hooks.state.settings import FIELDS as CONFIG_FIELDS
from sparsecomm.hooks.state.settings import K_SCOPES, OVERFLOW_CHOICES, SELECTOR_CHOICES, TopKConfig  # noqa: F401  (re-exported)
from sparsecomm.hooks.state.step import HookStats, StepJournal, StepLifecycle
from sparsecomm.hooks.state.unused_parameters import UnusedParameterAccounting
from sparsecomm.hooks.state_persistence import STATE_DICT_FORMAT, PersistentState  # noqa: F401  (re-exported)
from sparsecomm.hooks.wires.base import WireContext
from sparsecomm.hooks.wires.integrity import StepSeals
from sparsecomm.optim.dgc import warn_on_double_momentum


class DenseFallbackWarning(UserWarning):
    """Every bucket of a step went dense: at this density and world size sparse would send more."""


class TopKState(PersistentState):
    """Configuration and per-rank memory of :func:`topk_hook`.

    Each step, every bucket of gradients is reduced either densely (allreduce) or
    sparsely: the ``density`` fraction of entries with the largest magnitude (after
    adding what earlier steps did not send) is all-gathered as (index, value) pairs.

    Tuning, in order of importance:

    1. ``density``: fraction of each bucket sent. 0.01 cuts traffic ~50x at 2 bytes of
       index overhead per value; below ~0.001 convergence usually needs more steps.
       When ``k * world_size * (index + value bytes)`` would not be smaller than the
       dense buffer (density >= ~1/(2 world_size) for fp32), the hook reduces densely;
       when that happens to every bucket of a step it warns once
       (:class:`DenseFallbackWarning`), naming the density that would go sparse.
    2. ``error_feedback``: keep what was not sent and add it next step. Crucial for
       convergence (without it top-k is a biased compressor that drops most of the
       gradient for good); costs one residual tensor the size of the gradients.
    3. ``momentum``: DGC momentum correction. With SGD momentum, sparsifying the
       gradient and then applying momentum lets stale residuals drive the update; instead
       the hook keeps the velocity ``u = momentum * u + g`` itself, sends top-k of the
       accumulated velocity, and zeroes both where sent. Use it with an optimizer without
       momentum of its own (:func:`sparsecomm.dgc_optimizer` builds one;
       :meth:`check_optimizer` warns about a mismatch). ``nesterov=True`` is DGC's
       Nesterov variant: ``u = momentum * (u + g)``, accumulating ``u + g``. Requires
       error feedback. ``local_clip_norm`` adds DGC's local gradient clipping: before
       entering the velocity, each parameter's gradient on each rank is scaled down to an
       L2 norm of at most ``local_clip_norm / sqrt(world_size)``.
    4. ``warmup_steps``: dense steps at the start (at least 2 with error feedback). The
       memories are keyed by parameter name, so DDP's rebuild of its buckets after the
       first iteration loses nothing; the warm-up gives the optimizer dense first steps.
    5. ``selector``: ``"exact"`` top-k, ``"sampled"`` (threshold estimated from a ~1%
       sample, DGC style; one pass over the bucket instead of a sort), ``"random"``
       (random-k: same indices on all ranks, values allreduced; the cheap baseline), or
       ``"chunk"`` (chunked top-k: the top ``ceil(density * chunk_size)`` entries of every
       ``chunk_size`` entries of the bucket, as SparseLoCo/DeMo; the compact wire below).
    6. ``value_dtype``: dtype of values on the wire (None: the bucket's dtype). A
       narrower dtype's rounding error stays in the residual, so it is compensated too.
       With ``selector="chunk"``, ``index_codec`` (``"int32"``; ``"chunk"``: 12-bit
       chunk-local indices for 4096; ``"rice"``: Rice-coded gaps, ~8.5 bits at 1%) and
       ``value_codec`` (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"int8"``,
       ``"int4"``, ``"int2"``, ``"sign"``, with a bfloat16 scale per chunk for the last
       five) choose the wire; quantization error stays in the residual (exactly:
       ``decoded + residual == acc``). See docs/wire.md for the formats and their bytes.
    7. ``residual_dtype``: dtype of the residual and the velocity. None (default):
       float32 for 16-bit buckets (bf16/fp16 models, ``fp16_compress_wrapper``), so error
       feedback does not round small gradients away; the bucket's dtype otherwise.
       Cost for a 16-bit model: 4 bytes per parameter per memory (residual, velocity)
       instead of 2, plus one float32 scratch of the largest bucket.
       ``residual_dtype=torch.bfloat16`` on a bf16 model keeps 2 bytes.
    8. Overflow steps (``on_overflow``, ``grad_scaler``): a step whose gradient holds an
       Inf or NaN is still reduced and delivered to every rank (non-finite entries rank
       first and are sent), so the loop or ``torch.amp.GradScaler`` sees it and skips the
       step; the hook's memories never take in a non-finite value (those entries become
       0). Such a backward also leaves huge *finite* entries beside the Inf (a loss scale
       that is too large gives both), in every bucket of the step. ``"rollback"``
       (default) therefore copies the memories before each step and undoes, at the start of
       the next one, a step in which any reduced bucket was not finite: residuals,
       velocities, owner residuals, the step counter and the sampled selector's random
       stream, exactly as the optimizer skipping it, whatever loop or scaler skipped it.
       Cost: one more copy of the memories in memory and one copy pass over them per step
       (measured on the default task's step: ``experiments/bench_step_cost.py``).
       ``"drop"`` opts out (no copy) and keeps the finite part of an overflowing step's
       update: right only for a loop that never skips a step. With ``grad_scaler`` the
       memories follow the scaler's scale (rescaled exactly when it changes); a step the
       scaler skipped (its scale went down) is undone too. :meth:`skip_step` undoes a step
       the loop skipped for its own reasons.
    9. ``transport``: how the sparse payloads are all-gathered. ``"c10d"`` (default)
       uses the process group (gloo/NCCL), every rank sending a payload of capacity k.
       ``"mpi"`` uses MPI ``Iallgatherv`` (mpi4py; CPU tensors, the default process group,
       launched by mpiexec): with ``selector="sampled"`` and ``k_scope="bucket"`` each
       rank then sends only the entries above its sampled threshold (at most k), a
       different number per rank, after a small blocking exchange of the sizes; other
       selections send the same bytes as c10d (same results, bit for bit). Dense
       allreduces (warm-up, fallback) always use the process group.
    10. ``density_schedule``: start denser and reach ``density`` in stages (DGC's warm-up):
       ``{"kind": "exponential", "steps": N, "stages": 4}`` (each stage sends about a
       quarter of the previous one), a list of ``(first_step, density)`` pairs ending at
       ``density``, or a :class:`~sparsecomm.hooks.state.settings.DensitySchedule`.
       ``stats()["density"]`` is the density of the current step.
    11. ``exchange``: how the payloads travel. ``"allgather"`` (default): every rank
       receives every other rank's payload, (p-1) k entries, growing with the world size.
       ``"owner"`` (``selector="chunk"``, or ``"exact"``: top-k per range): every rank
       owns a contiguous range of the bucket; one all-to-all sends each owner the entries
       of its range, the owner sums them, adds its owner residual (second-level error
       feedback) and selects again, and one all-gather returns every owner's result: about k entries sent and
       2 k received per rank whatever p is. Costs one more residual-sized memory per rank
       and a blocking all-to-all in the hook (docs/exchange.md). ``"shared-index"`` (with
       ``selector="exact"`` or ``"chunk"`` and a float wire): one rank per bucket and step,
       rotating, broadcasts its selection; every rank allreduces its values there. No
       index bytes per rank and no scatter; what the leader's set leaves out stays in each
       rank's residual. ``"shared-mask"`` (``selector="exact"``, a float wire, the job's
       optimizer :class:`sparsecomm.optim.AdamS`): SCAPE's reducer. The hook synchronises
       AdamS's first moment: each rank sends ``beta1 m + (1 - beta1) g + residual`` at a mask
       the tensors' owners chose one step before (per tensor, top ``max(1, int(density x
       numel))`` of their own corrected momentum, all-gathered as bitmaps), values
       allreduced, no index bytes; the residual is momentum-space error feedback, and AdamS
       steps only on the mask. Needs ``attach_optimizer(adams)`` (``register_topk_hook(...,
       optimizer=)`` does it)
       (SCAPE's method; :mod:`sparsecomm.hooks.wires.shared_mask`). ``"auto"``: per
       bucket, the cheapest of all-gather, owner and shared-index the settings allow (and dense), modelled on ``link`` (e.g. ``"1gbit@50us"``; default
       ``"10gbit@50us"``) by the alpha-beta cost model; ``stats()`` counts each
       (``allgather_calls``, ``owner_calls``, ``shared_index_calls``, ``fallback_calls``;
       ``shared_mask_calls`` for ``"shared-mask"``). ``owner_dropped``: where the owner
       exchange keeps what an owner's re-selection drops: ``"owner"`` (default) in its owner
       residual, ``"sender"`` (Ok-Topk) back in each sender's residual (docs/exchange.md).
    12. ``wire_checksum`` (default True): every payload this rank puts on a sparse wire (the
       all-gather, chunked and compact payloads included; both legs of the owner exchange;
       the MPI all-gathers; the shared-index leader's index broadcast) is sealed with a
       CRC-32C right after encoding, and every receiver checks every payload it received,
       its own copy too, before decoding any of them into the bucket. A payload whose bytes
       changed on the way or in memory raises :class:`~sparsecomm.WireIntegrityError` (DDP
       re-raises it from ``backward()`` as a RuntimeError with the same message), naming
       the step, the bucket and the sender, before the optimizer step: no parameter changes,
       and with ``on_overflow="rollback"`` the hook's memories go back to before the step.
       After an all-gather every rank holds the same bytes, so a payload corrupted at its
       sender makes every rank raise the same error; one corrupted on its way to some
       receivers only makes those raise, while the others apply the intact bytes
       (docs/wire.md, "Integrity"). ``wire_agreement=True`` makes every rank raise in the
       same step then too: the checks record what they find and the step's last bucket
       agrees with one 8-byte allreduce (a step's worth of latency more; off by default).
       Costs 8 bytes per payload and a CRC pass over the bytes sent and received (the
       check: ``stats()["seconds_wire_checksum"]``).
       Allreduced values (random-k, the shared-index exchange's values, dense steps) are
       sums, which no per-payload checksum survives: they carry none. ``False`` opts out.

    At its first call the hook checks, with one small all-gather over the group, that
    every rank runs it with the same settings and at the same step, and raises the same
    ``ValueError`` on every rank otherwise.

    Args:
        process_group: group to reduce over; None means the DDP model's group when the
            state is bound to a DDP model (``module=ddp_model``, or
            :func:`register_topk_hook`), else the default group.
        module: the DDP model (or its module) whose parameter names key the residuals.
            Without it, parameters are named in the order the hook first sees them
            (``param0``, ``param1``, ...), which is deterministic for a given model but
            does not survive a change of model code; pass the DDP model for checkpoints,
            process subgroups and ``find_unused_parameters``.
        seed: seeds the random-k indices (shared by all ranks) and the sampled
            selector's per-rank sample.
        allow_dense_fallback: False forces the sparse path even when it sends more
            bytes than dense (for tests and measurements).
        k_scope: ``"bucket"`` picks the top k = ceil(density * numel) of each DDP bucket
            (the largest entries wherever they are); ``"parameter"`` picks
            ceil(density * numel) inside each parameter (layer-wise top-k), so the
            selection does not depend on how DDP groups parameters into buckets
            (``bucket_cap_mb``). Random-k always draws per parameter.
        budget: ``"model"`` shares ``density`` x the model's entries among the buckets,
            each bucket's k from the last step's model-wide top-k
            (:mod:`sparsecomm.hooks.state.model_budget`; one small all-reduce per step);
            ``"bucket"`` sends ``density`` x each bucket's entries. None (the default):
            ``"model"`` wherever it applies (exact or chunked selection, per-bucket k, c10d,
            any exchange but the shared mask), else ``"bucket"``. Models whose gradient mass
            sits in few layers (embeddings), split over many DDP buckets or FSDP modules,
            lose quality under the per-bucket budget.
        verify_conservation: check on every sparse call, bit for bit, that
            ``sent + new_residual`` equals ``grad / world_size (+ velocity) + old_residual``
            computed independently from the raw gradient and copies of the memories taken
            before the step (and that the residual is 0 where that is not finite); raise
            :class:`ConservationError` otherwise. Costs copies and extra passes; for
            tests and audits. It checks the fast (fused) path itself.
        transport: ``"c10d"`` or ``"mpi"`` (see 9. above; docs/mpi.md). ``"mpi"`` needs
            mpi4py, CPU buckets, the default process group and a job started by mpiexec;
            the first hook call checks that, on every rank, before any collective.
        grad_scaler: the ``torch.amp.GradScaler`` whose scaled gradients the hook
            reduces (see 8. above).
        on_overflow: ``"rollback"`` (default) or ``"drop"`` (see 8.).
        mask_dense_norms: with ``exchange="shared-mask"``: send norm weights and biases whole
            (default True, SCAPE's; see 11. above).
        leader_filter: with ``exchange="shared-index"``: ScaleCom's low-pass filter on the
            residual, beta in (0, 1]: ``residual = (1 - beta) residual + beta (acc - sent)``
            (None, the default, and 1: plain error feedback; below 1 not with
            ``verify_conservation``, whose invariant it gives up; docs/exchange.md).
        diagnose_leader_overlap: with ``exchange="shared-index"``: one dense allreduce of acc
            per bucket, and the share of the leader's index set among the top k of the ranks'
            summed acc, in ``stats()["leader_overlap"]`` (and ``last_step``'s); off by default.
    """

    __slots__ = (
        "config",  # TopKConfig: every setting, frozen (state.density etc. read it)
        # The fields below are internal state, in parts (one file each).
        "process_group",
        "step",
        "names",  # ParameterNames: the names that key the memories
        "memories",  # HookMemories: residuals, velocities, owner residuals (by parameter name)
        "lifecycle",  # StepLifecycle: buckets in flight, settled, agreed, the fallback warning
        "model_budget",  # ModelBudget with budget="model" (the shares of the model's k), else None
        "wires",  # PlanCache: every bucket's wire with its buffers; exchange="auto"'s choices
        "observers",  # Observers: callables receiving HookEvents (monitors, fault injectors)
        "seals",  # StepSeals of the current step (wire_checksum): its sealed buckets and the faults found
        "journal",  # StepJournal (on_overflow="rollback", the default), else None
        "scale",  # ScaleTracker of the grad_scaler, else None
        "unused",  # UnusedParameterAccounting of the bound DDP model, else None
        "sample_generator",  # per-rank generator for the sampled selector
        "_stats",  # HookStats (read with stats(), added to with count())
        "mpi",  # MPIAllgatherv, built by the first hook call when transport == "mpi" (mpi_transport()), else None
        "adams_link",  # AdamSLink: the job's AdamS as exchange="shared-mask" reads it (attach_optimizer)
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        density: float = 0.01,
        error_feedback: bool = True,
        momentum: float = 0.0,
        warmup_steps: int = 2,
        selector: str = "exact",
        value_dtype: torch.dtype | None = None,
        seed: int = 0,
        module: torch.nn.Module | None = None,
        allow_dense_fallback: bool = True,
        verify_conservation: bool = False,
        k_scope: str = "bucket",
        budget: str | None = None,
        density_schedule=None,
        nesterov: bool = False,
        local_clip_norm: float | None = None,
        transport: str = "c10d",
        residual_dtype: torch.dtype | None = None,
        grad_scaler=None,
        on_overflow: str = "rollback",
        chunk_size: int = 4096,
        index_codec: str = "int32",
        value_codec: str | None = None,
        exchange: str = "allgather",
        mask_dense_norms: bool = True,
        link: str | None = None,
        wire_checksum: bool = True,
        wire_agreement: bool = False,
        leader_filter: float | None = None,
        diagnose_leader_overlap: bool = False,
        owner_dropped: str = "owner",
    ):
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, "
                f"got {type(process_group).__name__}"
            )
        self.scale = None if grad_scaler is None else ScaleTracker(grad_scaler)
        self.config = TopKConfig.build(
            density=density, error_feedback=error_feedback, momentum=momentum, warmup_steps=warmup_steps,
            selector=selector, value_dtype=value_dtype, residual_dtype=residual_dtype, seed=seed,
            allow_dense_fallback=allow_dense_fallback, verify_conservation=verify_conservation, k_scope=k_scope,
            budget=budget,
            density_schedule=density_schedule, nesterov=nesterov, local_clip_norm=local_clip_norm,
            transport=transport, on_overflow=on_overflow,
            chunk_size=chunk_size, index_codec=index_codec, value_codec=value_codec, exchange=exchange,
            mask_dense_norms=mask_dense_norms, link=link, wire_checksum=wire_checksum, wire_agreement=wire_agreement,
            leader_filter=leader_filter, diagnose_leader_overlap=diagnose_leader_overlap,
            owner_dropped=owner_dropped,
        )
        self.process_group = process_group
        self.step = 0
        self.names = ParameterNames()
        self.memories = HookMemories()
        self.lifecycle = StepLifecycle()
        self.wires = PlanCache()
        self.model_budget = ModelBudget() if self.config.budget == "model" else None
        self.observers = Observers()
        self.seals = StepSeals()
        self.journal = StepJournal() if self.config.on_overflow == "rollback" else None
        self.unused = None
        self.sample_generator: torch.Generator | None = None
        self._stats = HookStats()
        self.mpi = None
        self.adams_link = AdamSLink()
        if module is not None:
            self.bind(module)
        if self.config.transport == "mpi" and dist.is_initialized():
            # Fail at construction when we can (every rank reaches the same verdict here).
            comm = mpi_allgatherv.import_mpi().COMM_WORLD
            mpi_allgatherv.check_matches_process_group(self.group(), comm, compare_ranks=False)

    def __getattr__(self, name):
        # state.density, state.selector, ...: the settings live in the frozen config.
        if name in CONFIG_FIELDS and name != "config":
            return getattr(object.__getattribute__(self, "config"), name)
        raise AttributeError(f"'TopKState' object has no attribute {name!r}")

    # ----- parameter names -------------------------------------------------------------

    def bind(self, module: torch.nn.Module) -> None:
        """Name residuals after ``module``'s parameters (a DDP model or the module it wraps).

        A DDP model also lends its process group (when the state has none) and, with
        ``find_unused_parameters``/``static_graph``, its record of which parameters no
        rank used (see :mod:`sparsecomm.hooks.state.unused_parameters`).
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        ddp = module if _is_ddp(module) else None
        inner = module.module if ddp is not None else module
        if self.names.module_id is not None and self.names.module_id != id(inner):
            raise ValueError(
                "this TopKState is already bound to another module; use one TopKState per DDP model"
            )
        if self.names.module_id is None and self.names.by_id:
            raise ValueError("bind() must be called before the hook first runs")
        shapes = {name for name, _ in inner.named_parameters()}
        foreign = sorted(set(self.memories.residuals.names()) - shapes)
        if foreign:
            raise ValueError(
                f"this TopKState holds residuals of {len(foreign)} parameter(s) the module does not have "
                f"(first: {foreign[:3]}): it belongs to another model"
            )
        if ddp is not None:
            if self.process_group is None:
                self.process_group = ddp.process_group  # reduce where DDP reduces (subgroups)
            elif self.process_group is not ddp.process_group:
                raise ValueError("state.process_group differs from the DDP model's process group")
            if UnusedParameterAccounting.applies_to(ddp):
                self.unused = UnusedParameterAccounting(ddp)
        self.names.bind(inner)

    # ----- observers ---------------------------------------------------------------------

    def add_observer(self, observer) -> None:
        """Call ``observer(event)`` with a :class:`~sparsecomm.hooks.state.events.HookEvent` at
        every stage of every bucket (see :mod:`sparsecomm.hooks.state.events`).

        An observer that does not read ``acc`` of the ``packed`` stage should say so with
        an attribute ``needs_acc = False``: the hook then keeps its fused kernel (which
        never materialises acc) and passes ``acc=None``. Any other observer makes the hook
        compensate the bucket in place first (same results, bit for bit, but slower);
        ``stats()["fused_calls"]`` counts the sparse calls that took the fused path.
        """
        self.observers.add(observer)

    def remove_observer(self, observer) -> None:
        self.observers.remove(observer)

    @property
    def pending_collectives(self) -> int:
        """Buckets sent but not yet delivered: non-zero means the step is not finished."""
        return self.lifecycle.pending

    # ----- process group ---------------------------------------------------------------

    def group(self) -> dist.ProcessGroup:
        """The group the hook reduces over (``process_group``, else the default group)."""
        if self.process_group is not None:
            return self.process_group
        if not dist.is_initialized():
            raise RuntimeError("TopKState needs torch.distributed to be initialised (init_process_group)")
        return dist.group.WORLD

    def rank_and_world_size(self) -> tuple[int, int]:
        group = self.group()
        return dist.get_rank(group), dist.get_world_size(group)

    def mpi_transport(self) -> mpi_allgatherv.MPIAllgatherv:
        """The MPI transport, built and checked on the first hook call (before any collective)."""
        if self.mpi is None:
            MPI = mpi_allgatherv.import_mpi()
            # Includes an all-gather over MPI (every rank's first hook call), so all ranks
            # raise alike.
            mpi_allgatherv.check_matches_process_group(self.group(), MPI.COMM_WORLD)
            self.mpi = mpi_allgatherv.MPIAllgatherv(MPI.COMM_WORLD)
        return self.mpi

    # ----- steps (the hook body calls these) ---------------------------------------------

    def begin_step(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """The first bucket of a step arrived: settle the last step, then check the ranks agree."""
        self.settle()
        steps = self.lifecycle
        if not steps.agreed:
            check_ranks_agree(self, group, device)  # one small all-gather, in the hook body
            steps.agreed = True
        if self.journal is not None:
            self.journal.start_step(self.sample_generator)
        self.seals = StepSeals(self.config.wire_agreement)
        self.adams_link.forget()  # AdamS steps every entry unless this step's masks say otherwise
        if self.model_budget is not None:
            self.model_budget.forget_step()  # what a step that failed midway observed
        steps.fallback_bound = None
        steps.open = True
        steps.settled = False

    def end_step(self) -> None:
        """The last bucket of the step was issued (its collectives may still be in flight)."""
        self.step += 1
        self.lifecycle.open = False

    def close_step_view(self) -> None:
        """Every collective of the step completed: its counters become ``stats()["last_step"]``."""
        self._stats.close_step(self.step - 1)
        last, steps = self._stats.last_step, self.lifecycle
        buckets = last["sparse_calls"] + last["warmup_calls"] + last["fallback_calls"]
        if (not steps.warned_all_dense and steps.fallback_bound is not None and buckets
                and last["fallback_calls"] == buckets):
            steps.warned_all_dense = True
            _, world_size = self.rank_and_world_size()
            warnings.warn(
                f"topk_hook: every bucket of step {last['step']} was reduced densely: with {world_size} ranks "
                f"an all-gather of the top {self.current_density():g} of each bucket would send more bytes than a "
                f"dense allreduce. Sparse reduction needs density < {steps.fallback_bound:.3g} here (about "
                f"1/(2 x world size) for float32); lower density, or pass allow_dense_fallback=False to force "
                "the sparse path",
                DenseFallbackWarning,
                stacklevel=2,
            )

    def settle(self) -> None:
        """Finish the last step's bookkeeping once every rank knows how it ended.

        Runs at the start of the next step (and before a state_dict or skip_step()):
        undoes a skipped step (rollback), gives unused parameters their sent entries back,
        and brings the memories to the scaler's current scale. Idempotent.
        """
        steps = self.lifecycle
        if steps.settled or steps.pending:
            return
        steps.settled = True
        skipped = False
        if self.journal is not None:
            skipped = self.journal.skip_requested or self.journal.overflowed() or (
                self.scale is not None and self.scale.decreased())
            if skipped:
                self.sample_generator = self.journal.undo(self.sample_generator)
                if self.model_budget is not None:
                    self.model_budget.undo_step()
                self.step -= 1  # the step never happened, as for the optimizer
                self._stats.count(skipped_steps=1)
        if self.unused is not None:
            if skipped:
                self.unused.forget()
            else:
                restored = self.unused.give_back(self.memories.residuals, self.names.by_id)
                if restored:
                    self._stats.count(unused_restored=restored)
        if self.scale is not None:
            factor = self.scale.factor()
            if factor is not None:
                self.memories.scale_(factor)

    def skip_step(self) -> None:
        """The loop skipped the step that just finished (for reasons the hook cannot see,
        e.g. a loss spike guard): undo what it did to the hook's memories and step count.

        Call it after the step's ``backward()`` and before the next one. Needs
        ``on_overflow="rollback"`` (the memories are copied before each step); Inf/NaN
        steps and steps a ``grad_scaler`` skipped are undone without it.
        """
        if self.journal is None:
            raise ValueError(
                "skip_step() needs TopKState(on_overflow='rollback') (the default; this state has 'drop'): only "
                "then does the hook keep copies of its memories from before the step; reset_residuals() restarts "
                "them instead"
            )
        steps = self.lifecycle
        if steps.pending:
            raise RuntimeError(f"skip_step() with {steps.pending} collective(s) in flight: call it after backward()")
        if steps.open or steps.settled:
            raise RuntimeError("skip_step(): no finished step to skip (call it after backward(), before the next one)")
        self.journal.skip_requested = True
        self.settle()

    def reset_residuals(self) -> None:
        """Zero every residual and velocity (error feedback restarts from nothing)."""
        if self.lifecycle.pending:
            raise RuntimeError(f"reset_residuals() with {self.lifecycle.pending} collective(s) in flight")
        self.memories.clear()
        if self.journal is not None:
            self.journal.forget()
        if self.unused is not None:
            self.unused.forget()

    # ----- stats -----------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since construction (or the last load), for this rank.

        Bytes sent are what this rank contributes to each collective: the payload of an
        all-gather (``k`` indices + values) or the buffer of an allreduce. Bytes received
        are the other ranks' data this rank takes in: their payloads for an all-gather
        (exact), ``2 (p-1)/p`` x the buffer for an allreduce (what a ring algorithm, as
        gloo's and NCCL's, moves per rank). ``effective_density`` = elements sent /
        elements reduced in sparse calls; ``compression`` = bytes_sent / bytes_dense over
        all calls. ``fused_calls``: sparse calls that ran the fused kernel (acc never
        materialised); the rest compensated the bucket first (momentum, clipping,
        observers reading acc). ``last_step`` holds the same counters for the last step
        whose collectives all completed (with its ``step`` number), or None. Times are
        host wall-clock (on CUDA they exclude kernel time unless something synchronises).
        ``skipped_steps`` counts steps undone by rollback (counted when the next step
        starts).
        """
        s = dict(self._stats.totals)
        s["steps"] = self.step
        s["density"] = self.current_density()
        s["effective_density"] = s["elements_sent"] / s["elements_sparse"] if s["elements_sparse"] else None
        s["compression"] = s["bytes_sent"] / s["bytes_dense"] if s["bytes_dense"] else None
        s["transport"] = self.config.transport
        s["last_step"] = None if self._stats.last_step is None else dict(self._stats.last_step)
        return s

    def attach_optimizer(self, optimizer) -> None:
        """``exchange="shared-mask"``: the job's :class:`sparsecomm.optim.AdamS`, whose first moment
        the hook synchronises and whose steps follow the hook's masks (call after binding the
        module, before the first step). TypeError/ValueError for any other optimizer or exchange."""
        if self.config.exchange != "shared-mask":
            raise ValueError(f"attach_optimizer() links AdamS to exchange='shared-mask'; this state has "
                             f"exchange={self.config.exchange!r}")
        if not self.names.by_id:
            raise ValueError("attach_optimizer(): bind the model first (TopKState(module=ddp_model), or "
                             "register_topk_hook), so that the optimizer's parameters have names")
        self.adams_link.attach(optimizer, self.names.by_id)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Warn if momentum correction is on and ``optimizer`` applies momentum too (True if so)."""
        return warn_on_double_momentum(self.config.momentum, optimizer)

    def current_density(self) -> float:
        """The density this step sends (the schedule's value at ``self.step``)."""
        return self.config.density_schedule(self.step)

    def count(self, **increments) -> None:
        """Add to the counters of ``stats()`` (the hook's steps and its wires call it)."""
        self._stats.count(**increments)

    def wire_context(self) -> WireContext:
        """What this step's wires may use of the state (``wires.base.WireContext``)."""
        return WireContext(caller="topk_hook", count=self._stats.count, seals=self.seals, rank=self.rank_and_world_size()[0],
                           step=self.step, journal=self.journal, generator=self.generator,
                           transport=self.mpi_transport() if self.config.transport == "mpi" else None,
                           memories=self.memories, unused=self.unused,
                           momentum=self.adams_link if self.adams_link.attached else None)

    def set_grad_scaler(self, grad_scaler) -> None:
        """Attach a ``torch.amp.GradScaler`` after construction (e.g. to an unpickled state);
        the memories are taken to be unscaled and follow the scaler from the next step. A
        state built with ``on_overflow="drop"`` keeps it: steps the scaler skips are then
        not undone in the memories."""
        if self.lifecycle.pending:
            raise RuntimeError(f"set_grad_scaler() with {self.lifecycle.pending} collective(s) in flight")
        self.scale = ScaleTracker(grad_scaler)
        self.scale.memory_scale = 1.0

    def generator(self, device: torch.device) -> torch.Generator:
        """The sampled selector's per-rank generator (seeded from ``seed`` and the rank)."""
        if self.sample_generator is None or self.sample_generator.device != device:
            if self.sample_generator is not None:
                raise RuntimeError(
                    f"the sampled selector's generator lives on {self.sample_generator.device} (restored from a "
                    f"checkpoint or pickle) but the gradients are on {device}: restore the state on the device it "
                    "was saved from"
                )
            rank, _ = self.rank_and_world_size()
            self.sample_generator = torch.Generator(device=device).manual_seed(self.config.seed * 1_000_003 + rank)
        return self.sample_generator


def _is_ddp(module) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)
