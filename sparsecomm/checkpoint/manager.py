"""Checkpoints that capture one consistent cut of a DDP job, verified beyond a checksum.

The layout on disk is described in :mod:`sparsecomm.checkpoint.structure`. What a rank
file holds: model, optimizer, LR scheduler, every RNG (python, numpy, torch, CUDA, owned
generators), the data position, the hook state with this rank's residuals under
rank-qualified keys, ledger counters, step, rank, world size, config hash and the classes
of optimizer, scheduler and hook state.

Saving (collective: every rank calls :meth:`CheckpointManager.save` at the same step):

1. refuse unless this is a step boundary (no hook collective in flight, the step counters
   of hook, optimizer, scheduler and data position agree with ``step``) and ``step`` is
   newer than every committed checkpoint (a checkpoint is never overwritten, and "latest"
   always means the highest step);
2. serialise, write into the temporary directory, fsync, read the file back, compare its
   SHA-256 and load it with the loader a load uses (verify on write: a file that would
   not load is never committed);
3. rank 0 gathers every rank's report: the parameter digest must be identical on all
   ranks (DDP replicas), every tensor finite, the loss of a fixed probe batch finite and
   identical on all ranks;
4. rank 0 writes the manifest, fsyncs it, renames the directory into place and fsyncs the
   root; only then are checkpoints beyond ``keep`` removed (always older ones), so the
   previous verified checkpoint survives until the new one has passed;
5. every rank learns the outcome; any failure raises on every rank (no hang, no commit).

:meth:`~CheckpointManager.save_async` stages a copy of the cut and runs steps 2-5 in a
background thread (see :mod:`sparsecomm.checkpoint.background`).

Loading is all-or-nothing across ranks (see :mod:`sparsecomm.checkpoint.restore`): every
rank reads and checks everything it will restore on temporaries, the ranks agree in one
all-gather, and only then does any rank change its model, optimizer, scheduler, RNGs or
hook state. Strict by default: a world-size or config mismatch, a missing shard or a
corrupt file raises naming file, rank and both values. Lenient (``strict=False``) loads
what is replicated from rank 0's file when this rank's file is missing, and resets
error-feedback residuals with a warning (``residual_reset`` in the returned info).

Every error the layer raises is a :class:`~sparsecomm.checkpoint.errors.CheckpointError`.
"""
import hashlib
import io
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from sparsecomm.checkpoint import files, restore, scratch
from sparsecomm.checkpoint.background import PendingSave, staged_copy
from sparsecomm.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointRefused,
    NoCheckpoint,
)
from sparsecomm.checkpoint.readback import check_reads_back
from sparsecomm.checkpoint.restore import LoadedCheckpoint
from sparsecomm.checkpoint.rng import capture_rng
from sparsecomm.checkpoint.structure import (  # noqa: F401  (re-exported: the public names of old)
    FORMAT,
    MANIFEST,
    class_name,
    committed_steps,
    non_finite,
    parameter_sha256,
    state_dict_sha256,
    step_directory,
    tensor_digests,
)


@dataclass
class _Cut:
    """One rank's state at ``step``, captured for writing (or why it could not be)."""

    step: int
    rank: int
    tmp_dir: Path
    final_dir: Path
    payload: dict | None
    probe_loss: float | None
    error: str | None
    started: float


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
        group: the process group of the job (default: the world).
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
        self._pending: PendingSave | None = None  # the asynchronous save in flight
        self._background_group = None  # made by the first save_async (collective)

    # ----- collective helpers -------------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        if not dist.is_initialized():
            raise CheckpointError("CheckpointManager needs torch.distributed initialised (init_process_group): "
                                  "saves and loads are collective")
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _remove_stale(self) -> None:
        """Rank 0, before its first collective of a save or load: best effort, never raises
        (a rank raising alone would leave the others waiting)."""
        try:
            scratch.remove_stale(self.root)
        except OSError as exc:
            warnings.warn(f"could not clean up leftovers of killed saves under {self.root}: {exc}", stacklevel=3)

    @staticmethod
    def _all_gather(value, group, what: str) -> list:
        """Every rank's ``value``; a failed collective (a rank died) becomes a CheckpointError."""
        gathered = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(gathered, value, group=group)
        except Exception as exc:
            raise CheckpointError(f"{what}: the ranks could not exchange their results (a rank died or "
                                  f"hung?): {type(exc).__name__}: {exc}") from exc
        return gathered

    @staticmethod
    def _broadcast_from_rank0(value, group, what: str):
        holder = [value]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        try:
            dist.broadcast_object_list(holder, src=src, group=group)
        except Exception as exc:
            raise CheckpointError(f"{what}: rank 0's outcome did not reach every rank (a rank died or hung?): "
                                  f"{type(exc).__name__}: {exc}") from exc
        return holder[0]

    # ----- saving --------------------------------------------------------------------------

    def save(self, step: int, *, data_position: dict, ledger: dict | None = None) -> Path:
        """Save this rank's part of the cut at ``step`` (collective). Returns the directory.

        Waits for an asynchronous save still in flight first (and raises its error, if it
        failed). Raises :class:`CheckpointRefused` (not a step boundary, or ``step`` is not
        newer than the newest checkpoint) or :class:`CheckpointCorrupt` (not committed) on
        every rank.
        """
        cut = self._capture(step, data_position, ledger, copy_state=False)
        return self._write_and_commit(cut, self.group)

    def save_async(self, step: int, *, data_position: dict, ledger: dict | None = None) -> PendingSave:
        """Like :meth:`save`, but return once the cut is copied; write it in the background.

        The weights, optimizer, hook state and the dicts passed in may change as soon as
        this returns. Collective, like :meth:`save`, and so is the first call's creation
        of a gloo group for the background collectives (every rank of the default group
        must make that call). The next ``save``, ``save_async`` or ``load`` waits for this
        one; :meth:`wait` does so explicitly and raises its error. Call :meth:`wait`
        before the process exits: a save cut short leaves no checkpoint.
        """
        started = time.perf_counter()
        if self._background_group is None:
            ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
            try:
                self._background_group = dist.new_group(ranks=ranks, backend="gloo")
            except Exception as exc:
                raise CheckpointError(f"cannot make the gloo group asynchronous saves use: "
                                      f"{type(exc).__name__}: {exc}") from exc
        cut = self._capture(step, data_position, ledger, copy_state=True, started=started)
        group = self._background_group
        self._pending = PendingSave(step, lambda: self._write_and_commit(cut, group), started)
        self._pending._start()
        return self._pending

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any; raise its error if it failed
        (unless its handle's ``wait()`` already raised it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending._settle()

    def _refusal(self, step: int, data_position) -> str | None:
        """Why saving ``step`` now would not give one consistent, new cut (None: it would)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            return f"step must be an integer >= 0, got {step!r}"
        if not isinstance(data_position, dict):
            return f"data_position must be a dict, got {type(data_position).__name__}"
        problems = []
        if self.hook_state is not None:
            if getattr(self.hook_state, "pending_collectives", 0):
                problems.append(f"{self.hook_state.pending_collectives} hook collective(s) in flight (save after "
                                "optimizer.step(); a SparseDeltaAverager with overlap=True: call its flush() first)")
            # A TopKState counts its steps in .step; an averager, whose step() is its API, in .optimizer_steps.
            counted = getattr(self.hook_state, "optimizer_steps", None)
            counted = self.hook_state.step if counted is None else counted
            if counted != step:
                problems.append(f"hook state counted {counted} steps, not {step}")
        if self.scheduler is not None and self.scheduler.last_epoch != step:
            problems.append(f"scheduler last_epoch is {self.scheduler.last_epoch}, not {step}")
        optimizer_steps = {int(s["step"]) for s in self.optimizer.state.values() if "step" in s}
        if optimizer_steps and optimizer_steps != {step}:
            problems.append(f"optimizer state counts steps {sorted(optimizer_steps)}, not {step}")
        if data_position.get("step", step) != step:
            problems.append(f"data position is at step {data_position['step']}, not {step}")
        if problems:
            return "; ".join(problems)
        committed = committed_steps(self.root)
        if step in committed:
            return f"{step_directory(self.root, step)} already exists; checkpoints are never overwritten"
        if committed and step < committed[-1]:
            # Committing it would make "latest" ambiguous, and with keep=1 retention would
            # have to delete either the new checkpoint or the newest verified one.
            return (f"step {step} is older than the newest checkpoint under {self.root} (step {committed[-1]}); "
                    f"resume from that one, or save this run under another root")
        return None

    def _capture(self, step: int, data_position, ledger, *, copy_state: bool, started: float | None = None) -> _Cut:
        """Agree that ``step`` may be saved, make the temporary directory, capture the state."""
        started = time.perf_counter() if started is None else started
        self.wait()
        rank, world_size = self._rank_world()
        try:
            local = self._refusal(step, data_position)
        except Exception as exc:  # e.g. a hook state that cannot report its step
            local = f"{type(exc).__name__}: {exc}"
        name = None
        if rank == 0:
            self._remove_stale()  # leftovers of killed saves (ours in flight: none, we waited)
            if local is None:
                name = scratch.new_name("tmp", step)
                try:
                    (self.root / name).mkdir(parents=True)
                except OSError as exc:
                    scratch.release(name)
                    name, local = None, f"cannot create a directory under {self.root}: {type(exc).__name__}: {exc}"
        answers = self._all_gather((local, name), self.group, f"saving step {step}")
        refused = [(r, e) for r, (e, _) in enumerate(answers) if e]
        if refused:
            if name is not None:
                shutil.rmtree(self.root / name, ignore_errors=True)
                scratch.release(name)
            raise CheckpointRefused("; ".join(f"rank {r}: {e}" for r, e in refused))
        payload, probe_loss, error = None, None, None
        try:
            payload = self._payload(step, rank, world_size, data_position, ledger)
            if copy_state:
                payload = staged_copy(payload)
            probe_loss = float(self.probe(self.module)) if self.probe is not None else None
        except Exception as exc:  # reported to every rank with the write reports
            error = f"capturing the state of step {step}: {type(exc).__name__}: {exc}"
        return _Cut(step, rank, self.root / answers[0][1], step_directory(self.root, step), payload, probe_loss,
                    error, started)

    def _payload(self, step: int, rank: int, world_size: int, data_position: dict, ledger) -> dict:
        return {
            "format": FORMAT,
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "config_hash": self.config_hash,
            "classes": {"optimizer": class_name(self.optimizer), "scheduler": class_name(self.scheduler),
                        "hook": class_name(self.hook_state)},
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": capture_rng(self.generators),
            "data_position": data_position,
            "hook": self.hook_state.state_dict() if self.hook_state is not None else None,
            "ledger": ledger or {},
        }

    def _write_and_commit(self, cut: _Cut, group) -> Path:
        """Write this rank's file, then commit on rank 0 if every rank's report passes."""
        report, error = {}, cut.error
        if error is None:
            path = cut.tmp_dir / f"rank{cut.rank}.pt"
            try:
                report = self._write_rank_file(cut, path)
            except Exception as exc:
                error = f"writing {path}: {type(exc).__name__}: {exc}"
        cut.payload = None  # the staged copy is no longer needed
        outcome = "rank 0 did not reach the commit"
        try:
            reports = self._all_gather((report, error), group, f"checkpoint at step {cut.step}")
            if cut.rank == 0:
                try:
                    outcome = self._commit(cut, reports, world_size=len(reports))
                except Exception as exc:  # must still reach the broadcast, or the other ranks wait
                    outcome = f"committing {cut.final_dir}: {type(exc).__name__}: {exc}"
                if outcome is not None:  # gone before any rank learns that the save failed
                    shutil.rmtree(cut.tmp_dir, ignore_errors=True)
            outcome = self._broadcast_from_rank0(outcome, group, f"checkpoint at step {cut.step}")
        finally:
            if cut.rank == 0:
                if outcome is not None:  # not committed (or a collective failed): it goes
                    shutil.rmtree(cut.tmp_dir, ignore_errors=True)
                scratch.release(cut.tmp_dir.name)
        if outcome:
            raise CheckpointCorrupt(f"checkpoint at step {cut.step} not committed: {outcome}")
        return cut.final_dir

    def _write_rank_file(self, cut: _Cut, path: Path) -> dict:
        buffer = io.BytesIO()
        torch.save(cut.payload, buffer)
        data = buffer.getvalue()
        entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                 "tensors": tensor_digests(cut.payload)}
        files.write_durably(path, data)
        del data, buffer
        check_reads_back(path, entry, cut.payload)  # verify on write, with the loader a load uses
        return {
            "file": path.name,
            **entry,
            "param_digest": state_dict_sha256(cut.payload["model"]),
            "non_finite": non_finite({k: cut.payload[k] for k in ("model", "optimizer", "hook")}),
            "probe_loss": cut.probe_loss,
        }

    def _commit(self, cut: _Cut, reports: list, world_size: int) -> str | None:
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
        not_finite = {r: p for r, p in probes.items() if p is not None and not abs(p) < float("inf")}
        if not_finite:  # checked first: NaN != NaN would read as "differs across ranks"
            return f"probe loss is not finite: {not_finite}"
        if len(set(probes.values())) != 1:
            return f"probe loss differs across ranks: {probes}"
        manifest = {
            "format": FORMAT,
            "step": cut.step,
            "world_size": world_size,
            "config_hash": self.config_hash,
            "created_unix": time.time(),
            "save_seconds": time.perf_counter() - cut.started,
            "param_digest": digests[0],
            "probe_loss": probes[0],
            "files": {rep["file"]: {"rank": r, "sha256": rep["sha256"], "bytes": rep["bytes"], "tensors": rep["tensors"]}
                      for r, (rep, _) in enumerate(reports)},
        }
        final_dir = cut.final_dir
        try:
            files.write_json_durably(cut.tmp_dir / MANIFEST, manifest)
            if (final_dir / MANIFEST).exists():
                return f"{final_dir} appeared while saving; checkpoints are never overwritten"
            if final_dir.exists():  # a step directory without a manifest: debris, never a checkpoint
                scratch.delete_directory(final_dir, cut.step)
            files.commit_directory(cut.tmp_dir, final_dir)
        except OSError as exc:
            return f"committing {final_dir}: {type(exc).__name__}: {exc}"
        for old in committed_steps(self.root)[: -self.keep]:
            if old < cut.step:  # never what was just written
                try:
                    scratch.delete_directory(step_directory(self.root, old), old)
                except OSError as exc:  # the new checkpoint stands; an old one stays behind
                    warnings.warn(f"could not remove {step_directory(self.root, old)}: {exc}", stacklevel=2)
        return None

    # ----- loading -------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The highest committed step (it may still fail to verify: :meth:`load` checks)."""
        steps = committed_steps(self.root)
        return steps[-1] if steps else None

    def load(self, step: int | None = None, *, strict: bool = True) -> LoadedCheckpoint:
        """Restore the checkpoint at ``step``, collectively, all or nothing across ranks.

        ``step=None`` loads the newest checkpoint that verifies on every rank: a newer one
        that is corrupt on any rank is skipped with a warning naming it and why, moved to
        ``root/corrupt-step-NNNNNNNN`` by rank 0 (kept for inspection; a recomputed step can
        then be saved again), and listed in the result's ``skipped`` (``fell_back`` is
        True). A mismatch (another world size, configuration, model or optimizer) is not
        skipped: every older checkpoint of the job would mismatch too. An explicit
        ``step`` never falls back. On failure every rank raises the same CheckpointError
        naming the failing ranks, and nothing was changed on any rank.
        """
        started = time.perf_counter()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise CheckpointError(f"step must be None (the latest) or an integer >= 0, got {step!r}")
        self.wait()
        rank, world_size = self._rank_world()
        if rank == 0:
            self._remove_stale()
        explicit = step is not None
        candidates = [step] if explicit else committed_steps(self.root)[::-1]
        skipped: dict[int, str] = {}
        for candidate in candidates + [None]:
            staged, failure = None, None
            if candidate is not None:
                try:
                    staged = restore.stage(self, self.root, candidate, rank, world_size, strict)
                except Exception as exc:  # reported to every rank below, as a CheckpointError
                    kind = "mismatch" if isinstance(exc, CheckpointMismatch) else "corrupt"
                    failure = (kind, f"{type(exc).__name__}: {exc}")
            verdicts = self._all_gather((candidate, failure), self.group, f"loading from {self.root}")
            if len({c for c, _ in verdicts}) != 1:
                seen = "; ".join(f"rank {r}: step {c}" for r, (c, _) in enumerate(verdicts))
                raise CheckpointCorrupt(f"the ranks see different checkpoints under {self.root}: {seen}")
            if candidate is None:
                break
            failed = [(r, f) for r, (_, f) in enumerate(verdicts) if f]
            if not failed:
                loaded = restore.apply(self, staged)
                if skipped:
                    self._set_aside(skipped, loaded, rank)
                loaded.seconds = time.perf_counter() - started
                return loaded
            message = "; ".join(f"rank {r}: {m}" for r, (_, m) in failed)
            mismatch = [k for _, (k, _) in failed if k == "mismatch"]
            if explicit or mismatch:
                kind = CheckpointMismatch if len(mismatch) == len(failed) else CheckpointCorrupt
                earlier = "".join(f"; skipped step {s} first: {why}" for s, why in skipped.items())
                raise kind(f"cannot restore {step_directory(self.root, candidate)}: {message}{earlier}")
            skipped[candidate] = message
        if skipped:
            raise CheckpointCorrupt(f"no checkpoint under {self.root} verifies on every rank: "
                                    + "; ".join(f"step {s} ({step_directory(self.root, s)}): {why}"
                                                for s, why in skipped.items()))
        raise NoCheckpoint(f"no committed checkpoint under {self.root}")

    def _set_aside(self, skipped: dict[int, str], loaded: LoadedCheckpoint, rank: int) -> None:
        """After a fallback: move the skipped checkpoints out of the step sequence (rank 0),
        so that "latest" no longer names them and their steps can be saved again; every
        rank waits for that, then warns."""
        loaded.skipped = dict(skipped)
        moved = {}
        if rank == 0:
            for step in skipped:
                directory = step_directory(self.root, step)
                aside, suffix = self.root / f"corrupt-{directory.name}", 1
                while aside.exists():
                    suffix += 1
                    aside = self.root / f"corrupt-{directory.name}-{suffix}"
                try:
                    os.rename(directory, aside)
                    files.fsync_directory(self.root)
                    moved[step] = f"moved to {aside}"
                except OSError as exc:  # e.g. a read-only copy: the load stands
                    moved[step] = f"could not move it aside ({type(exc).__name__}: {exc})"
        moved = self._broadcast_from_rank0(moved, self.group, f"setting skipped checkpoints aside under {self.root}")
        for step, why in skipped.items():
            warnings.warn(f"checkpoint {step_directory(self.root, step)} skipped, restored step {loaded.step} "
                          f"instead: {why}; {moved.get(step, '')}", stacklevel=3)
