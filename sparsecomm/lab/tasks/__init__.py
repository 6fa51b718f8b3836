"""Reference tasks (model + data) that need no download."""
from sparsecomm.lab.tasks.base import Task


def get_task(name: str) -> Task:
    """Build the task called ``name`` (loads its data)."""
    if name == "pydoc-gpt":
        from sparsecomm.lab.tasks.pydoc_gpt import PydocGPT

        return PydocGPT()
    if name == "digits-mlp":
        from sparsecomm.lab.tasks.digits import DigitsMLP

        return DigitsMLP()
    raise ValueError(f"task must be 'pydoc-gpt' or 'digits-mlp', got {name!r}")


__all__ = ["Task", "get_task"]
