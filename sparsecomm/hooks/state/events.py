"""What the hook shows its observers (monitors, fault injectors) while it works.

Observers are called synchronously, in the hook's thread for the stages before the
collective and in the Future's callback for ``reduced``. An observer that raises aborts
the bucket before anything is sent (stages ``gradient`` and ``packed``), which is how
guards stop a corrupt payload from reaching other ranks. Observers may modify the tensors
(fault injection); they must not keep references past the call.

Stages and their tensors:

- ``gradient``: ``gradient`` = the local bucket gradient as DDP filled it (a sum over
  the local batch, not yet divided by world size).
- ``packed``: ``acc`` = grad / world_size (+ velocity) + old residual, or None when the
  fused kernel formed it without writing it (only when every observer has
  ``needs_acc = False``); ``residual`` = the new residual (None without error feedback);
  ``indices`` = what was selected (None on the dense path); ``payload`` = the bytes about
  to be sent (the dense buffer on the dense path, the values for random-k); ``values`` =
  the sent values in the wire dtype (sparse paths only).
- ``reduced``: ``reduced`` = the averaged bucket every rank receives.
"""
from dataclasses import dataclass, field

import torch

from sparsecomm.compress.layout import PayloadLayout

STAGES = ("gradient", "packed", "reduced")


@dataclass
class HookEvent:
    stage: str
    step: int
    rank: int
    bucket_index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]
    dense: bool  # True when this bucket is reduced densely (warm-up or fallback)
    tensors: dict[str, torch.Tensor | None] = field(default_factory=dict)
    layout: PayloadLayout | None = None  # of ``payload`` at the packed stage of a top-k payload
