"""The hook's per-rank memories, keyed by parameter name, and the names that key them.

* :class:`ParameterNames`: a bound module's parameter names, or, unbound, ``param0``,
  ``param1``, ... in the order the hook first sees the parameters.
* :class:`ParameterMemory`: per-parameter tensors keyed by name. DDP rebuilds its buckets after
  the first iteration, and a user may change ``bucket_cap_mb``: state keyed by
  ``bucket.index()`` would then be applied to the wrong parameters. Here every entry belongs to a
  parameter name. For speed the entries of one bucket live in one flat tensor laid out like the
  bucket buffer, so the hook adds and updates a whole bucket in single tensor ops; a per-name
  view into that flat tensor is the entry itself. When a bucket's layout changes, a new flat
  tensor is built and each name's values are copied over: allocation happens only then, never
  on an ordinary step.
* :class:`HookMemories`: the error-feedback residuals, the momentum-correction velocities, the
  owner exchange's second-level residuals and the shared-mask exchange's next mask (the
  same on every rank: ``wires/shared_mask.py``), each a :class:`ParameterMemory`, and the
  float32 scratch in which a 16-bit bucket's acc is formed.
"""

import torch
import torch.distributed as dist


# Normalization layers, whatever their names (the shared mask sends their parameters whole).
NORM_LAYERS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.LocalResponseNorm, torch.nn.RMSNorm,
               torch.nn.modules.batchnorm._NormBase)


class ParameterNames:
    """Which name every parameter of this process has (by ``id``: ids belong to the process,
    so a pickle keeps only whether the names came from a module)."""

    __slots__ = ("by_id", "shapes", "module_id", "from_module", "of_norms")

    def __init__(self):
        self.by_id: dict[int, str] = {}  # id(parameter) -> name
        self.shapes: dict[str, tuple[int, torch.dtype]] = {}  # name -> (numel, dtype) of the bound module's
        self.module_id: int | None = None  # id of the module the names came from, None if unbound
        self.from_module = False  # True once names came from a module (an unpickled state must be re-bound)
        self.of_norms: frozenset[str] = frozenset()  # names of the parameters of normalization layers

    def bind(self, inner: torch.nn.Module) -> None:
        """Take the names of ``inner`` (the module a DDP model wraps)."""
        self.module_id = id(inner)
        self.from_module = True
        self.by_id = {id(p): name for name, p in inner.named_parameters()}
        self.shapes = {name: (p.numel(), p.dtype) for name, p in inner.named_parameters()}
        by_id = self.by_id
        self.of_norms = frozenset(by_id[id(p)] for module in inner.modules() if isinstance(module, NORM_LAYERS)
                                  for p in module.parameters(recurse=False) if id(p) in by_id)

    def bind_placeholders(self, owner: torch.nn.Module, placeholders: dict[str, tuple[torch.Tensor, torch.dtype]]) -> None:
        """Name buffers that are not parameters (FSDP2's per-module shard buffers,
        :mod:`sparsecomm.fsdp`): each is stood for by a placeholder tensor of its size, which
        the bucket lists as its one parameter; ``owner`` is the model they belong to."""
        if self.module_id is not None or self.by_id:
            raise ValueError("this TopKState is already bound to a module or has run: use a new TopKState")
        self.module_id = id(owner)
        self.from_module = True
        self.by_id = {id(tensor): name for name, (tensor, _) in placeholders.items()}
        self.shapes = {name: (tensor.numel(), dtype) for name, (tensor, dtype) in placeholders.items()}

    def forget_process(self) -> None:
        """What a pickle keeps: ids and the module belong to this process."""
        self.by_id, self.module_id = {}, None

    def of_bucket(self, bucket: dist.GradBucket) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(names, numels) of the bucket's parameters, in bucket order."""
        names, numels = [], []
        for param in bucket.parameters():
            name = self.by_id.get(id(param))
            if name is None:
                if self.module_id is not None:
                    raise ValueError(
                        "the hook saw a parameter that is not in the module bound to this "
                        "TopKState: register the state on the DDP model it was bound to"
                    )
                if self.from_module:
                    raise ValueError(
                        "this TopKState was unpickled (or copied) from a state bound to a model: bind it to "
                        "this process's model first, with state.bind(ddp_model) or "
                        "sparsecomm.register_topk_hook(ddp_model, state), so its residuals find their parameters"
                    )
                name = self.by_id[id(param)] = f"param{len(self.by_id)}"
            names.append(name)
            numels.append(param.numel())
        return tuple(names), tuple(numels)


class ParameterMemory:
    """Named per-parameter tensors, stored bucket-contiguously."""

    def __init__(self) -> None:
        # name -> 1-D view holding that parameter's entries (the authoritative copy)
        self._entries: dict[str, torch.Tensor] = {}
        # bucket index -> (names in bucket order, their sizes, flat tensor the views live in)
        self._flat: dict[int, tuple[tuple[str, ...], tuple[int, ...], torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> torch.Tensor:
        return self._entries[name]

    def bucket_tensor(
        self, bucket_index: int, names: tuple[str, ...], numels: tuple[int, ...], like: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The flat tensor for a bucket holding ``names`` (sizes ``numels``), shaped like ``like``
        (in ``dtype`` if given).

        Entries not seen before start at zero. Reuses the existing flat tensor when the
        bucket's layout, dtype and device are unchanged.
        """
        dtype = like.dtype if dtype is None else dtype
        cached = self._flat.get(bucket_index)
        if (
            cached is not None
            and cached[:2] == (names, numels)
            and cached[2].dtype == dtype
            and cached[2].device == like.device
        ):
            return cached[2]
        if sum(numels) != like.numel():
            raise ValueError(
                f"bucket {bucket_index}: parameters hold {sum(numels)} elements but the bucket "
                f"buffer has {like.numel()}; the bucket layout is not the parameters laid end to end"
            )
        flat = torch.zeros_like(like, dtype=dtype)
        for name, view in zip(names, flat.split(numels)):
            previous = self._entries.get(name)
            if previous is not None:
                if previous.numel() != view.numel():
                    raise ValueError(
                        f"parameter {name!r} has {view.numel()} elements but its stored entry has "
                        f"{previous.numel()}: the state does not belong to this model"
                    )
                view.copy_(previous)
            self._entries[name] = view
        # Other buckets that held any of these names no longer own them: drop them, so a
        # later return to their old layout rebuilds from the entries instead of reusing a
        # flat tensor whose views are no longer the authoritative copies.
        moved = set(names)
        for index in [i for i, (held, _, _) in self._flat.items() if moved.intersection(held)]:
            del self._flat[index]
        self._flat[bucket_index] = (names, numels, flat)
        return flat

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every entry, by parameter name."""
        return {name: entry.detach().clone() for name, entry in sorted(self._entries.items())}

    def load_state_dict(self, entries: dict[str, torch.Tensor]) -> None:
        """Replace all entries; flat bucket tensors are rebuilt on next use."""
        self._entries = {name: t.detach().clone().reshape(-1) for name, t in entries.items()}
        self._flat = {}

    def scale_(self, factor: float) -> None:
        """Multiply every entry by ``factor`` in place (one pass per bucket tensor)."""
        in_flat = set()
        for names, _, flat in self._flat.values():
            flat.mul_(factor)
            in_flat.update(names)
        for name, entry in self._entries.items():
            if name not in in_flat:  # loaded, not yet used by a bucket
                entry.mul_(factor)

    def clear(self) -> None:
        self._entries = {}
        self._flat = {}


class HookMemories:
    __slots__ = ("residuals", "velocities", "owner_residuals", "masks", "owner_ranges", "scratch")

    def __init__(self):
        self.residuals = ParameterMemory()  # error feedback
        self.velocities = ParameterMemory()  # momentum correction (DGC)
        self.owner_residuals = ParameterMemory()  # exchange="owner": what an owner did not send on
        self.masks = ParameterMemory()  # exchange="shared-mask": the next step's mask (0/1, the same on every rank)
        # bucket index -> (names, numels, owned range, world size) the owner memory is folded for
        self.owner_ranges: dict[int, tuple] = {}
        self.scratch = None  # float32 scratch of the largest 16-bit bucket (wide memories), or None

    def all(self) -> tuple[ParameterMemory, ...]:
        """The memories that hold gradients, in the grad scaler's units (not the masks)."""
        return self.residuals, self.velocities, self.owner_residuals

    def clear(self) -> None:
        for memory in (*self.all(), self.masks):
            memory.clear()
        self.owner_ranges = {}

    def scale_(self, factor: float) -> None:
        for memory in self.all():
            memory.scale_(factor)

    def wide_copy(self, buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``buffer`` converted to ``dtype`` in the shared scratch (used within one hook call only)."""
        scratch = self.scratch
        if scratch is None or scratch.numel() < buffer.numel() or scratch.dtype != dtype or scratch.device != buffer.device:
            size = max(buffer.numel(), 0 if scratch is None else scratch.numel())
            self.scratch = torch.empty(size, dtype=dtype, device=buffer.device)
        wide = self.scratch[: buffer.numel()]
        wide.copy_(buffer)
        return wide
