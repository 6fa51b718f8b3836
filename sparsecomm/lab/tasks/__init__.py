"""Tasks (model + data) for the experiment runner: the built-in ones, and yours.

A task of your own is a callable that returns a :class:`Task`, named
``MODULE:FACTORY`` (an importable module; the current directory is on the path) or
``path/to/file.py:FACTORY`` (its directory is on the path, as for a script):
``sparsecomm compare --task my_tasks:make_task``. The runner
calls it once in each rank of each run (after seeding torch with the run's seed), and once
in the command itself to read ``num_train_samples`` for the config's checks.
"""
import importlib
import importlib.util
import sys
from pathlib import Path

TASK_NAMES = ("pydoc-gpt", "digits-mlp")
TASK_ACCEPTED = f"one of {TASK_NAMES}, or MODULE:FACTORY / path/to/file.py:FACTORY (a callable returning a Task)"


def is_user_task(name) -> bool:
    """``name`` has the form of a user task (``MODULE:FACTORY``); whether it loads is another matter."""
    if not isinstance(name, str) or name.count(":") != 1:
        return False
    module, factory = name.split(":")
    return bool(module) and factory.isidentifier()


def _users_code(task: str, what: str, call):
    """``call()``, which runs the user's code: whatever ends it (an exception, ``sys.exit``, a
    KeyboardInterrupt) becomes a ValueError naming the task and what its code did, so that
    nothing the code does can end the command with success."""
    try:
        return call()
    except SystemExit as stop:
        raise ValueError(f"task {task}: {what} ended the process (SystemExit, code {stop.code!r}) instead of "
                         "returning") from None
    except KeyboardInterrupt:
        raise ValueError(f"task {task}: {what} raised KeyboardInterrupt") from None
    except Exception as error:  # noqa: BLE001 - the user's code: say whose it is, and what it raised
        raise ValueError(f"task {task}: {what} raised {type(error).__name__}: {error}") from error


def _import(module: str, task: str):
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise ValueError(f"task {module}: no such file (relative paths are relative to the current directory, "
                             f"{Path.cwd()})")
        if str(path.resolve().parent) not in sys.path:
            sys.path.insert(0, str(path.resolve().parent))  # as for a script run by path: its neighbours import
        spec = importlib.util.spec_from_file_location(f"sparsecomm_user_task_{path.stem}", path.resolve())
        loaded = importlib.util.module_from_spec(spec)
        _users_code(task, f"importing {module}", lambda: spec.loader.exec_module(loaded))
        return loaded
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: your module next to you imports
    try:
        return _users_code(task, f"importing {module}", lambda: importlib.import_module(module))
    except ValueError as error:
        if isinstance(error.__cause__, ModuleNotFoundError):
            raise ValueError(f"task {module}: cannot import it ({error.__cause__}); name an importable module or a "
                             ".py file") from None
        raise


def load_user_task(name: str) -> "Task":
    """Call the user's factory and check that it returned a Task; ValueError naming the task otherwise."""
    module_name, factory_name = name.split(":")
    module = _import(module_name, name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"task {name}: {module_name} has no callable {factory_name!r}")
    task = _users_code(name, f"{factory_name}()", factory)
    # A Task is an instance of a subclass of base.Task, so base is imported by then; when it is
    # not, the factory returned something else, and the command says so without importing torch.
    base = sys.modules.get("sparsecomm.lab.tasks.base")
    if base is None or not isinstance(task, base.Task):
        raise ValueError(f"task {name}: {factory_name}() returned {type(task).__name__}, not a "
                         "sparsecomm.lab.tasks.Task (subclass it: num_train_samples, build_model, train_batch, loss, "
                         "val_loss)")
    count = _users_code(name, "its num_train_samples", lambda: task.num_train_samples)
    if not (isinstance(count, int) and not isinstance(count, bool) and count >= 1):
        raise ValueError(f"task {name}: num_train_samples must be an integer >= 1, got {count!r}")
    return task


def get_task(name: str) -> "Task":
    """Build the task called ``name`` (loads its data)."""
    if name == "pydoc-gpt":
        from sparsecomm.lab.tasks.pydoc_gpt import PydocGPT

        return PydocGPT()
    if name == "digits-mlp":
        from sparsecomm.lab.tasks.digits import DigitsMLP

        return DigitsMLP()
    if is_user_task(name):
        return load_user_task(name)
    raise ValueError(f"task must be {TASK_ACCEPTED}, got {name!r}")


def __getattr__(name):
    # The Task protocol imports torch; the names above do not (config checks run without it).
    if name == "Task":
        from sparsecomm.lab.tasks.base import Task

        return Task
    raise AttributeError(f"module 'sparsecomm.lab.tasks' has no attribute {name!r}")


__all__ = ["TASK_ACCEPTED", "TASK_NAMES", "Task", "get_task", "is_user_task", "load_user_task"]
