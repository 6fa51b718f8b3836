"""The top-k hook's settings, in one module: the checks, the option table, the density schedule
and the frozen config they make (``TopKState.config``).

* **Checks** (``check_real``, ``check_int``, ...): each names the argument and the accepted range.
  They run when a state is built, so bad input fails before DDP issues any collective; the
  averager, the optimizers and the FSDP hook use them too.
* **The option table**: every ``TopKState`` setting written once, as a field of
  :class:`TopKConfig` with an :class:`Option` in its metadata. From the table come: the
  validation of each simple setting (:meth:`Option.check`), what the ranks compare at the first
  hook call (``rank_agreement``), what a checkpoint must match (``TopKConfig.checkpoint_dict``),
  the options a lab arm may set (``lab.experiment.arm_spec.TOPK_OPTIONS``), and the options
  table of the docs (:func:`markdown_table`; ``docs/options.md``, written by
  ``scripts/options_table.py`` and checked against it by a test).
* **Density schedules** (:class:`DensitySchedule`): how the fraction of each bucket that is sent
  changes over steps. Starting sparse from step one hurts quality most early in training, when
  gradients change fastest; DGC (Lin et al., ICLR 2018, section 3.3 "warm-up training")
  therefore raises sparsity in stages: 75%, 93.75%, 98.4375%, 99.6%, then the target 99.9%,
  i.e. each stage sends about a quarter of the previous one. :meth:`DensitySchedule.exponential`
  makes ``stages`` equal stages over ``steps`` steps with densities ``target ** ((i + 1) /
  (stages + 1))`` (for target 0.001 and 4 stages exactly DGC's 0.25, 0.0625, 0.0156, 0.0039);
  :meth:`DensitySchedule.piecewise` takes a user list of ``(first_step, density)`` pairs.
  Densities are piecewise constant, so the hook's payload buffers are reallocated only when a
  stage changes (a few times), not every step.
* **The config** (:class:`TopKConfig`): every setting checked here, when the state is built; the
  object never changes afterwards: a state that should behave differently is a new state.
"""

import bisect
import dataclasses
import importlib.util
import math
import numbers
import zlib

import torch

from sparsecomm.compress.chunking import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.value_codecs import FLOAT_CODECS, VALUE_CODECS
from sparsecomm.comm.mpi_allgatherv import TRANSPORTS
from sparsecomm.links.spec import parse_link


VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_real(name: str, value, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    """``value`` as a float inside the interval, else TypeError/ValueError naming ``name``."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in {interval}, got {type(value).__name__} {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high:
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high] (high None: unbounded), else TypeError/ValueError naming ``name``."""
    accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer {accepted}, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {accepted}, got {value}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value, choices: tuple) -> object:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_value_dtype(value, name: str = "value_dtype") -> torch.dtype | None:
    if value is None or value in VALUE_DTYPES:
        return value
    allowed = ", ".join(["None"] + [str(d) for d in VALUE_DTYPES])
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def check_transport(transport, selector: str) -> str:
    """``transport`` if it is usable here with ``selector``, else ValueError naming it.

    Only what needs no process group and does not start MPI is checked here; the first
    hook call checks the MPI world against the process group (see TopKState).
    """
    from sparsecomm.comm import TRANSPORTS

    check_choice("transport", transport, TRANSPORTS)
    if transport != "mpi":
        return transport
    if importlib.util.find_spec("mpi4py") is None:
        raise ValueError(
            "transport='mpi' needs mpi4py, which is not installed (pip install mpi4py mpich, or "
            f"sparsecomm[mpi]); transport must be one of {', '.join(map(repr, TRANSPORTS))}"
        )
    if selector == "random":
        raise ValueError(
            "transport='mpi' all-gathers sparse payloads, but selector='random' allreduces its values over "
            "the process group and would never use it: use transport='c10d' with selector='random'"
        )
    return transport

DTYPE_CHOICES = (None, *VALUE_DTYPES)  # a wire or memory dtype, or None


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting: how it is checked, what it means, and where it matters.

    ``kind``: "real" (in ``low``..``high``, each end open or closed), "int" (>= ``low``,
    <= ``high`` if given), "bool", "choice" (one of ``choices``), "dtype" (None or one of
    the wire's float dtypes), or "custom" (checked by ``TopKConfig.build`` itself;
    ``accepted`` says what it takes). A "choice" whose ``accepted`` is set is resolved by
    ``TopKConfig.build`` too (it depends on other settings). ``agree``: compared
    across ranks at the first hook call. ``arm``: a lab arm may set it. ``checkpoint``:
    "always", "wire" (with ``selector="chunk"`` or a compact wire), "if-set" (when not the
    default), or "never" (what travels, not what the memories hold).
    """

    doc: str
    kind: str = "custom"
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    accepted: str = ""
    condition: str = ""  # what else the value needs, as the docs say it after the range
    agree: bool = True
    arm: bool = True
    checkpoint: str = "always"

    def check(self, name: str, value):
        """``value`` checked (TypeError/ValueError naming ``name`` and the accepted range)."""
        if self.kind == "real":
            return check_real(name, value, self.low, self.high, low_open=self.low_open, high_open=self.high_open)
        if self.kind == "int":
            return check_int(name, value, int(self.low), None if self.high is None else int(self.high))
        if self.kind == "bool":
            return check_bool(name, value)
        if self.kind == "choice":
            return check_choice(name, value, self.choices)
        if self.kind == "dtype":
            return check_value_dtype(value, name=name)
        raise TypeError(f"{name} is checked by TopKConfig.build, not by its option")

    def accepted_text(self) -> str:
        """The accepted range as the docs show it (and what else it needs)."""
        return self._range_text() + (f"; {self.condition}" if self.condition else "")

    def _range_text(self) -> str:
        if self.accepted:
            return self.accepted
        if self.kind == "real":
            high = "inf" if self.high == math.inf else f"{self.high:g}"
            return f"a number in {'(' if self.low_open else '['}{self.low:g}, {high}{')' if self.high_open else ']'}"
        if self.kind == "int":
            return f"an integer >= {int(self.low)}" if self.high is None else \
                f"an integer in [{int(self.low)}, {int(self.high)}]"
        if self.kind == "bool":
            return "`True`, `False`"
        if self.kind == "choice":
            return ", ".join(_code(c) for c in self.choices)
        return ", ".join(_code(c) for c in DTYPE_CHOICES)


def _code(value) -> str:
    """A value as the docs show it: ``None``, ``"text"``, ``torch.float32``."""
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def option(default, doc: str, **spec):
    """A TopKConfig field whose metadata is its :class:`Option`."""
    return dataclasses.field(default=default, metadata={"option": Option(doc, **spec)})


def options(config_class) -> dict[str, Option]:
    """name -> Option of every field of ``config_class``, in field order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(config_class)}


OPTIONAL_REALS = ("local_clip_norm", "leader_filter")  # "custom" options: None or a positive number


def fingerprint(value) -> float:
    """A value no float64 holds (a list, a name) as one: the CRC-32 of its repr, equal on two
    ranks exactly when the values are (but for a collision, 1 in 2**32)."""
    return float(zlib.crc32(repr(value).encode()))


def agreement_value(name: str, spec: Option, value) -> float:
    """A setting as one float64 that is equal on two ranks exactly when the settings are."""
    if spec.kind in ("choice", "dtype"):
        return float(_choices(spec).index(value))
    if spec.kind == "custom":
        if name in OPTIONAL_REALS:
            return -1.0 if value is None else float(value)
        to_list = getattr(value, "to_list", None)  # a density schedule; else a link name or None
        return fingerprint(to_list() if to_list is not None else value)
    return float(value)


def shown_value(name: str, spec: Option, value: float):
    """How an agreement value is shown in the error that names a setting the ranks disagree on."""
    if spec.kind in ("choice", "dtype"):
        choice = _choices(spec)[int(value)]
        return None if choice is None else str(choice) if spec.kind == "dtype" else choice
    if spec.kind == "custom":
        if name in OPTIONAL_REALS:
            return None if value == -1.0 else int(value) if value.is_integer() else value
        return f"{name.replace('_', ' ')} #{int(value):08x}"
    return value if spec.kind == "real" else int(value)


def _choices(spec: Option) -> tuple:
    return DTYPE_CHOICES if spec.kind == "dtype" else spec.choices


def markdown_table(config_class) -> str:
    """The options table of the docs, one row per setting: name | default | accepted | meaning."""
    rows = ["| name | default | accepted | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(config_class):
        spec = field.metadata["option"]
        rows.append(f"| `{field.name}` | {_code(field.default)} | {spec.accepted_text()} | {spec.doc} |")
    return "\n".join(rows) + "\n"


@dataclasses.dataclass(frozen=True)
class DensitySchedule:
    """Piecewise-constant density by step: ``density(step)`` is the value of the last
    ``(first_step, density)`` pair with ``first_step <= step``; the last pair is the target."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self):
        if not self.points:
            raise ValueError("density schedule: needs at least one (first_step, density) pair, got none")
        for pair in self.points:
            if len(pair) != 2:
                raise ValueError(f"density schedule: entries must be (first_step, density) pairs, got {pair!r}")
            check_int("density schedule step", pair[0], 0)
            check_real("density schedule density", pair[1], 0.0, 1.0, low_open=True, high_open=False)
        steps = [step for step, _ in self.points]
        if steps[0] != 0:
            raise ValueError(f"density schedule: the first pair must start at step 0, got {steps[0]}")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"density schedule: first steps must increase strictly, got {steps}")

    @classmethod
    def constant(cls, density: float) -> "DensitySchedule":
        return cls(((0, density),))

    @classmethod
    def exponential(cls, target: float, steps: int, stages: int = 4) -> "DensitySchedule":
        """DGC's warm-up: ``stages`` equal stages over ``steps`` steps, then ``target``."""
        check_real("target density", target, 0.0, 1.0, low_open=True, high_open=False)
        check_int("steps", steps, 1)
        check_int("stages", stages, 1)
        if stages > steps:
            raise ValueError(f"stages must be <= steps ({steps}), got {stages}")
        points = [(steps * i // stages, target ** ((i + 1) / (stages + 1))) for i in range(stages)]
        return cls((*points, (steps, target)))

    @classmethod
    def geometric(cls, target: float, steps: int, start: float = 1.0) -> "DensitySchedule":
        """SCAPE's warm-up: ``start x (target / start) ** (t / steps)`` at step t < ``steps``
        (one value per step), then ``target``."""
        check_real("target density", target, 0.0, 1.0, low_open=True, high_open=False)
        check_real("start", start, target, 1.0, low_open=False, high_open=False)
        check_int("steps", steps, 1)
        points = [(t, start * (target / start) ** (t / steps)) for t in range(steps)]
        return cls((*points, (steps, target)))

    @classmethod
    def piecewise(cls, points, target: float) -> "DensitySchedule":
        """A user list of ``(first_step, density)``; it must end at ``target``."""
        points = tuple(tuple(pair) for pair in points)
        schedule = cls(points)
        if points[-1][1] != target:
            raise ValueError(
                f"density schedule must end at the target density {target}, but its last pair is {points[-1]}"
            )
        return schedule

    def __call__(self, step: int) -> float:
        index = bisect.bisect_right([s for s, _ in self.points], step) - 1
        return self.points[max(index, 0)][1]

    @property
    def target(self) -> float:
        return self.points[-1][1]

    def to_list(self) -> list[list]:
        return [[step, density] for step, density in self.points]

SELECTOR_CHOICES = ("exact", "sampled", "random", "chunk")
K_SCOPES = ("bucket", "parameter")
BUDGETS = ("bucket", "model")
OVERFLOW_CHOICES = ("rollback", "drop")
EXCHANGE_CHOICES = ("allgather", "owner", "shared-index", "shared-mask", "auto")
OWNER_DROPPED_CHOICES = ("owner", "sender")


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """What :func:`sparsecomm.topk_hook` does; see :class:`sparsecomm.TopKState` for each field."""

    # Hyperparameters users tune.
    density: float = option(0.01, "fraction of each bucket sent: k = ceil(density x numel) entries", kind="real",
                            low=0.0, high=1.0, low_open=True)
    error_feedback: bool = option(True, "keep what was not sent and add it next step", kind="bool")
    momentum: float = option(
        0.0, "DGC momentum correction: the hook owns the momentum and the optimizer has none of its own. "
             "`register_topk_hook(ddp, density=..., optimizer=opt)` (and `register_hsdp_hook`) set it from `opt` "
             "when `momentum` is left unset (AdamW's `betas[0]` moves into the hook); by hand: "
             '`sparsecomm.dgc_optimizer(params, "sgd"/"adamw", lr=...)`',
        accepted='a number in [0, 1); `register_topk_hook` and `register_hsdp_hook` with `optimizer=` also `"auto"`',
        kind="real", low=0.0, high=1.0, high_open=True, condition="> 0 needs `error_feedback`")
    nesterov: bool = option(False, "DGC's Nesterov variant of momentum correction", kind="bool",
                            condition="`True` needs `momentum` > 0")
    local_clip_norm: float | None = option(
        None, "DGC local gradient clipping: each parameter's local gradient norm <= value / sqrt(world size) before "
              "momentum", accepted="`None` or a number > 0")
    warmup_steps: int = option(2, "dense steps first", kind="int", low=0, condition=">= 2 with `error_feedback`")
    selector: str = option(
        "exact", '`"exact"` top-k; `"sampled"` a threshold from a ~1% sample (DGC); `"random"` random-k with shared '
                 'indices (values allreduced); `"chunk"` the top `ceil(density * chunk_size)` of every chunk '
                 "([wire.md](wire.md))", kind="choice", choices=SELECTOR_CHOICES)
    value_dtype: torch.dtype | None = option(
        None, "dtype of values on the wire; rounding error stays in the residual, out-of-range values saturate",
        kind="dtype")
    residual_dtype: torch.dtype | None = option(
        None, "dtype of the residual and velocity: `None` is float32 for 16-bit buckets (bf16/fp16 models, "
              "`fp16_compress_wrapper`), the bucket's dtype otherwise ([precision.md](precision.md))", kind="dtype",
        condition="not with `error_feedback=False`", checkpoint="never")
    seed: int = option(0, "seeds random-k indices and the sampled selector", kind="int", low=0, arm=False)
    density_schedule: DensitySchedule | None = option(
        None, "start denser: the exponential kind is DGC's warm-up (each stage sends ~1/4 of the previous); "
              '`stats()["density"]` shows the current one',
        accepted='`None`, `{"kind": "exponential", "steps": N, "stages": S}`, `{"kind": "geometric", "steps": N}` '
                 '(SCAPE\'s warm-up from 1.0), or `[(first_step, density), ...]` '
                 "ending at `density`")
    # Switches.
    allow_dense_fallback: bool = option(True, "`False` forces the sparse path even where it moves more bytes",
                                        kind="bool", checkpoint="never")
    verify_conservation: bool = option(False, "check the error-feedback invariant exactly every step", kind="bool",
                                       condition="`True` needs `error_feedback`", agree=False, checkpoint="never")
    k_scope: str = option("bucket", '`"bucket"`: top-k of each DDP bucket; `"parameter"`: layer-wise top-k, '
                                    "independent of the bucket layout", kind="choice", choices=K_SCOPES,
                          condition='chunked selection and compact codecs need `"bucket"`')
    budget: str | None = option(
        None, '`"model"`: the buckets (FSDP modules) share `density` x the model\'s entries, each bucket\'s k from '
              "the last step's model-wide top-k (one small all-reduce per step; "
              "[options.md](options.md#one-budget-for-the-model-budgetmodel)); `\"bucket\"`: every bucket sends "
              '`density` x its own entries; `None`: `"model"` wherever it applies, else `"bucket"`',
        kind="choice", choices=BUDGETS, accepted='`None`, `"bucket"`, `"model"`',
        condition='`"model"` needs `selector` `"exact"` or `"chunk"`, `k_scope="bucket"`, `transport="c10d"` and an '
                  'exchange other than `"shared-mask"` (random-k and `k_scope="parameter"` fix k per parameter, the '
                  "shared mask sizes its own mask, the sampled selector and MPI's variable all-gather send counts "
                  "of their own)",
        checkpoint="always")
    transport: str = option(
        "c10d", '`"c10d"`: all-gather over the process group; `"mpi"`: MPI `Iallgatherv`, where `selector="sampled"` '
                "sends a different number of entries per rank ([mpi.md](mpi.md))", kind="choice", choices=TRANSPORTS,
        condition='`"mpi"` needs mpi4py, CPU buckets, a job started by mpiexec', checkpoint="never")
    # What a step that carried an Inf/NaN leaves in the memories: "rollback" nothing (the safe
    # default, whatever loop or scaler skips the step), "drop" its finite part (no copy).
    on_overflow: str = option(
        "rollback", 'what a step with Inf/NaN gradients leaves in the memories: nothing (`"rollback"`), or its finite '
                    'part (`"drop"`, the opt-out; [precision.md](precision.md))', kind="choice",
        choices=OVERFLOW_CHOICES, arm=False, checkpoint="never")
    # The compact wire (selector="chunk", or exact top-k with codecs): chunk length, and how
    # its indices and values are written.
    chunk_size: int = option(4096, 'chunk length of `selector="chunk"`', kind="int", low=MIN_CHUNK_SIZE,
                             high=MAX_CHUNK_SIZE, condition='with `selector="chunk"` only', checkpoint="wire")
    index_codec: str = option(
        "int32", 'how indices are written: `"rice"` Rice-coded gaps (8.5 bits at 1%), `"chunk"` 12-bit chunk-local '
                 "indices for 4096-chunks", kind="choice", choices=INDEX_CODECS,
        condition='other than `"int32"`: with `selector="exact"` or `"chunk"`', checkpoint="wire")
    value_codec: str | None = option(
        None, "how values are written: the float codecs are `value_dtype`; the quantizing ones carry a bf16 scale per "
              "chunk (per 64 entries for exact top-k); quantization error stays in the residual, exactly",
        kind="choice", choices=(None, *VALUE_CODECS), condition='the quantizing ones: with `selector="exact"` or '
                                                                '`"chunk"`', checkpoint="wire")
    # How the sparse payloads travel (the wires: sparsecomm.hooks.wires).
    exchange: str = option(
        "allgather", '`"allgather"`: every rank receives every payload ((p-1) x k entries); `"owner"` '
                     '(`selector="exact"`: top-k per range, or `"chunk"`): each rank owns a range of the bucket, sums '
                     "what the others send it, keeps an owner residual and returns its selection, about 2k entries "
                     'received whatever the world size; `"shared-index"` (exact or chunked, float values): a '
                     'rotating leader broadcasts its selection and the values are allreduced; `"shared-mask"` (exact, '
                     "float values, the job's optimizer `sparsecomm.optim.AdamS`): SCAPE's reducer, AdamS's first "
                     "moment synchronised at a per-tensor mask its owners chose one step before, "
                     'and the values are allreduced, no index bytes (SCAPE); `"auto"`: the cheapest of allgather, '
                     "owner and shared-index per bucket, modelled on `link` ([exchange.md](exchange.md))",
        kind="choice", choices=EXCHANGE_CHOICES, checkpoint="if-set")
    mask_dense_norms: bool = option(
        True, "the shared mask sends norm weights and biases whole (tensors whose name holds layernorm, layer_norm, "
              "rmsnorm, rms_norm or bias: SCAPE's default; and the parameters of normalization layers, whatever "
              "their names); `False` ranks them like the others", kind="bool",
        condition='with `exchange="shared-mask"` only', checkpoint="if-set")
    # ScaleCom's low-pass filter (Chen et al., NeurIPS 2020, Algorithm 1): the memory keeps
    # (1 - beta) of itself and takes beta of what this step left, so that the rotating
    # leader's top-k follows what the ranks' memories share rather than one rank's noise.
    leader_filter: float | None = option(
        None, "ScaleCom's low-pass filter on the error-feedback memory of the shared-index exchange: "
              "`residual = (1 - beta) residual + beta (acc - sent)`, so the rotating leader's top-k follows the "
              "ranks' common part; `None` (and 1) is plain error feedback. Below 1 the memory no longer keeps "
              "`sent + residual == acc` ([exchange.md](exchange.md#scalecoms-low-pass-filter-leader_filter))",
        accepted="`None` or a number in (0, 1]",
        condition='with `exchange="shared-index"` and `error_feedback` only; below 1 not with `verify_conservation`',
        checkpoint="if-set")
    diagnose_leader_overlap: bool = option(
        False, "measure, per bucket and step, the share of the leader's k indices that are among the top k of the "
               'sum over ranks of acc (`stats()["leader_overlap"]`); costs one dense allreduce per bucket',
        kind="bool", condition='with `exchange="shared-index"` only', checkpoint="never")
    link: str | None = option(None, "the link `exchange=\"auto\"` models (`None`: `10gbit@50us`)",
                              accepted='`None` or a link name such as `"1gbit@50us"`',
                              condition='with `exchange="auto"` only', checkpoint="if-set")
    # Ok-Topk (Li and Hoefler, PPoPP 2022): what an owner's re-selection drops goes back to the
    # senders' residuals instead of staying in the owner's.
    owner_dropped: str = option(
        "owner", "where the owner exchange keeps what an owner's re-selection drops: `\"owner\"` in the owner's owner "
                 "residual; `\"sender\"` (Ok-Topk) back in each sender's residual, its own part, so no mass stays with "
                 "another rank and the owner residual keeps only the rounding of its reply "
                 "([exchange.md](exchange.md#what-the-re-selection-drops-owner_dropped))",
        kind="choice", choices=OWNER_DROPPED_CHOICES, condition='`"sender"` with `exchange="owner"` or `"auto"` only',
        checkpoint="if-set")
    # A CRC-32C sealing every payload of the sparse all-gathers, owner messages and index
    # broadcasts, checked by every receiver before it decodes anything (off: the opt-out).
    wire_checksum: bool = option(
        True, "seal every payload of the sparse wires (all-gathers, both owner legs, the index broadcast) with a "
              "CRC-32C, checked by every receiver before decoding; a mismatch raises `WireIntegrityError` before the "
              "optimizer step ([wire.md](wire.md#integrity-wire_checksum-on-by-default)); `False` opts out",
        kind="bool", checkpoint="never")
    # With the checksum: one allreduce per step so that a fault only some receivers saw makes
    # every rank raise in the same step (off: those raise, the others apply the intact bytes).
    wire_agreement: bool = option(False, "one 8-byte allreduce per step, so that a fault only some receivers saw "
                                         "makes every rank raise in the same step", kind="bool",
                                  condition="`True` needs `wire_checksum`", checkpoint="never")

    @classmethod
    def build(cls, *, density_schedule=None, **settings) -> "TopKConfig":
        """A validated config from :class:`TopKState`'s keyword arguments (TypeError/ValueError
        naming the argument otherwise). Each simple setting is checked by its option (the
        table above); the ones that depend on others are resolved here."""
        s = dict(settings)
        specs = options(cls)
        selector = specs["selector"].check("selector", s.get("selector", cls.selector))
        value_dtype, value_codec = _resolve_value_codec(s.get("value_codec"), check_value_dtype(s.get("value_dtype")),
                                                        selector)
        density = specs["density"].check("density", s.get("density", cls.density))
        clip = s.get("local_clip_norm")
        resolved = {
            "density": density, "selector": selector, "value_dtype": value_dtype, "value_codec": value_codec,
            "local_clip_norm": None if clip is None else check_real("local_clip_norm", clip, 0.0, math.inf,
                                                                    low_open=True, high_open=True),
            "density_schedule": _resolve_schedule(density_schedule, density),
            "transport": check_transport(s.get("transport", cls.transport), selector),
            "link": _check_link(s.get("link")),
            "leader_filter": None if s.get("leader_filter") is None else check_real(
                "leader_filter", s["leader_filter"], 0.0, 1.0, low_open=True, high_open=False),
            "budget": None if s.get("budget") is None else specs["budget"].check("budget", s["budget"]),
        }
        for name, spec in specs.items():
            if name not in resolved:
                resolved[name] = spec.check(name, s.get(name, getattr(cls, name)))
        if resolved["budget"] is None:  # the model's budget wherever it applies
            resolved["budget"] = "bucket" if _model_budget_refusal(resolved) is not None else "model"
        config = cls(**resolved)
        config._check_combinations()
        return config

    @property
    def compact_wire(self) -> bool:
        """Indices or values written by a codec other than int32 + a float dtype."""
        return self.index_codec != "int32" or self.value_codec is not None

    def _check_combinations(self) -> None:
        if self.selector in ("sampled", "random") and self.index_codec != "int32":
            raise ValueError(f"index_codec={self.index_codec!r} needs selector 'exact' or 'chunk' (a payload of a "
                             f"size known to every rank), got selector={self.selector!r}")
        if self.selector != "chunk" and self.chunk_size != TopKConfig.chunk_size:
            raise ValueError(f"chunk_size={self.chunk_size} is a setting of selector='chunk' "
                             f"(got selector={self.selector!r})")
        if (self.selector == "chunk" or self.compact_wire) and self.k_scope != "bucket":
            raise ValueError(f"selector={self.selector!r} with index_codec={self.index_codec!r} and value_codec="
                             f"{self.value_codec!r} encodes whole buckets: it needs k_scope='bucket', got "
                             f"k_scope={self.k_scope!r}")
        if self.budget == "model" and _model_budget_refusal(vars(self)) is not None:
            raise ValueError(f"budget='model' moves k between the buckets, {_model_budget_refusal(vars(self))}; use "
                             "budget='bucket', or leave budget unset (then it is 'model' wherever it applies)")
        if self.link is not None and self.exchange != "auto":
            raise ValueError(f"link={self.link!r} is what exchange='auto' models to choose an exchange; with "
                             f"exchange={self.exchange!r} it would be ignored")
        if self.exchange == "auto" and self.selector == "random":
            raise ValueError("exchange='auto' chooses how a selection's payload travels; random-k always allreduces "
                             "its values: use exchange='allgather' (the default) with selector='random'")
        if self.exchange == "owner":
            if self.selector not in ("exact", "chunk"):
                raise ValueError(f"exchange='owner' sends every owner a fixed-size selection of its range, so it "
                                 f"needs selector 'exact' (top-k per range) or 'chunk', got selector={self.selector!r}")
        if self.owner_dropped != TopKConfig.owner_dropped and self.exchange not in ("owner", "auto"):
            raise ValueError(f"owner_dropped={self.owner_dropped!r} says where the owner exchange keeps what an "
                             f"owner's re-selection drops: it needs exchange='owner' or 'auto', got "
                             f"exchange={self.exchange!r}")
        if self.exchange == "shared-index":
            if self.selector not in ("exact", "chunk"):
                raise ValueError(f"exchange='shared-index' broadcasts one rank's top-k (exact or per chunk): it "
                                 f"needs selector 'exact' or 'chunk', got selector={self.selector!r}")
            if self.value_codec is not None:
                raise ValueError(f"exchange='shared-index' sums the values with an allreduce, which needs a float "
                                 f"wire: value_codec='fp32', 'bf16' or 'fp16' (or value_dtype), got "
                                 f"value_codec={self.value_codec!r}")
            if self.transport != "c10d" or self.k_scope != "bucket":
                raise ValueError(f"exchange='shared-index' needs transport='c10d' and k_scope='bucket', got "
                                 f"transport={self.transport!r}, k_scope={self.k_scope!r}")
        if self.exchange == "shared-mask":
            if self.selector != "exact" or self.value_codec is not None:
                raise ValueError(f"exchange='shared-mask' selects its own entries (the shared mask) and sums their "
                                 f"values with an allreduce: it needs selector='exact' and a float wire (value_codec "
                                 f"None, 'fp32', 'bf16' or 'fp16'), got selector={self.selector!r}, "
                                 f"value_codec={self.value_codec!r}")
            if self.transport != "c10d" or self.k_scope != "bucket":
                raise ValueError(f"exchange='shared-mask' needs transport='c10d' and k_scope='bucket' (its masks are "
                                 f"per tensor already), got transport={self.transport!r}, k_scope={self.k_scope!r}")
            if self.momentum != 0 or not self.error_feedback:
                raise ValueError(f"exchange='shared-mask' synchronises AdamS's own first moment with momentum-space "
                                 f"error feedback: it needs momentum=0 and error_feedback=True, got "
                                 f"momentum={self.momentum}, error_feedback={self.error_feedback}")
        elif self.mask_dense_norms is not TopKConfig.mask_dense_norms:
            raise ValueError(f"mask_dense_norms={self.mask_dense_norms} is a setting of exchange='shared-mask' (got "
                             f"exchange={self.exchange!r})")
        self._check_leader_settings()
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0 (it is a variant of momentum correction)")
        if self.error_feedback and self.warmup_steps < 2:
            raise ValueError(
                f"warmup_steps must be >= 2 when error_feedback=True, got {self.warmup_steps}: "
                "the first steps are reduced densely"
            )
        if self.momentum > 0 and not self.error_feedback:
            raise ValueError(f"momentum={self.momentum} (momentum correction) requires error_feedback=True")
        if self.wire_agreement and not self.wire_checksum:
            raise ValueError("wire_agreement=True agrees on what the checksum finds: it needs wire_checksum=True")
        if self.residual_dtype is not None and not self.error_feedback:
            raise ValueError(f"residual_dtype={self.residual_dtype} is the dtype of the residual and the velocity, "
                             "which error_feedback=False does not keep: leave residual_dtype None")
        if self.verify_conservation and not self.error_feedback:
            raise ValueError("verify_conservation=True requires error_feedback=True (no residual to check)")

    def _check_leader_settings(self) -> None:
        """``leader_filter`` and ``diagnose_leader_overlap`` are the shared-index exchange's."""
        for name in ("leader_filter", "diagnose_leader_overlap"):
            value = getattr(self, name)
            if value != getattr(TopKConfig, name) and self.exchange != "shared-index":
                raise ValueError(f"{name}={value!r} is a setting of exchange='shared-index' (the rotating leader's "
                                 f"index set), got exchange={self.exchange!r}")
        if self.leader_filter is not None and not self.error_feedback:
            raise ValueError(f"leader_filter={self.leader_filter} filters the error-feedback memory: it needs "
                             "error_feedback=True")
        if self.filtered_memory_beta is not None and self.verify_conservation:
            raise ValueError(f"leader_filter={self.leader_filter} (below 1) keeps (1 - beta) of the old residual and "
                             "only beta of what was not sent, so sent + residual == acc no longer holds and "
                             "verify_conservation=True would fail every step: use one of them (leader_filter None or "
                             "1 is plain error feedback, which the audit checks)")

    @property
    def filtered_memory_beta(self) -> float | None:
        """The beta of ``leader_filter`` where it changes the memory (below 1), else None."""
        beta = self.leader_filter
        return beta if beta is not None and beta < 1.0 else None

    def checkpoint_dict(self) -> dict:
        """The settings a checkpoint must match to be restored into this config (those whose
        option says so: the wire's only where it means something, so checkpoints of the other
        selectors stay as they were; not what travels, only what the memories hold)."""
        wire = self.selector == "chunk" or self.compact_wire
        saved = {}
        for name, spec in options(TopKConfig).items():
            value = getattr(self, name)
            if spec.checkpoint == "always" or (spec.checkpoint == "wire" and wire) or (
                    spec.checkpoint == "if-set" and value != getattr(TopKConfig, name)):
                saved[name] = value.to_list() if name == "density_schedule" else (
                    str(value) if isinstance(value, torch.dtype) else value)
        return saved

    def memory_dtype(self, bucket_dtype: torch.dtype) -> torch.dtype:
        """dtype of the residual and velocity of a bucket of ``bucket_dtype``."""
        if self.residual_dtype is not None:
            return self.residual_dtype
        return torch.float32 if bucket_dtype in (torch.float16, torch.bfloat16) else bucket_dtype


FIELDS = tuple(f.name for f in dataclasses.fields(TopKConfig))


def _resolve_value_codec(value_codec, value_dtype, selector: str):
    """(value_dtype, value_codec): a float codec is the same thing as a value_dtype (one of
    them may be given, or both if they agree); the quantizing codecs need selector 'exact' or
    'chunk', whose scale groups (64 entries, or a chunk) carry their scales."""
    if value_codec is None:
        return value_dtype, None
    check_choice("value_codec", value_codec, VALUE_CODECS)
    if value_codec in FLOAT_CODECS:
        if value_dtype is not None and value_dtype != FLOAT_CODECS[value_codec]:
            raise ValueError(f"value_codec={value_codec!r} and value_dtype={value_dtype} disagree; give one of them")
        return FLOAT_CODECS[value_codec], None
    if selector not in ("exact", "chunk"):
        raise ValueError(f"value_codec={value_codec!r} quantizes with a scale per group of entries: it needs "
                         f"selector 'exact' or 'chunk' (got selector={selector!r}); the others take value_codec "
                         "'fp32', 'bf16' or 'fp16'")
    if value_dtype is not None:
        raise ValueError(f"value_codec={value_codec!r} sets the wire values; value_dtype={value_dtype} must be None")
    return None, value_codec


def _check_link(link):
    """A link name the cost model reads (``sparsecomm.links.spec``), normalised; or None."""
    if link is None:
        return None
    try:
        parsed = parse_link(link)
    except ValueError as error:
        raise ValueError(f"link: {error}") from None
    if not parsed.emulated:
        raise ValueError("link='loopback' has no known rate; exchange='auto' needs one such as '1gbit@50us'")
    return parsed.name


def _resolve_schedule(spec, density: float) -> DensitySchedule:
    """``density_schedule`` argument -> DensitySchedule ending at ``density``."""
    if spec is None:
        return DensitySchedule.constant(density)
    if isinstance(spec, DensitySchedule):
        if spec.target != density:
            raise ValueError(f"density_schedule must end at density={density}, but it ends at {spec.target}")
        return spec
    if isinstance(spec, dict):
        kind = spec.get("kind")
        if kind == "exponential" and set(spec) <= {"kind", "steps", "stages"} and "steps" in spec:
            return DensitySchedule.exponential(density, spec["steps"], spec.get("stages", 4))
        if kind == "geometric" and set(spec) <= {"kind", "steps", "start"} and "steps" in spec:
            return DensitySchedule.geometric(density, spec["steps"], spec.get("start", 1.0))
        raise ValueError(
            "density_schedule as a dict must be {'kind': 'exponential', 'steps': N[, 'stages': S]} or "
            f"{{'kind': 'geometric', 'steps': N[, 'start': 1.0]}}, got {spec!r}"
        )
    if isinstance(spec, (list, tuple)):
        return DensitySchedule.piecewise(spec, density)
    raise TypeError(
        "density_schedule must be None, a DensitySchedule, {'kind': 'exponential', 'steps': N} "
        f"or a list of (first_step, density) pairs, got {type(spec).__name__}"
    )


def _model_budget_refusal(settings: dict) -> str | None:
    """Why ``budget="model"`` cannot apply to these settings (None: it can)."""
    if settings["selector"] not in ("exact", "chunk"):
        return (f"which needs selector 'exact' or 'chunk' (random-k draws a fixed k per parameter; the sampled "
                f"selector's count is its own), got selector={settings['selector']!r}")
    if settings["k_scope"] != "bucket":
        return f"which needs k_scope='bucket' (a per-parameter k is fixed), got k_scope={settings['k_scope']!r}"
    if settings["exchange"] == "shared-mask":
        return "but exchange='shared-mask' sizes every tensor's mask itself (SCAPE's per-tensor top-k)"
    if settings["transport"] != "c10d":
        return f"which needs transport='c10d' (its counts are all-reduced there), got transport={settings['transport']!r}"
    return None
