"""The hook's per-rank memories inside torchtitan's DCP checkpoints.

torchtitan saves ``checkpointer.states`` with ``torch.distributed.checkpoint`` (DCP): every
rank hands in its state dict, and DCP keeps one copy of a key that several ranks hand in. The
hook's residuals differ on every rank, so its whole state goes under this process's global
rank (``sparsecomm.global_rank<g>.*``): no key is shared, none is deduplicated, and each rank
reads back exactly its own. The tensors (residuals, velocities: zeros for every module before
the first sparse step, so a fresh hook is a complete template for DCP to load into) are DCP
tensors; the rest (step, configuration, counters, the model budget's shares) is one JSON text,
because DCP loads only the entries its template already has, and a fresh hook has no shares.
A configuration that differs is refused by :meth:`sparsecomm.TopKState.load_state_dict`
naming both values (``strict_load=False``: residuals reset, with a warning).
"""
import json

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from sparsecomm.hooks.topk import TopKState

STATES_KEY = "sparsecomm"
"""The hook's entry in ``checkpointer.states`` (``--checkpoint.exclude_from_loading sparsecomm``
resumes a checkpoint with the hook started afresh)."""


class HookCheckpoint(Stateful):
    """``state`` as one entry of torchtitan's checkpoint states."""

    def __init__(self, state: TopKState, strict: bool = True):
        self.state, self.strict = state, strict

    def _key(self) -> str:
        return f"global_rank{dist.get_rank()}"

    def state_dict(self) -> dict:
        full = self.state.state_dict()  # refused while a hook collective is in flight
        tensors = {key: value for key, value in full.items() if isinstance(value, torch.Tensor)}
        rest = {key: value for key, value in full.items() if not isinstance(value, torch.Tensor)}
        return {self._key(): {"tensors": tensors, "rest": json.dumps(rest, sort_keys=True)}}

    def load_state_dict(self, state_dict: dict) -> None:
        mine = state_dict.get(self._key())
        if mine is None:
            raise ValueError(f"the checkpoint's sparsecomm state has no entry for this process ({self._key()}); "
                             f"it holds {sorted(state_dict)}: it was saved with another number of processes")
        rest = json.loads(mine["rest"])
        self.state.load_state_dict({**rest, **mine["tensors"]}, strict=self.strict)
