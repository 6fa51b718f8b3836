"""Inputs shared by the kernel tests of every backend (CPU, CUDA, Triton)."""
import torch

# (grad dtype, wire dtype) pairs where the wire's range is narrower than the gradient's.
NARROW_WIRE_PAIRS = [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]


def beyond_wire_range(grad_dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A gradient with values at and beyond fp16/bf16 limits, +-Inf and NaN, plus small noise;
    and k = the number of such special values (so they are exactly the ones selected)."""
    big = [65504.0, 65519.0, 65520.0, 70000.0, 1e6, 3.3e38, float("inf"), -float("inf"), float("nan")]
    if grad_dtype == torch.float32:
        big += [3.3895e38, 3.3896e38, 3.4e38, -3.4e38]
    grad = torch.cat([torch.tensor(big), -torch.tensor(big), torch.randn(50)]).to(grad_dtype)
    return grad, 2 * len(big)
