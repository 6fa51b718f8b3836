"""Sharded checkpoints of an HSDP job: the FSDP2 model, its optimizer and every rank's
error-feedback memories (the hook's, an averager's), in one ``torch.distributed.checkpoint``
(DCP) directory.

Each rank writes only what it holds: its shards of the weights and of the optimizer state
(DCP's sharded state dicts, ``torch.distributed.checkpoint.state_dict``), and its own
residuals, whose keys name the replica and the shard (``rank<r>.residual.<module>.flat_shard<s>``,
:func:`sparsecomm.register_hsdp_hook`), so no two ranks write one key. The save is one cut:
refused while a hook collective is in flight; written into a temporary directory that
becomes ``step-<N>`` by one rename once every rank has written (a crash leaves the previous
checkpoints and a temporary directory that loads ignore), with a manifest of every file's
SHA-256 and of the mesh; every rank learns whether the commit succeeded, and a failed save
leaves no temporary directory. A load checks the manifest and every checksum on every rank,
and the mesh (shape and dim names) before reading anything: another mesh is refused naming
both. It then reads the hook's and the averager's states alone and tries them on copies;
only when every rank's fit are the weights and the optimizer state read.
"""
import copy
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sparsecomm.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointRefused,
    NoCheckpoint,
)
from sparsecomm.checkpoint.files import commit_directory, fsync_directory, sha256_file, write_json_durably
from sparsecomm.checkpoint.structure import committed_steps, is_int, require_field
from sparsecomm.hooks.topk import TopKState

MANIFEST = "manifest.json"
FORMAT = "sparsecomm-hsdp-checkpoint-1"


def _mesh_record(mesh) -> dict:
    return {"shape": list(mesh.mesh.shape), "dims": list(mesh.mesh_dim_names or ())}


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def _model_and_optimizer(model, optimizer, averager) -> dict:
    """DCP's sharded state dicts of the model and optimizer. DCP keeps one copy of a key that
    several ranks hold alike: the replicas of a shard under the hook, which agree after every
    step. With an averager the replicas train apart between syncs (weights and optimizer
    states differ), so each replica's are saved under its own key."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    both = {"model": model_sd, "optimizer": optim_sd}
    return both if averager is None else {f"replica{dist.get_rank(averager.process_group)}": both}


def _restore_model_and_optimizer(model, optimizer, averager, loaded: dict) -> None:
    both = loaded if averager is None else loaded[f"replica{dist.get_rank(averager.process_group)}"]
    set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"])


def _extras(state: TopKState | None, averager) -> dict:
    """The per-rank memories beside model and optimizer: the hook's (keys unique per replica and
    shard already), and an averager's, under this process's global rank (its own keys name the
    replica only). So are the hook's ``budget_shares`` (``budget="model"``), as one JSON text:
    DCP loads only the keys its template holds, one per entry of a dict, and a fresh state has
    no shares yet; and under one key for all ranks DCP would keep one shard's text."""
    extras = {}
    if state is not None:
        extras["hook"] = state.state_dict()
        shares = extras["hook"].pop("budget_shares", None)
        if shares is not None:
            extras["budget_shares"] = {f"global_rank{dist.get_rank()}": json.dumps(shares)}
    if averager is not None:
        extras["averager"] = {f"global_rank{dist.get_rank()}": averager.state_dict()}
    return extras


def _hook_state(extras: dict) -> dict:
    """The hook's state dict in ``extras`` as :meth:`TopKState.state_dict` made it."""
    hook = dict(extras["hook"])
    if "budget_shares" in extras:
        hook["budget_shares"] = json.loads(extras["budget_shares"][f"global_rank{dist.get_rank()}"])
    return hook


def save_hsdp_checkpoint(root, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: TopKState | None = None, mesh, step: int, averager=None) -> Path:
    """Save ``step`` under ``root/step-<step>`` (collective: every rank calls it, between steps),
    with the hook's ``state`` and/or a :class:`~sparsecomm.SparseDeltaAverager` over the model.

    Raises :class:`~sparsecomm.checkpoint.CheckpointRefused` on every rank, before writing,
    while a hook collective or an averager's sync is in flight or when ``step-<step>`` exists
    (a dangling symbolic link too); and on every rank alike, naming the path, when writing or
    the commit fails (the temporary directory is removed).
    """
    _check_step(step)
    root = Path(root)
    final = _step_dir(root, step)
    problem = None
    if state is not None and state.lifecycle.pending:
        problem = f"{state.lifecycle.pending} hook collective(s) in flight: save between steps"
    elif averager is not None and averager.pending_collectives:
        problem = "the averager's sync is in flight (overlap=True): call averager.flush() first"
    elif os.path.lexists(final):  # a dangling symbolic link too: the rename would fail on it
        problem = f"{final} exists already: a checkpoint is never overwritten"
    _agree(None if problem is None else CheckpointRefused(problem))  # every rank refuses alike
    payload = {**_model_and_optimizer(model, optimizer, averager), **_extras(state, averager)}
    # One temporary name for all ranks (rank 0's choice), named after it so a load ignores it.
    tmp = [str(root / f".tmp-step-{step}-{os.getpid()}")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(tmp, src=0)
    tmp_dir = Path(tmp[0])
    made = None
    if dist.get_rank() == 0:
        try:
            tmp_dir.mkdir(parents=True)
        except OSError as error:
            made = CheckpointRefused(f"creating {tmp_dir} failed: {error}")
    _agree(made)
    try:
        dcp.save(payload, checkpoint_id=str(tmp_dir))
    except BaseException as error:  # DCP raises CheckpointException, a BaseException, on every rank
        if dist.get_rank() == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise CheckpointRefused(f"writing {tmp_dir} failed: {error}") from None
    dist.barrier()  # every rank's files are written
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            files = {p.name: sha256_file(p) for p in sorted(tmp_dir.iterdir())}
            write_json_durably(tmp_dir / MANIFEST, {"format": FORMAT, "step": step, "mesh": _mesh_record(mesh),
                                                    "world_size": dist.get_world_size(), "files": files})
            fsync_directory(tmp_dir)
            commit_directory(tmp_dir, final)  # fsyncs root
        except OSError as error:  # still reaches the broadcast: the other ranks learn it, none waits
            shutil.rmtree(tmp_dir, ignore_errors=True)
            outcome = [f"committing {final} failed, nothing was saved: {type(error).__name__}: {error}"]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointRefused(outcome[0])
    return final


def _check_step(step) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")


def _agree(problem: CheckpointError | None) -> None:
    """All-gather every rank's ``problem`` (None: none); if any rank has one, every rank raises
    the first one's class, naming each rank's."""
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, None if problem is None else (type(problem), str(problem)))
    failed = [(r, v) for r, v in enumerate(verdicts) if v]
    if failed:
        raise failed[0][1][0]("; ".join(f"rank {r}: {message}" for r, (_, message) in failed))


def latest_hsdp_step(root) -> int | None:
    """The newest committed step under ``root`` (temporary directories do not count)."""
    steps = committed_steps(root, _step_dir)
    return steps[-1] if steps else None


def _is_file_name(name) -> bool:
    """A plain name inside the checkpoint's directory (never a path out of it)."""
    return isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name


def _check_manifest(manifest, path: Path, step: int) -> None:
    """Refuse a manifest that is not what :func:`save_hsdp_checkpoint` writes (CheckpointCorrupt
    naming the field): nothing read from disk is trusted."""
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"{path} must hold a JSON object, got a JSON {type(manifest).__name__}")
    where = str(path)
    require_field(manifest, "format", lambda v: v == FORMAT, repr(FORMAT), where)
    require_field(manifest, "step", lambda v: is_int(v) and v == step, f"{step}, its directory's step", where)
    require_field(manifest, "world_size", lambda v: is_int(v) and v >= 1, "an integer >= 1", where)
    require_field(manifest, "mesh", lambda v: isinstance(v, dict) and isinstance(v.get("shape"), list)
                  and all(is_int(n) and n >= 1 for n in v["shape"]) and isinstance(v.get("dims"), list)
                  and all(isinstance(d, str) for d in v["dims"]),
                  'an object {"shape": [integers >= 1], "dims": [names]}', where)
    require_field(manifest, "files", lambda v: isinstance(v, dict) and v and all(
        _is_file_name(name) and isinstance(digest, str) and len(digest) == 64 for name, digest in v.items()),
        "a non-empty object of file name -> SHA-256 hex digest", where)


def _verify(directory: Path, mesh, step: int) -> dict:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointCorrupt(f"{directory / MANIFEST}: unreadable ({error})") from None
    _check_manifest(manifest, directory / MANIFEST, step)
    here = {**_mesh_record(mesh), "world_size": dist.get_world_size()}
    saved = {**manifest["mesh"], "world_size": manifest["world_size"]}
    differs = {key: (saved[key], here[key]) for key in here if saved.get(key) != here[key]}
    if differs:
        raise CheckpointMismatch(
            f"{directory} was saved on another mesh ((saved, now): {differs}): its residuals are per shard of that "
            "mesh; load it on the same (replicate, shard) shape")
    present = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST)
    if present != sorted(manifest["files"]):
        raise CheckpointCorrupt(f"{directory}: files {present} differ from the manifest's {sorted(manifest['files'])}")
    for name, digest in manifest["files"].items():
        if sha256_file(directory / name) != digest:
            raise CheckpointCorrupt(f"{directory / name}: SHA-256 differs from the manifest (changed after the save)")
    return manifest


def load_hsdp_checkpoint(root, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: TopKState | None = None, mesh, step: int | None = None, averager=None) -> int:
    """Restore ``model``, ``optimizer``, ``state`` and ``averager`` (those saved with it) from
    ``root/step-<step>`` (the latest when None; collective) and return the step. Every rank
    verifies the manifest, every file's checksum and the mesh first, then whether the saved
    hook and averager states fit ``state`` and ``averager`` (another density, model or rank:
    :class:`~sparsecomm.checkpoint.CheckpointMismatch` naming what differs); the ranks agree
    before anything changes, and all raise the same
    :class:`~sparsecomm.checkpoint.CheckpointError` otherwise."""
    if step is not None:
        _check_step(step)
    root = Path(root)
    if step is None:
        step = latest_hsdp_step(root)
        if step is None:
            raise NoCheckpoint(f"no committed checkpoint under {root}")
    directory = _step_dir(root, step)
    problem = None
    try:
        if not directory.is_dir():
            raise NoCheckpoint(f"{directory} does not exist")
        _verify(directory, mesh, step)
    except CheckpointError as error:
        problem = error
    _agree(problem)
    # The memories first, into templates DCP fills in place (copies: state_dict() clones), then
    # tried on copies of the hook and averager: a misfit leaves the weights unread.
    extras = _extras(state, averager)
    if extras:
        try:
            dcp.load(extras, checkpoint_id=str(directory))
            problem = _misfit(state, averager, extras, directory)
        except BaseException as error:  # DCP raises CheckpointException, a BaseException
            problem = CheckpointCorrupt(f"reading {directory} failed: {error}")
        _agree(problem)
    # Templates that share storage with the model and the optimizer: from here on they change.
    weights = _model_and_optimizer(model, optimizer, averager)
    try:
        dcp.load(weights, checkpoint_id=str(directory))
    except BaseException as error:
        raise CheckpointCorrupt(f"reading {directory} failed: {error}") from None
    _restore_model_and_optimizer(model, optimizer, averager, weights)
    if state is not None:
        state.load_state_dict(_hook_state(extras))
    if averager is not None:
        averager.load_state_dict(extras["averager"][f"global_rank{dist.get_rank()}"])
    return step


def _misfit(state: TopKState | None, averager, loaded: dict, directory: Path) -> CheckpointMismatch | None:
    """Whether the saved hook and averager states fit this job, tried by loading them into
    copies (as :class:`~sparsecomm.checkpoint.CheckpointManager` stages a restore)."""
    try:
        if state is not None:
            hook = copy.deepcopy(state)
            hook.process_group = state.process_group  # a copy drops it; the rank comes from it
            hook.load_state_dict(_hook_state(loaded))
    except ValueError as error:
        return CheckpointMismatch(f"{directory}: the saved hook state does not fit this TopKState: {error}")
    try:
        if averager is not None:
            copy.deepcopy(averager).load_state_dict(loaded["averager"][f"global_rank{dist.get_rank()}"])
    except ValueError as error:
        return CheckpointMismatch(f"{directory}: the saved averager state does not fit this SparseDeltaAverager: "
                                  f"{error}")
    return None
