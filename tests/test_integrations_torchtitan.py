"""sparsecomm.integrations.torchtitan: the top-k hook on the replica dimension of a torchtitan
0.3.0 job, with torchtitan's own components (its Trainer, its llama3 debug model and its
parallelize function, its DCP checkpointer, its metrics logger), at 2 replicas x 2 shards on
4 gloo ranks, each rank on its own data (torchtitan's data loader splits the data by rank).

Oracles: torchtitan's own Trainer with native HSDP (its blocks sharded over the 2-D mesh), the
same job uninterrupted for the resume, and TensorBoard's own event reader.
"""
import pytest
import torch

from rank_processes import run_on_ranks
from torchtitan_jobs import job_config, run_trainer

pytest.importorskip("torchtitan")  # the torchtitan extra (the test extra installs it)

pytestmark = [pytest.mark.timeout(300)]

WORLD = 4  # 2 replicas x 2 shards


def _dense_against_native(rank, world_size, folder, steps):
    native = run_trainer(rank, world_size, job_config(steps, f"{folder}/native"), "torchtitan")
    ours = run_trainer(rank, world_size, job_config(steps, f"{folder}/ours", density=1.0, momentum="0"))
    return native, ours


def test_density_one_equals_torchtitans_own_hsdp_bit_for_bit(tmp_path):
    # torchtitan divides no gradient in FSDP, so native HSDP sums over all four ranks; the hook
    # at density 1 averages over the 2 replicas and hands FSDP that times 2: exactly the sum.
    steps = 4
    for rank, (native, ours) in enumerate(run_on_ranks(_dense_against_native, str(tmp_path), steps,
                                                       world_size=WORLD, timeout=280)):
        native_losses, native_params, _, _ = native
        losses, params, hook, _ = ours
        assert sorted(losses) == list(range(1, steps + 1))
        assert losses == native_losses, f"rank {rank}: losses differ from torchtitan's HSDP"
        assert params.keys() == native_params.keys()
        for name in params:
            assert torch.equal(params[name], native_params[name]), f"rank {rank}: {name} differs"
        assert hook["step"] == steps
        assert hook["stats"]["sparse_calls"] == 0 and hook["stats"]["bytes_sent"] > 0
