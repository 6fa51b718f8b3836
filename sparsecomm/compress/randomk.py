"""Random-k selection: the cheap, unbiased-index baseline of the literature.

Every rank draws the same indices from a generator seeded by (seed, step, stream), where
the hook uses a hash of the parameter name as the stream, so the values can be summed with
an allreduce instead of all-gathering indices too.
"""
import torch

# Large odd multipliers spread (seed, step, stream) over the 63-bit seed space so that
# neighbouring steps or streams never reuse a random sequence.
_STEP_MIX = 0x9E3779B97F4A7C15
_STREAM_MIX = 0xBF58476D1CE4E5B9


def random_indices(numel: int, k: int, *, seed: int, step: int, stream: int) -> torch.Tensor:
    """``k`` distinct indices in ``[0, numel)``, identical on every rank for equal arguments.

    Drawn on a private CPU generator so the global RNG is untouched.
    """
    if k >= numel:
        return torch.arange(numel)
    mixed = (seed + step * _STEP_MIX + stream * _STREAM_MIX) % (2**63 - 1)
    generator = torch.Generator().manual_seed(mixed)
    return torch.randperm(numel, generator=generator)[:k]
