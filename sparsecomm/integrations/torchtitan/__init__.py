"""sparsecomm in a torchtitan job (torchtitan 0.3.0; ``pip install 'sparsecomm[torchtitan]'``).

- :class:`SparseCommTrainer` (:mod:`.trainer`): torchtitan's Trainer with the top-k hook on the
  replica dimension, switched on by ``--sparsecomm.enable`` (options: :mod:`.options`).
- :func:`to_sparsecomm` and ready configs (:mod:`.config_registry`), for torchtitan's launcher:
  ``torchrun ... -m torchtitan.train --module sparsecomm.integrations.torchtitan --config
  llama3_debugmodel_sparse``.
- :mod:`.cpu`: what torchtitan needs to run without an accelerator. Importing this package
  settles torchtitan's device on such a machine (:func:`.cpu.settle_device`), before anything
  of torchtitan's that copies it is imported.
- :mod:`.offline_data`: Python's help text and a byte tokenizer, so a job runs with no download.

Importing ``sparsecomm`` never imports this package or torchtitan.
"""
from sparsecomm.integrations.common import import_framework

import_framework("torchtitan.tools.utils", "torchtitan", "torchtitan")

from sparsecomm.integrations.torchtitan.cpu import settle_device  # noqa: E402

settle_device()  # before torchtitan.trainer (below) copies the device type

from sparsecomm.integrations.torchtitan.config_registry import to_sparsecomm  # noqa: E402
from sparsecomm.integrations.torchtitan.options import SparseCommOptions  # noqa: E402
from sparsecomm.integrations.torchtitan.trainer import SparseCommTrainer  # noqa: E402

__all__ = ["SparseCommOptions", "SparseCommTrainer", "settle_device", "to_sparsecomm"]
