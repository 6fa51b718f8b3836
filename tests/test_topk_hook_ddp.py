"""The top-k hook inside real DDP: 2 gloo ranks in spawned processes, different data per rank.

Each test localises one class of bug:
- density 1 vs torch's allreduce: averaging and in-place decompression;
- conservation and per-rank residuals: error-feedback bookkeeping, rank mixing;
- bucket rebuild / bucket size change: residuals keyed by name, not bucket index;
- no_sync, find_unused_parameters, static_graph, several buckets, fp16 wrapper: the DDP
  features the hook must compose with;
- state_dict: each rank keeps its own residual.
"""
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm import TopKState, topk_hook
from ddp_models import backward_error
from ddp_models import grads as _grads
from ddp_models import mlp as _mlp
from ddp_models import params as _params
from ddp_models import rank_data as _rank_data
from rank_processes import run_on_ranks

pytestmark = pytest.mark.timeout(120)

# The hook calls recorded by recording_hook in this process: (bucket index, numel, is_last).
CALLS = []


def recording_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    CALLS.append((bucket.index(), bucket.buffer().numel(), bucket.is_last()))
    return topk_hook(state, bucket)


# ----- density 1 equals allreduce ---------------------------------------------------------


def _density_one_worker(rank, world_size, allow_dense_fallback):
    reference = DDP(_mlp())
    reference.register_comm_hook(None, allreduce_hook)
    hooked = DDP(_mlp())
    state = TopKState(density=1.0, module=hooked, allow_dense_fallback=allow_dense_fallback)
    hooked.register_comm_hook(state, topk_hook)
    mismatches = []
    for step, x in enumerate(_rank_data(rank, 5, (8, 32))):
        for model in (reference, hooked):
            model.zero_grad()
            model(x).pow(2).mean().backward()
        for a, b in zip(_grads(reference.module), _grads(hooked.module)):
            if not torch.equal(a, b):
                mismatches.append((step, (a - b).abs().max().item()))
    return mismatches, state.stats()


@pytest.mark.parametrize("allow_dense_fallback", [True, False], ids=["dense-fallback", "sparse-k-equals-n"])
def test_density_one_equals_allreduce_hook_bitwise(allow_dense_fallback):
    # Bitwise: both divide by world size first, then sum two values per element; with two
    # ranks the all-gather + scatter-add onto zeros is 0 + a + b == a + b exactly.
    for mismatches, stats in run_on_ranks(_density_one_worker, allow_dense_fallback):
        assert mismatches == [], f"(step, max |diff|) where grads differ: {mismatches}"
        assert stats["warmup_calls"] >= 2
        if allow_dense_fallback:
            assert stats["sparse_calls"] == 0 and stats["fallback_calls"] >= 3
        else:
            assert stats["sparse_calls"] >= 3 and stats["effective_density"] == 1.0


# ----- conservation, per-rank residuals, several buckets ----------------------------------


def _several_buckets_worker(rank, world_size, selector, wrapper, value_dtype):
    CALLS.clear()
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    ddp = DDP(model, bucket_cap_mb=0.5)
    state = TopKState(
        density=0.01, module=ddp, selector=selector, value_dtype=value_dtype, verify_conservation=True
    )
    hook = fp16_compress_wrapper(recording_hook) if wrapper else recording_hook
    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for x in _rank_data(rank, 6, (16, 256)):
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
    residuals = {k: v for k, v in state.state_dict().items() if ".residual." in k}
    return list(CALLS), residuals, _params(model), state.stats()


@pytest.mark.parametrize(
    "selector,wrapper,value_dtype",
    [
        ("exact", False, None),
        ("sampled", False, None),
        ("random", False, None),
        ("exact", True, None),  # fp16_compress_wrapper: the hook sees an fp16 buffer
        ("exact", False, torch.bfloat16),  # narrower values on the wire
    ],
    ids=["exact", "sampled", "random", "fp16-wrapper", "bf16-values"],
)
def test_conservation_rebuild_and_per_rank_residuals(selector, wrapper, value_dtype):
    results = run_on_ranks(_several_buckets_worker, selector, wrapper, value_dtype)
    (calls, residuals0, params0, stats), (_, residuals1, params1, _) = results
    # verify_conservation=True made the hook check sent + residual == grad/ws + old residual
    # bit for bit on every sparse call; reaching here means it held every step.
    assert stats["sparse_calls"] > 0 and stats["steps"] == 6
    # DDP rebuilt its buckets after iteration 0 (one 1.5 MB bucket, then several of
    # <= 0.5 MB): the test really crosses a rebuild with residuals alive.
    first_step = [c for c in calls[: calls.index(next(c for c in calls if c[2])) + 1]]
    assert len(first_step) == 1
    assert len({index for index, _, _ in calls[-4:]}) >= 3
    # Residuals are keyed by parameter name and differ per rank (different data).
    names = {f"{i * 1}.{kind}" for i in range(6) for kind in ("weight", "bias")}
    assert {k.split(".residual.")[1] for k in residuals0} == names
    assert {k.split(".residual.")[1] for k in residuals1} == names
    assert all(k.startswith("rank0.") for k in residuals0) and all(k.startswith("rank1.") for k in residuals1)
    differing = [
        n for n in names if not torch.equal(residuals0[f"rank0.residual.{n}"], residuals1[f"rank1.residual.{n}"])
    ]
    assert len(differing) == len(names)
    # DDP replicas stay identical: every rank applied the same reduced gradient.
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)


def _broken_kernel(grad, residual, divisor, add_residual, k, indices_out, values_out, index_offset=0):
    """ef_topk_pack that forgets to keep what it did not send (drops gradient mass)."""
    sparsecomm.ops.reference.ef_topk_pack(grad, residual, divisor, add_residual, k, indices_out, values_out,
                                          index_offset)
    residual.zero_()


def _conservation_violation_worker(rank, world_size):
    sparsecomm.ops.register_kernel("ef_topk_pack", "cpu", _broken_kernel)
    ddp = DDP(_mlp())
    sparsecomm.register_topk_hook(ddp, density=0.1, verify_conservation=True)
    for step, x in enumerate(_rank_data(rank, 4, (8, 32))):
        try:
            ddp(x).pow(2).mean().backward()
        except Exception as error:  # DDP re-raises the hook's error from backward()
            return step, str(error)
    return None, ""


def test_conservation_check_catches_lost_mass():
    for step, message in run_on_ranks(_conservation_violation_worker):
        assert step == 2, "the first sparse step (after 2 warm-up steps) must fail"
        assert "sent + residual != grad/ws + old_residual" in message


# ----- residuals move with their parameters across a change of bucket size ----------------


def _bucket_size_change_worker(rank, world_size):
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = sparsecomm.register_topk_hook(ddp, density=0.05)
    for x in _rank_data(rank, 5, (8, 64)):
        ddp.zero_grad()
        ddp(x).pow(2).mean().backward()
    saved = state.state_dict()
    # Same parameters, very different bucket layout.
    ddp2 = DDP(model, bucket_cap_mb=25)
    state2 = TopKState(density=0.05, module=ddp2)
    state2.load_state_dict(saved)
    ddp2.register_comm_hook(state2, topk_hook)
    # A zero gradient makes the reduced gradient exactly what the residuals released.
    ddp2.zero_grad()
    (ddp2(torch.zeros(1, 64)).sum() * 0).backward()
    released = {n: p.grad.detach().clone().flatten() for n, p in model.named_parameters()}
    after = state2.state_dict()
    old = {k.split(".residual.")[1]: v for k, v in saved.items() if ".residual." in k}
    new = {k.split(".residual.")[1]: v for k, v in after.items() if ".residual." in k}
    return released, old, new


def test_residuals_follow_parameters_across_bucket_size_change():
    (released, old0, new0), (released1, old1, new1) = run_on_ranks(_bucket_size_change_worker)
    for name in released:
        assert torch.equal(released[name], released1[name])
        # Per element at most one of (released, new residual) is nonzero per rank, so this
        # sum is exact: what both ranks held == what was released + what both still hold.
        assert torch.equal((released[name] + new0[name]) + new1[name], old0[name] + old1[name]), name
        assert not torch.equal(old0[name], old1[name])


# ----- DDP features: no_sync, find_unused_parameters, static_graph ------------------------


class _Branchy(nn.Module):
    """Uses ``unused`` only on even steps: DDP must be told with find_unused_parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x, use_branch):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + self.unused(h)
        return self.head(h)


def _ddp_features_worker(rank, world_size, feature):
    if feature == "find_unused_parameters":
        model, ddp_kwargs = _Branchy(), {"find_unused_parameters": True}
    elif feature == "static_graph":
        model, ddp_kwargs = _mlp(), {"static_graph": True}
    elif feature == "gradient_as_bucket_view":
        model, ddp_kwargs = _mlp(), {"gradient_as_bucket_view": True}
    else:
        model, ddp_kwargs = _mlp(), {}
    ddp = DDP(model, **ddp_kwargs)
    state = sparsecomm.register_topk_hook(ddp, density=0.05, verify_conservation=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    micro = 3 if feature == "no_sync" else 1
    for step, x in enumerate(_rank_data(rank, 6 * micro, (8, 32))):
        args = (x, step % 2 == 0) if feature == "find_unused_parameters" else (x,)
        if (step + 1) % micro:
            with ddp.no_sync():
                ddp(*args).pow(2).mean().backward()
            continue
        ddp(*args).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return state.stats(), _params(model)


@pytest.mark.parametrize("feature", ["no_sync", "find_unused_parameters", "static_graph", "gradient_as_bucket_view"])
def test_ddp_features(feature):
    (stats, params0), (_, params1) = run_on_ranks(_ddp_features_worker, feature)
    # Steps count optimizer steps (synchronising backwards), not micro-batches.
    assert stats["steps"] == 6
    assert stats["sparse_calls"] >= 4
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)


def _no_sync_density_one_worker(rank, world_size):
    """Accumulated gradients through the hook at density 1 == DDP's own allreduce."""
    results = []
    for use_hook in (False, True):
        ddp = DDP(_mlp())
        if use_hook:
            ddp.register_comm_hook(TopKState(density=1.0, module=ddp), topk_hook)
        data = _rank_data(rank, 6, (8, 32))
        for i, x in enumerate(data):
            if i % 3 != 2:
                with ddp.no_sync():
                    ddp(x).pow(2).mean().backward()
            else:
                ddp(x).pow(2).mean().backward()
        results.append(_grads(ddp.module))
    return all(torch.equal(a, b) for a, b in zip(*results))


def test_no_sync_accumulation_matches_dense():
    assert run_on_ranks(_no_sync_density_one_worker) == [True, True]


# ----- state dict: rank-qualified, refused across ranks ----------------------------------


def _state_dict_worker(rank, world_size):
    ddp = DDP(_mlp())
    state = sparsecomm.register_topk_hook(ddp, density=0.05, selector="sampled")
    for x in _rank_data(rank, 4, (8, 32)):
        ddp(x).pow(2).mean().backward()
    saved = state.state_dict()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, saved)
    errors = {}
    other = everyone[1 - rank]
    for label, candidate, kwargs in [
        ("other rank", other, {}),
        ("world size", {**saved, "world_size": 4}, {}),
        ("config", {**saved, "config": {**saved["config"], "density": 0.5}}, {}),
    ]:
        try:
            TopKState(density=0.05, selector="sampled").load_state_dict(candidate, **kwargs)
        except ValueError as error:
            errors[label] = str(error)
    restored = TopKState(density=0.05, selector="sampled")
    restored.load_state_dict(saved)
    roundtrip = restored.state_dict()
    unpickled = pickle.loads(pickle.dumps(state))
    return saved, errors, roundtrip, unpickled.process_group, unpickled.state_dict()


def test_state_dict_is_rank_qualified_and_refuses_other_ranks():
    for rank, (saved, errors, roundtrip, pg, unpickled_sd) in enumerate(run_on_ranks(_state_dict_worker)):
        memory_keys = [k for k in saved if k.startswith("rank") and (".residual." in k or ".velocity." in k)]
        assert memory_keys and all(k.startswith(f"rank{rank}.") for k in memory_keys)
        assert f"state of rank(s) [{1 - rank}], this is rank {rank}" in errors["other rank"]
        assert "world_size=4" in errors["world size"] and "world_size=2" in errors["world size"]
        assert "density" in errors["config"] and "0.5" in errors["config"]
        for sd in (roundtrip, unpickled_sd):
            assert sd.keys() == saved.keys()
            for key in memory_keys:
                assert torch.equal(sd[key], saved[key]), key
        assert pg is None  # pickling drops the process group, as PowerSGDState does


# ----- misuse ------------------------------------------------------------------------------


def _double_registration_worker(rank, world_size):
    errors = []
    ddp = DDP(_mlp())
    sparsecomm.register_topk_hook(ddp, density=0.05)
    try:
        sparsecomm.register_topk_hook(ddp, density=0.05)
    except ValueError as error:
        errors.append(str(error))
    other = DDP(_mlp())
    other.register_comm_hook(None, allreduce_hook)
    try:
        sparsecomm.register_topk_hook(other, density=0.05)
    except ValueError as error:
        errors.append(str(error))
    state = TopKState(density=0.05, module=ddp)
    try:
        sparsecomm.register_topk_hook(DDP(_mlp()), state)
    except ValueError as error:
        errors.append(str(error))
    return errors


def test_double_registration_and_state_reuse_are_refused():
    for errors in run_on_ranks(_double_registration_worker):
        assert len(errors) == 3
        assert "already has a communication hook (topk_hook)" in errors[0]
        assert "allreduce_hook" in errors[1]
        assert "one TopKState per DDP model" in errors[2]


# ----- observers and in-flight tracking ---------------------------------------------------


def _observer_worker(rank, world_size):
    ddp = DDP(_mlp())
    state = sparsecomm.register_topk_hook(ddp, density=0.05)
    seen = []

    def record(event):
        seen.append((event.stage, event.step, event.dense, event.rank))

    state.add_observer(record)
    for x in _rank_data(rank, 3, (8, 32)):
        ddp(x).pow(2).mean().backward()
    pending_after_backward = state.pending_collectives
    refusal = None

    def save_mid_step(event):
        if event.stage == "packed":
            state.state_dict()

    state.remove_observer(record)
    state.add_observer(save_mid_step)
    try:
        ddp(torch.ones(8, 32)).pow(2).mean().backward()
    except Exception as error:  # DDP re-raises the hook's error from backward()
        refusal = str(error)
    return seen, pending_after_backward, refusal


def test_observers_see_every_stage_and_saving_mid_step_is_refused():
    for rank, (seen, pending, refusal) in enumerate(run_on_ranks(_observer_worker)):
        # one bucket per step: gradient -> packed -> reduced; dense during the 2 warm-up steps
        assert seen == [(stage, step, step < 2, rank) for step in range(3) for stage in ("gradient", "packed", "reduced")]
        assert pending == 0
        assert "collective(s) in flight" in refusal or "mid-update" in refusal


# ----- selection does not depend on DDP's bucket layout -----------------------------------


def _layout_worker(rank, world_size, selector):
    results = []
    for bucket_cap_mb in (0.01, 25):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        sparsecomm.register_topk_hook(ddp, density=0.02, selector=selector, k_scope="parameter")
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for x in _rank_data(rank, 6, (8, 64)):
            optimizer.zero_grad()
            ddp(x).pow(2).mean().backward()
            optimizer.step()
        results.append(_params(model))
    return all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("selector", ["exact", "random"])
def test_results_do_not_depend_on_bucket_cap(selector):
    # With k_scope="parameter" k is chosen inside each parameter, and random-k streams are
    # keyed by parameter name, so many small buckets and one big bucket train to bitwise
    # identical parameters.
    assert run_on_ranks(_layout_worker, selector) == [True, True]


# ----- native kernels and the pure-torch reference train identically ----------------------


def _training_worker(rank, world_size, k_scope, budget, observed):
    ddp = DDP(_mlp(), bucket_cap_mb=25 if budget == "bucket" else 0.002)  # the model budget: several buckets
    state = sparsecomm.register_topk_hook(ddp, density=0.05, k_scope=k_scope, budget=budget, momentum=0)
    if observed:  # an observer makes the hook compensate in the bucket first (unfused path)
        state.add_observer(lambda event: None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x in _rank_data(rank, 6, (8, 32)):
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
    return (_params(ddp.module), state.state_dict(), sparsecomm.ops.implementation("ef_topk_pack", "cpu").__module__,
            state.stats())


@pytest.mark.parametrize("k_scope, budget, observed, fused", [("bucket", "bucket", False, True),
                                                              ("parameter", "bucket", True, False),
                                                              ("bucket", "model", False, False)],
                         ids=["bucket-fused", "parameter-compensated-first", "model-budget-compensated-first"])
def test_native_kernels_train_bitwise_like_the_reference(monkeypatch, k_scope, budget, observed, fused):
    from sparsecomm.ops import native

    if not native.load()[0]:
        pytest.skip(f"native extension not built: {native.load()[1]}")
    results = {}
    for kernels in ("native", "reference"):
        monkeypatch.setenv("SPARSECOMM_KERNELS", kernels)  # inherited by the spawned ranks
        results[kernels] = run_on_ranks(_training_worker, k_scope, budget, observed)
    for (native_params, native_state, native_impl, native_stats), (ref_params, ref_state, ref_impl, ref_stats) in zip(
        results["native"], results["reference"]
    ):
        assert (native_impl, ref_impl) == ("sparsecomm.ops.native", "sparsecomm.ops.reference")
        # Both went through the kernels being compared: 4 sparse steps, on the fused path
        # unless an observer or the model budget (which counts acc's magnitudes) made the hook compensate first.
        for stats in (native_stats, ref_stats):
            assert stats["sparse_calls"] >= 4 and stats["fused_calls"] == (stats["sparse_calls"] if fused else 0)
        assert all(torch.equal(a, b) for a, b in zip(native_params, ref_params))
        assert native_state.keys() == ref_state.keys()
        assert all(torch.equal(native_state[key], ref_state[key]) for key in native_state
                   if isinstance(native_state[key], torch.Tensor))


def _fp16_with_bf16_wire_worker(rank, world_size):
    ddp = DDP(_mlp().half())
    sparsecomm.register_topk_hook(ddp, density=0.1, value_dtype=torch.bfloat16)
    return backward_error(ddp, _rank_data(rank, 1, (8, 32))[0].half())


def test_float16_gradients_with_bfloat16_values_are_refused_on_the_first_call():
    for message in run_on_ranks(_fp16_with_bf16_wire_worker):
        assert "value_dtype=torch.bfloat16 cannot carry float16 gradients" in message
