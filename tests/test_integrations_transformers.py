"""SparseCommTrainerCallback inside real Hugging Face Trainer runs: gloo ranks, CPU.

The model is a tiny randomly initialised GPT-2 (no download); the dataset is the same on
every rank and the Trainer's distributed sampler gives each rank different samples.
Importing transformers costs seconds per rank, so ranks are spawned twice for the whole
file: 3 ranks for the 3-rank run, then 2 ranks that run every 2-rank scenario in turn
(several Trainers each, in its own directory; a scenario that raises is reported by its
own test). Oracles: a dense run of the same Trainer (the hook changed the reduction), the
uninterrupted run (a resume is bit for bit), the files on disk, the ranks against each
other (replicas agree, residuals differ). That importing sparsecomm.integrations does not
import transformers is checked with the other frameworks in test_integrations_lightning.py.
"""
import math
import os
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from integration_checks import assert_defaults_are_topk_dgc
from metrics_checks import bytes_sent_per_step, scalars
from rank_processes import run_on_ranks

DENSITY = 0.01
# The callback's default: the Trainer example holds dense's final training loss within 0.1 at
# every seed there (experiments/examples/README.md, "Defaults that hold quality"); 0.01 does not.
MEASURED_DEFAULT_DENSITY = 0.03
STEPS, SAVE_AT = 6, 3
VOCAB, SEQUENCE = 64, 16


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


class Patterns(torch.utils.data.Dataset):
    """Arithmetic token sequences (learnable, so the loss can fall), the same on every rank."""

    def __init__(self, size: int = 64, offset: int = 0):
        self.size, self.offset = size, offset

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        index += self.offset
        start, stride = (7 * index) % VOCAB, 1 + index % 3
        tokens = (start + stride * torch.arange(SEQUENCE)) % VOCAB
        return {"input_ids": tokens, "labels": tokens.clone()}


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # No dropout: no random numbers in a step. Special tokens inside the tiny vocabulary.
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _trainer(output_dir, callbacks, *, max_steps=STEPS, save_steps=SAVE_AT, model=None, ddp_backend="gloo",
             **arguments):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, ddp_backend=ddp_backend, max_steps=max_steps,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, per_device_train_batch_size=4,
        learning_rate=3e-3, lr_scheduler_type="constant", disable_tqdm=True, seed=0, data_seed=0,
        log_level="error", **{"report_to": "none", "logging_steps": 1, **arguments},
    )
    eval_dataset = Patterns(16, offset=1000) if arguments.get("eval_strategy", "no") != "no" else None
    return Trainer(model=model or _model(), args=args, train_dataset=Patterns(), eval_dataset=eval_dataset,
                   callbacks=callbacks)


def _join_as_trainer_ranks(rank, world_size):
    # run_on_ranks already joined the gloo group; the Trainer (Accelerate) reads these and keeps it.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _memories(state):
    """Residuals and velocities of a TopKState, by key (rank-qualified)."""
    return {k: v for k, v in state.state_dict().items() if ".residual." in k or ".velocity." in k}


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _assert_bitwise_equal(actual: dict, expected: dict, what: str):
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{what}: {key} differs"


# ----- the two spawns ------------------------------------------------------------------------


def _three_rank_worker(rank, world_size, root):
    _join_as_trainer_ranks(rank, world_size)
    from sparsecomm.integrations import SparseCommTrainerCallback

    callback = SparseCommTrainerCallback(density=DENSITY)
    trainer = _trainer(Path(root), [callback], max_steps=4, save_steps=4)
    trainer.train()
    return dict(params=_params(trainer.model), stats=callback.state.stats())


@pytest.fixture(scope="module")
def three_ranks(transformers, tmp_path_factory):
    """The 3-rank run's results by rank, and the rank files of its checkpoint-4 (which 2
    ranks then refuse) as the run left them; its directory."""
    root = tmp_path_factory.mktemp("three")
    results = run_on_ranks(_three_rank_worker, str(root), world_size=3, timeout=90)
    return results, sorted(p.name for p in (root / "checkpoint-4").glob("sparsecomm_rank*")), root


def _two_rank_scenarios(rank, world_size, root, three_rank_root):
    """Every 2-rank scenario in turn, each in a directory of its own: what each returned, or
    ("raised", traceback). (A scenario that raises on one rank alone leaves the other waiting
    in a collective until the spawn's deadline, as it did with a spawn of its own.)"""
    scenarios = {"sparse_dense_resume": (_sparse_dense_resume_worker, Path(root) / "sparse_dense_resume"),
                 "defaults": (_defaults_worker, Path(root) / "defaults"),
                 "lab_and_momentum": (_lab_and_momentum_worker, Path(root) / "lab_and_momentum"),
                 "fewer_ranks": (_fewer_ranks_resume_worker, Path(three_rank_root)),
                 "refusals": (_refusals_worker, Path(root) / "refusals"),
                 "metrics": (_metrics_worker, Path(root) / "metrics")}
    results = {}
    for name, (worker, directory) in scenarios.items():
        try:
            results[name] = ("ok", worker(rank, world_size, str(directory)))
        except Exception:  # noqa: BLE001 - reported by the scenario's own test
            results[name] = ("raised", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def two_ranks(transformers, three_ranks, tmp_path_factory):
    """Every 2-rank scenario's per-rank results (scenario -> list by rank), and the root
    directory under which each scenario wrote its files."""
    root = tmp_path_factory.mktemp("two")
    per_rank = run_on_ranks(_two_rank_scenarios, str(root), str(three_ranks[2]), world_size=2, timeout=240)
    return per_rank, root


def _scenario(two_ranks, name):
    """That scenario's results by rank, and its directory; it fails here if it raised."""
    per_rank, root = two_ranks
    outcomes = [results[name] for results in per_rank]
    raised = [f"rank {rank}:\n{value}" for rank, (status, value) in enumerate(outcomes) if status == "raised"]
    assert not raised, "\n".join(raised)
    return [value for _, value in outcomes], root / name


# ----- 1-3: sparse vs dense, replicas, bit-for-bit resume -----------------------------------


def _sparse_dense_resume_worker(rank, world_size, root):
    _join_as_trainer_ranks(rank, world_size)
    from sparsecomm.integrations import SparseCommTrainerCallback

    root = Path(root)
    callback = SparseCommTrainerCallback(density=DENSITY)
    trainer = _trainer(root / "sparse", [callback])
    trainer.train()  # saves checkpoint-3 and checkpoint-6
    ddp_hooks = [hook.__qualname__ for hook, _ in trainer.model_wrapped._comm_hooks]
    uninterrupted = dict(params=_params(trainer.model), memories=_memories(callback.state),
                         stats=callback.state.stats(), losses=_losses(trainer), ddp_hooks=ddp_hooks)

    dense = _trainer(root / "dense", [], save_steps=0)
    dense.train()

    # A fresh Trainer and callback resume half way, in the same output directory.
    resumed_callback = SparseCommTrainerCallback(density=DENSITY)
    resumed = _trainer(root / "sparse", [resumed_callback])
    resumed.train(resume_from_checkpoint=str(root / "sparse" / f"checkpoint-{SAVE_AT}"))
    return dict(uninterrupted=uninterrupted, dense_params=_params(dense.model), dense_losses=_losses(dense),
                resumed_params=_params(resumed.model), resumed_memories=_memories(resumed_callback.state),
                resumed_stats=resumed_callback.state.stats(),
                momenta=(callback.state.config.momentum, resumed_callback.state.config.momentum))


# The first test that uses a spawn waits for it: 3 ranks, then 2 running five scenarios.
@pytest.mark.timeout(400)
def test_trainer_runs_sparse_and_a_resume_continues_bit_for_bit(two_ranks):
    results, tmp_path = _scenario(two_ranks, "sparse_dense_resume")
    for rank, r in enumerate(results):
        full, stats = r["uninterrupted"], r["uninterrupted"]["stats"]
        assert full["ddp_hooks"] == ["topk_hook"]  # registered once, on the Trainer's DDP model
        # (1) The hook ran: 2 dense warm-up steps, then sparse, far fewer bytes than dense.
        assert stats["steps"] == STEPS and stats["warmup_calls"] == 2 and stats["fallback_calls"] == 0
        assert stats["sparse_calls"] == STEPS - 2
        assert 0 < stats["bytes_sent"] < 0.5 * stats["bytes_dense"]
        # (2) It changed the reduction (the parameters differ from the dense run's) and training still works.
        changed = [n for n, p in full["params"].items() if not torch.equal(p, r["dense_params"][n])]
        assert changed, "sparse training produced the dense run's parameters"
        losses = full["losses"]
        assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < losses[0], losses
        assert r["dense_losses"][-1] < r["dense_losses"][0]
        # (3) Resumed at step 3 by a fresh Trainer: parameters and residuals equal the uninterrupted
        # run's bit for bit, and the hook went on from its saved step (no second warm-up). The
        # resumed AdamW comes back with betas[0] = 0, and the hook still takes its 0.9.
        assert r["momenta"] == (0.9, 0.9)
        _assert_bitwise_equal(r["resumed_params"], full["params"], f"rank {rank} parameters after resume")
        _assert_bitwise_equal(r["resumed_memories"], full["memories"], f"rank {rank} residuals after resume")
        assert all(key.startswith(f"rank{rank}.") for key in r["resumed_memories"])
        resumed = r["resumed_stats"]
        assert resumed["steps"] == STEPS and resumed["warmup_calls"] == 2
        assert resumed["sparse_calls"] == STEPS - 2
    # Replicas are bit-identical; each rank's residuals are its own (different data per rank).
    first, second = results[0]["uninterrupted"], results[1]["uninterrupted"]
    _assert_bitwise_equal(second["params"], first["params"], "rank 1 against rank 0")
    for key0, key1 in zip(sorted(first["memories"]), sorted(second["memories"])):
        assert key0.replace("rank0.", "rank1.") == key1
        assert not torch.equal(first["memories"][key0], second["memories"][key1]), f"{key0}: ranks hold the same"
    # Every rank wrote its own file into each checkpoint, holding its own residuals.
    for rank, r in enumerate(results):
        saved = torch.load(tmp_path / "sparse" / f"checkpoint-{STEPS}" / f"sparsecomm_rank{rank}.pt",
                           weights_only=True)
        assert (saved["rank"], saved["world_size"], saved["global_step"]) == (rank, 2, STEPS)
        _assert_bitwise_equal({k: v for k, v in saved["hook_state"].items() if k in r["resumed_memories"]},
                              r["uninterrupted"]["memories"], f"rank {rank} file")
        assert (tmp_path / "sparse" / f"checkpoint-{SAVE_AT}" / f"sparsecomm_rank{rank}.pt").is_file()
    assert not list((tmp_path / "sparse").rglob("*.tmp"))


# ----- the defaults: AdamW's first moment moves into the hook (the topk-dgc setting) ---------


def _defaults_worker(rank, world_size, root):
    _join_as_trainer_ranks(rank, world_size)
    from sparsecomm.integrations import SparseCommTrainerCallback
    from sparsecomm.hooks.momentum_handover import OptimizerChangedWarning

    runs = {}
    # (callback options, TrainingArguments): the defaults, density included; the topk-dgc setting
    # built by hand at the measured density (the Trainer's AdamW with adam_beta1=0, the hook's
    # momentum 0.9); plain error feedback.
    density = MEASURED_DEFAULT_DENSITY
    for name, options, arguments in [("defaults", {}, {}),
                                     ("by_hand", {"density": density, "momentum": 0.9}, {"adam_beta1": 0.0}),
                                     ("plain_ef", {"density": density, "momentum": 0}, {})]:
        callback = SparseCommTrainerCallback(**options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = _trainer(Path(root) / name, [callback], max_steps=4, save_steps=0, **arguments)
            trainer.train()
            alias = callback.hook_state
        runs[name] = dict(
            params=list(_params(trainer.model).values()), betas=[g["betas"] for g in trainer.optimizer.param_groups],
            optimizer=type(trainer.optimizer.optimizer).__name__, momentum=callback.state.config.momentum,
            sparse_calls=callback.state.stats()["sparse_calls"], alias_is_state=alias is callback.state,
            density=callback.state.config.density, stats=callback.state.stats(),
            announced=[str(w.message) for w in caught if issubclass(w.category, OptimizerChangedWarning)],
            deprecated=[w for w in caught
                        if issubclass(w.category, DeprecationWarning) and ".hook_state" in str(w.message)])
    return runs


@pytest.mark.timeout(400)
def test_defaults_move_adamws_first_moment_into_the_hook_and_say_so_on_rank_0(two_ranks):
    for rank, runs in enumerate(_scenario(two_ranks, "defaults")[0]):
        assert runs["defaults"]["optimizer"] == "AdamW"  # the Trainer's default
        assert_defaults_are_topk_dgc(runs, rank, "SparseCommTrainerCallback", sparse_calls=2)
        # .state is the name; .hook_state still answers, with a DeprecationWarning.
        assert runs["defaults"]["alias_is_state"] and len(runs["defaults"]["deprecated"]) == 1


@pytest.mark.timeout(400)
def test_the_default_density_is_the_one_measured_to_hold_quality(two_ranks):
    # SparseCommTrainerCallback() trains bit for bit as the topk-dgc setting at 0.03 (asserted
    # above: "defaults" against "by_hand"), and its hook sends ceil(0.03 x n) entries of the
    # n-entry bucket per sparse step: at 0.01 the Trainer example stays ~0.15 behind dense.
    for runs in _scenario(two_ranks, "defaults")[0]:
        stats = runs["defaults"]["stats"]
        assert runs["defaults"]["density"] == MEASURED_DEFAULT_DENSITY
        per_call = stats["elements_sparse"] // stats["sparse_calls"]
        assert stats["elements_sent"] == stats["sparse_calls"] * math.ceil(MEASURED_DEFAULT_DENSITY * per_call)


# ----- 4: what is refused in a distributed run -----------------------------------------------


def _error(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test compares type and message
        return type(error).__name__, str(error)
    return None


def _refusals_worker(rank, world_size, root):
    _join_as_trainer_ranks(rank, world_size)
    from sparsecomm.integrations import SparseCommTrainerCallback

    root = Path(root)
    errors = {}
    # A checkpoint saved without the callback, resumed from outside output_dir.
    _trainer(root / "dense", [], max_steps=SAVE_AT).train()
    dense_checkpoint = str(root / "dense" / f"checkpoint-{SAVE_AT}")
    errors["missing"] = _error(lambda: _trainer(
        root / "elsewhere", [SparseCommTrainerCallback(density=DENSITY)], resume_from_checkpoint=dense_checkpoint,
    ).train(resume_from_checkpoint=dense_checkpoint))
    # strict_load=False: a warning, and the hook starts afresh (its own dense warm-up).
    lenient = SparseCommTrainerCallback(density=DENSITY, strict_load=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(root / "elsewhere", [lenient], max_steps=SAVE_AT + 3, save_steps=0,
                 resume_from_checkpoint=dense_checkpoint).train(resume_from_checkpoint=dense_checkpoint)
    lenient_warnings = [str(w.message) for w in caught if "strict_load=False" in str(w.message)]

    # A sparse checkpoint, resumed with another hook configuration (TopKState refuses it; the
    # message names the file), then with files that say another world size saved them.
    callback = SparseCommTrainerCallback(density=DENSITY)
    sparse = _trainer(root / "sparse", [callback], max_steps=SAVE_AT)
    sparse.train()
    errors["config"] = _error(lambda: _trainer(root / "sparse", [SparseCommTrainerCallback(density=0.05)])
                              .train(resume_from_checkpoint=True))
    path = root / "sparse" / f"checkpoint-{SAVE_AT}" / f"sparsecomm_rank{rank}.pt"
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, "world_size": 3}, path)
    errors["world_size"] = _error(lambda: _trainer(root / "sparse", [SparseCommTrainerCallback(density=DENSITY)])
                                  .train(resume_from_checkpoint=True))

    # A second callback on a Trainer whose DDP model already has the first one's hook.
    sparse.pop_callback(callback)
    sparse.add_callback(SparseCommTrainerCallback(density=DENSITY))
    errors["second_hook"] = _error(sparse.train)
    return dict(errors=errors, lenient_warnings=lenient_warnings, lenient_stats=lenient.state.stats(),
                rank=rank)


@pytest.mark.timeout(400)
def test_missing_or_foreign_hook_state_and_a_second_hook_are_refused(two_ranks):
    results, tmp_path = _scenario(two_ranks, "refusals")
    for r in results:
        errors = r["errors"]
        # Every rank raises the same error, naming every rank's file.
        kind, message = errors["missing"]
        assert kind == "FileNotFoundError"
        for rank in range(2):
            assert f"{tmp_path}/dense/checkpoint-{SAVE_AT}/sparsecomm_rank{rank}.pt not found" in message
        kind, message = errors["world_size"]
        assert kind == "ValueError"
        for rank in range(2):
            assert f"sparsecomm_rank{rank}.pt was saved with world_size 3 (this run: 2)" in message
        kind, message = errors["config"]
        assert kind == "ValueError" and "state_dict config differs" in message and "density" in message
        assert f"from {tmp_path}/sparse/checkpoint-{SAVE_AT}/sparsecomm_rank{r['rank']}.pt" in message
        kind, message = errors["second_hook"]
        assert kind == "ValueError" and "already has a communication hook (topk_hook)" in message
        assert len(r["lenient_warnings"]) == 1 and "not found" in r["lenient_warnings"][0]
        stats = r["lenient_stats"]
        assert stats["steps"] == 3 and stats["warmup_calls"] == 2 and stats["sparse_calls"] == 1


# ----- the lab's script path, and momentum correction ---------------------------------------


class FakeLabRun:
    """What sparsecomm.lab.init() returns, as far as the callback uses it."""

    seed, steps = 0, None

    def __init__(self, sparse: bool = True):
        self.sparse, self.applied, self.logged, self.hook_state = sparse, [], [], None

    def apply(self, ddp_model, optimizer):
        import sparsecomm

        self.applied.append((type(ddp_model).__name__, type(optimizer).__name__))
        if self.sparse:  # the dense arm registers nothing: DDP's own allreduce
            self.hook_state = sparsecomm.register_topk_hook(ddp_model, density=DENSITY)
        return optimizer

    def log(self, metrics, step=None):
        self.logged.append((step, metrics))


def _lab_and_momentum_worker(rank, world_size, root):
    _join_as_trainer_ranks(rank, world_size)
    from sparsecomm.integrations import SparseCommTrainerCallback
    from sparsecomm.hooks.momentum_handover import OptimizerChangedWarning

    run = FakeLabRun()
    callback = SparseCommTrainerCallback.for_lab_run(run)
    trainer = _trainer(Path(root) / "lab", [callback], max_steps=4, save_steps=4, eval_strategy="steps", eval_steps=2)
    trainer.train()
    evaluations = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    saved = torch.load(Path(root) / "lab" / "checkpoint-4" / f"sparsecomm_rank{rank}.pt", weights_only=True)

    dense_run = FakeLabRun(sparse=False)
    dense = _trainer(Path(root) / "dense", [SparseCommTrainerCallback.for_lab_run(dense_run)], max_steps=2,
                     save_steps=2, eval_strategy="steps", eval_steps=2)
    dense.train()
    dense_saved = torch.load(Path(root) / "dense" / "checkpoint-2" / f"sparsecomm_rank{rank}.pt", weights_only=True)

    momentum = SparseCommTrainerCallback(density=DENSITY, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dgc = _trainer(Path(root) / "dgc", [momentum], max_steps=3, save_steps=0)
        dgc.train()
    return dict(applied=run.applied, logged=run.logged, evaluations=evaluations, dense_applied=dense_run.applied,
                dense_logged=[step for step, _ in dense_run.logged], dense_saved=dense_saved,
                dense_hooks=len(dense.model_wrapped._comm_hooks),
                hook_state_is_callbacks=callback.state is run.hook_state, saved_step=saved["hook_state"]["step"],
                stats=run.hook_state.stats(), betas=[g["betas"] for g in dgc.optimizer.param_groups],
                momentum_warnings=[str(w.message) for w in caught if issubclass(w.category, OptimizerChangedWarning)],
                velocities=[k for k in momentum.state.state_dict() if ".velocity." in k],
                dgc_stats=momentum.state.stats(), rank=rank)


@pytest.mark.timeout(400)
def test_lab_run_applies_once_logs_eval_loss_and_momentum_turns_adam_beta1_off(two_ranks):
    results, _ = _scenario(two_ranks, "lab_and_momentum")
    for r in results:
        # run.apply once, with the DDP model and the Trainer's torch optimizer (not Accelerate's wrapper).
        assert r["applied"] == [("DistributedDataParallel", "AdamW")]
        assert r["hook_state_is_callbacks"] and r["saved_step"] == 4  # run.hook_state went into the checkpoint
        assert r["stats"]["sparse_calls"] == 2
        # Each evaluation logged once, as val_loss, at its global step, with the Trainer's value.
        assert [(step, metrics) for step, metrics in r["logged"]] == [
            (step, {"val_loss": value}) for step, value in r["evaluations"]]
        assert [step for step, _ in r["evaluations"]] == [2, 4]
        # The dense arm: apply once, no hook, and a checkpoint file saying there is no hook state.
        assert r["dense_applied"] == [("DistributedDataParallel", "AdamW")] and r["dense_hooks"] == 0
        assert r["dense_logged"] == [2] and r["dense_saved"]["hook_state"] is None
        # momentum=0.9: AdamW's own first moment is off, the hook keeps velocities and ran sparse.
        assert all(betas[0] == 0.0 and betas[1] == 0.999 for betas in r["betas"])
        assert len(r["momentum_warnings"]) == (1 if r["rank"] == 0 else 0)
        assert all("AdamW betas (0.9, 0.999) -> (0.0, 0.999)" in w for w in r["momentum_warnings"])
        assert r["velocities"] and r["dgc_stats"]["sparse_calls"] == 1


# ----- 3 ranks, and resuming their checkpoint with 2 --------------------------------------


def _fewer_ranks_resume_worker(rank, world_size, root):
    _join_as_trainer_ranks(rank, world_size)
    from sparsecomm.integrations import SparseCommTrainerCallback

    trainer = _trainer(Path(root), [SparseCommTrainerCallback(density=DENSITY)], max_steps=6, save_steps=0)
    return _error(lambda: trainer.train(resume_from_checkpoint=True))


@pytest.mark.timeout(400)
def test_three_ranks_agree_and_their_checkpoint_is_refused_by_two(three_ranks, two_ranks):
    results, rank_files, _ = three_ranks
    for r in results:
        stats, last = r["stats"], r["stats"]["last_step"]
        assert stats["warmup_calls"] == 2 and stats["sparse_calls"] == 2
        # A sparse step sends k indices + values per bucket: ~2 x density of the dense bytes.
        assert last["sparse_calls"] == 1 and 0 < last["bytes_sent"] < 0.1 * last["bytes_dense"]
        _assert_bitwise_equal(r["params"], results[0]["params"], "replica")
    assert rank_files == [f"sparsecomm_rank{r}.pt" for r in range(3)]
    # The Trainer itself resumes a 3-rank checkpoint on 2 ranks; the hook state refuses it, on every rank.
    for kind, message in _scenario(two_ranks, "fewer_ranks")[0]:
        assert kind == "ValueError"
        for rank in range(2):
            assert f"checkpoint-4/sparsecomm_rank{rank}.pt was saved with world_size 3 (this run: 2)" in message


# ----- in this process: a single process, bad options, lazy import --------------------------


def _metrics_worker(rank, world_size, root):
    """The figures through report_to=["tensorboard"]: every 2 steps (the Trainer logs every step),
    and at every training log ("auto", logging every 3 steps)."""
    _join_as_trainer_ranks(rank, world_size)
    from sparsecomm.integrations import SparseCommTrainerCallback

    runs = {}
    for name, log_every, logging_steps in (("every2", 2, 1), ("auto", "auto", 3)):
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(Path(root) / name)  # TensorBoardCallback's directory
        callback = SparseCommTrainerCallback(density=DENSITY, budget="bucket", log_every=log_every)
        trainer = _trainer(Path(root) / name, [callback], save_steps=0, report_to=["tensorboard"],
                           logging_steps=logging_steps)
        del os.environ["TENSORBOARD_LOGGING_DIR"]
        trainer.train()
        runs[name] = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    return dict(callbacks=runs, numel=sum(p.numel() for p in trainer.model.parameters()))


@pytest.mark.timeout(400)
def test_figures_reach_the_report_to_integrations(two_ranks):
    results, root = _scenario(two_ranks, "metrics")
    numel = results[0]["numel"]
    for name, windows in (("every2", [(1, 2), (3, 4), (5, 6)]), ("auto", [(1, 3), (4, 6)])):
        # The callback moved ahead of TensorBoardCallback, which the Trainer put before it.
        callbacks = results[0]["callbacks"][name]
        assert callbacks.index("SparseCommTrainerCallback") < callbacks.index("TensorBoardCallback"), callbacks
        logged = scalars(root / name)
        assert [step for step, _ in logged["train/loss"]] == ([1, 2, 3, 4, 5, 6] if name == "every2" else [3, 6])
        assert logged["train/sparsecomm/bytes_sent_per_step"] == [
            (last, pytest.approx(bytes_sent_per_step(numel, DENSITY, first, last))) for first, last in windows], name
        assert [value for _, value in logged["train/sparsecomm/steps"]] == [last for _, last in windows]
        assert {"train/sparsecomm/compression", "train/sparsecomm/residual_norm"} <= logged.keys()


def test_single_process_warns_once_and_registers_nothing(transformers, tmp_path):
    from sparsecomm.integrations import SparseCommTrainerCallback
    from sparsecomm.integrations.transformers import NotDistributedWarning

    callback = SparseCommTrainerCallback(density=DENSITY)
    trainer = _trainer(tmp_path, [callback], max_steps=2, save_steps=2, ddp_backend=None)  # one process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        trainer.train()
    single = [w for w in caught if issubclass(w.category, NotDistributedWarning)]
    assert len(single) == 1 and "world_size=1" in str(single[0].message)
    assert callback.state is None
    assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    assert (tmp_path / "checkpoint-2").is_dir() and not list(tmp_path.rglob("sparsecomm_rank*"))


def _two_process_args():
    """What on_train_begin reads of TrainingArguments in a 2-process run (no process group needed)."""
    from types import SimpleNamespace

    from transformers.training_args import ParallelMode

    return SimpleNamespace(deepspeed=None, fsdp=None, distributed_state=None, parallel_mode=ParallelMode.DISTRIBUTED,
                           world_size=2, process_index=0, output_dir="unused")


def test_a_training_forward_outside_ddp_is_refused(transformers):
    from sparsecomm.integrations import SparseCommTrainerCallback

    # A 2-process run whose model the Trainer did not wrap in DDP (e.g. sharded at load time).
    model, callback = _model(), SparseCommTrainerCallback(density=DENSITY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback.on_train_begin(_two_process_args(), transformers.TrainerState(), transformers.TrainerControl(),
                            model=model, optimizer=optimizer)
    tokens = Patterns()[0]["input_ids"][None]
    model.eval()
    with torch.no_grad():
        model(tokens)  # an evaluation forward (eval_on_start): the callback keeps waiting for DDP's
    model.train()
    with pytest.raises(TypeError, match="a training forward of GPT2LMHeadModel that .*DistributedDataParallel does "
                                        "not wrap"):
        model(tokens)
    assert callback.state is None


def test_an_optimizer_whose_momentum_cannot_move_is_refused_before_training(transformers):
    from sparsecomm.integrations import SparseCommTrainerCallback

    model, callback = _model(), SparseCommTrainerCallback(density=DENSITY)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9)
    with pytest.raises(ValueError, match="SparseCommTrainerCallback: cannot move the momentum of RMSprop .* pass "
                                         "momentum=0 to keep RMSprop as it is"):
        callback.on_train_begin(_two_process_args(), transformers.TrainerState(), transformers.TrainerControl(),
                                model=model, optimizer=optimizer)
    assert optimizer.param_groups[0]["momentum"] == 0.9 and callback.state is None
    # momentum=0: plain error feedback, any optimizer, left as it is.
    SparseCommTrainerCallback(density=DENSITY, momentum=0).on_train_begin(
        _two_process_args(), transformers.TrainerState(), transformers.TrainerControl(), model=model,
        optimizer=optimizer)
    assert optimizer.param_groups[0]["momentum"] == 0.9


def test_fsdp_is_refused_before_training(transformers, tmp_path):
    from sparsecomm.integrations import SparseCommTrainerCallback

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp=True, report_to="none")
    callback = SparseCommTrainerCallback(density=DENSITY)
    with pytest.raises(ValueError, match=r"uses FSDP \(TrainingArguments\(fsdp=...\)\)"):
        callback.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(), model=_model())


def test_bad_options_are_refused(transformers):
    from sparsecomm.integrations import SparseCommTrainerCallback

    with pytest.raises(ValueError, match="density"):
        SparseCommTrainerCallback(density=0.0)
    with pytest.raises(ValueError, match="density"):
        SparseCommTrainerCallback(density=1.5)
    with pytest.raises(ValueError, match="warmup_steps"):
        SparseCommTrainerCallback(warmup_steps=-1)
    with pytest.raises(TypeError, match="either hook_factory or TopKState options, not both .*density"):
        SparseCommTrainerCallback(density=0.1, hook_factory=lambda ddp, optimizer: None)
    with pytest.raises(TypeError, match="hook_factory must be callable, got str"):
        SparseCommTrainerCallback(hook_factory="topk")
    with pytest.raises(TypeError, match="on_metrics must be callable"):
        SparseCommTrainerCallback(on_metrics=1)
    with pytest.raises(TypeError, match="module cannot be given"):
        SparseCommTrainerCallback(module=torch.nn.Linear(1, 1))
    with pytest.raises(TypeError, match="strict_load must be True or False"):
        SparseCommTrainerCallback(strict_load="yes")
    with pytest.raises(ValueError, match="momentum must be 'auto' .* got 'dgc'"):
        SparseCommTrainerCallback(momentum="dgc")
    with pytest.raises(ValueError, match=r"momentum must be in \[0.0, 1.0\)"):
        SparseCommTrainerCallback(momentum=1.0)
    with pytest.raises(ValueError, match="log_every must be None, 'auto' or an integer >= 1 .* got -2"):
        SparseCommTrainerCallback(log_every=-2)
    with pytest.raises(TypeError, match="either hook_factory or TopKState options, not both .*momentum"):
        SparseCommTrainerCallback(momentum=0.9, hook_factory=lambda ddp, optimizer: None)
