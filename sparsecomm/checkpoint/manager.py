"""Checkpoints that capture one consistent cut of a DDP job, verified beyond a checksum.

Layout under ``root`` (a directory every rank can see: one host, or a shared file system)::

    root/step-00000040/rank0.pt, rank1.pt, ...   one file per rank (torch.save)
    root/step-00000040/manifest.json             written last: the commit marker
    root/.tmp-step-00000040-<token>/             a save in progress (ignored by readers)

What a rank file holds: model, optimizer, LR scheduler, every RNG (python, numpy, torch,
CUDA, owned generators), the data position, the hook state with this rank's residuals
under rank-qualified keys, ledger counters, step, rank, world size and config hash.

Saving (collective: every rank calls :meth:`CheckpointManager.save` at the same step):

1. refuse unless this is a step boundary: no hook collective in flight, and the step
   counters of hook, optimizer, scheduler and data position agree with ``step``;
2. serialise, write to the temporary directory, fsync, read back and compare SHA-256
   (verify on write);
3. rank 0 gathers every rank's file digest, per-tensor digests and semantic
   fingerprints: the parameter digest must be identical on all ranks (DDP replicas),
   every tensor finite, the loss of a fixed probe batch identical on all ranks;
4. rank 0 writes the manifest, fsyncs, renames the directory into place and fsyncs the
   root; only then are checkpoints beyond ``keep`` removed, so the previous verified
   checkpoint survives until the new one has passed;
5. every rank learns the outcome; any failure raises on every rank (no hang, no partial
   commit).

Loading verifies the manifest, every file's SHA-256 and, after restoring, the parameter
digest and the probe loss (reproduced exactly on deterministic CPU). Strict by default: a
world-size or config mismatch, a missing shard or a corrupt file raises naming file,
rank and both values. Lenient (``strict=False``) loads what is replicated from rank 0's
file when this rank's file is missing, and resets error-feedback residuals with a warning
(``residual_reset`` in the returned info, for the ledger).
"""
import hashlib
import io
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from sparsecomm.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointRefused,
    NoCheckpoint,
)
from sparsecomm.checkpoint.files import commit_directory, sha256_file, write_durably, write_json_durably
from sparsecomm.checkpoint.rng import capture_rng, restore_rng

MANIFEST = "manifest.json"
FORMAT = 1


def step_directory(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed checkpoint (manifest present), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for path in root.glob("step-*"):
        if (path / MANIFEST).is_file() and path.name[5:].isdigit():
            steps.append(int(path.name[5:]))
    return sorted(steps)


def tensor_digests(obj, prefix: str = "") -> dict[str, str]:
    """SHA-256 of every tensor in a nested structure, keyed by its path."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = hashlib.sha256(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.update(tensor_digests(value, f"{prefix}/{key}" if prefix else str(key)))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(tensor_digests(value, f"{prefix}/{i}"))
    return out


def _non_finite(obj, prefix: str = "") -> list[str]:
    if isinstance(obj, torch.Tensor):
        return [prefix] if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _non_finite(v, f"{prefix}/{k}" if prefix else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in _non_finite(v, f"{prefix}/{i}")]
    return []


def parameter_sha256(module: torch.nn.Module) -> str:
    """SHA-256 over every parameter's bytes, in name order: equal iff replicas are equal."""
    digest = hashlib.sha256()
    for name, param in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class LoadedCheckpoint:
    step: int
    path: Path
    data_position: dict
    ledger: dict
    residual_reset: bool = False
    rng_restored: bool = True
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)


class CheckpointManager:
    """Saves and restores the whole training state of one rank, collectively.

    Args:
        root: directory of checkpoints (shared by all ranks).
        model: the DDP model or its module (replicated across ranks).
        optimizer, scheduler: restored with the model (scheduler may be None).
        hook_state: a :class:`~sparsecomm.hooks.TopKState` (or None for dense jobs).
        generators: project-owned ``torch.Generator`` objects by name.
        probe: ``probe(module) -> float``, the loss of a fixed probe batch; recorded at
            save and reproduced at load (None disables this check).
        config_hash: identifies the configuration; a different one is refused on load.
        keep: committed checkpoints kept (older ones are deleted after a verified save).
    """

    def __init__(self, root, *, model, optimizer, scheduler=None, hook_state=None,
                 generators: dict[str, torch.Generator] | None = None,
                 probe: Callable[[torch.nn.Module], float] | None = None,
                 config_hash: str = "", keep: int = 2, group=None):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1 (checkpoints kept), got {keep!r}")
        self.root = Path(root)
        self.module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.hook_state = hook_state
        self.generators = generators or {}
        self.probe = probe
        self.config_hash = config_hash
        self.keep = keep
        self.group = group

    # ----- collective helpers -------------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _agree(self, local_error: str | None, error_type: type[CheckpointError]) -> None:
        """Raise ``error_type`` on every rank if any rank reports an error."""
        errors = [None] * self._rank_world()[1]
        dist.all_gather_object(errors, local_error, group=self.group)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            raise error_type("; ".join(f"rank {r}: {e}" for r, e in failed))

    # ----- saving --------------------------------------------------------------------------

    def _consistency_error(self, step: int, data_position: dict) -> str | None:
        problems = []
        if self.hook_state is not None:
            if getattr(self.hook_state, "pending_collectives", 0):
                problems.append(f"{self.hook_state.pending_collectives} hook collective(s) in flight (save after optimizer.step())")
            if self.hook_state.step != step:
                problems.append(f"hook state counted {self.hook_state.step} steps, not {step}")
        if self.scheduler is not None and self.scheduler.last_epoch != step:
            problems.append(f"scheduler last_epoch is {self.scheduler.last_epoch}, not {step}")
        optimizer_steps = {int(s["step"]) for s in self.optimizer.state.values() if "step" in s}
        if optimizer_steps and optimizer_steps != {step}:
            problems.append(f"optimizer state counts steps {sorted(optimizer_steps)}, not {step}")
        if data_position.get("step", step) != step:
            problems.append(f"data position is at step {data_position['step']}, not {step}")
        return "; ".join(problems) or None

    def save(self, step: int, *, data_position: dict, ledger: dict | None = None) -> Path:
        """Save this rank's part of the cut at ``step`` (collective). Returns the directory."""
        started = time.perf_counter()
        rank, world_size = self._rank_world()
        final_dir = step_directory(self.root, step)
        local = self._consistency_error(step, data_position)
        if local is None and final_dir.exists():
            local = f"{final_dir} already exists; checkpoints are never overwritten"
        self._agree(local, CheckpointRefused)
        token = [os.urandom(4).hex()] if rank == 0 else [None]
        dist.broadcast_object_list(token, src=0, group=self.group)
        tmp_dir = self.root / f".tmp-step-{step:08d}-{token[0]}"
        payload = {
            "format": FORMAT,
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "config_hash": self.config_hash,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": capture_rng(self.generators),
            "data_position": data_position,
            "hook": self.hook_state.state_dict() if self.hook_state is not None else None,
            "ledger": ledger or {},
        }
        report, error = {}, None
        try:
            tmp_dir.mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            data = buffer.getvalue()
            path = tmp_dir / f"rank{rank}.pt"
            write_durably(path, data)
            written = hashlib.sha256(data).hexdigest()
            if sha256_file(path) != written:  # verify on write: read back what reached the disk
                raise CheckpointCorrupt(f"{path}: read-back SHA-256 differs from the bytes written")
            report = {
                "file": path.name,
                "sha256": written,
                "bytes": len(data),
                "tensors": tensor_digests(payload),
                "param_digest": parameter_sha256(self.module),
                "non_finite": _non_finite({k: payload[k] for k in ("model", "optimizer", "hook")}),
                "probe_loss": self.probe(self.module) if self.probe is not None else None,
            }
        except Exception as exc:  # reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
        reports = [None] * world_size
        dist.all_gather_object(reports, (report, error), group=self.group)
        outcome = [None]
        if rank == 0:
            outcome[0] = self._commit(step, reports, tmp_dir, final_dir, world_size, time.perf_counter() - started)
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0]:
            if rank == 0:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise CheckpointCorrupt(f"checkpoint at step {step} not committed: {outcome[0]}")
        return final_dir

    def _commit(self, step, reports, tmp_dir, final_dir, world_size, seconds) -> str | None:
        """Rank 0: verify every rank's report, write the manifest, rename into place."""
        errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(reports) if e]
        if errors:
            return "; ".join(errors)
        digests = {r: rep["param_digest"] for r, (rep, _) in enumerate(reports)}
        if len(set(digests.values())) != 1:
            odd = [r for r, d in digests.items() if d != digests[0]]
            return f"replicated parameters differ across ranks (ranks {odd} differ from rank 0)"
        bad = {r: rep["non_finite"] for r, (rep, _) in enumerate(reports) if rep["non_finite"]}
        if bad:
            return "non-finite values: " + "; ".join(f"rank {r}: {keys[:3]}" for r, keys in bad.items())
        probes = {r: rep["probe_loss"] for r, (rep, _) in enumerate(reports)}
        if len(set(probes.values())) != 1:
            return f"probe loss differs across ranks: {probes}"
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": world_size,
            "config_hash": self.config_hash,
            "created_unix": time.time(),
            "save_seconds": seconds,
            "param_digest": digests[0],
            "probe_loss": probes[0],
            "files": {rep["file"]: {"rank": r, "sha256": rep["sha256"], "bytes": rep["bytes"], "tensors": rep["tensors"]}
                      for r, (rep, _) in enumerate(reports)},
        }
        try:
            write_json_durably(tmp_dir / MANIFEST, manifest)
            commit_directory(tmp_dir, final_dir)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        for old in committed_steps(self.root)[: -self.keep]:
            shutil.rmtree(step_directory(self.root, old), ignore_errors=True)
        return None

    # ----- loading -------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        steps = committed_steps(self.root)
        return steps[-1] if steps else None

    def load(self, step: int | None = None, *, strict: bool = True) -> LoadedCheckpoint:
        """Restore the checkpoint at ``step`` (default: the latest committed), collectively."""
        started = time.perf_counter()
        rank, world_size = self._rank_world()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise NoCheckpoint(f"no committed checkpoint under {self.root}")
        result, error = None, None
        try:
            result = self._load_local(step, rank, world_size, strict)
        except (CheckpointError, ValueError, OSError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        errors = [None] * world_size
        dist.all_gather_object(errors, error, group=self.group)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            messages = "; ".join(f"rank {r}: {e}" for r, e in failed)
            kind = CheckpointMismatch if all("CheckpointMismatch" in e for _, e in failed) else CheckpointCorrupt
            raise kind(f"cannot restore {step_directory(self.root, step)}: {messages}")
        result.seconds = time.perf_counter() - started
        return result

    def _load_local(self, step: int, rank: int, world_size: int, strict: bool) -> LoadedCheckpoint:
        directory = step_directory(self.root, step)
        manifest_path = directory / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointCorrupt(f"{directory} has no {MANIFEST}: not a committed checkpoint")
        manifest = json.loads(manifest_path.read_text())
        notes = []
        if manifest["world_size"] != world_size:
            message = f"saved with world_size={manifest['world_size']}, this job has world_size={world_size}"
            if strict:
                raise CheckpointMismatch(f"{directory}: {message}")
            notes.append(message)
        if manifest["config_hash"] != self.config_hash:
            message = f"saved with config hash {manifest['config_hash']!r}, this job has {self.config_hash!r}"
            if strict:
                raise CheckpointMismatch(f"{directory}: {message}")
            notes.append(message)
        own = f"rank{rank}.pt"
        source = own
        if own not in manifest["files"] or not (directory / own).is_file():
            message = f"rank {rank}'s shard {directory / own} is missing"
            if strict:
                raise CheckpointCorrupt(message)
            notes.append(message + "; replicated state taken from rank 0's shard")
            source = "rank0.pt"
        path = directory / source
        expected = manifest["files"][source]
        if sha256_file(path) != expected["sha256"]:
            raise CheckpointCorrupt(f"{path}: SHA-256 differs from the manifest" + self._which_tensor(path, expected))
        payload = torch.load(path, map_location="cpu", weights_only=True)
        self._check_counters(payload, step, path)
        self.module.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        rng_restored = source == own
        if rng_restored:
            restore_rng(payload["rng"], self.generators)
        residual_reset = bool(notes)
        if self.hook_state is not None and payload["hook"] is not None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.hook_state.load_state_dict(payload["hook"], strict=strict and not notes)
            residual_reset = residual_reset or bool(self.hook_state.stats().get("residual_reset"))
            notes += [str(w.message) for w in caught]
        self._verify_semantics(directory, manifest, path)
        for note in notes:
            warnings.warn(f"lenient restore of {directory}: {note}", stacklevel=3)
        return LoadedCheckpoint(step, directory, payload["data_position"], payload["ledger"],
                                residual_reset=residual_reset, rng_restored=rng_restored, warnings=notes)

    @staticmethod
    def _check_counters(payload: dict, step: int, path: Path) -> None:
        """Every counter in the file must name the same step as the directory."""
        counters = {"file step": payload["step"], "data position": payload["data_position"].get("step", step)}
        if payload["hook"] is not None:
            counters["hook state"] = payload["hook"]["step"]
        if payload["scheduler"] is not None:
            counters["scheduler"] = payload["scheduler"]["last_epoch"]
        for state in payload["optimizer"]["state"].values():
            if "step" in state:
                counters["optimizer"] = int(state["step"])
                break
        wrong = {name: value for name, value in counters.items() if value != step}
        if wrong:
            raise CheckpointCorrupt(f"{path}: step counters disagree with step {step}: {wrong}")

    def _verify_semantics(self, directory: Path, manifest: dict, path: Path) -> None:
        digest = parameter_sha256(self.module)
        if digest != manifest["param_digest"]:
            raise CheckpointCorrupt(f"{path}: restored parameters' digest differs from the manifest's")
        if self.probe is not None and manifest["probe_loss"] is not None:
            loss = self.probe(self.module)
            if loss != manifest["probe_loss"]:
                raise CheckpointCorrupt(
                    f"{directory}: probe loss after restore is {loss!r}, recorded at save {manifest['probe_loss']!r}"
                )

    @staticmethod
    def _which_tensor(path: Path, expected: dict) -> str:
        """Name the tensors whose digest changed, when the file still loads."""
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated or garbled: the file itself is the finding
            return f" (file does not load: {type(exc).__name__})"
        now = tensor_digests(payload)
        changed = sorted(k for k, d in expected["tensors"].items() if now.get(k) != d)
        return f" (changed tensors: {changed[:5]})" if changed else ""
