"""sparsecomm.register_hsdp_hook: top-k + error feedback across the replicas of an FSDP2
model sharded over mesh["shard"] of a (replicate, shard) mesh, on gloo.

Oracles: FSDP2 itself. At density 1 the hook's dense wire must equal, bit for bit after 30
steps, custom HSDP with a plain all-reduce (the hook torchtitan installs: divide by the
replica count, then sum), and at 2 replicas native HSDP (the model sharded over the 2-D
mesh) too: dividing by 2 is exact, so fl(a / 2 + b / 2) == fl(a + b) / 2, FSDP's average.
Sparse: conservation checked bit for bit on every call (verify_conservation), and every
replica of a shard holds the same parameters after every step. Every rank trains on its
own data; the model's second layer (3 rows) does not split evenly, so shards are padded.
"""
import pytest
import torch
import torch.distributed as dist

from fsdp_models import STEPS, loss, mesh_of, model_on, replica_check, train
from rank_processes import run_on_ranks

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::sparsecomm.DenseFallbackWarning")]

def _plain_allreduce(replicas):
    def hook(reduce_output: torch.Tensor) -> None:
        reduce_output.div_(dist.get_world_size(replicas))
        dist.all_reduce(reduce_output, group=replicas)
    return hook


def _dense_against_fsdp(rank, world_size, replicas, shards):
    from torch.distributed.fsdp import FSDPModule

    import sparsecomm

    mesh = mesh_of(replicas, shards)
    ours = model_on(mesh["shard"])
    state = sparsecomm.register_hsdp_hook(ours, mesh, density=1.0)  # dense: every call a fallback or warm-up
    ours_params = train(ours, rank, STEPS)

    plain = model_on(mesh["shard"])
    for module in plain.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(_plain_allreduce(mesh.get_group("replicate")))
    plain_params = train(plain, rank, STEPS)

    native_params = None
    if replicas == 2:
        native_params = train(model_on(mesh), rank, STEPS)  # sharded over the 2-D mesh: FSDP's own HSDP
    stats = state.stats()
    return ours_params, plain_params, native_params, stats["fallback_calls"] + stats["warmup_calls"], state.step


@pytest.mark.parametrize("replicas,shards", [(2, 2), (2, 4), (4, 2)])
def test_density_one_equals_custom_hsdp_with_a_plain_allreduce_bit_for_bit(replicas, shards):
    for rank, (ours, plain, native, dense_calls, steps) in enumerate(
            run_on_ranks(_dense_against_fsdp, replicas, shards, world_size=replicas * shards, timeout=200)):
        assert steps == STEPS and dense_calls == 3 * STEPS  # three FSDP modules with parameters, every step
        for a, b in zip(ours, plain):
            assert torch.equal(a, b), f"rank {rank}: the dense wire differs from a plain all-reduce"
        if native is not None:
            for a, b in zip(ours, native):
                assert torch.equal(a, b), f"rank {rank}: the dense wire differs from native HSDP at 2 replicas"


def _summing(model):
    """``model`` as torchtitan sets its FSDP modules: no division by FSDP (the loss is already
    divided), and sums on the wire (gloo has no PREMUL_SUM); FSDP then sums over every rank."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _plain_sum(replicas):
    def hook(reduce_output: torch.Tensor) -> None:
        dist.all_reduce(reduce_output, group=replicas)
    return hook


def _dense_summing_against_fsdp(rank, world_size, replicas, shards):
    from torch.distributed.fsdp import FSDPModule

    import sparsecomm

    mesh = mesh_of(replicas, shards)
    ours = _summing(model_on(mesh["shard"]))
    sparsecomm.register_hsdp_hook(ours, mesh, density=1.0)
    ours_params = train(ours, rank, STEPS)
    plain = _summing(model_on(mesh["shard"]))
    for module in plain.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(_plain_sum(mesh.get_group("replicate")))
    plain_params = train(plain, rank, STEPS)
    native_params = train(_summing(model_on(mesh)), rank, STEPS) if replicas == 2 else None
    return ours_params, plain_params, native_params


@pytest.mark.parametrize("replicas,shards", [(2, 2), (4, 1)])
def test_a_module_with_its_own_divide_factor_gets_the_sum_over_replicas(replicas, shards):
    # Oracles: native HSDP with the same factor (2 replicas), a plain summing all-reduce (4).
    # The hook's average times a power-of-two replica count is exactly the sum: fl(a/4 + b/4 +
    # c/4 + d/4) * 4 == fl(a + b + c + d), the divisions and the product being exact.
    for rank, (ours, plain, native) in enumerate(run_on_ranks(
            _dense_summing_against_fsdp, replicas, shards, world_size=replicas * shards, timeout=200)):
        for a, b in zip(ours, plain):
            assert torch.equal(a, b), f"rank {rank}: the hook's sum differs from a plain summing all-reduce"
        if native is not None:
            for a, b in zip(ours, native):
                assert torch.equal(a, b), f"rank {rank}: the hook's sum differs from native HSDP (factor 1.0)"


def _sparse_replicas_agree(rank, world_size, replicas, shards, options, bf16):
    import sparsecomm

    mesh = mesh_of(replicas, shards)
    model = model_on(mesh["shard"], bf16)
    state = sparsecomm.register_hsdp_hook(model, mesh, verify_conservation=True, **options)
    disagreements = []
    check = replica_check(model, mesh, disagreements)  # every replica of a shard alike after each step

    generator = torch.Generator().manual_seed(100 + rank)
    x0 = torch.randn(16, 8, generator=generator)
    with torch.no_grad():
        first_loss = loss(model, x0).float().item()
    train(model, rank, STEPS, check)
    with torch.no_grad():
        last_loss = loss(model, x0).float().item()
    stats = state.stats()
    residuals = {k: v.dtype for k, v in state.state_dict().items() if ".residual." in k}
    return disagreements, stats, state.step, first_loss, last_loss, residuals, mesh.get_local_rank("shard")


@pytest.mark.parametrize("options,bf16", [
    (dict(density=0.1, allow_dense_fallback=False), False),
    (dict(density=0.1, allow_dense_fallback=False, selector="chunk", chunk_size=16, index_codec="rice",
          value_codec="int4", exchange="owner"), False),
    (dict(density=0.1, allow_dense_fallback=False), True),
    (dict(density=0.1, allow_dense_fallback=False, budget="model", momentum=0.9, index_codec="rice",
          value_codec="int2"), False),
], ids=["exact-allgather", "chunk-rice-int4-owner", "bf16-reduce", "model-budget-dgc-rice-int2"])
def test_sparse_replicas_stay_identical_and_conservation_holds(options, bf16):
    replicas, shards = 4, 2
    results = run_on_ranks(_sparse_replicas_agree, replicas, shards, options, bf16, world_size=8, timeout=200)
    for rank, (disagreements, stats, step, first, last, residuals, shard) in enumerate(results):
        assert not disagreements, f"rank {rank}: replicas differ at (step, parameter) {disagreements[:3]}"
        assert step == STEPS
        assert stats["sparse_calls"] > 0 and stats["bytes_sent"] > 0
        assert last < first, f"rank {rank}: the loss did not fall ({first} -> {last})"
        # Residuals keyed by module and shard: a rank's state dict is its own shard's.
        assert sorted(residuals) == [f"rank{rank // shards}.residual.{m}.flat_shard{shard}" for m in ("0", "2")] + \
            [f"rank{rank // shards}.residual.flat_shard{shard}"]
        # A bfloat16 reduction keeps float32 residuals, so small gradients are not rounded away.
        assert set(residuals.values()) == {torch.float32}


def _refusals(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    import sparsecomm

    mesh = mesh_of(2, 2)
    messages = {}

    def refused(what, call, error=ValueError):
        try:
            call()
        except error as caught:
            messages[what] = str(caught)
        else:
            messages[what] = None

    refused("not fsdp", lambda: sparsecomm.register_hsdp_hook(torch.nn.Linear(2, 2), mesh), TypeError)
    model = model_on(mesh["shard"])
    refused("1-d mesh", lambda: sparsecomm.register_hsdp_hook(model, mesh["shard"]))
    refused("dim names", lambda: sparsecomm.register_hsdp_hook(model, mesh, replicate_dim="dp"))
    refused("state and kwargs",
            lambda: sparsecomm.register_hsdp_hook(model, mesh, sparsecomm.TopKState(), density=0.1))
    refused("own group", lambda: sparsecomm.register_hsdp_hook(model, mesh, sparsecomm.TopKState(dist.group.WORLD)))
    native = model_on(mesh)
    refused("native hsdp", lambda: sparsecomm.register_hsdp_hook(native, mesh))
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(other[0], mesh=mesh["replicate"])
    fully_shard(other, mesh=mesh["shard"])
    refused("other ranks", lambda: sparsecomm.register_hsdp_hook(other, mesh))
    sparsecomm.register_hsdp_hook(model, mesh, density=0.1)
    refused("twice", lambda: sparsecomm.register_hsdp_hook(model, mesh, density=0.1))
    return messages


def test_misuse_is_refused_by_name_before_any_collective():
    messages = run_on_ranks(_refusals, world_size=4, timeout=120)[0]
    expected = {
        "not fsdp": "fully_shard",
        "1-d mesh": "2-D",
        "dim names": "replicate_dim='dp'",
        "state and kwargs": "not both",
        "own group": "process group of its own",
        "native hsdp": "native HSDP",
        "other ranks": "not over this rank's mesh['shard']",
        "twice": "already has an all-reduce hook",
    }
    for what, fragment in expected.items():
        assert messages[what] is not None, f"{what}: not refused"
        assert fragment in messages[what], f"{what}: {messages[what]}"


class _Sharded(torch.nn.Module):
    """A module whose FSDP state is ``state``, as ``fully_shard`` would give it."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def _get_fsdp_state(self):
        return self.state


def test_parameter_groups_are_read_as_each_supported_torch_keeps_them():
    from types import SimpleNamespace

    from sparsecomm.fsdp.fsdp_modules import _param_groups

    first, second = object(), object()
    # torch 2.12 and later: a list; 2.11: one group, or None for a module without parameters.
    assert _param_groups(_Sharded(SimpleNamespace(_fsdp_param_groups=[first, second]))) == [first, second]
    assert _param_groups(_Sharded(SimpleNamespace(_fsdp_param_group=first))) == [first]
    assert _param_groups(_Sharded(SimpleNamespace(_fsdp_param_group=None))) == []
    with pytest.raises(RuntimeError, match=r"_fsdp_param_groups, or _fsdp_param_group before torch 2\.12.*"
                                           r"torch 2\.11 to 2\.13"):
        _param_groups(_Sharded(SimpleNamespace()))


def _overflow_then_resume(rank, world_size, replicas, shards, bad_step):
    """A run in which one rank's loss is NaN at ``bad_step`` (the loop sees it and skips the
    optimizer step), and a run that draws the same batch there but does not train on it."""
    import sparsecomm

    mesh = mesh_of(replicas, shards)
    results = {}
    for kind in ("overflow", "skipped"):
        model = model_on(mesh["shard"])
        state = sparsecomm.register_hsdp_hook(model, mesh, density=0.1, allow_dense_fallback=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(100 + rank)
        seen_non_finite = False
        for step in range(12):
            x = torch.randn(4, 8, generator=generator)
            if step == bad_step and kind == "skipped":
                continue
            value = loss(model, x)
            if step == bad_step and rank == 0:
                value = value * float("nan")
            value.backward()
            grads_finite = all(torch.isfinite(p.grad.to_local()).all() for p in model.parameters())
            if step == bad_step:
                seen_non_finite = not grads_finite
                optimizer.zero_grad()  # the loop skips the step, as a GradScaler would
                continue
            optimizer.step()
            optimizer.zero_grad()
        memories = {k: v for k, v in state.state_dict().items() if ".residual." in k}
        results[kind] = ([p.to_local().detach().clone() for p in model.parameters()], memories, state.step,
                         seen_non_finite, state.stats()["skipped_steps"])
    return results


def test_a_non_finite_step_is_seen_by_every_rank_and_leaves_no_trace():
    replicas, shards, bad_step = 2, 2, 5
    for rank, result in enumerate(run_on_ranks(_overflow_then_resume, replicas, shards, bad_step, world_size=4)):
        params, memories, steps, seen, skipped = result["overflow"]
        reference, reference_memories, reference_steps, _, _ = result["skipped"]
        # Rank 0's NaN reaches every rank: within its shard group by FSDP's reduce-scatter,
        # across replicas by the hook (non-finite entries are sent first).
        assert seen, f"rank {rank} did not see the non-finite step"
        assert skipped == 1 and steps == reference_steps == 11
        assert all(torch.isfinite(m).all() for m in memories.values())
        # Rolled back: afterwards the run is the one that never took the step, bit for bit.
        for a, b in zip(params, reference):
            assert torch.equal(a, b), f"rank {rank}: the skipped step left a trace in the weights"
        for key in memories:
            assert torch.equal(memories[key], reference_memories[key]), f"rank {rank}: {key} differs"


def _gradients_along_a_trajectory(rank, world_size, replicas, shards):
    """At each of STEPS AdamW steps of our model at density 1: its sharded gradients (with every
    module's hook input recorded) and native HSDP's, computed from the same weights and data
    (native's shards are set to ours before its backward), so each step's reduction is
    compared on its own and rounding does not compound through the optimizer."""
    import sparsecomm

    mesh = mesh_of(replicas, shards)
    inputs = []

    def recording(hook, name):
        def recorded(reduce_output):
            inputs.append(reduce_output.detach().clone())  # this replica's shard-group average
            hook(reduce_output)
        return recorded

    ours = model_on(mesh["shard"])
    sparsecomm.register_hsdp_hook(ours, mesh, density=1.0, wrap=recording)
    native = model_on(mesh)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    group = mesh.get_group("replicate")
    steps = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=generator)
        inputs.clear()
        loss(ours, x).backward()
        with torch.no_grad():
            for mine, theirs in zip(ours.parameters(), native.parameters()):
                theirs.to_local().copy_(mine.to_local())
        loss(native, x).backward()
        # The largest sum over replicas of |hook input|, over every module, for the bound.
        largest = 0.0
        for tensor in inputs:
            total = tensor.abs()
            dist.all_reduce(total, group=group)
            largest = max(largest, total.max().item())
        steps.append(([p.grad.to_local().reshape(-1).clone() for p in ours.parameters()],
                      [p.grad.to_local().reshape(-1).clone() for p in native.parameters()], largest))
        optimizer.step()
        optimizer.zero_grad()
        native.zero_grad()
    return steps


def test_density_one_equals_native_hsdp_within_rounding_at_four_replicas():
    replicas = 4
    u = 2.0 ** -24
    for rank, steps in enumerate(run_on_ranks(_gradients_along_a_trajectory, replicas, 2, world_size=8, timeout=200)):
        assert len(steps) == STEPS
        for step, (ours, native, largest) in enumerate(steps):
            # Both sum the same R terms g_r / R (dividing by R = 4 is exact in binary), in
            # orders of their own: each sum is within (R - 1) u sum_r |g_r| / R of the exact
            # one, so the two differ by at most twice that. The hook's buffers are padded and
            # come in backward order, so the bound is taken at its largest entry over all of them.
            bound = 2 * (replicas - 1) * u * largest / replicas
            ours, native = torch.cat(ours), torch.cat(native)
            assert (ours != 0).any() and (ours - native).abs().max().item() <= bound, f"rank {rank}, step {step}"
