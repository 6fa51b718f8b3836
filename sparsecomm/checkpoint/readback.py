"""Read a rank file the one way a load reads it, and prove at save time that it does.

``torch.save`` pickles anything, but ``torch.load(weights_only=True)`` (what every load
uses: it executes no code from the file) refuses types outside its allow-list, such as
a NumPy integer in ``data_position``. A file holding one would commit and then never
load, so the save reads every file back with :func:`read_rank_file` before the commit and
names the key that does not load.
"""
import hashlib
import io
from pathlib import Path

import torch

from sparsecomm.checkpoint.errors import CheckpointCorrupt
from sparsecomm.checkpoint.structure import tensor_digests


def _load(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def read_rank_file(path: Path, entry: dict) -> dict:
    """The payload in ``path``, after its bytes matched ``entry["sha256"]`` (a manifest entry,
    with per-tensor digests under ``"tensors"``). Raises CheckpointCorrupt."""
    data = Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointCorrupt(f"{path}: SHA-256 differs from the manifest" + _changed_tensors(data, entry))
    try:
        return _load(data)
    except Exception as exc:  # the digest matched, so the file was written like this
        raise CheckpointCorrupt(f"{path} does not load with torch.load(weights_only=True): "
                                f"{type(exc).__name__}: {str(exc)[:300]}") from exc


def check_reads_back(path: Path, entry: dict, payload: dict) -> None:
    """Raise CheckpointCorrupt unless ``path`` holds the bytes written (SHA-256) and they load
    as a load will read them. (Equal bytes load to equal tensors: no need to compare those.)"""
    try:
        read_rank_file(path, entry)
    except CheckpointCorrupt as exc:
        key = unloadable_key(payload)
        if key is None:
            raise
        raise CheckpointCorrupt(f"{path} would never load (torch.load(weights_only=True) refuses it): "
                                f"{key[0]} holds a {key[1]}; store ints, floats, strings, lists, dicts "
                                "or tensors there") from exc


def _loads(value) -> bool:
    buffer = io.BytesIO()
    torch.save({"value": value}, buffer)
    try:
        _load(buffer.getvalue())
        return True
    except Exception:
        return False


def unloadable_key(obj, prefix: str = "") -> tuple[str, str] | None:
    """(path, type) of the smallest part of ``obj`` that weights_only loading refuses, or None."""
    if _loads(obj):
        return None
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in children:
        found = unloadable_key(value, f"{prefix}/{key}" if prefix else str(key))
        if found is not None:
            return found
    return prefix or "<top level>", f"{type(obj).__module__}.{type(obj).__qualname__}"


def _changed_tensors(data: bytes, entry: dict) -> str:
    """Name the tensors whose bytes changed, when the file still loads (else say it does not)."""
    try:
        now = tensor_digests(_load(data))
    except Exception as exc:  # truncated or garbled: the file itself is the finding
        return f" (file does not load: {type(exc).__name__})"
    changed = sorted(k for k, d in entry["tensors"].items() if now.get(k) != d)
    return f" (changed tensors: {changed[:5]})" if changed else ""
