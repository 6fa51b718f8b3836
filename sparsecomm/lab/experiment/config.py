"""What an experiment is: a task, arms, seeds, world size, training budget and a policy.

Named experiments are functions in :mod:`sparsecomm.lab.experiment.named`; a JSON file with
the same fields (``ExperimentConfig.to_dict()``) works too (``--config FILE``).
Everything is validated here, before any process is launched.
"""
import functools
import hashlib
import json
import math
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from sparsecomm.lab.experiment import arm_spec
from sparsecomm.lab.experiment.arm_spec import HOOK_PRESETS, UNREAD_FIELDS, PRESETS as ARM_NAMES
from sparsecomm.lab.results.policy import Policy
from sparsecomm.lab.results import NAME_ACCEPTED, is_safe_name
from sparsecomm.lab.tasks import TASK_ACCEPTED, TASK_NAMES, is_user_task, load_user_task
from sparsecomm.links.spec import ACCEPTED as LINK_ACCEPTED, parse_link

OPTIMIZERS = ("adamw", "sgd", "adams")
MODES = ("min", "max")
LAUNCHERS = ("torchrun", "mpiexec")
FAULT_KINDS = ("kill", "hang", "hook_error", "bitflip")
HSDP_REDUCERS = ("allreduce", "topk", "sparse-delta", "local")  # the arms parallelism "hsdp:RxS" runs
# One spelling per shape (ASCII digits, no leading zero): the run hash holds the string, so
# "hsdp:02x2" or "hsdp:٢x٢" beside "hsdp:2x2" would train the same runs again.
_HSDP_SHAPE = re.compile(r"hsdp:([1-9][0-9]*)x([1-9][0-9]*)")
PARALLELISM_FORM = ('"ddp" or "hsdp:RxS" (R replicas of S shards: positive integers in ASCII digits without a '
                    'leading zero, e.g. "hsdp:2x2")')
CORRUPTION_ACTIONS = ("stop", "rollback")
MAX_SEED = 2**32 - 1
"""Seeds go to torch.manual_seed (64 bits) and, for the powersgd arm, to numpy's
RandomState, which takes 32 bits: the narrower range is the accepted one."""
MAX_WORLD_SIZE = 1024
"""A hard bound on ranks (gloo on CPU, every rank connected to every other); ``sparsecomm
compare`` further bounds it by the machine's cores, since it starts every rank locally."""
MAX_GLOBAL_BATCH = 2**20
"""A bound on samples per step over all ranks (world_size x batch_size), whatever the
task's size: every rank draws the ids of the whole global batch each step (8 MiB of int64
at the bound) and the task builds its batch in memory; more is a typo, not an experiment."""
DEFAULT_STALENESS_LIMIT = Policy().staleness_limit


@functools.cache
def task_train_samples(task: str) -> int:
    """Training samples of a task, without loading it (or torch): the ids a batch draws from.

    digits-mlp: scikit-learn's 1,797 digit images less the 360 held out
    (:mod:`sparsecomm.lab.tasks.digits`); pydoc-gpt: one window per byte of the first 90% of
    Python's pydoc topics, less the 64-byte context (:mod:`sparsecomm.lab.tasks.pydoc_gpt`).
    """
    if is_user_task(task):
        return load_user_task(task).num_train_samples
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
    raise ValueError(f"task must be {TASK_ACCEPTED}, got {task!r}")


_PATHS_RELATIVE_TO: ContextVar[Path | None] = ContextVar("paths_relative_to", default=None)


def user_path(path: str) -> Path:
    """A path the config names (script, sources) as the command that started the experiment
    meant it: relative to the directory it was started in (:func:`paths_relative_to`; by
    default the current one), whatever directory a script changed to since."""
    base = _PATHS_RELATIVE_TO.get()
    return Path(path) if base is None else base / path


@contextmanager
def paths_relative_to(directory):
    """Inside it, configs resolve their relative paths against ``directory``."""
    token = _PATHS_RELATIVE_TO.set(Path(directory))
    try:
        yield
    finally:
        _PATHS_RELATIVE_TO.reset(token)


WIRE_DEFAULTS = {"selector": "exact", "chunk_size": 4096, "index_codec": "int32", "value_codec": None,
                 "exchange": "allgather"}


def _check_wire(config) -> None:
    """The top-k arms' wire settings, checked by the hook's own validation (same errors)."""
    from sparsecomm.hooks.state.settings import TopKConfig

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
    task: str | None = None
    """The model and data: one of TASK_NAMES, or ``MODULE:FACTORY`` / ``path/to/file.py:FACTORY``,
    a callable returning a :class:`sparsecomm.lab.tasks.Task` (docs/bring_your_own.md).
    Exactly one of task and script."""
    script: str | None = None
    """Your own training script instead of a task: launched once per arm x seed under
    torchrun, it joins the run with ``sparsecomm.lab.init()`` (docs/bring_your_own.md). Its
    path and contents are part of the run hash."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the script (the same in every run)."""
    sources: tuple[str, ...] = ()
    """Files and directories your task or script depends on that reading its imports cannot
    find (data files, modules imported by a name computed at run time): their contents are
    part of the run hash, as the task's or script's own files and the modules they import
    from your tree are (:mod:`sparsecomm.lab.experiment.run_sources`)."""
    metric: str = "val_loss"
    """The quality the verdicts compare: the built-in tasks' validation loss, or what your
    script logs under this name (``run.log({NAME: value})``)."""
    mode: str = "min"
    """Whether a lower ("min", a loss) or higher ("max", an accuracy) metric is better."""
    launcher: str = "torchrun"
    """What starts a run's ranks on this machine: "torchrun" (restarts possible), or
    "mpiexec" (the one beside the Python interpreter, else on PATH; no restarts). Under
    mpiexec a script joins with :func:`sparsecomm.dist.init_distributed`."""
    cluster: dict | None = None
    """Where the runs execute: None, one after another on this machine; or a JSON object of
    :class:`sparsecomm.lab.experiment.cluster_settings.ClusterSettings` fields, e.g. {"kind": "local",
    "parallel": 2} or {"kind": "slurm", "nodes": 2, "gpus_per_node": 8, "partition": "gpu"}
    (docs/cluster.md). Not part of the run hash: it changes where a run trains, not what."""
    arms: tuple[str, ...] = HOOK_PRESETS
    """Ways of reducing gradients to compare, by name: presets (ARM_NAMES) or arms defined in
    ``arm_definitions``; "dense" is the baseline every arm is paired with."""
    arm_definitions: dict = field(default_factory=dict)
    """Arms as data: name -> {"reducer": ..., "options": {...}, "optimizer": {...}}
    (:mod:`sparsecomm.lab.experiment.arm_spec`)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """One paired run per arm and seed: same initial weights and data order in every arm."""
    world_size: int = 2
    parallelism: str = "ddp"
    """How the model is spread over the ranks: "ddp" (every rank a whole replica; the arms'
    comm hooks on DDP), or "hsdp:RxS": FSDP2 hybrid sharding, R replicas of S shards each
    (R x S = world_size, R >= 2), every transformer block (each element of the model's
    ModuleLists) and the root ``fully_shard``-ed over the shard dimension; the arms then act
    on the cross-replica reduction (:func:`sparsecomm.register_hsdp_hook`; dense: a plain
    all-reduce there; averager arms: their sync over the replicas). Arms "allreduce", "topk",
    "sparse-delta" and "local" only; built-in tasks; no checkpoints, faults or replica monitors yet."""
    link: str = "loopback"
    """Link between the ranks: "loopback" (the machine's own), or an emulated link such as
    "1gbit" or "10gbit" (one network namespace per rank, shaped with tc; needs root; see
    :mod:`sparsecomm.links.netns`). Part of the run hash: timings differ per link."""
    steps: int = 300
    """Optimizer steps per run (dense's; every other arm's is ``step_budget`` x this)."""
    step_budget: float = 1.0
    """Steps of every arm but dense as a multiple of ``steps`` (a number >= 1; the product
    rounded to the nearest whole step: :meth:`steps_of`), so that an arm worse than dense at
    dense's step count can still show its steps- and time-to-target. Every run is evaluated at
    step ``steps`` as well, where ``sparsecomm scale --step-budget`` judges it. The lab's loop has
    no learning-rate schedule (the lr is constant), so the first ``steps`` steps of a longer run
    are those of the run at budget 1: same weights, data and updates. 1 with a script (it runs
    its own loop)."""
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
    """How the top-k arms write indices: "int32", "chunk" (12-bit chunk-local for 4096) or
    "rice" (Rice-coded gaps); the last two with selector "exact" or "chunk" alike. See docs/wire.md."""
    value_codec: str | None = None
    """How the top-k arms write values: None (the bucket's dtype), "fp32", "bf16", "fp16", or,
    with selector "exact" or "chunk": "fp8", "int8", "int4", "int2", "sign" (a bf16 scale per
    chunk; per 64 entries with selector "exact")."""
    exchange: str = "allgather"
    """How the top-k arms' payloads travel: "allgather", "owner" (selector "exact": top-k per
    range, or "chunk"), "shared-index", "shared-mask" or "auto", as :class:`sparsecomm.TopKState`
    (docs/exchange.md)."""
    warmup_steps: int = 2
    """Dense steps before compressed arms compress (the hook's default, 2; with error feedback
    :class:`sparsecomm.TopKState` takes no fewer than 2)."""
    powersgd_rank: int = 2
    bucket_cap_mb: float | None = None
    """DDP's bucket size in MiB; None: DDP's own default (25), as in a user's job. The built-in
    tasks set a small one, so that their gradient is reduced in several buckets as a real model's is."""
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
        _check((self.task is None) != (self.script is None), "task",
               "given exactly when script is not (a task or a script, not both)", self.task)
        if self.script is None:
            _check(isinstance(self.task, str) and (self.task in TASK_NAMES or is_user_task(self.task)), "task",
                   TASK_ACCEPTED, self.task)
        else:
            _check(isinstance(self.script, str) and self.script.endswith(".py") and user_path(self.script).is_file(),
                   "script", "the path of an existing Python file (*.py)", self.script)
        _check(isinstance(self.script_args, tuple) and all(isinstance(a, str) for a in self.script_args),
               "script_args", "a list of strings", self.script_args)
        _check(isinstance(self.sources, tuple) and all(isinstance(s, str) and s and user_path(s).exists()
                                                       for s in self.sources), "sources",
               "a list of paths of existing files or directories", self.sources)
        _check(not self.sources or self.script is not None or is_user_task(self.task), "sources",
               "empty with a built-in task (it declares files your own task or script depends on)", self.sources)
        _check(isinstance(self.metric, str) and self.metric.isidentifier(), "metric",
               "a name (letters, digits, underscores), e.g. val_loss or val_accuracy", self.metric)
        _check(self.mode in MODES, "mode", f"one of {MODES} (lower or higher is better)", self.mode)
        _check(self.launcher in LAUNCHERS, "launcher", f"one of {LAUNCHERS}", self.launcher)
        if self.launcher == "mpiexec":
            _check(self.max_restarts == 0, "max_restarts", "0 with launcher mpiexec (restarts need torchrun's agent)",
                   self.max_restarts)
            _check(self.link == "loopback", "link", "'loopback' with launcher mpiexec (an emulated link starts one "
                   "process per rank in its namespace itself)", self.link)
        _check(isinstance(self.arm_definitions, dict), "arm_definitions", "a JSON object of name -> definition",
               self.arm_definitions)
        object.__setattr__(self, "arm_definitions", {name: arm_spec.check_definition(name, definition)
                                                     for name, definition in self.arm_definitions.items()})
        known = (*ARM_NAMES, *self.arm_definitions)
        _check(isinstance(self.arms, tuple) and len(self.arms) >= 1 and all(a in known for a in self.arms)
               and len(set(self.arms)) == len(self.arms), "arms",
               f"distinct names of presets {ARM_NAMES} or of arm_definitions {tuple(self.arm_definitions)}", self.arms)
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
        _check(_is_real(self.step_budget) and self.step_budget >= 1, "step_budget",
               "a finite number >= 1 (the other arms' steps as a multiple of dense's)", self.step_budget)
        _check(self.script is None or self.step_budget == 1, "step_budget",
               "1 with a script (the script runs its own loop for run.steps steps)", self.step_budget)
        if self.task is not None:  # a script reads its own data
            samples = task_train_samples(self.task)
            by_samples, by_bound = max(1, samples // self.world_size), MAX_GLOBAL_BATCH // self.world_size
            why = (f"the {self.task} task's {samples} training samples / world_size {self.world_size}; a larger "
                   "global batch would repeat samples within a step" if by_samples <= by_bound else
                   f"MAX_GLOBAL_BATCH {MAX_GLOBAL_BATCH} (2**20) samples per step over all ranks / world_size "
                   f"{self.world_size}: every rank draws the whole global batch's ids each step")
            largest = min(by_samples, by_bound)
            _check(_is_int(self.batch_size) and 1 <= self.batch_size <= largest, "batch_size",
                   f"an integer >= 1 and <= {largest} (samples per rank per step: {why})", self.batch_size)
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
        _check(self.bucket_cap_mb is None or (_is_real(self.bucket_cap_mb) and self.bucket_cap_mb > 0), "bucket_cap_mb",
               "null (DDP's default) or a finite number > 0", self.bucket_cap_mb)
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
        _check(isinstance(self.policy, Policy), "policy", "a sparsecomm.lab.results.policy.Policy", self.policy)
        for name in self.arms:  # last: an arm resolves against the fields checked above
            self.arm(name)  # every arm's options are checked before anything runs
        if self.parallelism != "ddp":
            self._check_hsdp()
        if self.cluster is not None:
            self._check_cluster()

    @property
    def hsdp_shape(self) -> tuple[int, int] | None:
        """(replicas, shards) of ``parallelism="hsdp:RxS"``, None for "ddp"."""
        return hsdp_shape_of(self.parallelism)

    def _check_hsdp(self) -> None:
        accepted = f"{PARALLELISM_FORM} with R x S = world_size ({self.world_size}) and R >= 2"
        shape = hsdp_shape_of(self.parallelism) if isinstance(self.parallelism, str) else None
        _check(shape is not None and shape[0] >= 2 and shape[0] * shape[1] == self.world_size,
               "parallelism", accepted, self.parallelism)
        for name, value, ok in (("checkpoint_every", self.checkpoint_every, self.checkpoint_every == 0),
                                ("fault", self.fault, self.fault is None),
                                ("monitor_every", self.monitor_every, self.monitor_every == 0)):
            _check(ok, name, f"{'0' if name != 'fault' else 'None'} with parallelism {self.parallelism!r} "
                   "(sharded checkpoints, fault injection and replica monitors are not in the lab's HSDP runs yet)",
                   value)
        for name in self.arms:
            reducer = self.arm(name).reducer
            _check(reducer in HSDP_REDUCERS, "arms", f"arms whose reducer is one of {HSDP_REDUCERS} with parallelism "
                   f"{self.parallelism!r} (arm {name!r} is {reducer!r})", self.arms)

    def steps_of(self, arm: str) -> int:
        """Steps ``arm`` trains: ``steps`` for dense, ``step_budget`` x ``steps`` rounded to the
        nearest whole step (halves up) for every other arm."""
        if arm == "dense" or self.step_budget == 1:
            return self.steps
        return math.floor(self.step_budget * self.steps + 0.5)

    def arm(self, name: str) -> "arm_spec.ArmSpec":
        """The arm ``name`` resolved against this experiment: every option explicit."""
        return arm_spec.resolve(name, self)

    @functools.cached_property
    def code(self):
        """What a run executes of your code (:class:`run_sources.Code`; None for a built-in
        task), read once per config object: every hash of one experiment is of the code as it
        was when the experiment started."""
        from sparsecomm.lab.experiment import run_sources

        base = _PATHS_RELATIVE_TO.get()
        if self.script is not None:
            return run_sources.script_code(self.script, self.sources, base)
        return run_sources.task_code(self.task, self.sources, base) if is_user_task(self.task) else None

    @property
    def cluster_settings(self):
        """The ``cluster`` field as :class:`ClusterSettings` (None: runs one by one here)."""
        from sparsecomm.lab.experiment.cluster_settings import ClusterSettings

        return ClusterSettings.from_dict(self.cluster) if self.cluster is not None else None

    def _check_cluster(self) -> None:
        settings = self.cluster_settings  # ValueError naming the setting
        settings.check_world_size(self.world_size)
        _check(self.link == "loopback", "link", "'loopback' with a cluster (an emulated link is built on this machine "
               "for runs started here)", self.link)
        _check(self.launcher == "torchrun" or settings.nodes == 1, "launcher",
               "'torchrun' for runs on several nodes (one torchrun per node, joined by a c10d rendezvous)",
               self.launcher)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["arms"], d["seeds"], d["script_args"] = list(self.arms), list(self.seeds), list(self.script_args)
        d["sources"] = list(self.sources)
        for key in ("arm_definitions", "sources", "cluster"):
            if not d[key]:
                d.pop(key)  # configs without them keep their earlier form
        if self.step_budget == 1:
            d.pop("step_budget")  # likewise (and the runs' hashes)
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
        if "name" not in raw:
            raise ValueError(f"experiment config: name is required (accepted keys: {sorted(known)})")
        if "task" not in raw and "script" not in raw:
            raise ValueError(f"experiment config: task or script is required (accepted keys: {sorted(known)})")
        values = dict(raw)
        for key in ("arms", "seeds", "script_args", "sources"):
            if key in values:
                _check(isinstance(values[key], list), key, "a JSON list", values[key])
                values[key] = tuple(values[key])
        if "arms" in values:
            values["arms"], values["arm_definitions"] = _inline_definitions(values["arms"],
                                                                            values.get("arm_definitions", {}))
        if "policy" in values:
            policy = values["policy"]
            _check(isinstance(policy, dict), "policy", "a JSON object of Policy fields", policy)
            accepted = sorted(f.name for f in fields(Policy))
            unknown = sorted(set(policy) - set(accepted), key=str)
            if unknown:
                raise ValueError(f"experiment config: unknown policy keys {unknown}; accepted keys: {accepted}")
            values["policy"] = Policy(**policy)
        return cls(**values)

    @classmethod
    def of_run(cls, run_config: dict) -> "ExperimentConfig":
        """The config a rank reads from its run's ``run-config.json``: relative paths as the
        command that started the experiment meant them (``directory``), and your code as the
        experiment read it at its start; ValueError naming the files of it that changed since
        (trained under the old hash, their results would pass for the old code's)."""
        with paths_relative_to(run_config.get("directory") or Path.cwd()):
            config = cls.from_dict(run_config["config"])
        if run_config.get("code") is not None:
            from sparsecomm.lab.experiment.run_sources import Code

            code = Code.from_record(run_config["code"])
            changed = code.changed()
            if changed:
                raise ValueError(f"your code changed since the experiment started ({', '.join(changed)}): this run "
                                 "would train it under the hash of the code as it was; run the experiment again")
            config.__dict__["code"] = code  # the cached property `code`: as the experiment read it
        return config

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
        d.pop("cluster", None)  # where a run trains, not what it computes
        if arm == "dense":
            d.pop("step_budget", None)  # dense trains `steps` at any budget: the same run
        if d["link"] == "loopback":
            d.pop("link")  # runs from before links existed keep their hash
        if d["parallelism"] == "ddp":
            d.pop("parallelism")  # likewise for runs from before HSDP
        for key, default in WIRE_DEFAULTS.items():
            # The wire changes only what top-k arms send; at its default, runs keep their earlier hash.
            if not arm.startswith("topk-") or d[key] == default:
                d.pop(key)
        if self.policy.staleness_limit != DEFAULT_STALENESS_LIMIT:
            d["staleness_limit"] = self.policy.staleness_limit  # default: runs keep their earlier hash
        d.pop("arm_definitions", None)
        for key in ("metric", "mode", "launcher"):  # the report, and what started the same ranks
            d.pop(key)
        for key in ("script", "script_args"):
            if not d[key]:
                d.pop(key)  # built-in tasks keep their earlier hash
        code = self.code  # your code's files, by content
        if self.script is not None:
            d["script_sha256"] = code.files[code.entry]
            imported = code.digest(without_entry=True)
            if imported is not None:  # a script that imports nothing of yours keeps its earlier hash
                d["code_sha256"] = imported
        elif code is not None:
            d["code_sha256"] = code.digest()
        spec = self.arm(arm)
        for key in UNREAD_FIELDS.get(spec.name, ()):
            # As if at its default: one hash at every value, and the one runs already had.
            d[key] = self.__dataclass_fields__[key].default
        if spec.reducer == "topk" and spec.options.get("budget", "bucket") != "bucket":
            # The hook's default budget became "model": its runs are not the per-bucket runs of before.
            d["topk_budget"] = spec.options["budget"]
        if spec.name not in HOOK_PRESETS:
            # A defined arm carries its resolved options: the experiment's wire and optimizer
            # fields reach it only through them.
            for key in (*WIRE_DEFAULTS, "density", "dgc_momentum", "powersgd_rank", "optimizer", "lr", "momentum",
                        "weight_decay"):
                d.pop(key, None)
            d["arm_spec"] = {"reducer": spec.reducer, "options": spec.options, "optimizer": spec.optimizer}
        d.update(arm=arm, seed=seed)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def _inline_definitions(arms: tuple, definitions) -> tuple[tuple, dict]:
    """Arms written inline in a config file ({"name": ..., "reducer": ..., ...}) become names
    plus arm_definitions entries."""
    _check(isinstance(definitions, dict), "arm_definitions", "a JSON object of name -> definition", definitions)
    names, definitions = [], dict(definitions)
    for entry in arms:
        if isinstance(entry, dict):
            _check("name" in entry, "arms", "names, or objects with a name and a reducer", entry)
            name = entry["name"]
            _check(isinstance(name, str) and name not in definitions, "arms",
                   "objects with distinct string names not also in arm_definitions", entry)
            definitions[name] = {k: v for k, v in entry.items() if k != "name"}
            entry = name
        names.append(entry)
    return tuple(names), definitions


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def hsdp_shape_of(parallelism: str) -> tuple[int, int] | None:
    """(replicas, shards) of "hsdp:RxS" written as :data:`PARALLELISM_FORM` says; None for
    anything else ("ddp", or a form that is refused)."""
    match = _HSDP_SHAPE.fullmatch(parallelism)
    return None if match is None else (int(match[1]), int(match[2]))


def _check(ok: bool, name: str, accepted: str, value) -> None:
    if not ok:
        raise ValueError(f"experiment config: {name} must be {accepted}, got {value!r}")
