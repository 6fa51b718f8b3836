"""The loggers' packages, imported only when a sink (or the lab's export) needs one: importing
sparsecomm never imports TensorBoard or Weights & Biases."""
import importlib


def import_optional(module: str, package: str, extra: str, user: str):
    """``importlib.import_module(module)``, or an ImportError saying that ``user`` needs
    ``package`` and naming the pip extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{user} needs the {package!r} package ({module} could not be imported: {error}); install "
                          f"it with: pip install 'sparsecomm[{extra}]'") from error


def summary_writer_class(user: str):
    """``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard`` package)."""
    return import_optional("torch.utils.tensorboard", "tensorboard", "tensorboard", user).SummaryWriter
