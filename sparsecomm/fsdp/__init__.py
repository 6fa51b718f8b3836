"""Top-k + error feedback for FSDP2 models: the cross-replica reduction of hybrid sharding,
and sharded checkpoints of such a job."""
_CHECKPOINT_NAMES = ("latest_hsdp_step", "load_hsdp_checkpoint", "save_hsdp_checkpoint")
__all__ = ["register_hsdp_hook", *_CHECKPOINT_NAMES]


def __getattr__(name):
    # Imported on first use: torch.distributed.checkpoint costs every importer (the averager
    # and the lab's ranks import this package's layout checks) over a second.
    if name == "register_hsdp_hook":
        from sparsecomm.fsdp.hsdp_hook import register_hsdp_hook

        return register_hsdp_hook
    if name in _CHECKPOINT_NAMES:
        from sparsecomm.fsdp import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'sparsecomm.fsdp' has no attribute {name!r}")
