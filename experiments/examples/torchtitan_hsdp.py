"""sparsecomm in a torchtitan job: torchtitan's own launcher, Trainer, llama3 debug model and
parallelize function; the top-k hook on the replica dimension of HSDP.

    torchrun --standalone --nproc-per-node 4 experiments/examples/torchtitan_hsdp.py \
        --sparsecomm.enable --training.steps 50

Without ``--sparsecomm.enable`` it is torchtitan's own HSDP (the baseline). Any torchtitan flag
works (``--training.steps``, ``--debug.seed``, ``--metrics.enable_tensorboard``,
``--checkpoint.enable``, ``--parallelism.data_parallel_replicate_degree``...), and so does any
``--sparsecomm.*`` option (``--help`` lists them). 2 replicas: 4 processes give 2x2, 2 give
2x1. The data is Python's own help text in byte tokens, so nothing is downloaded.

What a job of your own needs is the config function below: return your config through
``to_sparsecomm`` (marked ``# sparsecomm``), and launch torchtitan with ``--module`` naming
the file that holds it.
"""
import os
import sys

import sparsecomm.integrations.torchtitan  # noqa: F401  (settles torchtitan's device first on a CPU-only machine)
from sparsecomm.integrations.torchtitan import to_sparsecomm  # sparsecomm (1/2)
from sparsecomm.integrations.torchtitan.cpu import has_accelerator, runnable_on_cpu
from sparsecomm.integrations.torchtitan.offline_data import use_offline_data


def llama3_debugmodel_hsdp():
    """torchtitan's llama3 debug model config, on offline data, with 2 replicas."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = use_offline_data(llama3_debugmodel())  # your own config function here
    config.training.seq_len, config.training.local_batch_size = 128, 2
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None
    config.parallelism.data_parallel_replicate_degree = 2
    if not has_accelerator():
        runnable_on_cpu(config)  # SDPA attention and gloo's sums (sparsecomm.integrations.torchtitan.cpu)
    return to_sparsecomm(config)  # sparsecomm (2/2): the job now takes --sparsecomm.* options


if __name__ == "__main__":
    # torchtitan's own entry point, with this file as the config registry.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.argv[1:1] = ["--module", "torchtitan_hsdp", "--config", "llama3_debugmodel_hsdp"]
    from torchtitan.train import main

    main()
