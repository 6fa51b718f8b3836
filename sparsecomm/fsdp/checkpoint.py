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
SHA-256 and of the mesh. A load checks the manifest and every checksum on every rank, and
the mesh (shape and dim names) before reading anything: another mesh is refused naming both.
"""
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sparsecomm.checkpoint.errors import CheckpointCorrupt, CheckpointMismatch, CheckpointRefused, NoCheckpoint
from sparsecomm.checkpoint.files import commit_directory, fsync_directory, sha256_file, write_json_durably
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
    replica only)."""
    extras = {}
    if state is not None:
        extras["hook"] = state.state_dict()
    if averager is not None:
        extras["averager"] = {f"global_rank{dist.get_rank()}": averager.state_dict()}
    return extras


def save_hsdp_checkpoint(root, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: TopKState | None = None, mesh, step: int, averager=None) -> Path:
    """Save ``step`` under ``root/step-<step>`` (collective: every rank calls it, between steps),
    with the hook's ``state`` and/or a :class:`~sparsecomm.SparseDeltaAverager` over the model.

    Raises :class:`~sparsecomm.checkpoint.CheckpointRefused` on every rank, before writing,
    while a hook collective or an averager's sync is in flight or when ``step-<step>`` exists.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    root = Path(root)
    final = _step_dir(root, step)
    problem = None
    if state is not None and state.lifecycle.pending:
        problem = f"{state.lifecycle.pending} hook collective(s) in flight: save between steps"
    elif averager is not None and averager.pending_collectives:
        problem = "the averager's sync is in flight (overlap=True): call averager.flush() first"
    elif final.exists():
        problem = f"{final} exists already: a checkpoint is never overwritten"
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem)  # every rank refuses alike
    refusals = [f"rank {r}: {p}" for r, p in enumerate(verdicts) if p]
    if refusals:
        raise CheckpointRefused("; ".join(refusals))
    payload = {**_model_and_optimizer(model, optimizer, averager), **_extras(state, averager)}
    # One temporary name for all ranks (rank 0's choice), named after it so a load ignores it.
    tmp = [str(root / f".tmp-step-{step}-{os.getpid()}")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(tmp, src=0)
    tmp_dir = Path(tmp[0])
    if dist.get_rank() == 0:
        tmp_dir.mkdir(parents=True)
    dist.barrier()
    try:
        dcp.save(payload, checkpoint_id=str(tmp_dir))
    except BaseException as error:  # DCP raises CheckpointException, a BaseException
        raise CheckpointRefused(f"writing {tmp_dir} failed: {error}") from None
    dist.barrier()  # every rank's files are written
    if dist.get_rank() == 0:
        files = {p.name: sha256_file(p) for p in sorted(tmp_dir.iterdir())}
        write_json_durably(tmp_dir / MANIFEST, {"format": FORMAT, "step": step, "mesh": _mesh_record(mesh),
                                                "world_size": dist.get_world_size(), "files": files})
        fsync_directory(tmp_dir)
        commit_directory(tmp_dir, final)
        fsync_directory(root)
    dist.barrier()
    return final


def latest_hsdp_step(root) -> int | None:
    """The newest committed step under ``root`` (temporary directories do not count)."""
    steps = [int(p.name[len("step-"):]) for p in Path(root).glob("step-*")
             if p.name[len("step-"):].isdigit() and (p / MANIFEST).exists()]
    return max(steps) if steps else None


def _verify(directory: Path, mesh) -> dict:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointCorrupt(f"{directory / MANIFEST}: unreadable ({error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointCorrupt(f"{directory / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
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
    ``root/step-<step>`` (the latest when None; collective) and return the step. Every rank verifies the manifest, every file's
    checksum and the mesh first; the ranks agree before anything changes, and all raise the
    same :class:`~sparsecomm.checkpoint.CheckpointError` otherwise."""
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
        _verify(directory, mesh)
    except (NoCheckpoint, CheckpointCorrupt, CheckpointMismatch) as error:
        problem = (type(error).__name__, str(error))
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem)
    failed = [(r, v) for r, v in enumerate(verdicts) if v]
    if failed:
        kind = {"NoCheckpoint": NoCheckpoint, "CheckpointCorrupt": CheckpointCorrupt,
                "CheckpointMismatch": CheckpointMismatch}[failed[0][1][0]]
        raise kind("; ".join(f"rank {r}: {message}" for r, (_, message) in failed))
    # Templates that DCP fills in place.
    payload = {**_model_and_optimizer(model, optimizer, averager), **_extras(state, averager)}
    try:
        dcp.load(payload, checkpoint_id=str(directory))
    except BaseException as error:
        raise CheckpointCorrupt(f"reading {directory} failed: {error}") from None
    _restore_model_and_optimizer(model, optimizer, averager, payload)
    if state is not None:
        state.load_state_dict(payload["hook"])
    if averager is not None:
        averager.load_state_dict(payload["averager"][f"global_rank{dist.get_rank()}"])
    return step

