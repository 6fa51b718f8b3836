"""Loading in two phases, so that a load failing on any rank changes nothing on any rank.

1. :func:`stage` reads this rank's file and checks everything it will restore, on
   temporaries only: the manifest and the file (SHA-256, structure, the file's own rank,
   world size, step counters and classes), the weights loaded into a copy of the module
   (whose parameter digest and probe-batch loss must match the manifest), the optimizer
   and scheduler states loaded into copies (an optimizer's ``load_state_dict`` builds new
   state, so a shallow copy leaves the original alone), the RNG states set on throwaway
   generators, the hook state loaded into a copy of the ``TopKState``.
2. The manager's one all-gather tells every rank whether every rank staged successfully.
3. :func:`apply` then loads the same, already checked, dicts into the live objects. Each
   of these loads already succeeded on an identical copy, so none of them fails here.

While it verifies, a load holds a second copy of the model, of the optimizer state read
from the file and of the residuals.
"""
import copy
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from sparsecomm.checkpoint.errors import CheckpointCorrupt, CheckpointMismatch
from sparsecomm.checkpoint.readback import read_rank_file
from sparsecomm.checkpoint.rng import check_rng, restore_rng
from sparsecomm.checkpoint.structure import (
    MANIFEST,
    check_manifest,
    check_payload,
    class_name,
    parameter_sha256,
    step_directory,
)


@dataclass
class LoadedCheckpoint:
    """What a load restored. ``skipped`` maps each newer checkpoint that a load of the
    latest passed over (it did not verify on every rank) to the reason; ``fell_back``
    says whether there was one (for the ledger)."""

    step: int
    path: Path
    data_position: dict
    ledger: dict
    residual_reset: bool = False
    rng_restored: bool = True
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)

    @property
    def fell_back(self) -> bool:
        return bool(self.skipped)


@dataclass
class Staged:
    """One rank's checked checkpoint, ready to apply."""

    step: int
    directory: Path
    payload: dict
    rng_restored: bool
    notes: list[str]  # mismatches a lenient load accepts (world size, config, lost shard)
    strict: bool


def stage(target, root: Path, step: int, rank: int, world_size: int, strict: bool) -> Staged:
    """Read and check what this rank would restore from ``step``; raises CheckpointError.

    ``target`` has the manager's ``module``, ``optimizer``, ``scheduler``, ``hook_state``,
    ``generators``, ``probe`` and ``config_hash``; none of them is changed.
    """
    directory = step_directory(root, step)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"{directory} has no {MANIFEST}: not a committed checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointCorrupt(f"{manifest_path} is not readable JSON: {type(exc).__name__}: {exc}") from exc
    check_manifest(manifest, manifest_path, step)
    notes = []

    def mismatch(message: str) -> None:
        if strict:
            raise CheckpointMismatch(f"{directory}: {message}")
        notes.append(message)

    if manifest["world_size"] != world_size:
        mismatch(f"saved with world_size={manifest['world_size']}, this job has world_size={world_size}")
    if manifest["config_hash"] != target.config_hash:
        mismatch(f"saved with config hash {manifest['config_hash']!r}, this job has {target.config_hash!r}")
    source = f"rank{rank}.pt"
    if source not in manifest["files"] or not (directory / source).is_file():
        message = f"rank {rank}'s shard {directory / source} is missing"
        if strict:
            raise CheckpointCorrupt(message)
        notes.append(message + "; replicated state taken from rank 0's shard")
        source = "rank0.pt"
        if source not in manifest["files"]:
            raise CheckpointCorrupt(f"{manifest_path} lists no {source} to take the replicated state from")
    path = directory / source
    entry = manifest["files"][source]
    payload = read_rank_file(path, entry)
    check_payload(payload, path)
    _check_identity(payload, manifest, entry, path, step)
    _check_classes(target, payload, path)
    own_file = source == f"rank{rank}.pt"
    _try_on_copies(target, payload, manifest, path, own_file, strict and not notes)
    return Staged(step, directory, payload, own_file, notes, strict)


def _check_identity(payload: dict, manifest: dict, entry: dict, path: Path, step: int) -> None:
    """The file must say it is the rank, job and step the manifest and its name say."""
    if payload["rank"] != entry["rank"]:
        raise CheckpointCorrupt(f"{path} holds rank {payload['rank']}'s state, but is rank {entry['rank']}'s file "
                                "(rank files swapped or renamed)")
    if payload["world_size"] != manifest["world_size"]:
        raise CheckpointCorrupt(f"{path} was saved with world_size={payload['world_size']}, its manifest says "
                                f"{manifest['world_size']}")
    if payload["config_hash"] != manifest["config_hash"]:
        raise CheckpointCorrupt(f"{path} was saved with config hash {payload['config_hash']!r}, its manifest says "
                                f"{manifest['config_hash']!r}")
    counters = {"file step": payload["step"], "data position": payload["data_position"].get("step", step)}
    if payload["hook"] is not None:
        counters["hook state"] = payload["hook"].get("step")
    if payload["scheduler"] is not None:
        counters["scheduler"] = payload["scheduler"].get("last_epoch", step)
    for state in payload["optimizer"]["state"].values():
        if isinstance(state, dict) and "step" in state:
            counters["optimizer"] = int(state["step"])
            break
    wrong = {name: value for name, value in counters.items() if value != step}
    if wrong:
        raise CheckpointCorrupt(f"{path}: step counters disagree with step {step}: {wrong}")


def _check_classes(target, payload: dict, path: Path) -> None:
    saved = payload["classes"]
    live = {"optimizer": class_name(target.optimizer), "scheduler": class_name(target.scheduler),
            "hook": class_name(target.hook_state)}
    differ = {k: (saved.get(k), v) for k, v in live.items() if saved.get(k) != v}
    if differ:
        raise CheckpointMismatch(f"{path} was saved by a job with other kinds of state (kind: (saved, this job)): "
                                 f"{differ}")


def _try_on_copies(target, payload: dict, manifest: dict, path: Path, own_file: bool, hook_strict: bool) -> None:
    """Every restore of :func:`apply`, on temporaries; raises CheckpointError naming what fails."""
    module = copy.deepcopy(target.module)  # parameters are copied without their gradients
    try:
        module.load_state_dict(payload["model"])
    except Exception as exc:
        raise CheckpointMismatch(f"{path}: the saved weights do not fit this model: {_first_line(exc)}") from exc
    if parameter_sha256(module) != manifest["param_digest"]:
        raise CheckpointCorrupt(f"{path}: restored parameters' digest differs from the manifest's")
    if target.probe is not None and manifest["probe_loss"] is not None:
        loss = float(target.probe(module))
        if loss != manifest["probe_loss"]:
            raise CheckpointCorrupt(f"{path.parent}: probe loss after restore is {loss!r}, recorded at save "
                                    f"{manifest['probe_loss']!r}")
    del module
    try:
        copy.copy(target.optimizer).load_state_dict(payload["optimizer"])
    except Exception as exc:
        raise CheckpointMismatch(f"{path}: the saved optimizer state does not fit this "
                                 f"{class_name(target.optimizer)}: {type(exc).__name__}: {_first_line(exc)}") from exc
    if target.scheduler is not None:
        # Deep, but sharing the optimizer: some schedulers' load_state_dict updates objects they hold.
        scheduler = copy.deepcopy(target.scheduler, {id(target.optimizer): target.optimizer})
        try:
            scheduler.load_state_dict(copy.copy(payload["scheduler"]))
        except Exception as exc:
            raise CheckpointMismatch(f"{path}: the saved scheduler state does not fit this "
                                     f"{class_name(target.scheduler)}: {type(exc).__name__}: {exc}") from exc
    if own_file:
        try:
            check_rng(payload["rng"], target.generators)
        except Exception as exc:
            raise CheckpointMismatch(f"{path}: the saved RNG states do not fit this job: {exc}") from exc
    if target.hook_state is not None:
        hook = copy.deepcopy(target.hook_state)
        hook.process_group = target.hook_state.process_group  # a copy drops it; ranks come from it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a lenient load warns when apply() runs it for real
            try:
                hook.load_state_dict(copy.copy(payload["hook"]), strict=hook_strict)
            except Exception as exc:
                raise CheckpointMismatch(f"{path}: the saved hook state does not fit this TopKState: "
                                         f"{type(exc).__name__}: {exc}") from exc


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[:3])[:500]


def apply(target, staged: Staged) -> LoadedCheckpoint:
    """Restore ``staged`` into the live objects (after every rank staged successfully)."""
    payload, notes = staged.payload, list(staged.notes)
    target.module.load_state_dict(payload["model"])
    target.optimizer.load_state_dict(payload["optimizer"])
    if target.scheduler is not None:
        target.scheduler.load_state_dict(payload["scheduler"])
    if staged.rng_restored:
        restore_rng(payload["rng"], target.generators)
    residual_reset = bool(notes)
    if target.hook_state is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            target.hook_state.load_state_dict(payload["hook"], strict=staged.strict and not staged.notes)
        residual_reset = residual_reset or bool(target.hook_state.stats().get("residual_reset"))
        notes += [str(w.message) for w in caught]
    for note in notes:
        warnings.warn(f"lenient restore of {staged.directory}: {note}", stacklevel=3)
    return LoadedCheckpoint(staged.step, staged.directory, payload["data_position"], payload["ledger"],
                            residual_reset=residual_reset, rng_restored=staged.rng_restored, warnings=notes)
