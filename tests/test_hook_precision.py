"""16-bit models (bf16/fp16 parameters, not only the compress wrappers): memories in float32.

Error feedback adds the same small gradient to the residual step after step until it is
large enough to be sent. In a bf16 residual that addition stops once the residual is 256
times the increment (bf16 has 8 significant bits; the next addition is a tie that rounds
to even), so small gradients are rounded away for good. The default keeps the residual
(and the velocity) in float32 for 16-bit buckets. Oracle: the exact sums, worked by hand.
"""
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from ddp_models import all_finite, backward_error, memories_finite, mlp, params, rank_data
from rank_processes import run_on_ranks

pytestmark = pytest.mark.timeout(180)

N = 64
STEPS = 300
WARMUP = 2
SMALL = 2.0**-12  # the local gradient of every entry but the first; exact in bf16


def _small_gradient_worker(rank, world_size, residual_dtype):
    # d(w . x)/dw = x: the gradient is the input, so it is known exactly. Entry 0 is the
    # largest (and differs per rank), so with k = 1 it is the one sent every step and the
    # other 63 entries only accumulate SMALL / world_size per step in the residual.
    model = nn.Linear(N, 1, bias=False).to(torch.bfloat16)
    ddp = DDP(model)
    state = sparsecomm.register_topk_hook(ddp, density=1 / N, residual_dtype=residual_dtype, warmup_steps=WARMUP,
                                          verify_conservation=True, budget="bucket")  # the fused path
    x = torch.full((1, N), SMALL, dtype=torch.bfloat16)
    x[0, 0] = 1.0 + rank
    for _ in range(STEPS):
        ddp(x).float().sum().backward()
        model.zero_grad()
    residual = state.state_dict()[f"rank{rank}.residual.weight"]
    return residual.dtype, residual[0].item(), residual[1:].unique().tolist(), state.stats()


@pytest.mark.parametrize("residual_dtype", [None, torch.bfloat16], ids=["default-float32", "bfloat16"])
def test_small_gradients_accumulate_in_a_float32_residual(residual_dtype):
    sparse_steps = STEPS - WARMUP
    for dtype, first, rest, stats in run_on_ranks(_small_gradient_worker, residual_dtype):
        assert stats["sparse_calls"] == sparse_steps
        # The audit (verify_conservation) checked every step of the fused path itself.
        assert stats["fused_calls"] == sparse_steps
        if residual_dtype is None:
            assert dtype == torch.float32
            assert rest == [sparse_steps * SMALL / 2]  # 298 x 2^-13, exact in float32
        else:
            assert dtype == torch.bfloat16
            assert rest == [2.0**-5]  # stalled at 256 x 2^-13: the rest was rounded away
        assert first == 0.0  # entry 0 is sent each step; bf16(1 + r) / 2 is exact


def _model_dtype_worker(rank, world_size, dtype, selector, momentum):
    model = mlp().to(dtype)
    ddp = DDP(model)
    state = sparsecomm.register_topk_hook(ddp, density=0.05, selector=selector, momentum=momentum,
                                          verify_conservation=selector != "sampled")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    evaluation = rank_data(0, 1, (64, 32), seed=7)[0].to(dtype)
    losses = []
    for x in rank_data(rank, 25, (8, 32)):
        optimizer.zero_grad()
        ddp(x.to(dtype)).float().pow(2).mean().backward()
        optimizer.step()
        with torch.no_grad():
            losses.append(float(model(evaluation).float().pow(2).mean()))
    memory_dtypes = {v.dtype for k, v in state.state_dict().items() if ".residual." in k or ".velocity." in k}
    return params(model), losses, memory_dtypes, memories_finite(state), state.stats()["sparse_calls"]


CONFIGS = (("exact", 0.0), ("sampled", 0.0), ("exact", 0.9), ("random", 0.0))


def _model_dtypes_worker(rank, world_size, dtype):
    return [_model_dtype_worker(rank, world_size, dtype, selector, momentum) for selector, momentum in CONFIGS]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_models_train_with_float32_memories(dtype):
    per_rank = run_on_ranks(_model_dtypes_worker, dtype, timeout=150)
    for i, config in enumerate(CONFIGS):
        for results in per_rank:
            model_params, losses, memory_dtypes, finite, sparse_calls = results[i]
            assert memory_dtypes == {torch.float32} and finite and sparse_calls > 0, config
            assert all(p.dtype == dtype for p in model_params)
            assert all_finite(torch.tensor(losses)) and losses[-1] < 0.8 * losses[0], config
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0][i][0], per_rank[1][i][0])), config


def _refused_worker(rank, world_size):
    ddp = DDP(mlp().to(torch.bfloat16))
    sparsecomm.register_topk_hook(ddp, density=0.05, residual_dtype=torch.float16)
    return backward_error(ddp, torch.ones(2, 32, dtype=torch.bfloat16))


def test_a_residual_dtype_that_cannot_hold_the_gradients_is_refused_before_any_collective():
    for message in run_on_ranks(_refused_worker):
        assert "residual_dtype=torch.float16 cannot hold torch.bfloat16 gradients" in message
