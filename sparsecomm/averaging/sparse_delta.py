"""Local steps with a sparse, error-fed outer sync of the weights (SparseLoCo-style).

Between syncs every replica trains alone: the averager registers a comm hook that reduces
nothing (:func:`sparsecomm.hooks.local_gradient.local_gradient_hook`), so the inner
optimizer (AdamW at its normal betas) sees this rank's own gradients. Every ``period``
optimizer steps, :meth:`SparseDeltaAverager.step` does the outer step::

    delta   = anchor - weights                 # this rank's pseudo-gradient since the last sync
    e       = ef_decay * e + delta              # the error-feedback buffer (stands in for outer momentum)
    sent    = C(e);  e -= decoded(sent)         # top-k (per chunk) + value codec, the hook's wire formats
    average = sum over ranks of decoded(sent) / world_size
    weights = anchor - outer_lr * average;  anchor = weights

With ``exchange="shared-index"`` the k indices are one rank's, the leader's, which rotates with
the syncs (sync s is led by rank s mod p): it selects from its own ``e`` and broadcasts the
index region (the index codec's bytes, once), every rank sends its ``e`` there in a float
wire dtype, an allreduce sums them, and ``e -= sent`` on every rank. What a rank receives is
then the index region and 2 (p-1)/p x k values whatever p is, where the all-gather's grows
as (p-1) payloads (docs/exchange.md). ``leader_filter`` (beta) puts ScaleCom's low-pass
filter on ``e`` there: ``e = (1 - beta) ef_decay e + beta (ef_decay e + delta - sent)``
(:func:`sparsecomm.hooks.wires.shared_index.low_pass`), and ``diagnose_leader_overlap``
measures how many of the leader's indices are among the top k of the ranks' summed buffers.
With ``exchange="owner"``
(the owner wire, :mod:`sparsecomm.hooks.wires.owner`) every rank sends each owner its selection of that
owner's range, the owner sums them with its owner residual and selects again at the same
density and codecs, and the owners' replies are all-gathered: about k entries sent and
2 k (p-1)/p received per rank, any value codec, error feedback at both levels (with
``owner_dropped="sender"``, what an owner's re-selection drops goes back to each sender's
error buffer instead of the owner residual).

Every rank decodes the same gathered bytes in rank order from the same anchor, so every
replica holds the same bits after a sync (the tests check it). A sync whose new anchor
would not be finite is refused on every rank alike, with nothing changed
(:mod:`sparsecomm.averaging.sync_guard`): no Inf or NaN reaches the anchor, the error
buffer or another replica. The inner optimizers'
states stay per rank, as in SparseLoCo and DiLoCo. The payload is the one the top-k hook
sends for a bucket of the model's size (``selector``, ``chunk_size``, ``index_codec``,
``value_codec``: docs/wire.md), all-gathered; bytes are counted as the hook counts them.
"""
import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sparsecomm import compress
from sparsecomm.averaging import rank_agreement, sharded_model, state_check
from sparsecomm.averaging.sharded_model import local_tensor
from sparsecomm.averaging.sync_guard import all_finite, refusal
from sparsecomm.comm.collectives import allgather_future
from sparsecomm.compress.value_codecs import FLOAT_CODECS
from sparsecomm.fsdp.fsdp_modules import is_fsdp_module
from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.local_gradient import local_gradient_hook
from sparsecomm.hooks.pipeline import steps
from sparsecomm.hooks.wires.base import WireCall, WireContext
from sparsecomm.hooks.wires.integrity import StepSeals
from sparsecomm.hooks.wires.shared_index_owners import SharedIndexOwnersWire
from sparsecomm.hooks.state.settings import check_bool, check_choice, check_int, check_real

STATS = ("syncs", "bytes_sent", "bytes_dense", "bytes_received", "elements_sent", "elements_total",
         "seconds_encode", "seconds_exchange", "seconds_decode", "leader_overlap_syncs", "leader_overlap_sum")
LEADER_OVERLAP = {"leader_overlap_buckets": "leader_overlap_syncs", "leader_overlap_sum": "leader_overlap_sum"}
"""The wire's counts the averager keeps (``diagnose_leader_overlap``; the model is one bucket, so a
measured bucket is a measured sync), under its own names; the wire's timings are inside its own."""


EXCHANGES = ("allgather", "owner", "shared-index", "auto")


@dataclasses.dataclass
class StartedSync:
    """A sync whose last collective is under way: applied by ``_finish`` (at once, or one
    step late with ``overlap``)."""

    step: int  # the optimizer step that started it
    future: torch.futures.Future  # the last collective's: its result feeds outer_step
    new_error: torch.Tensor  # the error buffer once it is applied
    outer_step: Callable[[torch.Tensor], torch.Tensor]  # the collective's result -> the new anchor
    refusal: Callable[[torch.Tensor], Exception]  # the error every rank raises when the new anchor is not finite
    commit: Callable[[], None] | None = None  # the exchange's own buffers, assigned with the anchor
    counts: dict = dataclasses.field(default_factory=dict)  # counters known when it started
    weights: torch.Tensor | None = None  # overlap: the local weights when it started


def check_settings(*, period, density, selector, chunk_size, index_codec, value_codec, outer_lr, ef_decay,
                   exchange="allgather", link=None, overlap=False, leader_filter=None,
                   diagnose_leader_overlap=False, owner_dropped="owner") -> TopKConfig:
    """The averager's settings checked (ValueError/TypeError naming the argument and its
    range); returns the wire's TopKConfig. Needs no model: configs are checked before a run."""
    check_int("period", period, 1)
    check_real("outer_lr", outer_lr, 0.0, math.inf, low_open=True, high_open=True)
    check_real("ef_decay", ef_decay, 0.0, 1.0, low_open=False, high_open=False)
    check_choice("selector", selector, ("chunk", "exact"))
    check_choice("exchange", exchange, EXCHANGES)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if leader_filter is not None:
        leader_filter = check_real("leader_filter", leader_filter, 0.0, 1.0, low_open=True, high_open=False)
    check_bool("diagnose_leader_overlap", diagnose_leader_overlap)
    for name, value, default in (("leader_filter", leader_filter, None),
                                 ("diagnose_leader_overlap", diagnose_leader_overlap, False)):
        if value != default and exchange != "shared-index":
            raise ValueError(f"{name}={value!r} is a setting of exchange='shared-index' (the rotating leader's index "
                             f"set), got exchange={exchange!r}")
    # The wire's own validation: the same refusals and messages as the hook's (shared-index:
    # a float wire). The averager keeps its own error feedback, so the hook's (and its
    # warm-up) is off here; the wire checksum is on, as the hook's default: every payload the
    # averager puts on a wire is sealed and checked before it is decoded.
    # Its shared-index exchange also takes quantized values (through the owners), which the
    # hook's does not: those settings are checked as the hook's all-gather wire.
    quantized = is_quantized(value_codec)
    config = TopKConfig.build(density=density, selector=selector, chunk_size=chunk_size, index_codec=index_codec,
                              value_codec=value_codec, warmup_steps=0, error_feedback=False,
                              exchange="allgather" if exchange == "shared-index" and quantized else exchange,
                              wire_checksum=True, link=link, owner_dropped=owner_dropped)
    # The shared-index wire reads the leader's settings from its config; checked above against
    # the averager's own exchange and error feedback (which the hook's checks do not see).
    return dataclasses.replace(config, leader_filter=leader_filter, diagnose_leader_overlap=diagnose_leader_overlap)


def is_quantized(value_codec: str | None) -> bool:
    """Values written with a scale (int8 ... sign), which the shared-index exchange sums through the
    owners (:mod:`~sparsecomm.hooks.wires.shared_index_owners`) instead of one allreduce."""
    return value_codec is not None and value_codec not in FLOAT_CODECS


def choose_exchange(config: TopKConfig, numel: int, density: float, world_size: int) -> str:
    """``exchange="auto"``: the exchange whose wire the hook's cost model
    (:mod:`sparsecomm.hooks.pipeline.exchange_choice`) finds fastest on ``config.link`` for one
    buffer of the model's size (the averager has no dense path: dense is not a candidate).
    The same numbers on every rank give the same choice, with no collective."""
    from sparsecomm.hooks.pipeline import exchange_choice

    costs = exchange_choice.modelled_seconds(config, numel, density, torch.float32,
                                             config.value_dtype or torch.float32, world_size,
                                             compress.num_selected(numel, density))
    costs.pop("dense", None)
    return min(costs, key=costs.get)  # ties: the first, in the cost model's candidate order


class SparseDeltaAverager:
    """Local steps with a sparse outer sync; call :meth:`step` after every ``optimizer.step()``
    that happened (not after a step the loop skipped).

    Args:
        ddp_model: the DDP model (no comm hook yet: the averager registers its own).
        period: optimizer steps between outer syncs (H), an integer >= 1.
        density: fraction of the model's entries sent per sync, in (0, 1] (64/4096 = 1.5625%: SparseLoCo's).
        selector: "chunk" (the top entries of every ``chunk_size`` entries) or "exact".
        chunk_size, index_codec, value_codec: the wire, as :class:`sparsecomm.TopKState`
            (defaults: chunks of 4096, Rice-coded indices, 2-bit values with a bf16 scale per chunk).
        outer_lr: the outer step's learning rate, > 0 (SparseLoCo: 0.6-1.0).
        ef_decay: decay of the error-feedback buffer, in [0, 1] (SparseLoCo: 0.95).
        exchange: "allgather" (every rank's payload to every rank), "owner" (each rank's
            selection of an owner's range to that owner, which selects again from their sum
            and its owner residual; the owners' replies all-gathered) or "shared-index" (a
            rotating leader's indices, every rank's values there allreduced; needs a float
            ``value_codec``: None/"fp32", "bf16" or "fp16"). Owner and shared-index keep
            the bytes a rank receives flat in p; the all-gather's grow as p - 1. "auto" picks
            the one the cost model finds fastest on ``link`` (:func:`choose_exchange`; the
            choice is :attr:`exchange`). Only time is modelled, not quality.
        link: the link "auto" models, e.g. "1gbit@100us" (None: the hook's default,
            10 Gb/s with 50 us per message); only with ``exchange="auto"``.
        owner_dropped: where the owner exchange keeps what an owner's re-selection drops:
            "owner" (default) in the owner residual; "sender" (Ok-Topk) back in each rank's own
            error buffer, its own part, the owner residual keeping only its reply's rounding (the
            hook's ``owner_dropped``, docs/exchange.md); only with ``exchange="owner"`` or "auto".
        leader_filter: with ``exchange="shared-index"``: ScaleCom's low-pass filter on the
            error buffer, beta in (0, 1] (None, the default, and 1: plain error feedback):
            ``e = (1 - beta) (ef_decay e) + beta (ef_decay e + delta - decoded(sent))``, so the
            rotating leader's selection of its own buffer follows what the replicas share
            (docs/exchange.md). Below 1, what is sent plus the new buffer is no longer the old
            buffer plus delta.
        diagnose_leader_overlap: with ``exchange="shared-index"``: at every sync, one more
            allreduce (the ranks' buffers summed, dense) and the share of the leader's indices
            among the top k of that sum; :meth:`stats` ``leader_overlap`` (mean over the syncs
            measured) and ``leader_overlap_last``. A diagnostic: off by default.
        overlap: False (default): a sync finishes inside the :meth:`step` that starts it.
            True: the sync's last collective (the all-gather of the payloads or of the
            owners' replies, or the shared-index allreduce) runs while the next optimizer step
            computes, and the next :meth:`step` applies it one step late, keeping the local
            step taken meanwhile (``weights = new anchor + (weights - weights at the sync)``:
            the eager correction); the wait it still costs is the exposed communication.
            The replicas then agree only after :meth:`flush` (a checkpoint needs one).
        process_group: the group to average over (None: the default group).
        mesh, replicate_dim, shard_dim: for an FSDP2 model (``fully_shard`` over
            ``mesh[shard_dim]`` of a (replicate, shard) mesh, as for
            :func:`sparsecomm.register_hsdp_hook`) instead of a DDP model: every rank averages its
            local shards with the same shards of the other replicas, over
            ``mesh.get_group(replicate_dim)``; between syncs FSDP reduces inside the shard
            group only. The replicas must start from the same weights (checked: FSDP does not
            broadcast them).
    """

    def __init__(self, ddp_model, *, period: int = 16, density: float = 64 / 4096, selector: str = "chunk",
                 chunk_size: int = 4096, index_codec: str = "rice", value_codec: str | None = "int2",
                 outer_lr: float = 0.7, ef_decay: float = 0.95, process_group: dist.ProcessGroup | None = None,
                 register_hook: bool = True, exchange: str = "allgather", link: str | None = None,
                 overlap: bool = False, mesh=None, replicate_dim: str = "replicate", shard_dim: str = "shard",
                 leader_filter: float | None = None, diagnose_leader_overlap: bool = False,
                 owner_dropped: str = "owner"):
        sharded = is_fsdp_module(ddp_model)
        if not sharded and not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"ddp_model must be a torch DistributedDataParallel model or an FSDP2 (fully_shard) "
                            f"model with mesh=, got {type(ddp_model).__name__}")
        if sharded and (mesh is None or process_group is not None):
            raise ValueError("an FSDP2 model averages over the replicas of mesh=(replicate, shard): pass mesh, "
                             "not process_group")
        if not sharded and mesh is not None:
            raise ValueError("mesh is for FSDP2 models; a DDP model averages over process_group")
        wire_config = check_settings(period=period, density=density, selector=selector, chunk_size=chunk_size,
                                     index_codec=index_codec, value_codec=value_codec, outer_lr=outer_lr,
                                     ef_decay=ef_decay, exchange=exchange, link=link, overlap=overlap,
                                     leader_filter=leader_filter, diagnose_leader_overlap=diagnose_leader_overlap,
                                     owner_dropped=owner_dropped)
        self.wire_config = wire_config
        self.agreed = False  # the ranks' settings were compared (at the first sync, and again after a load)
        self.period, self.outer_lr, self.ef_decay = period, float(outer_lr), float(ef_decay)
        self.exchange_setting, self.link, self.overlap = exchange, link, overlap
        self._in_flight = None  # with overlap: the started sync, applied by the next step()
        self.density, self.selector, self.chunk_size = wire_config.density, selector, chunk_size
        self.index_codec, self.value_codec = index_codec, value_codec
        if sharded:
            process_group = sharded_model.replica_group(ddp_model, mesh, replicate_dim, shard_dim)
            register_hook = False  # FSDP reduces inside the shard group only: nothing crosses replicas
        self.process_group = process_group
        self.module = ddp_model if sharded else ddp_model.module
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("ddp_model has no parameter that requires grad: nothing to average")
        numel = sum(local_tensor(p).numel() for p in self.params)
        device = local_tensor(self.params[0]).device
        if exchange == "auto":
            exchange = choose_exchange(wire_config, numel, self.density, dist.get_world_size(process_group))
        self.exchange = exchange  # the exchange the syncs use ("auto"'s choice)
        self.owner_residual = None  # the owner exchange's second-level error feedback (sum over ranks)
        # The wire's value dtype: a float codec's; the scaled codecs decode to float32.
        self.value_dtype = wire_config.value_dtype or FLOAT_CODECS.get(value_codec, torch.float32)
        # The hook's wire for one bucket of the model's size: its kernels, checksums and byte counts.
        if exchange == "shared-index" and is_quantized(value_codec):  # (a wire the hook's settings refuse)
            self.wire = SharedIndexOwnersWire(wire_config, numel, self.density, dist.get_world_size(process_group))
        else:
            self.wire = steps.build(wire_config, exchange, numel, self.density,
                                    compress.num_selected(numel, self.density), self.value_dtype,
                                    dist.get_world_size(process_group))
        if exchange == "owner" or isinstance(self.wire, SharedIndexOwnersWire):  # the owners' second level
            self.owner_residual = torch.zeros(numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            self.anchor = self._flat_weights()  # replicas are equal here: DDP broadcast rank 0's weights
        if sharded:
            sharded_model.check_replicas_start_equal(self.anchor, process_group)  # FSDP broadcasts nothing
        self.error = torch.zeros(numel, dtype=torch.float32, device=device)
        self.step_count = 0
        self.counters = dict.fromkeys(STATS, 0)
        self.counters["seconds_encode"] = self.counters["seconds_exchange"] = self.counters["seconds_decode"] = 0.0
        self.leader_overlap_last = None  # diagnose_leader_overlap: the last sync's (not saved: a figure)
        if register_hook:  # False: the caller registers local_gradient_hook itself (wrapped, e.g. timed)
            ddp_model.register_comm_hook(None, local_gradient_hook)

    @contextlib.contextmanager
    def consensus_weights(self):
        """Inside, the model holds the weights of the last sync (the same on every rank: the
        model the replicas agree on, to evaluate); its local weights come back after."""
        with torch.no_grad():
            local = self._flat_weights()
            self._write_weights(self.anchor)
        try:
            yield self.module
        finally:
            with torch.no_grad():
                self._write_weights(local)

    # -- the hook-state protocol the checkpoint manager reads ----------------------------------

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps counted (the checkpoint manager checks it against its own)."""
        return self.step_count

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    # -- the outer step --------------------------------------------------------------------------

    def step(self) -> bool:
        """Count one optimizer step; at the end of a period, sync (True when it did).

        Call it after every ``optimizer.step()`` that happened, and not after a step the
        loop skipped: every rank's k-th sync is the same collective, so ranks may skip
        different steps (their syncs then fall on different batches; a rank waits in the
        sync's all-gather for the others). A loop whose ranks can skip different steps must
        therefore end on :attr:`optimizer_steps`, the same on every rank, not on a count of
        batches. Raises :class:`~sparsecomm.averaging.NonFiniteSyncError` on every rank
        alike, with nothing changed and this step not counted, when the sync would put
        Inf or NaN into the weights (with ``overlap``: raised by the step() that applies
        the sync, which then is dropped: the weights keep their local progress, the anchor
        and the error buffer are as before it, and the next sync sends it all). The first
        sync (and the first after :meth:`load_state_dict`) first compares the ranks' settings
        (period, density, wire, outer_lr, ef_decay, exchange, overlap, model size, step
        count): if any differ, every rank raises the same ValueError naming each rank's
        value, before the sync's collectives (:mod:`sparsecomm.averaging.rank_agreement`)."""
        step = self.step_count + 1
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self._finish(in_flight)
        if step % self.period == 0:
            if self.overlap:
                self._in_flight = self._start(step)
            else:
                self._finish(self._start(step))
        self.step_count = step
        return step % self.period == 0

    @property
    def pending_collectives(self) -> int:
        """Syncs started and not yet applied (0 or 1; with ``overlap`` only). The checkpoint
        manager refuses to save while one is in flight: call :meth:`flush` first."""
        return int(self._in_flight is not None)

    def flush(self) -> None:
        """Apply the sync in flight now, if any (``overlap``): right after a sync step the
        replicas then hold the same weights, as without overlap."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self._finish(in_flight)

    @torch.no_grad()
    def _start(self, step: int) -> "StartedSync":
        """Encode this rank's outer step and run its exchange up to the last collective,
        which is issued and not waited for (the all-gather of the payloads or of the owners'
        replies, or the allreduce of the shared-index values)."""
        if not self.agreed:  # one small all-gather before the sync's own collectives
            rank_agreement.check_ranks_agree(self, self.wire_config, step, self.anchor.device)
            self.agreed = True
        started = time.perf_counter()
        weights = self._flat_weights()
        new_error = self.error * self.ef_decay
        sync = self._start_on_wire(step, weights, new_error)
        sync.weights = weights if self.overlap else None
        sync.counts["seconds_encode"] = time.perf_counter() - started
        return sync

    def _start_on_wire(self, step: int, weights: torch.Tensor, new_error: torch.Tensor) -> "StartedSync":
        """The sync on the hook's wire (all-gather, owner or shared index), the model's flat
        buffer one bucket: ``new_error`` becomes ``ef_decay * error + delta - decoded(sent)``, the
        owner exchange's owner residual its owners' second level; every payload sealed and
        checked; the future's value is the sum over ranks of what they sent (the owners' replies)."""
        wire, world_size = self.wire, self.world_size
        kept = dict.fromkeys(LEADER_OVERLAP.values(), 0)

        def count(**counted):  # the leader overlap kept; the wire's timings are inside the averager's seconds_*
            for name, value in counted.items():
                if name in LEADER_OVERLAP:
                    kept[LEADER_OVERLAP[name]] += value

        call = self._wire_call(step, self.anchor - weights, torch.empty_like(self.anchor), count)
        new_owner_residual = call.owner_memory = None if self.owner_residual is None else self.owner_residual.clone()
        fused = wire.fuses_compensation(call)
        if not fused:  # the reference forms acc here, the kernel in its own pass
            call.grad.add_(new_error)
        packed = wire.encode(call, new_error, fused)  # the hook's step 3
        future = wire.exchange(call, packed)  # its step 5
        accumulate = wire.accumulate(call, packed)  # its step 6, run here when the sync is applied (so a
        # payload that fails its check raises its WireIntegrityError in the caller, not in a callback)

        def outer_step(_) -> torch.Tensor:
            summed = accumulate(future)
            if packed.layout is None:  # values at indices every rank shares: only those entries move
                new_anchor = self.anchor.clone()
                new_anchor[packed.indices] -= self.outer_lr * (summed[packed.indices] / world_size)
                return new_anchor
            summed.div_(world_size)  # the mean of what the ranks sent, then the outer step from the anchor:
            return torch.sub(self.anchor, summed, alpha=self.outer_lr, out=summed)

        def refused(summed: torch.Tensor) -> Exception:
            if wire.name == "allgather":  # every rank's payload is here: name the ranks whose decodes are not finite
                rows = wire.gathered.view(world_size, -1)[:, : wire.layout.nbytes]
                return refusal(rows, self._decoded, step)
            return self._refusal_naming_senders(bool(torch.isfinite(packed.values).all()), step)

        def commit():
            if new_owner_residual is not None:
                self.owner_residual = new_owner_residual

        return StartedSync(step, future, new_error, outer_step, refused, commit,
                           dict(bytes_sent=wire.bytes_sent(call, packed), elements_sent=packed.count,
                                bytes_received=wire.bytes_received(call, packed), **kept))

    def _wire_call(self, step: int, delta: torch.Tensor, out: torch.Tensor, count) -> WireCall:
        """The model's flat buffer as the one bucket of a wire call, for the sync at ``step``
        (the context's step is the sync's number, which rotates the shared-index leader);
        ``count`` takes the wire's counts."""
        context = WireContext(caller="SparseDeltaAverager", count=count, seals=StepSeals(),
                              rank=dist.get_rank(self.process_group), step=step // self.period - 1)
        group = dist.group.WORLD if self.process_group is None else self.process_group
        call = WireCall(context, 0, ("model",), (delta.numel(),), group, self.world_size)
        call.divisor = 1.0  # the mean is taken after the sum (outer_step)
        call.grad, call.out, call.wire, call.value_dtype = delta, out, self.wire, self.value_dtype
        call.k = self.wire.capacity
        call.ks = (call.k,)
        call.fusable = True  # nothing reads acc: a kernel may form it in its own pass
        return call

    @torch.no_grad()
    def _finish(self, sync: "StartedSync") -> None:
        """Wait for a started sync's last collective and apply it: the outer step into new
        buffers, assigned only when the new anchor is finite (the same bits, so the same
        verdict, on every rank); with overlap, plus the local step taken since it started."""
        waited = time.perf_counter()
        result = sync.future.wait()
        exchanged = time.perf_counter()
        new_anchor = sync.outer_step(result)
        if not all_finite(new_anchor):
            raise sync.refusal(result)
        if sync.commit is not None:
            sync.commit()
        weights = new_anchor
        if sync.weights is not None:  # overlap: keep the local step(s) taken while it travelled
            weights = new_anchor + (self._flat_weights() - sync.weights)
        self.anchor, self.error = new_anchor, sync.new_error
        if sync.counts["leader_overlap_syncs"]:
            self.leader_overlap_last = sync.counts["leader_overlap_sum"] / sync.counts["leader_overlap_syncs"]
        self._write_weights(weights)
        done = time.perf_counter()
        self._count(syncs=1, bytes_dense=self.anchor.numel() * 4, elements_total=self.anchor.numel(),
                    seconds_exchange=exchanged - waited, seconds_decode=done - exchanged, **sync.counts)

    def _refusal_naming_senders(self, finite: bool, step: int):
        """The refusal of a sync whose values were summed (no rank's payload on its own):
        every rank's own verdict (``finite``: what it sent, or its error buffer, was finite)
        gathered, one row per rank, Inf where it was not."""
        mine = torch.tensor([0.0 if finite else math.inf], device=self.anchor.device)
        verdicts = torch.empty(self.world_size, dtype=mine.dtype, device=mine.device)
        allgather_future(verdicts, mine, self.process_group).wait()
        return refusal(verdicts.view(self.world_size, 1), lambda row: row, step)

    def _decoded(self, gathered: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(self.anchor)
        self.wire.decode_add(gathered, out)
        return out

    def _flat_weights(self) -> torch.Tensor:
        return torch.cat([local_tensor(p.detach()).reshape(-1).float() for p in self.params])

    def _write_weights(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            local = local_tensor(p.data)  # an FSDP2 parameter: this rank's shard, written in place
            local.copy_(flat[offset: offset + local.numel()].view_as(local))
            offset += local.numel()

    def _count(self, **increments) -> None:
        for name, value in increments.items():
            self.counters[name] += value

    # -- stats and checkpoints -------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since construction (or the last load), for this rank; byte counters as
        :meth:`sparsecomm.TopKState.stats` (``bytes_dense``: an fp32 allreduce of the
        weights at every sync); ``bytes_sent_per_step``: amortised over the steps counted."""
        s = dict(self.counters)
        s["steps"] = self.step_count
        s["compression"] = s["bytes_sent"] / s["bytes_dense"] if s["bytes_dense"] else None
        s["bytes_sent_per_step"] = s["bytes_sent"] / self.step_count if self.step_count else None
        measured = s["leader_overlap_syncs"]
        s["leader_overlap"] = s["leader_overlap_sum"] / measured if measured else None
        s["leader_overlap_last"] = self.leader_overlap_last
        s["residual_reset"] = False
        return s

    def settings(self) -> dict:
        settings = {"period": self.period, "density": self.density, "selector": self.selector,
                    "chunk_size": self.chunk_size, "index_codec": self.index_codec, "value_codec": self.value_codec,
                    "outer_lr": self.outer_lr, "ef_decay": self.ef_decay}
        if self.exchange_setting != "allgather":  # (checkpoints of the all-gather keep the keys they always had)
            settings["exchange"] = self.exchange_setting
        if self.link is not None:
            settings["link"] = self.link
        if self.overlap:
            settings["overlap"] = True
        if self.wire_config.leader_filter is not None:  # (what the error buffer holds depends on it)
            settings["leader_filter"] = self.wire_config.leader_filter
        if self.wire_config.owner_dropped != "owner":  # (so do the error buffer and the owner residual)
            settings["owner_dropped"] = self.wire_config.owner_dropped
        return settings

    def state_dict(self) -> dict:
        """This rank's state: its error buffer and the anchor (the weights at the last sync),
        and with the owner exchange its owner residual, under ``rank<r>.`` keys, with the
        settings and the step count."""
        if self._in_flight is not None:
            raise RuntimeError("SparseDeltaAverager.state_dict(): a sync is in flight (overlap=True) and its result "
                               "is in no buffer yet; call flush() first (right after a sync step the replicas then "
                               "agree, as a checkpoint needs)")
        rank = dist.get_rank(self.process_group)
        return {"kind": "SparseDeltaAverager", "settings": self.settings(), "step": self.step_count,
                "world_size": self.world_size, "counters": dict(self.counters),
                **{f"rank{rank}.{name}": buffer.clone() for name, buffer in self._buffers().items()}}

    def _buffers(self) -> dict:
        """This rank's per-rank buffers by name (state_check.BUFFERS, and the owner residual)."""
        buffers = {"error": self.error, "anchor": self.anchor}
        if self.owner_residual is not None:
            buffers["owner_residual"] = self.owner_residual
        return buffers

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Restore :meth:`state_dict` bit for bit, all or nothing: the whole dict is checked
        first (:mod:`sparsecomm.averaging.state_check`: format, keys, step >= 0, world size,
        this rank's entries, their dtype, size and finiteness, counters and, ``strict``,
        the settings), a ValueError names the key and what is accepted, and only a dict
        that passes is assigned. ``strict=False`` loads it under other settings."""
        checked = state_check.check(state, rank=dist.get_rank(self.process_group), world_size=self.world_size,
                                    numel=self.anchor.numel(), settings=self.settings(), counter_names=STATS,
                                    strict=strict, buffers=tuple(self._buffers()))
        for name, buffer in self._buffers().items():
            buffer.copy_(checked.buffers[name])
        self.step_count = checked.step
        self.counters = dict.fromkeys(STATS, 0) | checked.counters
        self.agreed = False  # every rank may have loaded another step: compare again at the next sync

    def __deepcopy__(self, memo):
        # The checkpoint manager stages a restore on a copy: copy the state, share the model.
        clone = copy.copy(self)
        clone.error, clone.anchor = self.error.clone(), self.anchor.clone()
        if self.owner_residual is not None:
            clone.owner_residual = self.owner_residual.clone()
        clone.counters = dict(self.counters)
        return clone
