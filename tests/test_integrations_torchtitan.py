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
    # The dense wire: every entry in the gradient's dtype (int2 at density 1 would still compress).
    ours = run_trainer(rank, world_size, job_config(steps, f"{folder}/ours", density=1.0, momentum="0",
                                                    index_codec="int32", value_codec=None))
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


def _accumulating(rank, world_size, folder):
    config = job_config(2, folder, density=0.1)
    config.training.global_batch_size = 2 * WORLD * config.training.local_batch_size  # 2 micro-batches
    try:
        run_trainer(rank, world_size, config)
    except ValueError as error:
        return str(error)
    return None


def test_gradient_accumulation_is_refused_before_the_first_step(tmp_path):
    # torchtitan reduces every micro-batch across replicas: the hook would count each as a step.
    for message in run_on_ranks(_accumulating, str(tmp_path), world_size=WORLD, timeout=200):
        assert message is not None and "2 micro-batches per step" in message and "--training.global_batch_size" in message


# -- configs, command line, set-up: one process, no process group -----------------------------

CLI = ["--module", "sparsecomm.integrations.torchtitan", "--config", "llama3_debugmodel_sparse"]


def test_command_line_options_reach_the_hook():
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(CLI + ["--sparsecomm.density", "0.05", "--sparsecomm.momentum", "0.8",
                                               "--sparsecomm.exchange", "owner", "--sparsecomm.warmup_steps", "5"])
    assert config.sparsecomm.enable and config.parallelism.data_parallel_replicate_degree == 2
    assert config.sparsecomm.state_options() == {
        "density": 0.05, "momentum": 0.8, "exchange": "owner", "warmup_steps": 5, "index_codec": "rice",
        "value_codec": "int2", "selector": "exact"}


@pytest.mark.parametrize("flags,named", [
    (["--sparsecomm.density", "2"], "density must be in (0.0, 1.0]"),
    (["--sparsecomm.momentum", "1.5"], "--sparsecomm.momentum must be 'auto' or a number in [0, 1)"),
    (["--sparsecomm.value_codec", "int3"], "value_codec must be one of"),
    (["--parallelism.data_parallel_replicate_degree", "1"], "--parallelism.data_parallel_replicate_degree must be > 1"),
    (["--parallelism.spmd_backend", "spmd_types"], "--parallelism.spmd_backend must be 'partial_dtensor'"),
    (["--parallelism.pipeline_parallel_degree", "2"], "--parallelism.pipeline_parallel_degree must be 1"),
])
def test_bad_command_lines_are_refused_naming_the_flag(flags, named, capsys):
    from torchtitan.config import ConfigManager

    with pytest.raises(SystemExit) as exited:
        ConfigManager().parse_args(CLI + flags)
    assert exited.value.code == 2
    said = " ".join(capsys.readouterr().err.replace("│", " ").split())  # tyro's box, unwrapped
    assert named in said, said


def test_a_config_changed_after_it_was_built_is_refused_before_any_process_group():
    import torch.distributed as dist

    from sparsecomm.integrations.torchtitan import SparseCommTrainer
    from sparsecomm.integrations.torchtitan.config_registry import llama3_debugmodel_offline

    config = llama3_debugmodel_offline()
    config.sparsecomm.enable = True  # replicate degree still 1
    with pytest.raises(ValueError, match="data_parallel_replicate_degree must be > 1"):
        SparseCommTrainer(config)
    assert not dist.is_initialized()


def test_to_sparsecomm_keeps_the_job_and_unwraps_the_chunked_loss():
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from sparsecomm.integrations.torchtitan import to_sparsecomm

    original = llama3_debugmodel()
    assert isinstance(original.loss, ChunkedLossWrapper.Config)
    original.parallelism.data_parallel_replicate_degree = 2
    converted = to_sparsecomm(original, enable=True, density=0.1)
    assert isinstance(converted.loss, CrossEntropyLoss.Config) and converted.loss is original.loss.loss_fn
    assert converted.training is original.training and converted.optimizer is original.optimizer
    assert converted.parallelism.spmd_backend == "partial_dtensor"
    assert converted.sparsecomm.enable and converted.sparsecomm.density == 0.1
    with pytest.raises(TypeError, match="Trainer.Config"):
        to_sparsecomm({"training": {}})
    with pytest.raises(TypeError):
        to_sparsecomm(original, densty=0.1)  # a misspelt option


def test_offline_data_is_pythons_help_text_in_bytes():
    from pydoc_data.topics import topics

    from sparsecomm.integrations.torchtitan.offline_data import ByteTokenizer, load_pydoc_topics

    tokenizer = ByteTokenizer()
    assert tokenizer.encode("é!", add_bos=True, add_eos=True) == [256, 0xC3, 0xA9, 0x21, 257]
    assert tokenizer.decode([256, 0xC3, 0xA9, 0x21, 257]) == "é!" and tokenizer.get_vocab_size() == 258
    data = load_pydoc_topics("unused")
    assert data["text"] == [topics[name] for name in sorted(topics)]


def test_importing_sparsecomm_never_imports_torchtitan_and_the_integration_settles_the_device():
    import subprocess
    import sys

    from sparsecomm.integrations.torchtitan.cpu import has_accelerator

    script = ("import sys, sparsecomm, sparsecomm.integrations, sparsecomm.fsdp\n"
              "assert not [m for m in sys.modules if m.startswith('torchtitan')], 'torchtitan imported'\n"
              # torchtitan's metrics module copies the device type at import: imported first here
              "import torchtitan.components.metrics as metrics\n"
              "before = metrics.device_type\n"
              "import sparsecomm.integrations.torchtitan\n"
              "print(before, metrics.device_type, type(metrics.device_module).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if not has_accelerator():
        assert done.stdout.split() == ["cuda", "cpu", "CpuDeviceModule"]


def test_the_worked_example_trains_on_two_cpu_ranks(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "experiments" / "examples" / "torchtitan_hsdp.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--local-ranks-filter", "0", str(example), "--sparsecomm.enable", "--sparsecomm.density", "0.035",
               "--sparsecomm.index_codec", "rice", "--sparsecomm.value_codec", "int2", "--training.steps", "4",
               "--metrics.log_freq", "2", "--dump_folder", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "sparsecomm: step 4: sent" in said and "of dense" in said, said[-3000:]
    assert "register_hsdp_hook: AdamW betas (0.9, 0.95) -> (0.0, 0.95)" in said  # the momentum handover, said once
