"""Where an experiment's runs train: one after another in this command
(:func:`sparsecomm.lab.experiment.runner.run_experiment`), or as jobs when the config has a
``cluster`` (:func:`sparsecomm.lab.cluster.submit.run_on_cluster`, which imports submitit).
Both return the experiment directory and raise ExperimentInterrupted on SIGINT/SIGTERM."""
from pathlib import Path

from sparsecomm.lab.experiment.config import ExperimentConfig


def run_experiment(config: ExperimentConfig, root: Path, *, progress=print) -> Path:
    if config.cluster is not None:
        from sparsecomm.lab.cluster.submit import run_on_cluster

        return run_on_cluster(config, root, progress=progress)
    from sparsecomm.lab.experiment import runner

    return runner.run_experiment(config, root, progress=progress)
