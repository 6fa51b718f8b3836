"""What a checkpoint holds on disk, and the structural checks of what is read back.

Layout under ``root`` (a directory every rank can see: one host, or a shared file system)::

    root/step-00000040/rank0.pt, rank1.pt, ...   one file per rank (torch.save)
    root/step-00000040/manifest.json             inside the directory before it is renamed
                                                 into place: its presence marks a commit
    root/.tmp-step-00000040-<token>-<pid>-<host>/    a save in progress (readers ignore it)
    root/.trash-step-00000040-<token>-<pid>-<host>/  a directory being deleted
    root/corrupt-step-00000040/                  a checkpoint a load skipped (kept for a person)

Nothing read from disk is trusted: a manifest or a rank file may be truncated, edited or
written by another version, so every field is checked for presence and type before it is
used, and a problem raises :class:`CheckpointCorrupt` naming the file and the field.
"""
import hashlib
import re
from pathlib import Path

import torch

from sparsecomm.checkpoint.errors import CheckpointCorrupt, CheckpointMismatch

MANIFEST = "manifest.json"
FORMAT = 2  # 2: rank files record the classes of optimizer, scheduler and hook state


def step_directory(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


# ASCII digits only: str.isdigit() and int() also take "²" or "٩٩", which name no step a save writes.
_STEP_NAME = re.compile(r"step-([0-9]+)")


def committed_steps(root: Path, directory=step_directory) -> list[int]:
    """Steps with a committed checkpoint (manifest present), oldest first: the folders named
    exactly as ``directory(root, step)`` names them (any other name under ``root``, a
    temporary, a trash or a stray folder, is not a checkpoint)."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for path in root.glob("step-*"):
        match = _STEP_NAME.fullmatch(path.name)
        if match and path == directory(root, int(match.group(1))) and (path / MANIFEST).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_digests(obj, prefix: str = "") -> dict[str, str]:
    """SHA-256 of every tensor in a nested structure, keyed by its path."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = hashlib.sha256(tensor_bytes(obj)).hexdigest()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.update(tensor_digests(value, f"{prefix}/{key}" if prefix else str(key)))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(tensor_digests(value, f"{prefix}/{i}"))
    return out


def non_finite(obj, prefix: str = "") -> list[str]:
    """Paths of the floating tensors in a nested structure that hold Inf or NaN."""
    if isinstance(obj, torch.Tensor):
        return [prefix] if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in non_finite(v, f"{prefix}/{k}" if prefix else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in non_finite(v, f"{prefix}/{i}")]
    return []


def state_dict_sha256(state_dict: dict) -> str:
    """SHA-256 over every entry's bytes, in name order: equal iff replicas are equal."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state_dict.items()):
        digest.update(name.encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()


def parameter_sha256(module: torch.nn.Module) -> str:
    return state_dict_sha256(module.state_dict())


def class_name(obj) -> str | None:
    return None if obj is None else type(obj).__qualname__


# ----- checks of what was read back ------------------------------------------------------

def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_field(container: dict, key: str, check, expected: str, where: str) -> None:
    if key not in container:
        raise CheckpointCorrupt(f"{where} has no {key!r} ({expected} expected)")
    if not check(container[key]):
        raise CheckpointCorrupt(f"{where}: {key!r} must be {expected}, got {type(container[key]).__name__} "
                                f"{container[key]!r:.80}")


def _check_format(container: dict, where: str) -> None:
    """A missing or garbled format is corruption; another version's format is a mismatch."""
    require_field(container, "format", is_int, "an integer", where)
    if container["format"] != FORMAT:
        raise CheckpointMismatch(f"{where} is of checkpoint format {container['format']}; this version reads "
                                 f"format {FORMAT}")


def check_manifest(manifest, path: Path, step: int) -> None:
    """Refuse a manifest that is not what :meth:`CheckpointManager.save` writes."""
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"{path} must hold a JSON object, got a JSON {type(manifest).__name__}")
    _check_format(manifest, str(path))
    require_field(manifest, "step", is_int, "an integer", str(path))
    if manifest["step"] != step:
        raise CheckpointCorrupt(f"{path} says step {manifest['step']}, its directory is step {step}")
    require_field(manifest, "world_size", lambda v: is_int(v) and v >= 1, "an integer >= 1", str(path))
    require_field(manifest, "config_hash", lambda v: isinstance(v, str), "a string", str(path))
    require_field(manifest, "param_digest", lambda v: isinstance(v, str), "a string", str(path))
    require_field(manifest, "probe_loss", lambda v: v is None or _is_number(v), "a number or null", str(path))
    require_field(manifest, "files", lambda v: isinstance(v, dict) and v, "a non-empty object", str(path))
    for name, entry in manifest["files"].items():
        where = f"{path} files[{name!r}]"
        if not isinstance(entry, dict):
            raise CheckpointCorrupt(f"{where} must be an object, got {type(entry).__name__}")
        require_field(entry, "rank", lambda v: is_int(v) and v >= 0, "an integer >= 0", where)
        require_field(entry, "sha256", lambda v: isinstance(v, str) and len(v) == 64, "a SHA-256 hex string", where)
        require_field(entry, "bytes", lambda v: is_int(v) and v >= 0, "an integer >= 0", where)
        require_field(entry, "tensors", lambda v: isinstance(v, dict), "an object", where)
        if name != f"rank{entry['rank']}.pt":
            raise CheckpointCorrupt(f"{where} says it is rank {entry['rank']}'s file")


_PAYLOAD_FIELDS = {
    "format": (is_int, "an integer"),
    "step": (is_int, "an integer"),
    "rank": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "world_size": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "config_hash": (lambda v: isinstance(v, str), "a string"),
    "classes": (lambda v: isinstance(v, dict), "a dict"),
    "model": (lambda v: isinstance(v, dict), "a dict"),
    "optimizer": (lambda v: isinstance(v, dict) and isinstance(v.get("state"), dict)
                  and isinstance(v.get("param_groups"), list), "an optimizer state dict"),
    "scheduler": (lambda v: v is None or isinstance(v, dict), "a dict or None"),
    "rng": (lambda v: isinstance(v, dict), "a dict"),
    "data_position": (lambda v: isinstance(v, dict), "a dict"),
    "hook": (lambda v: v is None or isinstance(v, dict), "a dict or None"),
    "ledger": (lambda v: isinstance(v, dict), "a dict"),
}


def check_payload(payload, path: Path) -> None:
    """Refuse a rank file whose contents are not what a save writes."""
    if not isinstance(payload, dict):
        raise CheckpointCorrupt(f"{path} must hold a dict, got {type(payload).__name__}")
    _check_format(payload, str(path))
    for key, (check, expected) in _PAYLOAD_FIELDS.items():
        require_field(payload, key, check, expected, str(path))
    bad = [k for k, v in payload["model"].items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointCorrupt(f"{path}: model entries must be tensors keyed by name (first bad: {bad[:3]!r})")
