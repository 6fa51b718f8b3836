"""What an experiment is: a task, arms, seeds, world size, training budget and a policy.

Named experiments are functions in :mod:`sparsecomm.lab.experiment.named`; a JSON file with
the same fields (``ExperimentConfig.to_dict()``) works too (``--config FILE``).
Everything is validated here, before any process is launched.
"""
import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

from sparsecomm.links.spec import ACCEPTED as LINK_ACCEPTED, parse_link
from sparsecomm.lab.policy import Policy
from sparsecomm.lab.results import NAME_ACCEPTED, is_safe_name

ARM_NAMES = ("dense", "dense-bf16", "powersgd", "topk-ef", "topk-noef", "topk-dgc")
TASK_NAMES = ("pydoc-gpt", "digits-mlp")
OPTIMIZERS = ("adamw", "sgd")
FAULT_KINDS = ("kill", "hang", "hook_error", "bitflip")
CORRUPTION_ACTIONS = ("stop", "rollback")
MAX_SEED = 2**32 - 1
"""Seeds go to torch.manual_seed (64 bits) and, for the powersgd arm, to numpy's
RandomState, which takes 32 bits: the narrower range is the accepted one."""
MAX_WORLD_SIZE = 1024
"""A hard bound on ranks (gloo on CPU, every rank connected to every other); ``sparsecomm
compare`` further bounds it by the machine's cores, since it starts every rank locally."""
DEFAULT_STALENESS_LIMIT = Policy().staleness_limit


@functools.cache
def task_train_samples(task: str) -> int:
    """Training samples of a task, without loading it (or torch): the ids a batch draws from.

    digits-mlp: scikit-learn's 1,797 digit images less the 360 held out
    (:mod:`sparsecomm.lab.tasks.digits`); pydoc-gpt: one window per byte of the first 90% of
    Python's pydoc topics, less the 64-byte context (:mod:`sparsecomm.lab.tasks.pydoc_gpt`).
    """
    if task == "digits-mlp":
        return 1797 - 360
    if task == "pydoc-gpt":
        try:
            from pydoc_data.topics import topics
        except ImportError:
            raise ValueError("task pydoc-gpt needs Python's pydoc_data (part of the standard library, missing in "
                             "this Python); use task digits-mlp") from None

        size = len("\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8"))
        return int(size * (1 - 0.1)) - 64
    raise ValueError(f"task must be one of {TASK_NAMES}, got {task!r}")


WIRE_DEFAULTS = {"selector": "exact", "chunk_size": 4096, "index_codec": "int32", "value_codec": None,
                 "exchange": "allgather"}


def _check_wire(config) -> None:
    """The top-k arms' wire settings, checked by the hook's own validation (same errors)."""
    from sparsecomm.hooks.config import TopKConfig

    _check(config.selector in ("exact", "chunk"), "selector", "'exact' or 'chunk'", config.selector)
    try:
        TopKConfig.build(density=config.density, selector=config.selector, chunk_size=config.chunk_size,
                         index_codec=config.index_codec, value_codec=config.value_codec, exchange=config.exchange)
    except (TypeError, ValueError) as error:
        raise ValueError(f"experiment config: {error}") from None


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    name: str
    """Names the run directory (``RUN_ROOT/<name>``) and the plots folder."""
    task: str
    """One of TASK_NAMES: the model and data."""
    arms: tuple[str, ...] = ARM_NAMES
    """Ways of reducing gradients to compare; "dense" is the baseline every arm is paired with."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """One paired run per arm and seed: same initial weights and data order in every arm."""
    world_size: int = 2
    link: str = "loopback"
    """Link between the ranks: "loopback" (the machine's own), or an emulated link such as
    "1gbit" or "10gbit" (one network namespace per rank, shaped with tc; needs root; see
    :mod:`sparsecomm.links.netns`). Part of the run hash: timings differ per link."""
    steps: int = 300
    """Optimizer steps per run."""
    batch_size: int = 16
    """Samples per rank per step (every rank reads different samples)."""
    eval_every: int = 25
    """Validation cadence in steps; also the resolution of steps-to-target."""
    optimizer: str = "adamw"
    lr: float = 3e-3
    momentum: float = 0.9
    """SGD momentum (ignored by AdamW)."""
    weight_decay: float = 0.0
    density: float = 0.01
    """Fraction of each gradient bucket the top-k arms send."""
    dgc_momentum: float = 0.9
    """Momentum of the topk-dgc arm's hook (DGC momentum correction); that arm's optimizer
    then has no momentum of its own (SGD momentum 0, AdamW betas[0] = 0)."""
    selector: str = "exact"
    """How the top-k arms select: "exact" (top-k of each bucket) or "chunk" (the top entries of
    every ``chunk_size`` entries), as :class:`sparsecomm.TopKState`."""
    chunk_size: int = 4096
    index_codec: str = "int32"
    """How the top-k arms write indices: "int32", or with selector "chunk": "chunk" (12-bit
    chunk-local for 4096) or "rice" (Rice-coded gaps). See docs/wire.md."""
    value_codec: str | None = None
    """How the top-k arms write values: None (the bucket's dtype), "fp32", "bf16", "fp16", or
    with selector "chunk": "fp8", "int8", "int4", "int2", "sign" (a bf16 scale per chunk)."""
    exchange: str = "allgather"
    """How the top-k arms' payloads travel: "allgather", "owner" (selector "chunk"),
    "shared-index" or "auto", as :class:`sparsecomm.TopKState` (docs/exchange.md)."""
    warmup_steps: int = 2
    """Dense steps before compressed arms compress (DDP rebuilds buckets after step 1)."""
    powersgd_rank: int = 2
    bucket_cap_mb: float = 1.0
    target_loss: float | None = None
    """Declared target validation loss; None derives it from dense (median final + tolerance)."""
    collective_timeout_s: float = 60.0
    """A collective that takes longer fails the run (counted as failed) instead of hanging."""
    stall_timeout_s: float = 120.0
    """A run that completes no step for this long (start-up included) is killed and counted as failed."""
    checkpoint_every: int = 0
    """Save a verified checkpoint every this many steps (0: never)."""
    keep_checkpoints: int = 2
    max_restarts: int = 0
    """torchrun --max-restarts: how often a failed run is restarted from its last checkpoint."""
    fault: dict | None = None
    """Injected fault, e.g. {"kind": "kill", "rank": 1, "step": 120}; kinds: kill (the rank
    exits), hang (the rank sleeps past the collective timeout), hook_error (the comm hook
    raises), bitflip (an exponent bit of one weight flips on that rank after the step:
    silent corruption, for the monitors). Fires once, in the first attempt. Recovery time
    and lost work are measured."""
    monitor_every: int = 0
    """Compare the replicas' parameter digests every this many steps (0: never)."""
    on_corruption: str = "rollback"
    """What a detected corruption does: "stop" the run, or "rollback" to the last verified
    checkpoint and recompute (needs checkpoint_every)."""
    fault_rate_per_hour: float = 1.0
    """Declared fault rate: the ledger's expected recovery = measured cost per fault x rate x run hours."""
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self):
        _check(is_safe_name(self.name), "name", f"a non-empty string without '/': {NAME_ACCEPTED}", self.name)
        _check(self.task in TASK_NAMES, "task", f"one of {TASK_NAMES}", self.task)
        _check(isinstance(self.arms, tuple) and len(self.arms) >= 1 and all(a in ARM_NAMES for a in self.arms)
               and len(set(self.arms)) == len(self.arms), "arms", f"distinct names from {ARM_NAMES}", self.arms)
        _check("dense" in self.arms, "arms", "a list that includes 'dense' (the paired baseline)", self.arms)
        _check(isinstance(self.seeds, tuple) and len(self.seeds) >= 1 and all(_is_int(s) and 0 <= s <= MAX_SEED
                                                                               for s in self.seeds)
               and len(set(self.seeds)) == len(self.seeds), "seeds",
               f"distinct integers >= 0 and <= {MAX_SEED} (2**32 - 1: numpy's RandomState, which seeds the "
               "powersgd arm, takes 32 bits)", self.seeds)
        _check(_is_int(self.world_size) and 2 <= self.world_size <= MAX_WORLD_SIZE, "world_size",
               f"an integer >= 2 and <= {MAX_WORLD_SIZE}", self.world_size)
        try:
            link = parse_link(self.link)
        except ValueError:
            link = None
        _check(link is not None and link.name == self.link, "link", f"{LINK_ACCEPTED} (lower case)", self.link)
        if link.emulated:
            _check(self.max_restarts == 0, "max_restarts",
                   "0 with an emulated link (restarts need torchrun's agent, which cannot span the link's namespaces)",
                   self.max_restarts)
        _check(_is_int(self.steps) and self.steps >= 1, "steps", "an integer >= 1", self.steps)
        largest = max(1, task_train_samples(self.task) // self.world_size)
        _check(_is_int(self.batch_size) and 1 <= self.batch_size <= largest, "batch_size",
               f"an integer >= 1 and <= {largest} (samples per rank per step: the {self.task} task's "
               f"{task_train_samples(self.task)} training samples / world_size {self.world_size}; a larger global "
               "batch would repeat samples within a step)", self.batch_size)
        _check(_is_int(self.eval_every) and 1 <= self.eval_every, "eval_every", "an integer >= 1", self.eval_every)
        _check(self.optimizer in OPTIMIZERS, "optimizer", f"one of {OPTIMIZERS}", self.optimizer)
        _check(_is_real(self.lr) and self.lr > 0, "lr", "a finite number > 0", self.lr)
        _check(_is_real(self.momentum) and 0 <= self.momentum < 1, "momentum", "in [0, 1)", self.momentum)
        _check(_is_real(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "a finite number >= 0", self.weight_decay)
        _check(_is_real(self.density) and 0 < self.density <= 1, "density", "in (0, 1]", self.density)
        _check(_is_real(self.dgc_momentum) and 0 < self.dgc_momentum < 1, "dgc_momentum", "in (0, 1)",
               self.dgc_momentum)
        _check_wire(self)
        _check(_is_int(self.warmup_steps) and self.warmup_steps >= 2, "warmup_steps", "an integer >= 2", self.warmup_steps)
        _check(_is_int(self.powersgd_rank) and self.powersgd_rank >= 1, "powersgd_rank", "an integer >= 1", self.powersgd_rank)
        _check(_is_real(self.bucket_cap_mb) and self.bucket_cap_mb > 0, "bucket_cap_mb", "a finite number > 0", self.bucket_cap_mb)
        _check(self.target_loss is None or (_is_real(self.target_loss) and self.target_loss > 0), "target_loss",
               "None or a finite number > 0", self.target_loss)
        _check(_is_real(self.collective_timeout_s) and self.collective_timeout_s > 0, "collective_timeout_s",
               "a finite number > 0", self.collective_timeout_s)
        _check(_is_real(self.stall_timeout_s) and self.stall_timeout_s > 0, "stall_timeout_s",
               "a finite number > 0", self.stall_timeout_s)
        _check(_is_int(self.checkpoint_every) and self.checkpoint_every >= 0, "checkpoint_every",
               "an integer >= 0 (0: no checkpoints)", self.checkpoint_every)
        _check(_is_int(self.keep_checkpoints) and self.keep_checkpoints >= 1, "keep_checkpoints", "an integer >= 1",
               self.keep_checkpoints)
        _check(_is_int(self.max_restarts) and self.max_restarts >= 0, "max_restarts", "an integer >= 0", self.max_restarts)
        _check(_is_int(self.monitor_every) and self.monitor_every >= 0, "monitor_every", "an integer >= 0",
               self.monitor_every)
        _check(self.on_corruption in CORRUPTION_ACTIONS, "on_corruption", f"one of {CORRUPTION_ACTIONS}", self.on_corruption)
        if self.monitor_every and self.on_corruption == "rollback":
            _check(self.checkpoint_every >= 1, "checkpoint_every",
                   ">= 1 when monitor_every > 0 and on_corruption='rollback' (nothing to roll back to)", self.checkpoint_every)
        _check(_is_real(self.fault_rate_per_hour) and self.fault_rate_per_hour >= 0, "fault_rate_per_hour",
               "a finite number >= 0", self.fault_rate_per_hour)
        if self.fault is not None:
            _check(isinstance(self.fault, dict) and set(self.fault) == {"kind", "rank", "step"}, "fault",
                   'None or {"kind": ..., "rank": ..., "step": ...}', self.fault)
            _check(self.fault["kind"] in FAULT_KINDS, "fault.kind", f"one of {FAULT_KINDS}", self.fault["kind"])
            _check(_is_int(self.fault["rank"]) and 0 <= self.fault["rank"] < self.world_size, "fault.rank",
                   f"an integer in [0, {self.world_size - 1}]", self.fault["rank"])
            _check(_is_int(self.fault["step"]) and 1 <= self.fault["step"] <= self.steps, "fault.step",
                   f"an integer in [1, {self.steps}]", self.fault["step"])
            if self.fault["kind"] == "bitflip":
                _check(self.monitor_every >= 1 and self.checkpoint_every >= 1, "fault",
                       "of kind bitflip used with monitor_every >= 1 and checkpoint_every >= 1", self.fault)
            else:
                _check(self.max_restarts >= 1 and self.checkpoint_every >= 1, "fault",
                       "used with max_restarts >= 1 and checkpoint_every >= 1 (otherwise nothing recovers)", self.fault)
        _check(isinstance(self.policy, Policy), "policy", "a sparsecomm.lab.policy.Policy", self.policy)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["arms"], d["seeds"] = list(self.arms), list(self.seeds)
        return d

    @classmethod
    def from_dict(cls, raw: dict) -> "ExperimentConfig":
        """A config from its JSON form; raises ValueError naming the field for any bad value."""
        if not isinstance(raw, dict):
            raise ValueError(f"experiment config must be a JSON object of ExperimentConfig fields, got "
                             f"{type(raw).__name__ if raw is not None else 'null'}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known, key=str)
        if unknown:
            raise ValueError(f"unknown experiment config keys {unknown}; accepted keys: {sorted(known)}")
        missing = sorted(f.name for f in fields(cls) if f.name in ("name", "task") and f.name not in raw)
        if missing:
            raise ValueError(f"experiment config: {missing[0]} is required (accepted keys: {sorted(known)})")
        values = dict(raw)
        for key in ("arms", "seeds"):
            if key in values:
                _check(isinstance(values[key], list), key, "a JSON list", values[key])
                values[key] = tuple(values[key])
        if "policy" in values:
            policy = values["policy"]
            _check(isinstance(policy, dict), "policy", "a JSON object of Policy fields", policy)
            accepted = sorted(f.name for f in fields(Policy))
            unknown = sorted(set(policy) - set(accepted), key=str)
            if unknown:
                raise ValueError(f"experiment config: unknown policy keys {unknown}; accepted keys: {accepted}")
            values["policy"] = Policy(**policy)
        return cls(**values)

    def with_overrides(self, **overrides) -> "ExperimentConfig":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def run_hash(self, arm: str, seed: int) -> str:
        """Identifies one run: everything that changes what it computes, plus arm and seed.

        The experiment's name, arm list, seed list, target, quality tolerance and redundancy
        budget only change the report, so a finished run is reused when they change. The
        staleness limit is recorded in the run (its summary's ``unverified_reason``), so
        it is part of the hash when it is not the default.
        """
        d = self.to_dict()
        for key in ("name", "arms", "seeds", "target_loss", "policy", "stall_timeout_s", "fault_rate_per_hour"):
            d.pop(key)
        if d["link"] == "loopback":
            d.pop("link")  # runs from before links existed keep their hash
        for key, default in WIRE_DEFAULTS.items():
            # The wire changes only what top-k arms send; at its default, runs keep their earlier hash.
            if not arm.startswith("topk-") or d[key] == default:
                d.pop(key)
        if self.policy.staleness_limit != DEFAULT_STALENESS_LIMIT:
            d["staleness_limit"] = self.policy.staleness_limit  # default: runs keep their earlier hash
        d.update(arm=arm, seed=seed)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, accepted: str, value) -> None:
    if not ok:
        raise ValueError(f"experiment config: {name} must be {accepted}, got {value!r}")
