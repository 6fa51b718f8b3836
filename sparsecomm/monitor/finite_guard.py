"""NaN/Inf guard inside the hook: stop a non-finite value before it is sent or kept.

A NaN or Inf in one rank's gradient is contagious: top-k selects it first (it has the
largest magnitude), the all-gather hands it to every rank, and every replica's weights
become NaN in the same optimizer step. Kept in a residual instead, it poisons every later
step of that rank. Checking the bucket at the two stages before the collective stops it
on the rank where it appeared, before anything leaves that rank.

Cost: one ``aminmax`` pass (no temporaries) over the gradient and one over the new
residual, plus the k sent values; the detailed scan that names the parameter runs only
after a hit. The guard does not need the compensated bucket ``acc``, so the hook keeps its
fused kernel (which never writes acc) while the guard watches: every entry of acc is
either sent or kept (``sent + residual == acc``, bit for bit), so a non-finite entry of
acc is in the values or in the residual. When the hook writes acc anyway (momentum, local
clipping, another observer that reads it) the guard checks it too.

Guards alone are far from sufficient: in fault-injection studies NaN/Inf is about 1% of
the outcomes of silent data corruption (docs/reliability.md, "Monitors"); most corruptions are
finite and wrong. Pair it with the digest and spike monitors.

What a rank that raises here leaves behind: its bucket was never sent, so its peers wait
in that collective until the process group's timeout (or until the raising process exits
and the transport reports the closed connection). Pair the guard with
:class:`~sparsecomm.monitor.gradient_agreement.GradientAgreementMonitor` (pass the caught
error as ``local_error``) so that every rank abandons the step, and give the DDP process
group a timeout short enough for that wait. The DDP group is unusable afterwards (one
collective half-done); stop, or roll back and rebuild the job.
"""
import math

import torch

from sparsecomm.monitor.payload_view import locate, payload_layout
from sparsecomm.monitor.errors import NonFiniteError

ACTIONS = ("raise", "record")


class FiniteGuard:
    """TopKState observer: raise :class:`NonFiniteError` on the first NaN/Inf it sees.

    Stage ``gradient``: the local gradient. Stage ``packed``: the new residual, the values
    about to be sent (the dense buffer on the dense path, the values for random-k, the
    packed values of a top-k payload, decoded with the wire dtype from ``state`` when
    given) and the compensated bucket ``acc`` (gradient/ws + old residual) when the hook
    wrote it; a NaN already in the old residual shows up in acc, else in the new residual
    or the sent values. Values narrowed to a smaller wire dtype cannot overflow to Inf (the
    hook saturates them), and with error feedback any mismatch lands in the residual,
    which is checked too.

    Usage::

        state.add_observer(FiniteGuard(state=state))

    Args:
        state: the hook's TopKState; gives the wire dtype (``state.value_dtype``), so the
            guard decodes the packed values themselves. Without it the guard checks
            ``acc[indices]`` (the values before the cast to the wire dtype), or the hook's
            record of the sent values when acc was not written, instead.
        action: ``"raise"`` (default; aborts the bucket before it is sent) or ``"record"``
            (append to :attr:`alarms` and let the hook go on, for measurements).

    Attributes:
        alarms: the errors seen in ``"record"`` mode, oldest first.
    """

    # Reads acc only when the hook wrote it: the hook keeps its fused kernel (see
    # TopKState.add_observer and the module docstring).
    needs_acc = False

    def __init__(self, *, state=None, action: str = "raise"):
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        self.state = state
        self.action = action
        self.alarms: list[NonFiniteError] = []

    def __call__(self, event) -> None:
        tensors = event.tensors
        if event.stage == "gradient":
            self._check(event, "gradient", tensors["gradient"])
        elif event.stage == "packed":
            acc = tensors["acc"]
            if acc is not None:
                self._check(event, "acc", acc)
            if tensors.get("residual") is not None:
                self._check(event, "residual", tensors["residual"])
            self._check_payload(event, tensors)

    def _check_payload(self, event, tensors) -> None:
        acc, payload, indices = tensors["acc"], tensors.get("payload"), tensors.get("indices")
        if payload is None:
            return
        if event.dense:
            if payload.data_ptr() != acc.data_ptr():  # the dense path sends acc itself
                self._check(event, "payload", payload)
            return
        if payload.is_floating_point():  # random-k: the values themselves
            values = payload
        elif self.state is not None or event.layout is not None:
            values = payload_layout(payload, acc, indices, self.state, event).values_copy(payload)[: indices.numel()]
        else:  # the values before any cast to the wire dtype, or the hook's record of them
            values = acc[indices] if acc is not None else tensors.get("values")
        if values is not None:
            self._check(event, "payload", values, positions=indices)

    def _check(self, event, tensor_name: str, tensor: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        if tensor.numel() == 0:
            return
        low, high = torch.aminmax(tensor)
        if math.isfinite(low.item()) and math.isfinite(high.item()):
            return
        bad = (~torch.isfinite(tensor)).nonzero().flatten()
        first = int(bad[0])
        flat = int(positions[first]) if positions is not None else first
        parameter, element = locate(event.names, event.numels, flat)
        value = tensor[first].item()
        error = NonFiniteError(
            "finite",
            event.step,
            (event.rank,),
            f"{bad.numel()} non-finite entr{'y' if bad.numel() == 1 else 'ies'} in {tensor_name} at stage "
            f"{event.stage!r} of bucket {event.bucket_index} on rank {event.rank}; first: {value} in "
            f"{parameter}[{element}] (flat index {flat})",
            stage=event.stage,
            bucket_index=event.bucket_index,
            tensor=tensor_name,
            parameter=parameter,
            element=element,
            count=int(bad.numel()),
        )
        if self.action == "raise":
            raise error
        self.alarms.append(error)
