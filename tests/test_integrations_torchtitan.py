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


def _sparse(rank, world_size, folder, steps):
    config = job_config(steps, folder, density=0.035, index_codec="rice", value_codec="int2")
    config.metrics.enable_tensorboard = True
    return run_trainer(rank, world_size, config)


def test_sparse_replicas_stay_identical_and_the_figures_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = 8
    results = run_on_ranks(_sparse, str(tmp_path), steps, world_size=WORLD, timeout=280)
    for rank, (losses, _, hook, replicas_agree) in enumerate(results):
        assert replicas_agree, f"rank {rank}: the replicas of its shards hold different parameters"
        assert hook["stats"]["sparse_calls"] > 0 and hook["step"] == steps
        assert losses[steps] < losses[1] - 1.0, f"rank {rank}: the loss did not fall ({losses})"
    # torchtitan's TensorBoard logger (rank 0 writes) holds the hook's figures at every step.
    (events,) = [p.parent for p in tmp_path.glob("tb/*/events.out.tfevents.*")]
    reader = EventAccumulator(str(events))
    reader.Reload()
    tags = reader.Tags()["scalars"]
    for figure in ("bytes_sent_per_step", "bytes_dense_per_step", "residual_norm", "density"):
        assert f"sparsecomm/{figure}" in tags, tags
    sent = reader.Scalars("sparsecomm/bytes_sent_per_step")
    assert [event.step for event in sent] == list(range(1, steps + 1))
    stats = results[0][2]["stats"]
    # Every step logged: the per-step windows add up to rank 0's counter (float32 in the file).
    assert sum(event.value for event in sent) == pytest.approx(stats["bytes_sent"], rel=1e-6)
    dense = reader.Scalars("sparsecomm/bytes_dense_per_step")[-1].value
    assert sent[-1].value < 0.05 * dense  # 3.5% of the entries, 2-bit values and Rice-coded indices
    assert all(event.value > 0 for event in reader.Scalars("sparsecomm/residual_norm")[2:])  # after warm-up


def _resume(rank, world_size, folder, steps, saved_at, drop_hook_state):
    import shutil

    import torch.distributed as dist

    options = dict(density=0.035, index_codec="rice", value_codec="int2")
    whole = job_config(steps, f"{folder}/whole", **options)
    whole.checkpoint.enable, whole.checkpoint.interval = True, saved_at
    uninterrupted = run_trainer(rank, world_size, whole)
    if rank == 0:  # a job stopped right after the save at step `saved_at`
        shutil.copytree(f"{folder}/whole/checkpoint/step-{saved_at}", f"{folder}/resumed/checkpoint/step-{saved_at}")
    dist.barrier()
    resumed_config = job_config(steps, f"{folder}/resumed", **options)
    resumed_config.checkpoint.enable, resumed_config.checkpoint.interval = True, saved_at
    if drop_hook_state:
        resumed_config.checkpoint.exclude_from_loading = ["sparsecomm"]
    resumed = run_trainer(rank, world_size, resumed_config)
    return uninterrupted, resumed


@pytest.mark.parametrize("drop_hook_state", [False, True])
def test_a_checkpoint_resumes_bit_for_bit(tmp_path, drop_hook_state):
    # The checkpoint is torchtitan's own (DCP): weights, optimizer, data loader, and through
    # checkpointer.states every rank's residuals. Without them (the control) the resumed job
    # starts the hook afresh and must differ.
    steps, saved_at = 6, 3
    for rank, (whole, resumed) in enumerate(run_on_ranks(_resume, str(tmp_path), steps, saved_at, drop_hook_state,
                                                         world_size=WORLD, timeout=280)):
        whole_losses, whole_params, whole_hook, _ = whole
        losses, params, hook, replicas_agree = resumed
        assert sorted(losses) == list(range(saved_at + 1, steps + 1))
        same = all(torch.equal(params[name], whole_params[name]) for name in params)
        if drop_hook_state:
            assert not same, f"rank {rank}: resuming without the residuals changed nothing: the test cannot fail"
            continue
        assert same, f"rank {rank}: the resumed job's parameters differ from the uninterrupted job's"
        assert all(losses[s] == whole_losses[s] for s in losses), (losses, whole_losses)
        assert hook["step"] == whole_hook["step"] == steps and replicas_agree
