"""register_hsdp_hook on GPUs with NCCL: the paths the gloo tests cannot reach (the hook's own
CUDA stream, which FSDP waits on before it uses the reduced shard; the CUDA selection and
codecs). Skipped without enough GPUs; scripts/gpu_check.sh runs it.

- one GPU (a 1 x 1 mesh): at density 1 the hook on its own stream leaves, bit for bit after 30
  steps, the weights of FSDP without a hook (averaging one replica divides by 1), so FSDP
  read the shard only after the hook's stream wrote it; sparse (per-chunk top-k, Rice, int4,
  the conservation audit on every call) trains;
- 2 or 4 GPUs (2 x 1, 2 x 2): at density 1, bit for bit custom HSDP with a plain NCCL
  all-reduce hook; sparse: every replica of a shard holds the same weights after every step.
"""
import pytest
import torch
import torch.distributed as dist

from fsdp_models import STEPS, loss, mesh_of, model_on, replica_check, train
from rank_processes import run_on_ranks

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::sparsecomm.DenseFallbackWarning"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")]


def _needs_gpus(count):
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} GPU(s), one NCCL rank each")


def _plain_allreduce(replicas):
    def hook(reduce_output: torch.Tensor) -> None:
        reduce_output.div_(dist.get_world_size(replicas))
        dist.all_reduce(reduce_output, group=replicas)
    return hook


def _with_plain_hooks(model, replicas):
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(_plain_allreduce(replicas))
    return model


def _dense_against_plain(rank, world_size, replicas, shards):
    import sparsecomm

    mesh = mesh_of(replicas, shards, "cuda")
    ours = model_on(mesh["shard"])
    state = sparsecomm.register_hsdp_hook(ours, mesh, density=1.0)
    ours_params = train(ours, rank, STEPS, device="cuda")
    if replicas == 1:
        reference = model_on(mesh["shard"])  # FSDP without a hook: nothing to average
    else:
        reference = _with_plain_hooks(model_on(mesh["shard"]), mesh.get_group("replicate"))
    return ours_params, train(reference, rank, STEPS, device="cuda"), state.step


def _sparse_trains(rank, world_size, replicas, shards):
    import sparsecomm

    mesh = mesh_of(replicas, shards, "cuda")
    model = model_on(mesh["shard"])
    state = sparsecomm.register_hsdp_hook(model, mesh, density=0.1, allow_dense_fallback=False,
                                          selector="chunk", chunk_size=16, index_codec="rice",
                                          value_codec="int4", verify_conservation=True)
    disagreements = []
    check = replica_check(model, mesh, disagreements)  # every replica of a shard alike after each step

    x0 = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + rank)).cuda()
    with torch.no_grad():
        first = loss(model, x0).item()
    train(model, rank, STEPS, check, device="cuda")
    with torch.no_grad():
        last = loss(model, x0).item()
    stats = state.stats()
    return disagreements, stats["sparse_calls"], first, last


@pytest.mark.parametrize("replicas,shards", [
    pytest.param(1, 1, marks=_needs_gpus(1)),
    pytest.param(2, 1, marks=_needs_gpus(2)),
    pytest.param(2, 2, marks=_needs_gpus(4)),
])
def test_density_one_on_the_hooks_stream_equals_fsdp_bit_for_bit(replicas, shards):
    for rank, (ours, reference, steps) in enumerate(run_on_ranks(
            _dense_against_plain, replicas, shards, world_size=replicas * shards, timeout=240, backend="nccl")):
        assert steps == STEPS
        for a, b in zip(ours, reference):
            assert torch.equal(a, b), f"rank {rank}: the hook on its own stream differs from FSDP's own reduction"


@pytest.mark.parametrize("replicas,shards", [
    pytest.param(1, 1, marks=_needs_gpus(1)),
    pytest.param(2, 2, marks=_needs_gpus(4)),
])
def test_sparse_on_cuda_conserves_and_keeps_replicas_identical(replicas, shards):
    for rank, (disagreements, sparse_calls, first, last) in enumerate(run_on_ranks(
            _sparse_trains, replicas, shards, world_size=replicas * shards, timeout=240, backend="nccl")):
        assert not disagreements, f"rank {rank}: replicas differ at (step, parameter) {disagreements[:5]}"
        assert sparse_calls > 0 and last < first, f"rank {rank}: {sparse_calls} sparse calls, loss {first} -> {last}"
