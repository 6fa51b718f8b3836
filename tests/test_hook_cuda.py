"""The hook under DDP with NCCL on one GPU (world size 1): the device checks of the paths
the CPU tests cannot reach. Skipped without CUDA; scripts/gpu_check.sh runs it.

- an fp16 autocast + GradScaler loop overflows by design at first: the hook skips with the
  scaler and its memories stay finite (CUDA kernels: the non-finite rule);
- a bf16 model keeps float32 memories and trains;
- the sampled selector's generator is saved on the GPU and comes back there;
- selector="chunk" with Rice indices and int4 / fp32 values trains with the conservation
  audit on, bit for bit like the pure-torch reference path on the same GPU (whichever
  encoder sparsecomm/ops/dispatch.py picks for CUDA: the CUDA kernels, csrc/cuda/chunk_*.cu,
  or the reference).
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm import TopKState
from ddp_models import autocast_fp16_scaler_loop, fit_doubling, memories_finite, mlp, rank_data

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")]


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    yield
    dist.destroy_process_group()


def _cuda_batches(steps, shape, dtype=torch.float32):
    return [x.to("cuda", dtype) for x in rank_data(0, steps, shape)]


def test_fp16_autocast_grad_scaler_on_cuda(nccl_group):
    model = mlp(width=64).cuda()
    ddp = DDP(model, device_ids=[0])
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**24)
    state = sparsecomm.register_topk_hook(ddp, density=0.05, grad_scaler=scaler)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    skipped = autocast_fp16_scaler_loop(ddp, optimizer, scaler, _cuda_batches(30, (16, 64)), "cuda")
    stats = state.stats()
    assert skipped >= 3 and stats["skipped_steps"] == skipped and stats["sparse_calls"] > 0
    assert memories_finite(state)


def test_bf16_model_on_cuda_keeps_float32_memories(nccl_group):
    model = mlp().cuda().to(torch.bfloat16)
    ddp = DDP(model, device_ids=[0])
    state = sparsecomm.register_topk_hook(ddp, density=0.05, verify_conservation=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x in _cuda_batches(10, (8, 32), torch.bfloat16):
        optimizer.zero_grad()
        ddp(x).float().pow(2).mean().backward()
        optimizer.step()
    dtypes = {v.dtype for k, v in state.state_dict().items() if ".residual." in k}
    assert dtypes == {torch.float32} and state.stats()["fused_calls"] == state.stats()["sparse_calls"] > 0


def test_sampled_generator_is_restored_on_the_gpu(nccl_group):
    ddp = DDP(mlp().cuda(), device_ids=[0])
    state = sparsecomm.register_topk_hook(ddp, density=0.05, selector="sampled")
    for x in _cuda_batches(4, (8, 32)):
        ddp(x).pow(2).mean().backward()
    saved = state.state_dict()
    assert saved["rank0.sample_generator_device"].startswith("cuda")
    restored = TopKState(density=0.05, selector="sampled")
    restored.load_state_dict(saved)
    assert restored.sample_generator.device.type == "cuda"
    assert torch.equal(restored.sample_generator.get_state(), saved["rank0.sample_generator"])


def _train_chunk(kernels, value_codec, monkeypatch):
    monkeypatch.setenv("SPARSECOMM_KERNELS", kernels)  # read at every dispatch
    torch.manual_seed(0)
    ddp = DDP(mlp(width=64, depth=3).cuda(), device_ids=[0], bucket_cap_mb=0.01)
    state = sparsecomm.register_topk_hook(ddp, density=0.02, selector="chunk", chunk_size=512, index_codec="rice",
                                          value_codec=value_codec, verify_conservation=True)
    trained = [p.cpu() for p in fit_doubling(ddp, 0, 6, 64)]
    return trained, state.stats(), memories_finite(state)


@pytest.mark.parametrize("value_codec", ["int4", "fp32"])
def test_chunk_selector_on_cuda_matches_the_reference_path(nccl_group, monkeypatch, value_codec):
    auto, auto_stats, auto_finite = _train_chunk("auto", value_codec, monkeypatch)
    plain, plain_stats, plain_finite = _train_chunk("reference", value_codec, monkeypatch)
    assert auto_stats["sparse_calls"] > 0 and auto_finite and plain_finite
    assert all(torch.isfinite(p).all() for p in auto)
    assert all(torch.equal(a, b) for a, b in zip(auto, plain))
    assert auto_stats["bytes_sent"] == plain_stats["bytes_sent"]
