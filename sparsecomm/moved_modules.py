"""Modules that moved, still importable under their old names (each warns once, naming the new one).

The package's folders are floors that only point down (docs/architecture.md); modules moved when
the floors were drawn. A program that imports an old name gets the new module itself (the same
object, so ``isinstance`` and monkeypatching still work) and one ``DeprecationWarning``.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "sparsecomm.hooks.config": "sparsecomm.hooks.state.settings",
    "sparsecomm.hooks.options": "sparsecomm.hooks.state.settings",
    "sparsecomm.hooks.validation": "sparsecomm.hooks.state.settings",
    "sparsecomm.hooks.density_schedule": "sparsecomm.hooks.state.settings",
    "sparsecomm.hooks.parameter_names": "sparsecomm.hooks.state.memories",
    "sparsecomm.hooks.parameter_memory": "sparsecomm.hooks.state.memories",
    "sparsecomm.hooks.memories": "sparsecomm.hooks.state.memories",
    "sparsecomm.hooks.stats": "sparsecomm.hooks.state.step",
    "sparsecomm.hooks.step_lifecycle": "sparsecomm.hooks.state.step",
    "sparsecomm.hooks.step_journal": "sparsecomm.hooks.state.step",
    "sparsecomm.hooks.grad_scaler": "sparsecomm.hooks.state.grad_scaler",
    "sparsecomm.hooks.observers": "sparsecomm.hooks.state.observers",
    "sparsecomm.hooks.events": "sparsecomm.hooks.state.events",
    "sparsecomm.hooks.unused_parameters": "sparsecomm.hooks.state.unused_parameters",
    "sparsecomm.hooks.model_budget": "sparsecomm.hooks.state.model_budget",
    "sparsecomm.hooks.rank_agreement": "sparsecomm.hooks.state.rank_agreement",
    "sparsecomm.hooks.state_dict_check": "sparsecomm.hooks.state.state_dict_check",
    "sparsecomm.hooks.conservation": "sparsecomm.hooks.state.conservation",
    "sparsecomm.hooks.pipeline.integrity": "sparsecomm.hooks.wires.integrity",
    "sparsecomm.hooks.pipeline.plan": "sparsecomm.hooks.pipeline.steps",
    "sparsecomm.hooks.pipeline.acc": "sparsecomm.hooks.pipeline.steps",
    "sparsecomm.hooks.pipeline.record": "sparsecomm.hooks.pipeline.steps",
    "sparsecomm.hooks.optimizer": "sparsecomm.optim.dgc",
    "sparsecomm.hooks.sign_sgd": "sparsecomm.optim.sign_sgd",
    "sparsecomm.lab.policy": "sparsecomm.lab.results.policy",
    "sparsecomm.lab.quantity": "sparsecomm.lab.results.quantity",
    "sparsecomm.lab.target": "sparsecomm.lab.results.target",
    "sparsecomm.lab.text": "sparsecomm.lab.results.text",
    "sparsecomm.lab.script_run": "sparsecomm.lab.experiment.script_run",
    "sparsecomm.lab.experiment.compare": "sparsecomm.lab.compare",
    "sparsecomm.lab.experiment.run_where": "sparsecomm.lab.run_where",
    "sparsecomm.lab.cluster.settings": "sparsecomm.lab.experiment.cluster_settings",
    "sparsecomm.monitor._consensus": "sparsecomm.monitor.consensus",
    "sparsecomm.monitor._layout": "sparsecomm.monitor.payload_view",
    "sparsecomm.integrations._common": "sparsecomm.integrations.common",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of :data:`MOVED` and loads it as the new module."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the new module is already executed


def install() -> None:
    """Make the old names importable (once per process)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
