"""Keep what was sent for parameters that no rank used: DDP drops it.

With ``find_unused_parameters=True`` (or ``static_graph=True`` with parameters that are
never used) DDP still hands the hook a bucket slot for a parameter that no rank used this
step (zeros), but afterwards leaves that parameter's ``.grad`` untouched: the reduced
values are thrown away. The hook has added the parameter's residual to those zeros and
may have sent part of it, so without a correction that error-feedback mass is lost for
good (it was taken out of the residual and never applied). DDP knows which parameters
were used by no rank only after the step (its used-parameter map is all-reduced after the
last bucket); so at the start of the next step each rank adds back into its residual what
it sent itself for such parameters. Every rank does this for its own contribution, so the
sum over ranks of (applied gradient + residual) stays the sum of the mean gradients.

Needs DDP's used-parameter map (``reducer._get_local_used_map()``, a private but long
stable DDP method); without it the hook warns when bound and goes on without the correction.
"""
import warnings

import torch


class SentRecord:
    """What this rank sent for one bucket this step: entries (indices, values) or a dense copy."""

    __slots__ = ("names", "numels", "indices", "values", "dense")

    def __init__(self, names, numels, indices=None, values=None, dense=None):
        self.names, self.numels = names, numels
        self.indices, self.values, self.dense = indices, values, dense


class UnusedParameterAccounting:
    """Gives a DDP model's globally unused parameters their sent entries back."""

    def __init__(self, ddp_model) -> None:
        params, _ = ddp_model._build_params_for_reducer()
        # DDP's used map is indexed like the reducer's parameter list. The map is fetched
        # here, once: the hook runs while DDP's reducer holds its lock, so asking the
        # reducer from inside the hook would deadlock. The tensor is DDP's own device-side
        # map, which after a backward holds how many ranks used each parameter (and is
        # rewritten only after the last bucket of the next backward).
        self._parameters = list(params)
        self._used = _used_map(ddp_model, len(self._parameters))
        self._records: dict[int, SentRecord] = {}

    @staticmethod
    def applies_to(ddp_model) -> bool:
        """Only these DDP modes can leave a parameter's reduced gradient unapplied."""
        return bool(getattr(ddp_model, "find_unused_parameters", False) or getattr(ddp_model, "static_graph", False))

    def record(self, bucket_index: int, record: SentRecord) -> None:
        self._records[bucket_index] = record

    def forget(self) -> None:
        self._records = {}

    def _unused(self) -> set[int]:
        """ids of the parameters no rank used in the last step."""
        if self._used is None:
            return set()
        return {id(p) for p, count in zip(self._parameters, self._used.tolist()) if count == 0}

    def give_back(self, residuals, param_names: dict[int, str]) -> int:
        """Add this rank's sent entries of the last step's unused parameters back to their
        residuals; returns how many parameters got something back."""
        records, self._records = self._records, {}
        if not records:
            return 0
        unused = {param_names[i] for i in self._unused() if i in param_names}
        restored = 0
        for record in records.values():
            offset = 0
            for name, numel in zip(record.names, record.numels):
                if name in unused and name in residuals:
                    _add_sent(residuals.get(name), record, offset, numel)
                    restored += 1
                offset += numel
        return restored


def _used_map(ddp_model, count: int):
    reducer = getattr(ddp_model, "reducer", None)
    fetch = getattr(reducer, "_get_local_used_map", None)
    used = fetch() if fetch is not None else None
    if used is None or not isinstance(used, torch.Tensor) or used.numel() != count:
        warnings.warn("topk_hook: this torch's DDP does not expose its used-parameter map; error feedback of "
                      "parameters that no rank used in a step is lost", stacklevel=4)
        return None
    return used


def _add_sent(residual: torch.Tensor, record: SentRecord, offset: int, numel: int) -> None:
    if record.dense is not None:
        residual.add_(record.dense[offset : offset + numel].to(residual.dtype).nan_to_num(nan=0.0, posinf=0.0,
                                                                                           neginf=0.0))
        return
    indices = record.indices.long()
    inside = (indices >= offset) & (indices < offset + numel)
    values = record.values[inside].to(residual.dtype)
    # A sent Inf/NaN (an overflow step) never enters a residual, here neither.
    values = torch.where(torch.isfinite(values), values, torch.zeros_like(values))
    residual.index_add_(0, indices[inside] - offset, values)
