"""Per-parameter tensors (error-feedback residuals, velocities) keyed by parameter name.

DDP rebuilds its buckets after the first iteration, and a user may change
``bucket_cap_mb``: state keyed by ``bucket.index()`` would then be applied to the wrong
parameters. Here every entry belongs to a parameter name. For speed the entries of one
bucket live in one flat tensor laid out like the bucket buffer, so the hook adds and
updates a whole bucket in single tensor ops; a per-name view into that flat tensor is the
entry itself. When a bucket's layout changes, a new flat tensor is built and each name's
values are copied over: allocation happens only then, never on an ordinary step.
"""
import torch


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
