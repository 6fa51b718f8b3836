"""The ``sparsecomm`` section of a torchtitan job's config: the top-k hook on the replica
dimension, switched on and set from the command line or a config function
(``--sparsecomm.enable --sparsecomm.density 0.035 --sparsecomm.index_codec rice ...``).

The defaults are :class:`sparsecomm.TopKState`'s, read from its signature (written once), except
four, chosen for a torchtitan job (docs/torchtitan.md, "Measured"):

- ``momentum`` "auto", as in every framework integration (the hook's momentum correction takes
  over AdamW's first moment);
- ``density`` 0.2 with ``index_codec`` "rice" and ``value_codec`` "int2": on torchtitan's llama3
  debug model with its own AdamW, the setting measured to hold (every seed of 3 ahead of dense
  after 200 steps, 4.7% of dense's bytes across replicas); 3.5% fell 0.21-0.24 behind, 1% (the
  hook's default) further.
Every value is checked when the config is built (a bad one names ``--sparsecomm.<field>`` and
the accepted range), before torchtitan starts any process group.
"""
import inspect
from dataclasses import dataclass, fields

from sparsecomm.hooks.momentum_handover import AUTO
from sparsecomm.hooks.topk_state import TopKState
from sparsecomm.integrations.common import check_state_options

OWNER = "sparsecomm.integrations.torchtitan"


def _topk_default(name: str):
    return inspect.signature(TopKState.__init__).parameters[name].default


@dataclass(kw_only=True, slots=True)
class SparseCommOptions:
    """The top-k hook on torchtitan's replica dimension (``dp_replicate``)."""

    enable: bool = False
    """Reduce gradients across replicas with sparsecomm's top-k + error feedback (needs
    --parallelism.data_parallel_replicate_degree > 1)."""

    density: float = 0.2
    """Fraction of each FSDP module's shard sent per step, in (0, 1] (module docstring: why 0.2)."""

    index_codec: str = "rice"
    """How indices travel: int32, chunk, rice (docs/wire.md)."""

    value_codec: str | None = "int2"
    """How values travel: None (the gradient's dtype), fp32, bf16, fp16, fp8, int8, int4, int2, sign."""

    exchange: str = _topk_default("exchange")
    """allgather, owner, shared-index, auto (docs/exchange.md; shared-mask is DDP only)."""

    selector: str = _topk_default("selector")
    """exact, chunk, sampled, random."""

    budget: str | None = _topk_default("budget")
    """None (the hook's default for FSDP modules: "model", one top-k budget shared by the
    modules) or "bucket" (each module its own density)."""

    warmup_steps: int = _topk_default("warmup_steps")
    """Dense steps at the start (>= 0)."""

    momentum: str = AUTO
    """"auto": the hook's momentum correction takes over AdamW's betas[0] (set to 0 in the
    optimizer); a number in [0, 1): that momentum correction; "0": plain error feedback, the
    optimizer left as it is."""

    strict_load: bool = True
    """Refuse a checkpoint whose hook state is from another mesh or configuration (False:
    reset the residuals with a warning)."""

    def __post_init__(self) -> None:
        self.state_options()  # raises naming the field

    def state_options(self) -> dict:
        """The TopKState keyword arguments these options stand for (checked)."""
        options = {f.name: getattr(self, f.name) for f in fields(self)
                   if f.name not in ("enable", "strict_load", "momentum")}
        if self.budget is None:
            options.pop("budget")
        options["momentum"] = self._momentum()
        try:
            return check_state_options(OWNER, options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"--sparsecomm: {error}") from None

    def _momentum(self):
        if self.momentum == AUTO:
            return AUTO
        try:
            value = float(self.momentum)
        except (TypeError, ValueError):
            value = None
        if value is None or not 0.0 <= value < 1.0:
            raise ValueError(f"--sparsecomm.momentum must be {AUTO!r} or a number in [0, 1), got {self.momentum!r}")
        return value
