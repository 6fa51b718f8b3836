"""An arm as data: a name, the reducer, the reducer's options and the optimizer's changes.

Preset names: six (``dense``, ``dense-bf16``, ``powersgd``, ``topk-ef``, ``topk-noef``,
``topk-dgc``: :data:`HOOK_PRESETS`) resolve from the experiment's fields (density,
dgc_momentum, wire settings, powersgd_rank), and the others (``sparseloco``,
``sparseloco-overlap``, ``topk-sign``, ``scape``, ``scape-10pc``, ``scape-dense``, ...:
:data:`FIXED_PRESETS`) carry options of their own. Any other arm is defined in
``ExperimentConfig.arm_definitions``, in a config file::

    "arms": ["dense", "topk-dgc", "topk-0.3pc"],
    "arm_definitions": {"topk-0.3pc": {"reducer": "topk",
                                       "options": {"density": 0.003, "momentum": 0.9, "value_codec": "int4",
                                                   "selector": "chunk", "index_codec": "rice"},
                                       "optimizer": {"lr": 0.002}}}

or on the command line, ``--arms dense topk-0.3pc=topk:density=0.003,momentum=0.9,opt.lr=0.002``.

Reducers and their options:

| reducer    | hook                                    | options                                           |
|------------|-----------------------------------------|---------------------------------------------------|
| allreduce  | torch ``allreduce_hook``                 | none                                              |
| fp16, bf16 | torch ``fp16_/bf16_compress_hook``        | none (bf16 needs NCCL; on gloo it is fp16)        |
| powersgd   | torch ``powerSGD_hook``                  | ``rank``, ``start_iter``, ``use_error_feedback``, ``warm_start`` |
| topk       | sparsecomm ``topk_hook`` + ``TopKState``   | every ``TopKState`` keyword that a JSON value can hold (:data:`TOPK_OPTIONS`) |
| sparse-delta | ``SparseDeltaAverager``: local steps, a sparse outer sync every ``period`` | :data:`SPARSE_DELTA_OPTIONS` |
| local      | a hook that reduces nothing: the no-communication floor of the step time (its quality means nothing: the replicas never meet) | none |

A topk arm with ``momentum`` > 0 (DGC momentum correction) runs an optimizer without
momentum of its own, as the ``topk-dgc`` preset does. Optimizer changes (``optimizer``:
adamw, sgd, signsgd or adams, ``lr``, ``momentum``, ``weight_decay``, ``beta2``) override the
experiment's for that arm only (``beta2``, AdamW's or AdamS's second beta, only where the arm sets
it: 0.999, torch's default, otherwise); ``signsgd`` with a topk arm is the sign mode (DeMo-style: error feedback,
then the sign of the aggregate); ``adams`` is :class:`sparsecomm.optim.AdamS` (Adam without
the second moment, at AdamW's betas and eps), refused on an arm whose hook corrects momentum
(its momentum is also its normalizer: it cannot be handed to the hook).
Options an arm leaves out take the experiment's values (``density``, ``warmup_steps``, the
wire fields; ``seed`` is always the run's), and the resolved arm (every option explicit)
is what is hashed, stored with each run and printed in the report.
"""
import json
import math
from dataclasses import dataclass, field

from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.state.settings import options
from sparsecomm.lab.results import NAME_ACCEPTED, is_safe_name

HOOK_PRESETS = ("dense", "dense-bf16", "powersgd", "topk-ef", "topk-noef", "topk-dgc")
"""The presets that resolve from the experiment's fields (density, dgc_momentum, wire, powersgd_rank)."""
UNREAD_FIELDS = {
    "dense": ("density", "dgc_momentum", "powersgd_rank"),
    "dense-bf16": ("density", "dgc_momentum", "powersgd_rank"),
    "powersgd": ("density", "dgc_momentum"),
}
"""Experiment fields a hook preset's runs never read: kept out of their run hash, so that a
density sweep's dense runs are one run per seed, not one per density."""
FIXED_PRESETS = {
    # Full AdamW at its normal betas, local steps, a sparse outer sync every 2 steps: exact
    # top-k of 1.5625% (SparseLoCo's 64 of 4096) with Rice indices and 2-bit values. Measured
    # equivalent to dense on the default task (docs/local_steps.md).
    "sparseloco": {"reducer": "sparse-delta", "options": {
        "period": 2, "density": 64 / 4096, "selector": "exact", "index_codec": "rice", "value_codec": "int2",
        "outer_lr": 1.0, "ef_decay": 0.95}},
    # sparseloco with per-chunk top-k (chunks of 65536, on the native kernels) and the sync
    # applied one step late behind the next step's compute (overlap, the local step kept).
    # Measured equivalent to dense at 2 ranks over an emulated 1 Gb/s link, 1.02x the
    # no-communication floor's step, 1% of the step exposed (docs/results.md).
    "sparseloco-overlap": {"reducer": "sparse-delta", "options": {
        "period": 2, "density": 64 / 4096, "selector": "chunk", "chunk_size": 65536, "index_codec": "rice",
        "value_codec": "int2", "outer_lr": 1.0, "ef_decay": 0.95, "overlap": True}},
    # The sign mode (DeMo-style): error feedback, chunked top-k of the experiment's density
    # with 1-bit values, sign-SGD on the aggregate.
    "topk-sign": {"reducer": "topk", "options": {"selector": "chunk", "index_codec": "rice", "value_codec": "sign"},
                  "optimizer": {"optimizer": "signsgd"}},
    # SCAPE's reducer (exchange="shared-mask", sparsecomm/hooks/wires/shared_mask.py): AdamS's first
    # moment synchronised at the per-tensor mask its owners chose one step before, density warmed
    # up geometrically from 1.0 over the first 10% of the default task's 400 steps (the authors':
    # 10,000 of 100,000). AdamS at lr 1e-3: at the task's AdamW lr (3e-3) dense AdamS is worse
    # (docs/results.md). ``scape-dense`` is the dense baseline it is judged against besides dense.
    "scape": {"reducer": "topk", "options": {"density": 0.01, "exchange": "shared-mask",
                                             "density_schedule": {"kind": "geometric", "steps": 40}},
              "optimizer": {"optimizer": "adams", "lr": 1e-3}},
    "scape-10pc": {"reducer": "topk", "options": {"density": 0.1, "exchange": "shared-mask",
                                                  "density_schedule": {"kind": "geometric", "steps": 40}},
                   "optimizer": {"optimizer": "adams", "lr": 1e-3}},
    "scape-dense": {"reducer": "allreduce", "options": {}, "optimizer": {"optimizer": "adams", "lr": 1e-3}},
}
"""Presets with options of their own (their run hash covers them, as a defined arm's does)."""
PRESETS = (*HOOK_PRESETS, *FIXED_PRESETS)
REDUCERS = ("allreduce", "fp16", "bf16", "powersgd", "topk", "sparse-delta", "local")
TOPK_OPTIONS = tuple(name for name, spec in options(TopKConfig).items() if spec.arm)
"""TopKState keywords an arm may set. Not here: process_group and module (the run's),
seed (the run's seed), grad_scaler and on_overflow (tasks run without a loss scaler, under the
default on_overflow="rollback")."""
POWERSGD_OPTIONS = ("rank", "start_iter", "use_error_feedback", "warm_start")
SPARSE_DELTA_OPTIONS = ("period", "density", "selector", "chunk_size", "index_codec", "value_codec", "outer_lr",
                        "ef_decay", "exchange", "link", "overlap", "owner_dropped", "leader_filter",
                        "diagnose_leader_overlap")
"""SparseDeltaAverager keywords: local steps, then every ``period`` steps a sparse outer sync."""
SPARSE_DELTA_DEFAULTS = {"period": 10, "selector": "chunk", "chunk_size": 4096, "index_codec": "rice",
                         "value_codec": "int2", "outer_lr": 0.7, "ef_decay": 0.95}
"""What a sparse-delta arm leaves out (density: the experiment's): SparseLoCo's wire (chunks
of 4096, Rice indices, 2-bit values), its outer learning rate and error-feedback decay."""
OPTIMIZER_OPTIONS = ("optimizer", "lr", "momentum", "weight_decay", "beta2")
"""What an arm may change of its optimizer; ``beta2`` is in the resolved arm only where the arm sets it
(so the arms that do not keep their run hashes)."""
BETA2_DEFAULT = 0.999
"""AdamW's and AdamS's second beta where an arm does not set ``beta2``: torch's default."""
ARM_OPTIMIZERS = ("adamw", "sgd", "signsgd", "adams")
"""An arm's optimizer: the experiment's three (adamw, sgd, adams: ``sparsecomm.optim.AdamS``), or
sign-SGD (the sign mode: ``sparsecomm.optim.sign_sgd``)."""
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""``value_dtype`` / ``residual_dtype`` are written as these names (a JSON value cannot hold a torch.dtype)."""
OPTIONS = {"allreduce": (), "fp16": (), "bf16": (), "powersgd": POWERSGD_OPTIONS, "topk": TOPK_OPTIONS,
           "sparse-delta": SPARSE_DELTA_OPTIONS, "local": ()}


@dataclass(frozen=True)
class ArmSpec:
    """One resolved arm: every option explicit."""

    name: str
    reducer: str
    options: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    """The optimizer of this arm: kind, lr, momentum, weight_decay (all explicit); for a
    script's arm only the changes it makes to the script's own optimizer."""
    preset: bool = False

    @property
    def momentum_correction(self) -> float:
        """The hook's momentum (DGC momentum correction; then the optimizer has none of its own)."""
        return float(self.options.get("momentum", 0.0)) if self.reducer == "topk" else 0.0

    def to_dict(self) -> dict:
        return {"name": self.name, "reducer": self.reducer, "options": dict(self.options),
                "optimizer": dict(self.optimizer), "preset": self.preset}

    def describe(self) -> str:
        """One line: reducer, options and optimizer, e.g. "topk density=0.003 momentum=0.9; adamw lr=0.003"."""
        options = " ".join(f"{key}={_show(value)}" for key, value in self.options.items())
        opt = self.optimizer
        if "optimizer" in opt:
            optimizer = f"{opt['optimizer']} lr={opt['lr']:g}"
            if opt["weight_decay"]:
                optimizer += f" weight_decay={opt['weight_decay']:g}"
            if "beta2" in opt:
                optimizer += f" beta2={opt['beta2']:g}"
            if opt["optimizer"] == "sgd" and not self.momentum_correction:
                optimizer += f" momentum={opt['momentum']:g}"
        else:  # a script's optimizer, with this arm's changes
            optimizer = " ".join(["the script's optimizer", *(f"{k}={_show(v)}" for k, v in opt.items())])
        if self.momentum_correction:
            optimizer += " (no momentum of its own: the hook corrects momentum)"
        return f"{self.reducer}{' ' + options if options else ''}; {optimizer}"


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else json.dumps(value) if not isinstance(value, str) else value


def check_definition(name: str, definition) -> dict:
    """A user's arm definition, validated in shape (names, keys, reducer); ValueError naming what is wrong.

    The option values are checked when the arm resolves against the experiment
    (:func:`resolve`), by the hook's own validation.
    """
    where = f"arm_definitions[{name!r}]"
    if not is_safe_name(name):
        raise ValueError(f"experiment config: arm name must be {NAME_ACCEPTED}, got {name!r}")
    if name in PRESETS:
        raise ValueError(f"experiment config: {where}: {name!r} is a preset arm ({', '.join(PRESETS)}); give the "
                         "arm you define another name")
    if not isinstance(definition, dict):
        raise ValueError(f"experiment config: {where} must be a JSON object with keys reducer, options, optimizer; "
                         f"got {definition!r}")
    unknown = sorted(set(definition) - {"reducer", "options", "optimizer"}, key=str)
    if unknown:
        raise ValueError(f"experiment config: {where}: unknown keys {unknown}; accepted: reducer, options, optimizer")
    reducer = definition.get("reducer")
    if reducer not in REDUCERS:
        raise ValueError(f"experiment config: {where}.reducer must be one of {REDUCERS}, got {reducer!r}")
    options, optimizer = definition.get("options", {}), definition.get("optimizer", {})
    for key, value, accepted in (("options", options, OPTIONS[reducer]), ("optimizer", optimizer, OPTIMIZER_OPTIONS)):
        if not isinstance(value, dict):
            raise ValueError(f"experiment config: {where}.{key} must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(accepted), key=str)
        if unknown:
            raise ValueError(f"experiment config: {where}.{key}: unknown keys {unknown} for reducer {reducer!r}; "
                             f"accepted: {list(accepted) or 'none'}")
    return {"reducer": reducer, "options": dict(options), "optimizer": dict(optimizer)}


def _preset_definition(name: str, config) -> dict:
    """The preset ``name`` written as a definition, from the experiment's fields."""
    if name in FIXED_PRESETS:
        return FIXED_PRESETS[name]
    if name == "dense":
        return {"reducer": "allreduce"}
    if name == "dense-bf16":
        return {"reducer": "bf16"}
    if name == "powersgd":
        return {"reducer": "powersgd", "options": {"rank": config.powersgd_rank}}
    momentum = config.dgc_momentum if name == "topk-dgc" else 0.0
    return {"reducer": "topk", "options": {"error_feedback": name != "topk-noef", "momentum": momentum}}


def resolve(name: str, config) -> ArmSpec:
    """The arm called ``name`` in ``config`` (a preset or one of its arm_definitions), every option explicit."""
    if name in PRESETS:
        definition, preset = _preset_definition(name, config), True
    elif name in config.arm_definitions:
        definition, preset = config.arm_definitions[name], False
    else:
        raise ValueError(f"experiment config: arm {name!r} is neither a preset ({', '.join(PRESETS)}) nor defined in "
                         f"arm_definitions ({', '.join(config.arm_definitions) or 'none defined'})")
    reducer = definition["reducer"]
    options = dict(definition.get("options", {}))
    if reducer == "topk":
        options = {"density": config.density, "warmup_steps": config.warmup_steps, "selector": config.selector,
                   "chunk_size": config.chunk_size, "index_codec": config.index_codec,
                   "value_codec": config.value_codec, "exchange": config.exchange, **options}
        _check_topk(name, options)
        if options.get("transport") == "mpi" and config.launcher != "mpiexec":
            raise ValueError(f"experiment config: arm {name!r}: transport 'mpi' needs launcher 'mpiexec' (the ranks "
                             f"must be one MPI job; under {config.launcher} every rank is an MPI job of one process), "
                             f"got launcher {config.launcher!r}")
    elif reducer == "powersgd":
        options = {"rank": config.powersgd_rank, "start_iter": config.warmup_steps, "use_error_feedback": True,
                   "warm_start": True, **options}
        _check_powersgd(name, options)
    elif reducer == "sparse-delta":
        options = {"density": config.density, **SPARSE_DELTA_DEFAULTS, **options}
        _check_sparse_delta(name, options, config)
    if config.script is not None:
        # The script builds its own optimizer: an arm can only change it (run.apply does, in place).
        optimizer = dict(definition.get("optimizer", {}))
        if "optimizer" in optimizer:
            raise ValueError(f"experiment config: arm {name!r}: an arm of a script cannot change the optimizer's "
                             "kind (the script builds it); set lr, momentum or weight_decay")
    else:
        optimizer = {"optimizer": config.optimizer, "lr": config.lr, "momentum": config.momentum,
                     "weight_decay": config.weight_decay, **definition.get("optimizer", {})}
    _check_optimizer(name, optimizer)
    spec = ArmSpec(name, reducer, options, optimizer, preset)
    if "momentum" in definition.get("optimizer", {}):
        _check_optimizer_momentum_applies(spec)
    _check_adams_without_momentum_correction(spec)
    return spec


def topk_state_kwargs(options: dict) -> dict:
    """``TopKState`` keyword arguments from a topk arm's JSON options (dtype names -> torch dtypes)."""
    import torch

    kwargs = dict(options)
    for key in ("value_dtype", "residual_dtype"):
        if kwargs.get(key) is not None:
            kwargs[key] = getattr(torch, kwargs[key])
    if isinstance(kwargs.get("density_schedule"), list):  # (a dict, {"kind": ...}, the hook reads itself)
        from sparsecomm.hooks import DensitySchedule

        kwargs["density_schedule"] = DensitySchedule(points=tuple(tuple(p) for p in kwargs["density_schedule"]))
    return kwargs


def _check_topk(name: str, options: dict) -> None:
    """Check a topk arm's options by the hook's own validation, and write down the budget they
    resolve to (the hook's default is "model" where it applies), so that the stored arm says
    it and a run of another budget is never taken for this one."""
    from sparsecomm.hooks.state.settings import TopKConfig

    for key in ("value_dtype", "residual_dtype"):
        if options.get(key) is not None and options[key] not in DTYPE_NAMES:
            raise ValueError(f"experiment config: arm {name!r}: {key} must be None or one of {DTYPE_NAMES}, "
                             f"got {options[key]!r}")
    schedule = options.get("density_schedule")
    if schedule is not None and not isinstance(schedule, dict) and not (isinstance(schedule, list) and all(
            isinstance(p, list) and len(p) == 2 for p in schedule)):
        raise ValueError(f"experiment config: arm {name!r}: density_schedule must be None, a list of [step, density] "
                         f"pairs (DensitySchedule.to_list()) or a dict such as {{\"kind\": \"geometric\", "
                         f"\"steps\": 40}}, got {schedule!r}")
    try:
        kwargs = topk_state_kwargs(options)
        options["budget"] = TopKConfig.build(**kwargs).budget
    except (TypeError, ValueError) as error:
        raise ValueError(f"experiment config: arm {name!r}: {error}") from None


def _check_sparse_delta(name: str, options: dict, config) -> None:
    from sparsecomm.averaging.sparse_delta import check_settings

    try:
        check_settings(**options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"experiment config: arm {name!r}: {error}") from None
    period = options["period"]
    if options.get("overlap") and config.monitor_every:
        raise ValueError(f"experiment config: arm {name!r}: overlap=True keeps each replica's local step after every "
                         f"sync, so the replicas never hold the same weights for the replica monitor; set "
                         f"monitor_every to 0 (got {config.monitor_every})")
    # Checkpoints and replica checks need the replicas equal: right after a sync.
    for field_name in ("checkpoint_every", "monitor_every"):
        value = getattr(config, field_name)
        if value % period:
            raise ValueError(f"experiment config: arm {name!r}: {field_name} must be a multiple of its period "
                             f"{period} (the replicas agree only right after a sync), got {value}")


def _check_powersgd(name: str, options: dict) -> None:
    rank, start = options["rank"], options["start_iter"]
    if not (_is_int(rank) and rank >= 1):
        raise ValueError(f"experiment config: arm {name!r}: rank must be an integer >= 1, got {rank!r}")
    if not (_is_int(start) and start >= 2):
        raise ValueError(f"experiment config: arm {name!r}: start_iter must be an integer >= 2 (DDP rebuilds its "
                         f"buckets after step 1), got {start!r}")
    for key in ("use_error_feedback", "warm_start"):
        if not isinstance(options[key], bool):
            raise ValueError(f"experiment config: arm {name!r}: {key} must be true or false, got {options[key]!r}")


def _check_optimizer(name: str, optimizer: dict) -> None:
    def bad(key: str, accepted: str):
        raise ValueError(f"experiment config: arm {name!r}: optimizer {key} must be {accepted}, got {optimizer[key]!r}")

    checks = {"optimizer": (lambda v: v in ARM_OPTIMIZERS, f"one of {ARM_OPTIMIZERS}"),
              "lr": (lambda v: _is_real(v) and v > 0, "a finite number > 0"),
              "momentum": (lambda v: _is_real(v) and 0 <= v < 1, "in [0, 1)"),
              "weight_decay": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
              "beta2": (lambda v: _is_real(v) and 0 <= v < 1, "in [0, 1)")}
    for key, value in optimizer.items():  # a task's arm: the four, and beta2 where set; a script's arm: its changes
        ok, accepted = checks[key]
        if not ok(value):
            bad(key, accepted)
    if "beta2" in optimizer and optimizer.get("optimizer", "adamw") not in ("adamw", "adams"):
        raise ValueError(f"experiment config: arm {name!r}: optimizer beta2 applies to adamw and adams only (the "
                         f"second moment's beta; AdamS's normalizer weight), got optimizer {optimizer['optimizer']!r}")


def _check_optimizer_momentum_applies(spec: ArmSpec) -> None:
    """An arm that sets the optimizer's momentum gets it, or is refused: under momentum
    correction the optimizer runs without momentum, and only SGD has a momentum setting
    (a script's optimizer is known at ``run.apply``, which checks it there)."""
    if spec.momentum_correction:
        raise ValueError(f"experiment config: arm {spec.name!r}: optimizer momentum "
                         f"{spec.optimizer['momentum']!r} cannot apply: the arm's hook corrects momentum "
                         f"(momentum={spec.momentum_correction:g}), so its optimizer runs without momentum of its "
                         "own; leave the optimizer's momentum out, or set the hook's momentum to 0")
    kind = spec.optimizer.get("optimizer")
    if kind is not None and kind != "sgd":
        raise ValueError(f"experiment config: arm {spec.name!r}: optimizer momentum {spec.optimizer['momentum']!r} "
                         f"cannot apply: only optimizer sgd has a momentum setting, the arm's optimizer is {kind!r}")


def _check_adams_without_momentum_correction(spec: ArmSpec) -> None:
    """AdamS keeps its momentum: under the hook's momentum correction the optimizer must run
    without one, and AdamS's momentum is also its normalizer, so it cannot be taken out."""
    if spec.optimizer.get("optimizer") == "adams" and spec.momentum_correction:
        raise ValueError(f"experiment config: arm {spec.name!r}: optimizer 'adams' cannot run under the hook's "
                         f"momentum correction (option momentum={spec.momentum_correction:g}): AdamS's momentum is "
                         "also its normalizer, so it cannot be handed to the hook; set the arm's option momentum "
                         "to 0, or choose optimizer adamw or sgd")


def parse_cli_arm(text: str) -> tuple[str, dict | None]:
    """``--arms`` item: a name, or ``NAME=REDUCER[:key=value,...]`` (``opt.KEY`` for the optimizer).

    Values are JSON (``0.003``, ``true``, ``null``, ``[[0, 0.1]]``) or else plain strings
    (``int4``). Returns (name, definition or None for a bare name).
    """
    if "=" not in text.split(":", 1)[0]:
        return text, None
    name, rest = text.split("=", 1)
    reducer, _, settings = rest.partition(":")
    definition = {"reducer": reducer, "options": {}, "optimizer": {}}
    for item in _split_settings(settings):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"argument --arms: {text!r}: settings are key=value separated by commas, got {item!r}")
        target = definition["optimizer"] if key.startswith("opt.") else definition["options"]
        if key.removeprefix("opt.") in target:  # the last would silently win
            raise ValueError(f"argument --arms: {text!r}: {key} is given twice; give each setting once")
        target[key.removeprefix("opt.")] = _parse_value(value)
    return name, definition


def _split_settings(settings: str) -> list[str]:
    """Split on commas outside brackets (a density_schedule value is a JSON list)."""
    items, depth, current = [], 0, ""
    for char in settings:
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if current:
        items.append(current)
    return [item.strip() for item in items if item.strip()]


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
