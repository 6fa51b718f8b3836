"""Top-k + error feedback for FSDP2 models: the cross-replica reduction of hybrid sharding."""
from sparsecomm.fsdp.hsdp_hook import register_hsdp_hook  # noqa: F401
