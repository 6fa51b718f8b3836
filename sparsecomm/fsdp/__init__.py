"""Top-k + error feedback for FSDP2 models: the cross-replica reduction of hybrid sharding,
and sharded checkpoints of such a job."""
from sparsecomm.fsdp.checkpoint import latest_hsdp_step, load_hsdp_checkpoint, save_hsdp_checkpoint  # noqa: F401
from sparsecomm.fsdp.hsdp_hook import register_hsdp_hook  # noqa: F401
