"""Persistence of the top-k hook's state: checkpoints (``state_dict``) and pickles.

A mixin of :class:`~sparsecomm.hooks.topk_state.TopKState`, apart from the hook and the
step bookkeeping: what is saved (every per-rank memory under ``rank{r}.``, the config, the
grad scaler's scale the memories are in), what a load checks before it changes anything
(:mod:`sparsecomm.hooks.state.state_dict_check`), and what a pickle leaves behind (what belongs
to the process: the group, communicators, observers, the DDP model).
"""
import copy
import warnings

import torch

from sparsecomm.hooks.pipeline import exchange_choice
from sparsecomm.hooks.pipeline.steps import PlanCache
from sparsecomm.hooks.state import state_dict_check
from sparsecomm.hooks.state.observers import Observers
from sparsecomm.hooks.state.settings import FIELDS as CONFIG_FIELDS
from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.state.step import HookStats, StepJournal

STATE_DICT_FORMAT = 1
CONFIG_DEFAULTS = {name: getattr(TopKConfig, name) for name in CONFIG_FIELDS}  # what a saved config leaves out


class PersistentState:
    """state_dict / load_state_dict / pickling of a TopKState."""

    __slots__ = ()

    def state_dict(self) -> dict:
        """This rank's state, with every per-rank entry under ``rank{r}.``.

        ``rank{r}.residual.{name}``, ``rank{r}.velocity.{name}``, ``rank{r}.stats`` (and
        ``owner_residual`` / ``mask`` entries for the owner / shared-mask exchanges: the mask is
        the next step's, 0/1 float32, the same on every rank),
        ``rank{r}.sample_generator`` and ``rank{r}.sample_generator_device`` differ per
        rank; ``format``, ``world_size``, ``step``, ``config``, ``memory_scale`` (the
        grad scaler's scale the memories are in, None without a scaler) and, with
        ``budget="model"``, ``budget_shares`` are the same on every rank. Rank-qualified keys matter for torch.distributed.checkpoint, which
        treats an unqualified key saved by every rank as replicated and hands rank 0's
        value to all. With a bound module and error feedback, every parameter has a
        residual entry (zeros before the first sparse step), so the dict is also a
        complete template for DCP to load into. Refused while a collective is in flight.
        The last step is settled first (a skipped step is undone), so the dict is what
        the next step starts from.
        """
        pending = self.lifecycle.pending
        if pending:
            raise RuntimeError(
                f"TopKState.state_dict() with {pending} collective(s) in flight: the "
                "residuals are mid-update; save between steps (after optimizer.step())"
            )
        self.settle()
        rank, world_size = self.rank_and_world_size()
        prefix = f"rank{rank}."
        sd = {"format": STATE_DICT_FORMAT, "world_size": world_size, "step": self.step, "config": self.config.checkpoint_dict(),
              "memory_scale": None if self.scale is None else self.scale.memory_scale}
        if self.model_budget is not None:  # the same on every rank (agreed by an allreduce)
            sd["budget_shares"] = self.model_budget.state_dict()
        sd[f"{prefix}stats"] = dict(self._stats.totals)
        memories = [("residual", self.memories.residuals, self.config.error_feedback),
                    ("velocity", self.memories.velocities, self.config.momentum > 0),
                    ("owner_residual", self.memories.owner_residuals, self._has_owner_memory()),
                    ("mask", self.memories.masks, self.config.exchange == "shared-mask")]
        for kind, memory, used in memories:
            entries = memory.state_dict()
            if used:
                for name, (numel, dtype) in self.names.shapes.items():
                    zero_dtype = torch.float32 if kind == "mask" else self.config.memory_dtype(dtype)
                    entries.setdefault(name, torch.zeros(numel, dtype=zero_dtype))
            for name, tensor in sorted(entries.items()):
                sd[f"{prefix}{kind}.{name}"] = tensor
        if self.sample_generator is not None:
            sd[f"{prefix}sample_generator"] = self.sample_generator.get_state()
            sd[f"{prefix}sample_generator_device"] = str(self.sample_generator.device)
        return sd

    def load_state_dict(self, state_dict: dict, *, strict: bool = True) -> None:
        """Restore this rank's state from ``state_dict`` (made by :meth:`state_dict`).

        A malformed dict (keys or values :meth:`state_dict` never writes: a 2-D or
        non-float residual, a negative step, a key that is not ``rank<r>.<kind>.<name>``)
        is always refused with a ValueError naming the key. Strict (default): also refuses
        another rank's state, a different world size, a different configuration and, for a
        bound state, residuals missing, extra or of the wrong size for any parameter,
        memories holding Inf or NaN, and shares of the model's k (``budget_shares``, each a
        number in [0, 2**53]) of parameters the model does not have; every message gives
        both values. Shares that differ between ranks are refused at the next step, on every
        rank (:mod:`sparsecomm.hooks.state.rank_agreement`). Lenient (``strict=False``): in those
        cases the residuals and velocities are reset to zero with a warning, and
        ``stats()["residual_reset"]`` becomes True so the ledger can report it (error
        feedback then restarts from nothing; convergence usually survives an occasional
        reset, DeepSpeed's 1-bit optimizers always reset). Memories saved under a grad
        scaler come back in the units of this state's scaler (or unscaled without one).
        The sampled selector's generator comes back on the device it was saved from.
        """
        if self.lifecycle.pending:
            raise RuntimeError(f"TopKState.load_state_dict() with {self.lifecycle.pending} collective(s) in flight")
        rank, world_size = self.rank_and_world_size()
        parsed = state_dict_check.parse(state_dict, rank, STATE_DICT_FORMAT)  # malformed: always refused
        problems = []
        if parsed.saved_world_size != world_size:
            problems.append(
                f"state_dict was saved with world_size={parsed.saved_world_size}, this job has world_size={world_size}"
            )
        if rank not in parsed.ranks:
            problems.append(
                f"state_dict holds the state of rank(s) {parsed.ranks}, this is rank {rank}: "
                "every rank's residual differs; save and load each rank's own state dict"
            )
        diffs = state_dict_check.config_differences(parsed.config, self.config.checkpoint_dict(), CONFIG_DEFAULTS)
        if diffs:
            problems.append(f"state_dict config differs from this TopKState (key: (saved, current)): {diffs}")
        if not problems:
            problems += state_dict_check.mismatches(parsed, self.names.shapes, self.config.error_feedback,
                                                    self.config.momentum > 0, rank, self._has_owner_memory(),
                                                    self.config.exchange == "shared-mask")
        memories = parsed.memories
        generator_state = parsed.per_rank.get("sample_generator")
        generator_device = parsed.per_rank.get("sample_generator_device", "cpu")
        if generator_state is not None and not problems:
            generator_device = _usable_device(generator_device, problems)
        reset = bool(problems)
        if reset and strict:
            raise ValueError("; ".join(problems) + "; pass strict=False to reset the residuals instead")
        if reset:
            warnings.warn(
                "TopKState.load_state_dict(strict=False): resetting error-feedback residuals: " + "; ".join(problems),
                stacklevel=2,
            )
            memories = {kind: {} for kind in state_dict_check.MEMORY_KINDS}
        self.memories.residuals.load_state_dict(memories["residual"])
        self.memories.velocities.load_state_dict(memories["velocity"])
        self.memories.owner_residuals.load_state_dict(memories["owner_residual"])
        self.memories.masks.load_state_dict(memories["mask"])
        self.memories.owner_ranges = {}
        if self.model_budget is not None:  # without saved shares (or reset): the plain share until a step agrees
            self.model_budget.load_state_dict({} if reset else parsed.budget_shares or {})
        self._load_memory_scale(None if reset else parsed.memory_scale)
        self.sample_generator = None
        if generator_state is not None and not reset:
            self.sample_generator = torch.Generator(device=generator_device).set_state(generator_state)
        self.step = parsed.step
        self._stats = HookStats(parsed.per_rank.get("stats", {}))
        self._stats.totals["residual_reset"] = reset or bool(self._stats.totals.get("residual_reset"))
        self.wires = PlanCache()
        self._forget_step()

    def _load_memory_scale(self, saved_scale: float | None) -> None:
        """Memories saved in units of a scaler's ``saved_scale``: keep them in this state's units."""
        if self.scale is not None:
            self.scale.memory_scale = 1.0 if saved_scale is None else float(saved_scale)
        elif saved_scale is not None and saved_scale != 1.0:
            self.memories.scale_(1.0 / saved_scale)  # no scaler here: unscaled units

    def _has_owner_memory(self) -> bool:
        config = self.config
        return config.error_feedback and (config.exchange == "owner" or (
            config.exchange == "auto" and "owner" in exchange_choice.candidates(config)))

    def _forget_step(self) -> None:
        """Memories were replaced: nothing of the last step is left to settle or undo."""
        self.lifecycle.forget()
        if self.journal is not None:
            self.journal.forget()
        if self.unused is not None:
            self.unused.forget()

    def __getstate__(self) -> dict:
        """Everything but what belongs to this process: the process group, the ids of its
        parameters, communicators, observers, buffers, the DDP model (as PowerSGDState drops
        its group)."""
        if self.lifecycle.pending:
            raise RuntimeError(
                f"cannot pickle a TopKState with {self.lifecycle.pending} collective(s) in flight: "
                "save between steps, after backward() and optimizer.step() returned"
            )
        self.settle()
        state = {name: getattr(self, name) for name in self.__slots__ if name != "process_group"}
        state["mpi"] = None  # a communicator and a thread of this process
        state["observers"] = Observers()  # observers belong to this process (monitors, injectors)
        state["names"] = copy.copy(self.names)
        state["names"].forget_process()  # keyed by id(): meaningless in another process
        state["memories"] = copy.copy(self.memories)
        state["memories"].scratch = None
        state["wires"] = PlanCache()  # buffers; "auto" decides again
        state["unused"] = None  # holds the DDP model; bind() again in the new process
        state["scale"] = None if self.scale is None else self.scale.memory_scale  # the scaler is the loop's
        if self.sample_generator is not None:
            state["sample_generator"] = (self.sample_generator.get_state(), str(self.sample_generator.device))
        state["seals"] = None  # futures of this process; the next step starts a new one
        state["journal"] = None if self.journal is None else StepJournal()
        return state

    def __setstate__(self, state: dict) -> None:
        generator = state.pop("sample_generator")
        memory_scale = state.pop("scale", None)
        state.setdefault("mpi", None)
        if "config" not in state:  # pickles from before the settings moved into one TopKConfig
            settings = {name: state.pop(name) for name in CONFIG_FIELDS if name in state}
            state["config"] = TopKConfig(**settings)
        for name, value in state.items():
            setattr(self, name, value)
        self.process_group = None
        self.scale = None
        self.lifecycle.agreed = False  # a new process: compare the ranks again at the first call
        # The memories are in units of the old scaler's scale; with no scaler here they
        # are brought to unscaled units (pass the new scaler with set_grad_scaler()).
        self._load_memory_scale(memory_scale)
        self.sample_generator = None
        if generator is not None:
            generator_state, device = generator if isinstance(generator, tuple) else (generator, "cpu")
            self.sample_generator = torch.Generator(device=_usable_device(device)).set_state(generator_state)


def _usable_device(device: str, problems: list | None = None) -> str:
    """``device`` if this process can hold a generator there; else an error (or a problem noted)."""
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        message = (f"the sampled selector's generator was saved on {device}, which this process does not have; "
                   "restore the state on a machine with that device")
        if problems is None:
            raise ValueError(message)
        problems.append(message)
        return "cpu"
    return device
