"""The top-k hook's settings: one frozen, validated object (``TopKState.config``).

Every setting is checked here, when the state is built, so that bad input fails with an
error naming the argument and the accepted range before DDP issues any collective. The
object never changes afterwards: a state that should behave differently is a new state.
"""
import dataclasses
import math

import torch

from sparsecomm.compress.chunking import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.value_codecs import FLOAT_CODECS, VALUE_CODECS
from sparsecomm.hooks.density_schedule import DensitySchedule
from sparsecomm.links.spec import parse_link
from sparsecomm.hooks.validation import (
    check_bool,
    check_choice,
    check_int,
    check_real,
    check_transport,
    check_value_dtype,
)

SELECTOR_CHOICES = ("exact", "sampled", "random", "chunk")
K_SCOPES = ("bucket", "parameter")
OVERFLOW_CHOICES = ("rollback", "drop")
EXCHANGE_CHOICES = ("allgather", "owner", "shared-index", "auto")


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """What :func:`sparsecomm.topk_hook` does; see :class:`sparsecomm.TopKState` for each field."""

    # Hyperparameters users tune.
    density: float = 0.01
    error_feedback: bool = True
    momentum: float = 0.0
    nesterov: bool = False
    local_clip_norm: float | None = None
    warmup_steps: int = 2
    selector: str = "exact"
    value_dtype: torch.dtype | None = None
    residual_dtype: torch.dtype | None = None  # None: float32 for 16-bit buckets, the bucket's dtype otherwise
    seed: int = 0
    density_schedule: DensitySchedule | None = None  # density by step, ending at `density`
    # Switches.
    allow_dense_fallback: bool = True
    verify_conservation: bool = False
    k_scope: str = "bucket"
    transport: str = "c10d"  # "c10d" | "mpi": who all-gathers the sparse payloads
    # What a step that carried an Inf/NaN leaves in the memories: "rollback" nothing (the safe
    # default, whatever loop or scaler skips the step), "drop" its finite part (no copy).
    on_overflow: str = "rollback"
    # The wire of selector="chunk": chunk length, and how its indices and values are written.
    chunk_size: int = 4096
    index_codec: str = "int32"
    value_codec: str | None = None  # a quantizing codec; the float ones are value_dtype
    # How the sparse payloads travel: every rank's to every rank, or through range owners.
    exchange: str = "allgather"
    link: str | None = None  # exchange="auto": the link it models, e.g. "1gbit@50us" (None: 10gbit@50us)
    # A CRC-32C sealing every payload of the sparse all-gathers, owner messages and index
    # broadcasts, checked by every receiver before it decodes anything (off: the opt-out).
    wire_checksum: bool = True
    # With the checksum: one allreduce per step so that a fault only some receivers saw makes
    # every rank raise in the same step (off: those raise, the others apply the intact bytes).
    wire_agreement: bool = False

    @classmethod
    def build(cls, *, density_schedule=None, **settings) -> "TopKConfig":
        """A validated config from :class:`TopKState`'s keyword arguments (TypeError/ValueError
        naming the argument otherwise)."""
        s = dict(settings)
        selector = check_choice("selector", s.get("selector", cls.selector), SELECTOR_CHOICES)
        value_dtype, value_codec = _resolve_value_codec(s.get("value_codec"), check_value_dtype(s.get("value_dtype")),
                                                        selector)
        density = check_real("density", s.get("density", cls.density), 0.0, 1.0, low_open=True, high_open=False)
        clip = s.get("local_clip_norm")
        config = cls(
            density=density,
            error_feedback=check_bool("error_feedback", s.get("error_feedback", cls.error_feedback)),
            momentum=check_real("momentum", s.get("momentum", cls.momentum), 0.0, 1.0, low_open=False,
                                high_open=True),
            nesterov=check_bool("nesterov", s.get("nesterov", cls.nesterov)),
            local_clip_norm=None if clip is None else check_real("local_clip_norm", clip, 0.0, math.inf,
                                                                 low_open=True, high_open=True),
            warmup_steps=check_int("warmup_steps", s.get("warmup_steps", cls.warmup_steps), 0),
            selector=selector,
            value_dtype=value_dtype,
            residual_dtype=check_value_dtype(s.get("residual_dtype"), name="residual_dtype"),
            seed=check_int("seed", s.get("seed", cls.seed), 0),
            density_schedule=_resolve_schedule(density_schedule, density),
            allow_dense_fallback=check_bool("allow_dense_fallback", s.get("allow_dense_fallback", True)),
            verify_conservation=check_bool("verify_conservation", s.get("verify_conservation", False)),
            k_scope=check_choice("k_scope", s.get("k_scope", cls.k_scope), K_SCOPES),
            transport=check_transport(s.get("transport", cls.transport),
                                      check_choice("selector", s.get("selector", cls.selector), SELECTOR_CHOICES)),
            on_overflow=check_choice("on_overflow", s.get("on_overflow", cls.on_overflow), OVERFLOW_CHOICES),
            chunk_size=check_int("chunk_size", s.get("chunk_size", cls.chunk_size), MIN_CHUNK_SIZE, MAX_CHUNK_SIZE),
            index_codec=check_choice("index_codec", s.get("index_codec", cls.index_codec), INDEX_CODECS),
            value_codec=value_codec,
            exchange=check_choice("exchange", s.get("exchange", cls.exchange), EXCHANGE_CHOICES),
            link=_check_link(s.get("link")),
            wire_checksum=check_bool("wire_checksum", s.get("wire_checksum", cls.wire_checksum)),
            wire_agreement=check_bool("wire_agreement", s.get("wire_agreement", cls.wire_agreement)),
        )
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
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0 (it is a variant of momentum correction)")
        if self.error_feedback and self.warmup_steps < 2:
            raise ValueError(
                f"warmup_steps must be >= 2 when error_feedback=True, got {self.warmup_steps}: "
                "DDP rebuilds its buckets after the first iteration, so the hook reduces "
                "densely until then"
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

    def checkpoint_dict(self) -> dict:
        """The settings a checkpoint must match to be restored into this config."""
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
            # Only where they mean something, so checkpoints of the other selectors stay as they were.
            **({"chunk_size": self.chunk_size, "index_codec": self.index_codec, "value_codec": self.value_codec}
               if self.selector == "chunk" or self.compact_wire else {}),
            **({"exchange": self.exchange} if self.exchange != TopKConfig.exchange else {}),
            **({"link": self.link} if self.link is not None else {}),
            # Not wire_checksum, wire_agreement: they change what travels, not what the memories hold.
        }

    def memory_dtype(self, bucket_dtype: torch.dtype) -> torch.dtype:
        """dtype of the residual and velocity of a bucket of ``bucket_dtype``."""
        if self.residual_dtype is not None:
            return self.residual_dtype
        return torch.float32 if bucket_dtype in (torch.float16, torch.bfloat16) else bucket_dtype


FIELDS = tuple(f.name for f in dataclasses.fields(TopKConfig))


def _resolve_value_codec(value_codec, value_dtype, selector: str):
    """(value_dtype, value_codec): a float codec is the same thing as a value_dtype (one of
    them may be given, or both if they agree); the quantizing codecs need selector='chunk',
    whose chunks carry their scales."""
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
