"""Top-k sparsification with error feedback, as a DDP communication hook.

Usage::

    state = sparsecomm.TopKState(density=0.01, module=ddp_model)
    ddp_model.register_comm_hook(state, sparsecomm.topk_hook)

or ``sparsecomm.register_topk_hook(ddp_model, density=0.01)``, which also guards against
double registration and non-DDP modules.
"""
# No ``from __future__ import annotations`` here: DDP checks the hook's ``bucket``
# annotation by identity, and string annotations fail that check.
import itertools
import math
import time
import warnings
import zlib

import torch
import torch.distributed as dist

from sparsecomm import compress, ops
from sparsecomm.comm import TRANSPORTS, allgather_future, allreduce_future
from sparsecomm.comm import mpi_allgatherv
from sparsecomm.compress.error_feedback import divide_
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.compress.sampled_threshold import sample_positions, sample_size, threshold_of_sample
from sparsecomm.errors import ConservationError
from sparsecomm.hooks.density_schedule import DensitySchedule
from sparsecomm.hooks.events import HookEvent
from sparsecomm.hooks.optimizer import warn_on_double_momentum
from sparsecomm.hooks.parameter_memory import ParameterMemory
from sparsecomm.hooks.validation import (
    check_bool,
    check_choice,
    check_int,
    check_real,
    check_transport,
    check_value_dtype,
)

SELECTOR_CHOICES = ("exact", "sampled", "random")
K_SCOPES = ("bucket", "parameter")
STATE_DICT_FORMAT = 1
# Int32 indices on the wire bound the size of one bucket.
MAX_BUCKET_NUMEL = 2**31 - 1
_STAT_NAMES = (
    "sparse_calls",  # bucket reductions that went sparse
    "warmup_calls",  # dense because the step was inside warm-up
    "fallback_calls",  # dense because the sparse payload would not have been smaller
    "elements_total",  # gradient elements reduced, all calls
    "elements_sparse",  # gradient elements in sparse calls
    "elements_sent",  # elements this rank put on the wire in sparse calls
    "bytes_dense",  # bytes a dense allreduce would have taken from this rank
    "bytes_sent",  # bytes this rank actually contributed (payload or dense buffer)
    "seconds_select_pack",  # host time: error feedback + selection + packing
    "seconds_unpack",  # host time: scatter-add of the gathered payloads
    "residual_reset",  # residuals were reset by a lenient load (error feedback restarted)
    "seconds_count_exchange",  # host time blocked exchanging payload sizes (transport="mpi", sampled)
)


class TopKState:
    """Configuration and per-rank memory of :func:`topk_hook`.

    Each step, every bucket of gradients is reduced either densely (allreduce) or
    sparsely: the ``density`` fraction of entries with the largest magnitude (after
    adding what earlier steps did not send) is all-gathered as (index, value) pairs.

    Tuning, in order of importance:

    1. ``density``: fraction of each bucket sent. 0.01 cuts traffic ~50x at 2 bytes of
       index overhead per value; below ~0.001 convergence usually needs more steps.
       When ``k * world_size * (index + value bytes)`` would not be smaller than the
       dense buffer (density >= ~1/(2 world_size) for fp32), the hook reduces densely.
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
    4. ``warmup_steps``: dense steps at the start. At least 2 with error feedback,
       because DDP rebuilds its buckets after the first iteration.
    5. ``selector``: ``"exact"`` top-k, ``"sampled"`` (threshold estimated from a ~1%
       sample, DGC style; one pass over the bucket instead of a sort), or ``"random"``
       (random-k: same indices on all ranks, values allreduced; the cheap baseline).
    6. ``value_dtype``: dtype of values on the wire (None: the bucket's dtype). A
       narrower dtype's rounding error stays in the residual, so it is compensated too.
    7. ``transport``: how the sparse payloads are all-gathered. ``"c10d"`` (default)
       uses the process group (gloo/NCCL), every rank sending a payload of capacity k.
       ``"mpi"`` uses MPI ``Iallgatherv`` (mpi4py; CPU tensors, the default process group,
       launched by mpiexec): with ``selector="sampled"`` and ``k_scope="bucket"`` each
       rank then sends only the entries above its sampled threshold (at most k), a
       different number per rank, after a small blocking exchange of the sizes; other
       selections send the same bytes as c10d (same results, bit for bit). Dense
       allreduces (warm-up, fallback) always use the process group.
    8. ``density_schedule``: start denser and reach ``density`` in stages (DGC's warm-up):
       ``{"kind": "exponential", "steps": N, "stages": 4}`` (each stage sends about a
       quarter of the previous one), a list of ``(first_step, density)`` pairs ending at
       ``density``, or a :class:`~sparsecomm.hooks.density_schedule.DensitySchedule`.
       ``stats()["density"]`` is the density of the current step.

    Args:
        process_group: group to reduce over; None means the default group.
        module: the DDP model (or its module) whose parameter names key the residuals.
            Without it, parameters are named in the order the hook first sees them
            (``param0``, ``param1``, ...), which is deterministic for a given model but
            does not survive a change of model code; pass the module for checkpoints.
        seed: seeds the random-k indices (shared by all ranks) and the sampled
            selector's per-rank sample.
        allow_dense_fallback: False forces the sparse path even when it sends more
            bytes than dense (for tests and measurements).
        k_scope: ``"bucket"`` picks the top k = ceil(density * numel) of each DDP bucket
            (the largest entries wherever they are); ``"parameter"`` picks
            ceil(density * numel) inside each parameter (layer-wise top-k), so the
            selection does not depend on how DDP groups parameters into buckets
            (``bucket_cap_mb``). Random-k always draws per parameter.
        verify_conservation: check ``sent + new_residual == grad/ws + old_residual``
            bit for bit on every sparse call and raise :class:`ConservationError`
            otherwise. Costs two extra passes and a temporary; meant for tests/audits.
        transport: ``"c10d"`` or ``"mpi"`` (see 7. above; docs/mpi.md). ``"mpi"`` needs
            mpi4py, CPU buckets, the default process group and a job started by mpiexec;
            the first hook call checks that, on every rank, before any collective.
    """

    __slots__ = (
        # The fields below are the hyperparameters users tune.
        "density",
        "error_feedback",
        "momentum",
        "nesterov",
        "local_clip_norm",
        "warmup_steps",
        "selector",
        "value_dtype",
        "seed",
        "density_schedule",  # DensitySchedule: density by step, ending at `density`
        # Switches.
        "allow_dense_fallback",
        "verify_conservation",
        "k_scope",
        "transport",  # "c10d" | "mpi": who all-gathers the sparse payloads
        # The fields below are internal state.
        "process_group",
        "step",
        "_param_names",  # id(parameter) -> name
        "_param_shapes",  # name -> (numel, dtype) of the bound module's parameters
        "_bound_module_id",  # id of the module the names came from, None if unbound
        "_residuals",  # ParameterMemory of error-feedback residuals
        "_velocities",  # ParameterMemory of momentum-correction velocities
        "_buffers",  # bucket index -> (k, value dtype, payload, gathered): reused every step
        "_sample_generator",  # per-rank generator for the sampled selector
        "_stats",
        "_bypass",  # True while rebuild_buckets() runs a pass that must change nothing
        "_observers",  # callables receiving HookEvents (monitors, fault injectors)
        "_pending",  # collectives issued whose result has not been delivered yet
        "_rank",  # this process's rank in the group, cached on first use
        "_mpi",  # MPIAllgatherv, built by the first hook call when transport == "mpi"
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
        density_schedule=None,
        nesterov: bool = False,
        local_clip_norm: float | None = None,
        transport: str = "c10d",
    ):
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, "
                f"got {type(process_group).__name__}"
            )
        self.density = check_real("density", density, 0.0, 1.0, low_open=True, high_open=False)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.momentum = check_real("momentum", momentum, 0.0, 1.0, low_open=False, high_open=True)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.selector = check_choice("selector", selector, SELECTOR_CHOICES)
        self.value_dtype = check_value_dtype(value_dtype)
        self.seed = check_int("seed", seed, 0)
        self.allow_dense_fallback = check_bool("allow_dense_fallback", allow_dense_fallback)
        self.verify_conservation = check_bool("verify_conservation", verify_conservation)
        self.k_scope = check_choice("k_scope", k_scope, K_SCOPES)
        self.density_schedule = _resolve_schedule(density_schedule, self.density)
        self.nesterov = check_bool("nesterov", nesterov)
        self.local_clip_norm = (None if local_clip_norm is None else
                                check_real("local_clip_norm", local_clip_norm, 0.0, math.inf, low_open=True,
                                           high_open=True))
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0 (it is a variant of momentum correction)")
        if self.error_feedback and self.warmup_steps < 2:
            raise ValueError(
                f"warmup_steps must be >= 2 when error_feedback=True, got {self.warmup_steps}: "
                "DDP rebuilds its buckets after the first iteration, so the hook reduces "
                "densely until then"
            )
        if self.momentum > 0 and not self.error_feedback:
            raise ValueError(
                f"momentum={self.momentum} (momentum correction) requires error_feedback=True"
            )
        if self.verify_conservation and not self.error_feedback:
            raise ValueError("verify_conservation=True requires error_feedback=True (no residual to check)")
        self.transport = check_transport(transport, self.selector)
        self.process_group = process_group
        self.step = 0
        self._param_names: dict[int, str] = {}
        self._param_shapes: dict[str, tuple[int, torch.dtype]] = {}
        self._bound_module_id: int | None = None
        self._residuals = ParameterMemory()
        self._velocities = ParameterMemory()
        self._buffers: dict[int, tuple] = {}
        self._sample_generator: torch.Generator | None = None
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._stats["residual_reset"] = False
        self._bypass = False
        self._observers = []
        self._pending = 0
        self._rank = None
        self._mpi = None
        if module is not None:
            self.bind(module)
        if self.transport == "mpi" and dist.is_initialized():
            # Fail at construction when we can (every rank reaches the same verdict here).
            comm = mpi_allgatherv.import_mpi().COMM_WORLD
            mpi_allgatherv.check_matches_process_group(self._group(), comm, compare_ranks=False)

    # ----- parameter names -------------------------------------------------------------

    def bind(self, module: torch.nn.Module) -> None:
        """Name residuals after ``module``'s parameters (a DDP model or the module it wraps)."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        inner = getattr(module, "module", module) if _is_ddp(module) else module
        if self._bound_module_id is not None and self._bound_module_id != id(inner):
            raise ValueError(
                "this TopKState is already bound to another module; use one TopKState per DDP model"
            )
        if self._bound_module_id is None and self._param_names:
            raise ValueError("bind() must be called before the hook first runs")
        self._bound_module_id = id(inner)
        self._param_names = {id(p): name for name, p in inner.named_parameters()}
        self._param_shapes = {name: (p.numel(), p.dtype) for name, p in inner.named_parameters()}

    def _bucket_layout(self, bucket: dist.GradBucket) -> tuple[tuple[str, ...], tuple[int, ...]]:
        names, numels = [], []
        for param in bucket.parameters():
            name = self._param_names.get(id(param))
            if name is None:
                if self._bound_module_id is not None:
                    raise ValueError(
                        "the hook saw a parameter that is not in the module bound to this "
                        "TopKState: register the state on the DDP model it was bound to"
                    )
                name = self._param_names[id(param)] = f"param{len(self._param_names)}"
            names.append(name)
            numels.append(param.numel())
        return tuple(names), tuple(numels)

    # ----- observers ---------------------------------------------------------------------

    def add_observer(self, observer) -> None:
        """Call ``observer(event)`` with a :class:`~sparsecomm.hooks.events.HookEvent` at
        every stage of every bucket (see :mod:`sparsecomm.hooks.events`)."""
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {type(observer).__name__}")
        self._observers.append(observer)

    def remove_observer(self, observer) -> None:
        self._observers.remove(observer)

    @property
    def pending_collectives(self) -> int:
        """Buckets sent but not yet delivered: non-zero means the step is not finished."""
        return self._pending

    def _emit(self, stage, bucket, names, numels, dense, step=None, **tensors) -> None:
        if not self._observers:
            return
        if self._rank is None:
            self._rank = dist.get_rank(self._group())
        step = self.step if step is None else step
        event = HookEvent(stage, step, self._rank, bucket.index(), names, numels, dense, tensors)
        for observer in self._observers:
            observer(event)

    # ----- process group ---------------------------------------------------------------

    def _group(self) -> dist.ProcessGroup:
        if self.process_group is not None:
            return self.process_group
        if not dist.is_initialized():
            raise RuntimeError("TopKState needs torch.distributed to be initialised (init_process_group)")
        return dist.group.WORLD

    def _rank_and_world_size(self) -> tuple[int, int]:
        group = self._group()
        return dist.get_rank(group), dist.get_world_size(group)

    def _mpi_transport(self) -> mpi_allgatherv.MPIAllgatherv:
        """The MPI transport, built and checked on the first hook call (before any collective)."""
        if self._mpi is None:
            MPI = mpi_allgatherv.import_mpi()
            # Includes an all-gather over MPI (every rank's first hook call), so all ranks
            # raise alike.
            mpi_allgatherv.check_matches_process_group(self._group(), MPI.COMM_WORLD)
            self._mpi = mpi_allgatherv.MPIAllgatherv(MPI.COMM_WORLD)
        return self._mpi

    # ----- stats -----------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since construction (or the last load), for this rank.

        Bytes are what this rank contributes to each collective: the payload of an
        all-gather (``k`` indices + values) or the buffer of an allreduce. A ring
        algorithm moves about ``(p-1)`` payloads resp. ``2(p-1)/p`` buffers per rank.
        ``effective_density`` = elements sent / elements reduced in sparse calls;
        ``compression`` = bytes_sent / bytes_dense over all calls. Times are host
        wall-clock (on CUDA they exclude kernel time unless something synchronises).
        """
        s = dict(self._stats)
        s["steps"] = self.step
        s["density"] = self.current_density()
        s["effective_density"] = s["elements_sent"] / s["elements_sparse"] if s["elements_sparse"] else None
        s["compression"] = s["bytes_sent"] / s["bytes_dense"] if s["bytes_dense"] else None
        s["transport"] = self.transport
        return s

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Warn if momentum correction is on and ``optimizer`` applies momentum too (True if so)."""
        return warn_on_double_momentum(self.momentum, optimizer)

    def current_density(self) -> float:
        """The density this step sends (the schedule's value at ``self.step``)."""
        return self.density_schedule(self.step)

    def _count(self, **increments) -> None:
        for name, value in increments.items():
            self._stats[name] += value

    # ----- checkpointing ---------------------------------------------------------------

    def _config(self) -> dict:
        return {
            "density": self.density,
            "density_schedule": self.density_schedule.to_list(),
            "error_feedback": self.error_feedback,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "local_clip_norm": self.local_clip_norm,
            "warmup_steps": self.warmup_steps,
            "selector": self.selector,
            "value_dtype": None if self.value_dtype is None else str(self.value_dtype),
            "seed": self.seed,
            "k_scope": self.k_scope,
        }

    def state_dict(self) -> dict:
        """This rank's state, with every per-rank entry under ``rank{r}.``.

        ``rank{r}.residual.{name}``, ``rank{r}.velocity.{name}``, ``rank{r}.stats`` and
        ``rank{r}.sample_generator`` differ per rank; ``format``, ``world_size``, ``step``
        and ``config`` are the same on every rank. Rank-qualified keys matter for
        torch.distributed.checkpoint, which treats an unqualified key saved by every rank
        as replicated and hands rank 0's value to all. With a bound module and error
        feedback, every parameter has a residual entry (zeros before the first sparse
        step), so the dict is also a complete template for DCP to load into.
        Refused while a collective is in flight.
        """
        if self._pending:
            raise RuntimeError(
                f"TopKState.state_dict() with {self._pending} collective(s) in flight: the "
                "residuals are mid-update; save between steps (after optimizer.step())"
            )
        rank, world_size = self._rank_and_world_size()
        prefix = f"rank{rank}."
        sd = {"format": STATE_DICT_FORMAT, "world_size": world_size, "step": self.step, "config": self._config()}
        sd[f"{prefix}stats"] = dict(self._stats)
        memories = [("residual", self._residuals, self.error_feedback), ("velocity", self._velocities, self.momentum > 0)]
        for kind, memory, used in memories:
            entries = memory.state_dict()
            if used:
                for name, (numel, dtype) in self._param_shapes.items():
                    entries.setdefault(name, torch.zeros(numel, dtype=dtype))
            for name, tensor in sorted(entries.items()):
                sd[f"{prefix}{kind}.{name}"] = tensor
        if self._sample_generator is not None:
            sd[f"{prefix}sample_generator"] = self._sample_generator.get_state()
        return sd

    def load_state_dict(self, state_dict: dict, *, strict: bool = True) -> None:
        """Restore this rank's state from ``state_dict`` (made by :meth:`state_dict`).

        Strict (default): refuses another rank's state, a different world size, a
        different configuration and, for a bound state, a residual missing for any
        parameter; every message gives both values. Lenient (``strict=False``): in those
        cases the residuals and velocities are reset to zero with a warning, and
        ``stats()["residual_reset"]`` becomes True so the ledger can report it (error
        feedback then restarts from nothing; convergence usually survives an occasional
        reset, DeepSpeed's 1-bit optimizers always reset).
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(
                f"state_dict is not a TopKState state dict of format {STATE_DICT_FORMAT} "
                f"(got format {state_dict.get('format') if isinstance(state_dict, dict) else type(state_dict).__name__!r})"
            )
        rank, world_size = self._rank_and_world_size()
        prefix = f"rank{rank}."
        problems = []
        if state_dict["world_size"] != world_size:
            problems.append(
                f"state_dict was saved with world_size={state_dict['world_size']}, this job has world_size={world_size}"
            )
        saved_ranks = sorted({int(k.split(".", 1)[0][4:]) for k in state_dict if k.startswith("rank") and "." in k})
        if rank not in saved_ranks:
            problems.append(
                f"state_dict holds the state of rank(s) {saved_ranks}, this is rank {rank}: "
                "every rank's residual differs; save and load each rank's own state dict"
            )
        if state_dict["config"] != self._config():
            diffs = {
                key: (state_dict["config"].get(key), value)
                for key, value in self._config().items()
                if state_dict["config"].get(key) != value
            }
            problems.append(f"state_dict config differs from this TopKState (key: (saved, current)): {diffs}")
        memories = {"residual": {}, "velocity": {}}
        for key, value in state_dict.items():
            if key.startswith(prefix) and key.split(".", 2)[1] in memories:
                _, kind, name = key.split(".", 2)
                memories[kind][name] = value
        if self.error_feedback and not problems:
            missing = sorted(set(self._param_shapes) - set(memories["residual"]))
            if missing:
                problems.append(f"rank {rank}'s residuals are missing for {len(missing)} parameter(s): {missing[:5]}")
        reset = bool(problems)
        if reset and strict:
            raise ValueError("; ".join(problems) + "; pass strict=False to reset the residuals instead")
        if reset:
            warnings.warn(
                "TopKState.load_state_dict(strict=False): resetting error-feedback residuals: " + "; ".join(problems),
                stacklevel=2,
            )
            memories = {"residual": {}, "velocity": {}}
        self._residuals.load_state_dict(memories["residual"])
        self._velocities.load_state_dict(memories["velocity"])
        generator_state = None if reset else state_dict.get(f"{prefix}sample_generator")
        self._sample_generator = None
        if generator_state is not None:
            self._sample_generator = torch.Generator().set_state(generator_state)
        self.step = state_dict["step"]
        self._stats = dict.fromkeys(_STAT_NAMES, 0) | state_dict.get(f"{prefix}stats", {})
        self._stats["residual_reset"] = reset or bool(self._stats.get("residual_reset"))
        self._buffers = {}

    def __getstate__(self) -> dict:
        """Everything but the process group, which cannot be pickled (as PowerSGDState)."""
        if self._pending:
            raise RuntimeError(
                f"cannot pickle a TopKState with {self._pending} collective(s) in flight: "
                "save between steps, after backward() and optimizer.step() returned"
            )
        state = {name: getattr(self, name) for name in self.__slots__ if name != "process_group"}
        state["_mpi"] = None  # a communicator and a thread of this process
        state["_observers"] = []  # observers belong to this process (monitors, injectors)
        state["_rank"] = None
        if self._sample_generator is not None:
            state["_sample_generator"] = self._sample_generator.get_state()
        state["_buffers"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        generator_state = state.pop("_sample_generator")
        state = {"transport": "c10d", "_mpi": None} | state  # pickles from before transports existed
        for name, value in state.items():
            setattr(self, name, value)
        self.process_group = None
        self._sample_generator = None
        if generator_state is not None:
            self._sample_generator = torch.Generator().set_state(generator_state)

    # ----- hot-path helpers ------------------------------------------------------------

    def _wire_buffers(self, bucket_index: int, k: int, value_dtype: torch.dtype, world_size: int, device):
        """Payload and gather buffers for a bucket, allocated once per layout."""
        cached = self._buffers.get(bucket_index)
        if cached is not None and cached[:2] == (k, value_dtype) and cached[2].device == device:
            return cached[2], cached[3]
        nbytes = payload_nbytes(k, value_dtype)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        gathered = torch.empty(world_size * nbytes, dtype=torch.uint8, device=device)
        self._buffers[bucket_index] = (k, value_dtype, payload, gathered)
        return payload, gathered

    def _generator(self, device: torch.device) -> torch.Generator:
        if self._sample_generator is None or self._sample_generator.device != device:
            rank, _ = self._rank_and_world_size()
            self._sample_generator = torch.Generator(device=device).manual_seed(
                self.seed * 1_000_003 + rank
            )
        return self._sample_generator


def _resolve_schedule(spec, density: float) -> DensitySchedule:
    """``density_schedule`` argument -> DensitySchedule ending at ``density``."""
    if spec is None:
        return DensitySchedule.constant(density)
    if isinstance(spec, DensitySchedule):
        if spec.target != density:
            raise ValueError(f"density_schedule must end at density={density}, but it ends at {spec.target}")
        return spec
    if isinstance(spec, dict):
        if spec.get("kind") != "exponential" or not set(spec) <= {"kind", "steps", "stages"} or "steps" not in spec:
            raise ValueError(
                "density_schedule as a dict must be {'kind': 'exponential', 'steps': N[, 'stages': S]}, "
                f"got {spec!r}"
            )
        return DensitySchedule.exponential(density, spec["steps"], spec.get("stages", 4))
    if isinstance(spec, (list, tuple)):
        return DensitySchedule.piecewise(spec, density)
    raise TypeError(
        "density_schedule must be None, a DensitySchedule, {'kind': 'exponential', 'steps': N} "
        f"or a list of (first_step, density) pairs, got {type(spec).__name__}"
    )


def _is_ddp(module) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def _completed(tensor: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _check_conservation(acc, residual, sent, bucket_index, step) -> None:
    """Raise unless ``sent + residual == acc`` exactly (NaN never passes)."""
    reconstructed = sent + residual
    if not torch.equal(reconstructed, acc):
        bad = (reconstructed != acc).nonzero().flatten()
        first = bad[:5].tolist()
        raise ConservationError(
            f"step {step}, bucket {bucket_index}: sent + residual != grad/ws + old_residual at "
            f"{bad.numel()} of {acc.numel()} entries; first indices {first}: "
            f"expected {acc[bad[:5]].tolist()}, got {reconstructed[bad[:5]].tolist()}"
        )


def _dense(state, bucket, buffer, names, numels, group, world_size, *, warmup) -> torch.futures.Future:
    """Allreduce the compensated bucket; any residual is sent in full and cleared."""
    # During warm-up no residual exists yet: do not allocate one for a layout DDP discards.
    use_residual = state.error_feedback and len(state._residuals) > 0
    _, residual = _compensated(state, bucket, buffer, names, numels, world_size, use_residual)
    if residual is not None:
        residual.zero_()
    state._emit("packed", bucket, names, numels, True, acc=buffer, residual=residual, indices=None, payload=buffer)
    nbytes = buffer.numel() * buffer.element_size()
    state._count(
        **{"warmup_calls" if warmup else "fallback_calls": 1},
        elements_total=buffer.numel(),
        bytes_dense=nbytes,
        bytes_sent=nbytes,
    )
    return allreduce_future(buffer, group)


def _compensated(state, bucket, buffer, names, numels, world_size, use_residual):
    """``buffer`` turned in place into ``grad/ws (+ velocity) + residual``; returns the memories."""
    compress.compensate(buffer, None, world_size)
    if state.local_clip_norm is not None:
        _clip_locally(buffer, numels, state.local_clip_norm, world_size)
    velocity = residual = None
    if state.momentum > 0:
        velocity = state._velocities.bucket_tensor(bucket.index(), names, numels, buffer)
        if state.nesterov:  # DGC's Nesterov: u = m (u + g); accumulate u + g
            velocity.add_(buffer).mul_(state.momentum)
            buffer.add_(velocity)
        else:  # u = m u + g; accumulate u
            velocity.mul_(state.momentum).add_(buffer)
            buffer.copy_(velocity)
    if use_residual:
        residual = state._residuals.bucket_tensor(bucket.index(), names, numels, buffer)
        buffer.add_(residual)
    return velocity, residual


def _clip_locally(buffer: torch.Tensor, numels, clip_norm: float, world_size: int) -> None:
    """DGC's local clipping of ``buffer = grad / world_size``, per parameter slice, in place.

    The local gradient's norm limit is ``clip_norm / sqrt(world_size)``; on the divided
    buffer that is ``clip_norm / sqrt(world_size) / world_size``.
    """
    limit = clip_norm / math.sqrt(world_size) / world_size
    offset = 0
    for numel in numels:
        part = buffer[offset : offset + numel]
        norm = float(torch.linalg.vector_norm(part.float()))
        if norm > limit:
            part.mul_(limit / norm)
        offset += numel


def _selection_sizes(state, numels: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """(entries per parameter, payload capacity k) of a bucket.

    Per parameter when the scope is "parameter" or the selector is random-k (which always
    draws per parameter); otherwise k is taken over the whole bucket.
    """
    density = state.current_density()
    ks = tuple(compress.num_selected(n, density) for n in numels)
    if state.k_scope == "parameter" or state.selector == "random":
        return ks, sum(ks)
    return ks, compress.num_selected(sum(numels), density)


def _selector(state, ks, numels):
    selector = compress.SELECTORS[state.selector]
    if state.k_scope == "parameter":
        return compress.per_parameter(selector, ks, numels)
    return selector


def _acc_inputs(state, bucket, buffer, names, numels, world_size, *, fusable: bool):
    """(fused, velocity, residual) for a sparse call.

    Fused: the kernel reads grad and residual once and computes acc = grad / ws + residual
    itself, so the bucket keeps grad and acc is never materialised. Momentum, local
    clipping, observers and the conservation audit need acc in the bucket, so with any of
    them (or a selection without a fused kernel) the bucket is compensated first.
    """
    fused = (fusable and state.momentum == 0 and state.local_clip_norm is None
             and not state._observers and not state.verify_conservation)
    if fused:
        residual = (state._residuals.bucket_tensor(bucket.index(), names, numels, buffer)
                    if state.error_feedback else None)
        return True, None, residual
    velocity, residual = _compensated(state, bucket, buffer, names, numels, world_size, state.error_feedback)
    return False, velocity, residual


def _count_sparse_call(state, acc: torch.Tensor, elements_sent: int, bytes_sent: int, started: float) -> None:
    """Count one sparse call of the bucket ``acc``; host time since ``started`` is select + pack."""
    state._count(
        sparse_calls=1,
        elements_total=acc.numel(),
        elements_sparse=acc.numel(),
        elements_sent=elements_sent,
        bytes_dense=acc.numel() * acc.element_size(),
        bytes_sent=bytes_sent,
        seconds_select_pack=time.perf_counter() - started,
    )


def _exact_topk_pack(state, buffer, residual, world_size, compensated, ks, numels, k, payload, value_dtype):
    """Fused error feedback + exact top-k + pack through the kernel dispatch point.

    ``compensated``: ``buffer`` already holds ``acc`` (the residual is then only written);
    otherwise the kernel computes ``grad / world_size + residual`` itself in the same pass,
    leaving ``buffer`` as it is (it is overwritten by the unpack anyway).
    Returns the payload's int32 index view (bucket-relative indices of the sent entries).
    """
    divisor, add_residual = (1.0, False) if compensated else (float(world_size), residual is not None)
    index_view, value_view = ops.payload_views(payload, k, value_dtype)
    index_view, value_view = index_view[0], value_view[0]
    if state.k_scope == "bucket":
        ops.ef_topk_pack(buffer, residual, divisor, add_residual, k, index_view, value_view, 0)
    else:  # one selection per parameter slice, into consecutive parts of the payload
        offset = position = 0
        for k_part, numel in zip(ks, numels):
            part = slice(offset, offset + numel)
            ops.ef_topk_pack(buffer[part], None if residual is None else residual[part], divisor, add_residual,
                             k_part, index_view[position : position + k_part],
                             value_view[position : position + k_part], offset)
            offset, position = offset + numel, position + k_part
    payload[index_view.numel() * 4 + value_view.numel() * value_view.element_size() :].zero_()  # alignment pad
    return index_view


def _sparse_topk(state, bucket, buffer, names, numels, group, world_size, ks, k, value_dtype):
    """All-gather (index, value) payloads of the selected entries; scatter-add them."""
    started = time.perf_counter()
    payload, gathered = state._wire_buffers(bucket.index(), k, value_dtype, world_size, buffer.device)
    fused, velocity, residual = _acc_inputs(state, bucket, buffer, names, numels, world_size,
                                            fusable=state.selector == "exact")
    acc = buffer
    acc_before = acc.clone() if state.verify_conservation else None
    if state.selector == "exact":
        indices = _exact_topk_pack(state, buffer, residual, world_size, not fused, ks, numels, k, payload, value_dtype)
    else:
        # The residual is rewritten from acc, so read the old one only through acc.
        indices = ops.select_and_pack(
            acc,
            k,
            _selector(state, ks, numels),
            payload,
            value_dtype,
            residual_out=residual,
            generator=state._generator(buffer.device),
        )
    if velocity is not None:
        velocity[indices] = 0  # momentum factor masking (DGC): sent velocity starts over
    state._emit("packed", bucket, names, numels, False, acc=acc, residual=residual, indices=indices, payload=payload)
    if acc_before is not None:
        sent = ops.unpack_payloads(payload, torch.empty_like(acc), k, value_dtype)
        _check_conservation(acc_before, residual, sent, bucket.index(), state.step)
    _count_sparse_call(state, acc, indices.numel(), payload.numel(), started)

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        unpack_started = time.perf_counter()
        ops.unpack_payloads(fut.value(), buffer, k, value_dtype)  # in place: no second bucket-size tensor
        state._count(seconds_unpack=time.perf_counter() - unpack_started)
        return buffer

    if state.transport == "mpi":  # same bytes as c10d, so the same result bit for bit
        fut = state._mpi.allgatherv(payload, gathered, [payload.numel()] * world_size)
    else:
        fut = allgather_future(gathered, payload, group)
    return fut.then(unpack)


def _sampled_threshold(grad, residual, divisor: float, k: int, generator) -> float:
    """Magnitude of the k-th largest entry of ``acc = grad / divisor (+ residual)``, estimated
    from a ~1% sample (as the sampled selector); exact when the bucket is small. Only the
    sampled entries of acc are computed."""
    n = grad.numel()
    index = slice(None) if sample_size(n) == n else sample_positions(n, generator, grad.device)
    sample = divide_(grad[index].clone(), divisor)  # rounded as the hook's own compensation
    if residual is not None:
        sample.add_(residual[index])
    return float(threshold_of_sample(sample.abs().float(), k, n))


def _sparse_threshold_variable(state, bucket, buffer, names, numels, world_size, k, value_dtype):
    """Sampled selector over MPI: send the entries above this rank's threshold, however many.

    The threshold is estimated from a sample (DGC), so the count differs per rank and step;
    it is capped at the payload capacity k (entries beyond it, lowest indices kept, stay in
    the residual). Each rank's payload is ``[m int32 indices | m values | pad to 8 bytes]``;
    the sizes are exchanged first (blocking, here in the hook body), then the payloads are
    all-gathered back to back in rank order and scatter-added in rank order.
    """
    started = time.perf_counter()
    payload, gathered = state._wire_buffers(bucket.index(), k, value_dtype, world_size, buffer.device)
    fused, velocity, residual = _acc_inputs(state, bucket, buffer, names, numels, world_size, fusable=True)
    divisor, add_residual = (float(world_size), residual is not None) if fused else (1.0, False)
    acc_before = buffer.clone() if state.verify_conservation else None
    threshold = _sampled_threshold(buffer, residual if add_residual else None, divisor, k,
                                   state._generator(buffer.device))
    index_view = ops.payload_views(payload, k, value_dtype)[0][0]
    # Scratch for the values: the front of this bucket's gather buffer, idle until the
    # all-gather below is issued (the last step's unpack has finished), so no allocation.
    values = gathered[: k * value_dtype.itemsize].view(value_dtype)
    m = int(ops.ef_threshold_pack(buffer, residual, divisor, add_residual, threshold, index_view, values))
    # Compact to [m indices | m values | pad]: the values move from offset 4k down to 4m.
    nbytes = payload_nbytes(m, value_dtype)
    value_bytes = m * value_dtype.itemsize
    payload[4 * m : 4 * m + value_bytes].copy_(values[:m].view(torch.uint8))
    payload[4 * m + value_bytes : nbytes].zero_()
    send = payload[:nbytes]
    indices = index_view[:m]
    if velocity is not None:
        velocity[indices.long()] = 0  # momentum factor masking (DGC): sent velocity starts over
    state._emit("packed", bucket, names, numels, False, acc=buffer, residual=residual, indices=indices, payload=send)
    if acc_before is not None:
        sent = _unpack_variable(send, [m], torch.empty_like(buffer), value_dtype)
        _check_conservation(acc_before, residual, sent, bucket.index(), state.step)
    _count_sparse_call(state, buffer, m, nbytes, started)
    exchange_started = time.perf_counter()
    counts = state._mpi.allgather_counts(m)  # entries per rank
    state._count(seconds_count_exchange=time.perf_counter() - exchange_started)

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        unpack_started = time.perf_counter()
        _unpack_variable(fut.value(), counts, buffer, value_dtype)
        state._count(seconds_unpack=time.perf_counter() - unpack_started)
        return buffer

    byte_counts = [payload_nbytes(count, value_dtype) for count in counts]
    return state._mpi.allgatherv(send, gathered, byte_counts).then(unpack)


def _unpack_variable(gathered: torch.Tensor, counts, out: torch.Tensor, value_dtype) -> torch.Tensor:
    """Overwrite ``out`` with the sum of back-to-back payloads of ``counts[r]`` entries, in rank order."""
    out.zero_()
    offset = 0
    for m in counts:
        nbytes = payload_nbytes(m, value_dtype)
        if m:  # onto zeros in rank order: the same additions as the fixed-size unpack
            indices, values = ops.payload_views(gathered[offset : offset + nbytes], m, value_dtype)
            ops.unpack_add(indices, values, out, False)
        offset += nbytes
    return out


def _sparse_random(state, bucket, buffer, names, numels, group, world_size, ks, k, value_dtype):
    """Allreduce the values at indices every rank drew from the same seeded stream."""
    started = time.perf_counter()
    velocity, residual = _compensated(
        state, bucket, buffer, names, numels, world_size, state.error_feedback
    )
    acc = buffer
    # One stream per parameter name: the same indices whatever the bucket layout.
    offsets = [0, *itertools.accumulate(numels)]
    indices = torch.cat([
        compress.random_indices(n, k_part, seed=state.seed, step=state.step, stream=zlib.crc32(name.encode())) + offset
        for name, n, k_part, offset in zip(names, numels, ks, offsets)
    ]).to(acc.device)
    values = compress.to_wire_dtype(acc[indices], value_dtype)
    if residual is not None:
        residual.copy_(acc)
        residual[indices] = acc[indices] - values.to(acc.dtype)
        if state.verify_conservation:
            sent = torch.zeros_like(acc).index_put_((indices,), values.to(acc.dtype))
            _check_conservation(acc, residual, sent, bucket.index(), state.step)
    if velocity is not None:
        velocity[indices] = 0
    state._emit("packed", bucket, names, numels, False, acc=acc, residual=residual, indices=indices, payload=values)
    _count_sparse_call(state, acc, k, values.numel() * values.element_size(), started)

    def scatter(fut: torch.futures.Future) -> torch.Tensor:
        buffer.zero_()
        buffer[indices] = fut.value().to(buffer.dtype)
        return buffer

    return allreduce_future(values, group).then(scatter)


def _sparse_is_smaller(state, numel: int, k: int, buffer_dtype, value_dtype, world_size: int) -> bool:
    dense_bytes = numel * buffer_dtype.itemsize
    if state.selector == "random":
        return k * value_dtype.itemsize < dense_bytes
    return world_size * payload_nbytes(k, value_dtype) < dense_bytes


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce a gradient bucket by sending only its largest entries, with error feedback.

    1. Until ``state.warmup_steps`` steps have passed, allreduce the bucket densely
       (DDP rebuilds buckets after the first iteration; residuals start after that).
    2. Compensate: ``acc = grad / world_size + residual`` (dividing first avoids fp16
       overflow), with the velocity in between when momentum correction is on.
    3. Select k = ceil(density * numel) entries of ``acc`` (exact top-k, sampled
       threshold, or random-k; per bucket or, with ``k_scope="parameter"``, inside each
       parameter) and pack their int32 indices and values into one buffer.
    4. Keep ``acc - sent`` as the new residual (so ``sent + residual == acc`` exactly).
    5. All-gather the fixed-size payloads (one collective per bucket) and scatter-add
       them into the bucket buffer in place: the result is the average over ranks of
       what each sent. Random-k allreduces the values instead. With
       ``transport="mpi"`` the all-gather is MPI's ``Iallgatherv``; the sampled selector
       then sends a variable number of entries per rank (sizes exchanged first).
    If the sparse payload would not be smaller than the dense buffer, step 5 becomes a
    dense allreduce of ``acc`` and the residual is cleared.

    Args:
        state: a :class:`TopKState`.
        bucket: the gradient bucket DDP hands to the hook.

    Returns:
        Future holding the averaged bucket, shaped like ``bucket.buffer()``.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = TopKState(density=0.01, module=ddp_model)
        >>> ddp_model.register_comm_hook(state, topk_hook)
    """
    if not isinstance(state, TopKState):
        raise TypeError(f"topk_hook: state must be a sparsecomm.TopKState, got {type(state).__name__}")
    buffer = bucket.buffer()
    if state._bypass:
        return _completed(buffer)  # see rebuild_buckets(): no communication, no state change
    if not buffer.is_floating_point():
        raise TypeError(f"topk_hook: bucket buffer must be floating point, got {buffer.dtype}")
    if buffer.dtype == torch.float16 and state.value_dtype == torch.bfloat16:
        # bf16 rounds fp16 values near 65504 up to 65536, which is Inf back in fp16: the
        # residual would become -Inf. Refused on the first call, before any collective.
        raise ValueError("topk_hook: value_dtype=torch.bfloat16 cannot carry float16 gradients losslessly "
                         "(values near 65504 decode to Inf); use value_dtype torch.float16 or torch.float32")
    group = state._group()
    if state.transport == "mpi":
        if buffer.device.type != "cpu":
            raise ValueError(f"topk_hook: transport='mpi' needs CPU gradients (this MPI reads host memory), got a "
                             f"bucket on {buffer.device}; use transport='c10d' (NCCL) for GPU buckets")
        state._mpi_transport()  # first call: checks the MPI world against the group
    world_size = dist.get_world_size(group)
    names, numels = state._bucket_layout(bucket)
    numel = buffer.numel()
    # From here until the reduced bucket is delivered the residuals are mid-update.
    state._pending += 1
    try:
        warmup = state.step < state.warmup_steps
        value_dtype = state.value_dtype or buffer.dtype
        ks, k = _selection_sizes(state, numels)
        dense = warmup or (
            state.allow_dense_fallback and not _sparse_is_smaller(state, numel, k, buffer.dtype, value_dtype, world_size)
        )
        state._emit("gradient", bucket, names, numels, dense, gradient=buffer)
        if dense:
            fut = _dense(state, bucket, buffer, names, numels, group, world_size, warmup=warmup)
        else:
            if numel > MAX_BUCKET_NUMEL:
                raise ValueError(
                    f"bucket {bucket.index()} has {numel} elements; int32 indices allow at most "
                    f"{MAX_BUCKET_NUMEL}: lower bucket_cap_mb"
                )
            if state.selector == "random":
                fut = _sparse_random(state, bucket, buffer, names, numels, group, world_size, ks, k, value_dtype)
            elif state.transport == "mpi" and state.selector == "sampled" and state.k_scope == "bucket":
                fut = _sparse_threshold_variable(state, bucket, buffer, names, numels, world_size, k, value_dtype)
            else:
                fut = _sparse_topk(state, bucket, buffer, names, numels, group, world_size, ks, k, value_dtype)
    except BaseException:
        state._pending -= 1
        raise
    step = state.step  # the callback may run after the step counter moved on

    def deliver(done: torch.futures.Future) -> torch.Tensor:
        try:
            reduced = done.value()  # re-raises a failed collective
        finally:
            state._pending -= 1
        state._emit("reduced", bucket, names, numels, dense, step=step, reduced=reduced)
        return reduced

    if bucket.is_last():
        state.step += 1
    return fut.then(deliver)
