"""The run hash covers what a run executes of your code: the task's or script's file, the
modules it imports from your tree (read from its import statements, nothing run), and the
files you declare (``sources``); what it cannot cover is named in a warning. Editing any of
them makes ``compare`` run the runs again instead of reusing the old results."""
import json
import sys
import textwrap
from pathlib import Path

import pytest

from sparsecomm.lab.experiment import launch, runner
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.run_sources import script_code, task_code

pytestmark = pytest.mark.timeout(240)

TASK = """
import torch
import torch.nn.functional as F
from sparsecomm.lab.tasks import Task
import {helpers}

class Regression(Task):
    name = "regression"
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)
    num_train_samples = 192
    def build_model(self):
        return {helpers}.model()
    def train_batch(self, ids):
        return self.x[ids], self.y[ids]
    def loss(self, model, inputs, targets):
        return F.mse_loss(model(inputs), targets)
    def val_loss(self, model):
        with torch.no_grad():
            return F.mse_loss(model(self.x[192:]), self.y[192:]).item()

def make():
    return Regression()
"""
HELPERS = """
import torch
WIDTH = {width}
def model():
    return torch.nn.Sequential(torch.nn.Linear(4, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _hash(**fields) -> str:
    return ExperimentConfig(name="x", arms=("dense", "topk-ef"), **fields).run_hash("topk-ef", 0)


def _each_edit_changes_the_hash(root: Path, names, make_hash) -> None:
    before = make_hash()
    for name in names:
        path = root / name
        original = path.read_text()
        path.write_text(original + "\n# edited\n")
        assert make_hash() != before, f"editing {name} left the run hash as it was"
        path.write_text(original)
        assert make_hash() == before


SCRIPT_TREE = {
    "train.py": """
        import json, torch                  # the standard library and an installed package: not yours
        import sparsecomm.lab               # the lab itself: not yours
        import helpers
        import calendar                     # yours: next to the script, it shadows the standard library's
        from models import net
        from models.blocks import Block
        import nspkg.sub                    # a namespace package (no __init__.py)
        def later():
            import late_import              # imports inside functions count too
        """,
    "helpers.py": "WIDTH = 8\n",
    "calendar.py": "MONTHS = 12\n",
    "late_import.py": "LATE = 1\n",
    "models/__init__.py": "",
    "models/net.py": "from . import layers\nfrom .blocks import Block\n",
    "models/layers.py": "DEPTH = 2\n",
    "models/blocks.py": "class Block:\n    pass\n",
    "nspkg/sub.py": "SUB = 1\n",
    "unused.py": "NOT_IMPORTED = 1\n",
}


def test_a_scripts_hash_covers_every_module_it_imports_from_your_tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, SCRIPT_TREE)
    code = script_code("train.py")
    assert sorted(code.files) == ["calendar.py", "helpers.py", "late_import.py", "models/__init__.py",
                                  "models/blocks.py", "models/layers.py", "models/net.py", "nspkg/sub.py", "train.py"]
    assert code.not_covered == []
    _each_edit_changes_the_hash(tmp_path, sorted(code.files), lambda: _hash(script="train.py"))
    before = _hash(script="train.py")
    (tmp_path / "unused.py").write_text("NOT_IMPORTED = 2\n")  # not executed by the run: not part of it
    assert _hash(script="train.py") == before


@pytest.mark.parametrize("form", ["file", "module"])
def test_a_user_tasks_hash_covers_its_file_and_the_modules_it_imports(tmp_path, monkeypatch, form):
    monkeypatch.chdir(tmp_path)
    task_module, helpers = f"hash_task_{form}", f"hash_helpers_{form}"  # fresh module names: imports are cached
    _write(tmp_path, {f"{task_module}.py": TASK.format(helpers=helpers), f"{helpers}.py": HELPERS.format(width=8)})
    task = f"{task_module}.py:make" if form == "file" else f"{task_module}:make"
    assert sorted(task_code(task).files) == [f"{helpers}.py", f"{task_module}.py"]
    _each_edit_changes_the_hash(tmp_path, [f"{task_module}.py", f"{helpers}.py"], lambda: _hash(task=task))


def test_declared_sources_are_covered_and_what_reading_cannot_see_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, {
        "train.py": """
            import importlib, sys
            plugin = importlib.import_module(sys.argv[1])
            helpers = importlib.import_module("helpers")
            exec(open("snippet.py").read())
            import not_installed_anywhere
            """,
        "helpers.py": "X = 1\n",
        "plugins/a.py": "A = 1\n",
        "data/table.csv": "1,2\n",
        "data/nested/more.csv": "3,4\n",
    })
    code = script_code("train.py")
    assert sorted(code.files) == ["helpers.py", "train.py"]  # a literal name is followed
    assert code.not_covered == ["what importlib.import_module(...) at train.py:3 loads (known only at run time)",
                                "what exec(...) at train.py:5 loads (known only at run time)",
                                "'not_installed_anywhere' imported at train.py:6 (not found here)"]
    sources = ("plugins", "data/table.csv", "data/nested")
    assert sorted(script_code("train.py", sources).files) == [
        "declared:data/nested/more.csv", "declared:data/table.csv", "declared:plugins/a.py", "helpers.py", "train.py"]
    _each_edit_changes_the_hash(tmp_path, ["plugins/a.py", "data/table.csv", "data/nested/more.csv"],
                                lambda: _hash(script="train.py", sources=sources))
    with pytest.raises(ValueError, match="sources must be a list of paths of existing files or directories"):
        _hash(script="train.py", sources=("missing.csv",))
    with pytest.raises(ValueError, match="sources must be empty with a built-in task"):
        _hash(task="digits-mlp", sources=("data",))

    # The runner says what is covered and warns about the rest before the first run.
    monkeypatch.setattr(launch, "torchrun_command", lambda *args: [sys.executable, "-c", "raise SystemExit(1)"])
    lines = []
    config = ExperimentConfig(name="x", script="train.py", arms=("dense",), seeds=(0,))
    runner.run_experiment(config, tmp_path / "runs", progress=lines.append)
    assert lines[0] == "the run hash covers 2 file(s) of your code: helpers.py, train.py"
    assert lines[1].startswith("warning: the run hash does not cover what importlib.import_module(...) at "
                               "train.py:3 loads (known only at run time); ")
    assert "list the files with --sources (config: sources)" in lines[1]


def test_editing_a_tasks_helper_module_runs_the_run_again(tmp_path, monkeypatch):
    """The issue's case end to end: after an edit, the run is not reused ("finished earlier,
    skipped") but trained again, on the new model."""
    monkeypatch.chdir(tmp_path)  # the runs start here, as from the command line
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m sparsecomm` has it
    _write(tmp_path, {"e2e_task.py": TASK.format(helpers="e2e_helpers"), "e2e_helpers.py": HELPERS.format(width=8)})

    def run() -> tuple[list[str], dict]:
        lines = []
        config = ExperimentConfig(name="x", task="e2e_task.py:make", arms=("dense",), seeds=(0,), steps=3)
        runner.run_experiment(config, tmp_path / "runs", progress=lines.append)
        return lines, json.loads((runner.run_directory(config, tmp_path / "runs", "dense", 0) / "summary.json").read_text())

    lines, first = run()
    assert first["status"] == "ok" and first["num_parameters"] == 4 * 8 + 8 + 8 + 1
    (tmp_path / "e2e_helpers.py").write_text(textwrap.dedent(HELPERS.format(width=16)))
    lines, second = run()
    assert not any("skipped" in line for line in lines), lines
    assert second["status"] == "ok" and second["num_parameters"] == 4 * 16 + 16 + 16 + 1


def test_a_rank_refuses_to_train_code_changed_after_the_experiment_started(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _write(tmp_path, {"mid_task.py": TASK.format(helpers="mid_helpers"), "mid_helpers.py": HELPERS.format(width=8)})
    launch = runner._launch

    def edit_then_launch(*args, **kwargs):  # the user edits a module while the experiment runs
        (tmp_path / "mid_helpers.py").write_text(textwrap.dedent(HELPERS.format(width=32)))
        return launch(*args, **kwargs)

    monkeypatch.setattr(runner, "_launch", edit_then_launch)
    config = ExperimentConfig(name="x", task="mid_task.py:make", arms=("dense",), seeds=(0,), steps=3)
    runner.run_experiment(config, tmp_path / "runs", progress=lambda line: None)
    summary = json.loads((runner.run_directory(config, tmp_path / "runs", "dense", 0) / "summary.json").read_text())
    assert summary["status"] == "failed" and "your code changed since the experiment started" in summary["error"]


def test_a_run_hash_covers_the_experiment_fields_its_arm_reads_and_no_other():
    from sparsecomm.lab.experiment.named import digits_quick

    base = digits_quick()
    for arm, reads, unread in [("dense", {}, {"density": 0.5, "dgc_momentum": 0.5, "powersgd_rank": 7}),
                               ("dense-bf16", {}, {"density": 0.5, "dgc_momentum": 0.5, "powersgd_rank": 7}),
                               ("powersgd", {"powersgd_rank": 7}, {"density": 0.5, "dgc_momentum": 0.5}),
                               ("topk-ef", {"density": 0.5}, {}),
                               ("topk-dgc", {"density": 0.5, "dgc_momentum": 0.5}, {})]:
        for key, value in unread.items():  # a dense run at another density is the same run
            assert base.with_overrides(**{key: value}).run_hash(arm, 0) == base.run_hash(arm, 0), (arm, key)
        for key, value in reads.items():
            assert base.with_overrides(**{key: value}).run_hash(arm, 0) != base.run_hash(arm, 0), (arm, key)
        for key in ("lr", "steps"):  # what every arm reads
            changed = {"lr": base.lr * 2, "steps": base.steps + 1}[key]
            assert base.with_overrides(**{key: changed}).run_hash(arm, 0) != base.run_hash(arm, 0), (arm, key)
