"""SparseCommCallback inside a real Lightning DDP fit: 2 gloo ranks, different data per rank.

One spawn of 2 ranks covers the expensive parts (Lightning takes seconds to import per
rank), one scenario after the other: the hook runs sparse on CPU, a checkpoint holds every
rank's residuals and a resumed fit gives each rank its own back bit for bit, and the two
ways of registering a second hook are refused; then the defaults' momentum handover; then the
hook's figures in the Trainer's own TensorBoard and CSV loggers.
Checks that need no process group run in this process; one subprocess checks that
importing sparsecomm needs none of the frameworks (Lightning, Accelerate, transformers).
"""
import os
import subprocess
import sys
import traceback

import pytest
import torch

from rank_processes import run_on_ranks
from integration_checks import assert_defaults_are_topk_dgc, assert_sparse_then_restored
from metrics_checks import bytes_sent_per_step, scalars

STEPS, MORE_STEPS = 6, 2
DENSITY = 0.01


@pytest.fixture(scope="module")
def pl():
    return pytest.importorskip("lightning.pytorch")


def _module_and_data(pl):
    """A LightningModule on a regression task; the dataset is the same on every rank and
    Lightning's DistributedSampler gives each rank a different half of it."""

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))

        def training_step(self, batch, batch_index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=generator)
    data = torch.utils.data.TensorDataset(x, x[:, :4].sin())
    return Regressor, torch.utils.data.DataLoader(data, batch_size=8)


def _trainer(pl, callbacks, max_steps, root, **strategy_kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    return pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, strategy=DDPStrategy(**strategy_kwargs), callbacks=callbacks,
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )


def _residuals(state):
    return {k: v for k, v in state.state_dict().items() if ".residual." in k}


def _lightning_worker(rank, world_size, root):
    # run_on_ranks already joined the gloo group; Lightning sees LOCAL_RANK, takes the
    # processes as launched externally and keeps the existing group.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    import lightning.pytorch as pl
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from sparsecomm.integrations import SparseCommCallback

    Regressor, loader = _module_and_data(pl)
    checkpoint = os.path.join(root, "run.ckpt")

    callback = SparseCommCallback(density=DENSITY)
    trainer = _trainer(pl, [callback], STEPS, root)
    model = Regressor()
    trainer.fit(model, loader)
    trainer.save_checkpoint(checkpoint, weights_only=False)
    saved_residuals, stats = _residuals(callback.state), callback.state.stats()
    params = [p.detach().clone() for p in model.parameters()]

    class Probe(pl.Callback):
        """Records the restored residuals after Lightning restored everything, before step 1."""

        def on_train_start(self, trainer, pl_module):
            self.residuals = _residuals(resumed.state)
            self.steps = resumed.state.step

    resumed, probe = SparseCommCallback(density=DENSITY), Probe()
    trainer = _trainer(pl, [resumed, probe], STEPS + MORE_STEPS, root)
    trainer.fit(Regressor(), loader, ckpt_path=checkpoint)
    resumed_stats = resumed.state.stats()

    errors = {}
    try:
        _trainer(pl, [SparseCommCallback(density=DENSITY)], 1, root, ddp_comm_hook=allreduce_hook).fit(
            Regressor(), loader)
    except ValueError as error:
        errors["ddp_comm_hook"] = str(error)

    class OtherHook(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            trainer.strategy.model.register_comm_hook(None, allreduce_hook)

    try:
        _trainer(pl, [OtherHook(), SparseCommCallback(density=DENSITY)], 1, root).fit(Regressor(), loader)
    except ValueError as error:
        errors["second_hook"] = str(error)
    return dict(saved=saved_residuals, stats=stats, params=params, restored=probe.residuals,
                restored_step=probe.steps, resumed_stats=resumed_stats, errors=errors)


def _both_scenarios(rank, world_size, root):
    """Each scenario in its own directory: what it returned, or ("raised", traceback)."""
    results = {}
    for name, worker in (("fit", _lightning_worker), ("defaults", _defaults_worker), ("metrics", _metrics_worker)):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        try:
            results[name] = ("ok", worker(rank, world_size, os.path.join(root, name)))
        except Exception:  # noqa: BLE001 - reported by the scenario's own test
            results[name] = ("raised", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def spawned(pl, tmp_path_factory):
    root = tmp_path_factory.mktemp("spawned")
    return run_on_ranks(_both_scenarios, str(root), timeout=200), root


def _scenario(spawned, name):
    """That scenario's results by rank, and its directory; it fails here if it raised."""
    per_rank, root = spawned
    outcomes = [results[name] for results in per_rank]
    raised = [f"rank {rank}:\n{value}" for rank, (status, value) in enumerate(outcomes) if status == "raised"]
    assert not raised, "\n".join(raised)
    return [value for _, value in outcomes], root / name


# The first test that uses the spawn waits for both scenarios.
@pytest.mark.timeout(240)
def test_fit_runs_sparse_and_resume_restores_each_ranks_residuals(spawned):
    results, tmp_path = _scenario(spawned, "fit")
    for rank, r in enumerate(results):
        assert_sparse_then_restored(r, rank, steps=STEPS, more_steps=MORE_STEPS, density=DENSITY)
        assert "ddp_comm_hook" in r["errors"]["ddp_comm_hook"] and "allreduce_hook" in r["errors"]["ddp_comm_hook"]
        assert "already has a communication hook (allreduce_hook)" in r["errors"]["second_hook"]
    # Different data per rank: every residual differs between the ranks, yet the replicas agree.
    saved0, saved1 = results[0]["saved"], results[1]["saved"]
    for key0, key1 in zip(sorted(saved0), sorted(saved1)):
        assert key0.replace("rank0.", "rank1.") == key1
        assert not torch.equal(saved0[key0], saved1[key1]), f"{key0}: ranks hold the same residual"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    # Rank 0 wrote one file holding both ranks' residuals, bit for bit.
    stored = torch.load(tmp_path / "run.ckpt", weights_only=True)["callbacks"]["SparseCommCallback"]
    for key, value in {**saved0, **saved1}.items():
        assert torch.equal(stored[key], value)


def _defaults_worker(rank, world_size, root):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    import warnings

    import lightning.pytorch as pl

    from sparsecomm.integrations import SparseCommCallback
    from sparsecomm.hooks.momentum_handover import OptimizerChangedWarning

    Regressor, loader = _module_and_data(pl)

    def fit(callback, make_optimizer):
        made = []

        class WithOptimizer(Regressor):
            def configure_optimizers(self):
                made.append(make_optimizer(self.parameters()))
                return made[-1]

        model = WithOptimizer()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _trainer(pl, [callback], 4, root).fit(model, loader)
            except ValueError as error:
                return dict(error=str(error), momentum=made[0].param_groups[0]["momentum"])
        return dict(params=[p.detach().clone() for p in model.parameters()], momentum=callback.state.config.momentum,
                    betas=[g["betas"] for g in made[0].param_groups],
                    sparse_calls=callback.state.stats()["sparse_calls"],
                    announced=[str(w.message) for w in caught if issubclass(w.category, OptimizerChangedWarning)])

    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    return dict(
        defaults=fit(SparseCommCallback(density=DENSITY), adamw),
        # The topk-dgc setting built by hand: AdamW without a first moment, the hook's momentum 0.9.
        by_hand=fit(SparseCommCallback(density=DENSITY, momentum=0.9),
                    lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.0, 0.999))),
        plain_ef=fit(SparseCommCallback(density=DENSITY, momentum=0), adamw),
        refused=fit(SparseCommCallback(density=DENSITY), lambda params: torch.optim.RMSprop(params, lr=1e-2,
                                                                                             momentum=0.9)),
    )


@pytest.mark.timeout(240)
def test_defaults_move_adamws_first_moment_into_the_hook_and_say_so_on_rank_0(spawned):
    for rank, runs in enumerate(_scenario(spawned, "defaults")[0]):
        assert_defaults_are_topk_dgc(runs, rank, "SparseCommCallback", sparse_calls=2)
        # An optimizer whose momentum cannot move: refused when fit starts, left as it was.
        refused = runs["refused"]
        assert "SparseCommCallback: cannot move the momentum of RMSprop" in refused["error"]
        assert refused["momentum"] == 0.9


def _metrics_worker(rank, world_size, root):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy

    from sparsecomm.integrations import SparseCommCallback

    Regressor, loader = _module_and_data(pl)

    class Logged(Regressor):
        def training_step(self, batch, batch_index):
            loss = super().training_step(batch, batch_index)
            self.log("loss", loss)  # Lightning's own value, to line the figures up with
            return loss

    loggers = [TensorBoardLogger(root, name="tb", version=0), CSVLogger(root, name="csv", version=0)]
    callback = SparseCommCallback(density=DENSITY, budget="bucket")  # log_every="auto": log_every_n_steps
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=DDPStrategy(), callbacks=[callback],
                         max_steps=STEPS, log_every_n_steps=2, logger=loggers, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    model = Logged()
    trainer.fit(model, loader)
    return dict(numel=sum(p.numel() for p in model.parameters()))


@pytest.mark.timeout(240)
def test_figures_reach_the_trainers_loggers_at_lightnings_steps(spawned):
    results, root = _scenario(spawned, "metrics")
    numel = results[0]["numel"]
    # Written every log_every_n_steps = 2 optimizer steps, at the step Lightning gives the
    # batch of optimizer step 2, 4, 6 (1, 3, 5), where its own "loss" is.
    logged = scalars(root / "tb" / "version_0")
    assert [step for step, _ in logged["loss"]] == [1, 3, 5]
    expected = [bytes_sent_per_step(numel, DENSITY, first, first + 1) for first in (1, 3, 5)]
    assert logged["sparsecomm/bytes_sent_per_step"] == [(1, pytest.approx(expected[0])), (3, pytest.approx(
        expected[1])), (5, pytest.approx(expected[2]))]
    assert [value for _, value in logged["sparsecomm/steps"]] == [2, 4, 6]
    assert {"sparsecomm/compression", "sparsecomm/residual_norm", "sparsecomm/density"} <= logged.keys()
    # The CSV logger got the same figures, at the steps of Lightning's own values.
    import csv

    with open(root / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(row["step"]), float(row["sparsecomm/bytes_sent_per_step"])) for row in rows
            if row["sparsecomm/bytes_sent_per_step"]] == [(1, pytest.approx(expected[0])),
                                                          (3, pytest.approx(expected[1])), (5, pytest.approx(expected[2]))]
    assert [int(row["step"]) for row in rows if row["loss"]] == [1, 3, 5]


def test_strategy_without_ddp_is_refused(pl, tmp_path):
    from sparsecomm.integrations import SparseCommCallback

    Regressor, loader = _module_and_data(pl)
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[SparseCommCallback()], max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(TypeError, match="needs trainer strategy DDPStrategy.*got SingleDeviceStrategy"):
        trainer.fit(Regressor(), loader)


def test_two_callbacks_and_bad_options_are_refused(pl):
    from sparsecomm.integrations import SparseCommCallback

    with pytest.raises(RuntimeError, match="more than one stateful callback of type `SparseCommCallback`"):
        pl.Trainer(accelerator="cpu", callbacks=[SparseCommCallback(), SparseCommCallback()], logger=False)
    with pytest.raises(ValueError, match="density"):
        SparseCommCallback(density=0.0)
    with pytest.raises(TypeError, match="module cannot be given"):
        SparseCommCallback(module=torch.nn.Linear(1, 1))
    with pytest.raises(TypeError, match="strict_load must be True or False"):
        SparseCommCallback(strict_load="yes")
    with pytest.raises(ValueError, match="momentum must be 'auto' .* got 'dgc'"):
        SparseCommCallback(momentum="dgc")
    with pytest.raises(ValueError, match="log_every must be None, 'auto' or an integer >= 1 .* got 0"):
        SparseCommCallback(log_every=0)
    with pytest.raises(TypeError, match="log_every must be None, 'auto' or an integer >= 1 .* got 2.5"):
        SparseCommCallback(log_every=2.5)


def test_importing_sparsecomm_needs_no_framework_and_names_the_extra():
    """Lightning and Accelerate as if not installed: sparsecomm and its integrations import;
    transformers (installed) is not imported by that; each integration then names its extra."""
    code = (
        "import sys\n"
        "for name in ('lightning', 'lightning.pytorch', 'accelerate'):\n"
        "    sys.modules[name] = None  # as if not installed\n"
        "import sparsecomm, sparsecomm.integrations\n"
        "assert 'transformers' not in sys.modules, 'imported transformers'\n"
        "sys.modules['transformers'] = None  # as if not installed\n"
        "for attr, extra in (('SparseCommCallback', 'lightning'), ('register_topk_hook_accelerate', 'accelerate'),\n"
        "                    ('SparseCommTrainerCallback', 'transformers')):\n"
        "    try:\n"
        "        getattr(sparsecomm.integrations, attr)\n"
        "    except ImportError as error:\n"
        "        assert f\"pip install 'sparsecomm[{extra}]'\" in str(error), error\n"
        "    else:\n"
        "        raise AssertionError(attr + ' imported without its framework')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
