"""The examples in experiments/examples/, run as users run them: torchrun, 2 CPU ranks.

Each example prints one line per rank ("rank r: S steps, C sparse bucket reductions,
sent P% of dense bytes, loss ..."); the tests read those lines and the files the
examples write (TensorBoard's with TensorBoard's own reader). A run that exceeds its deadline
is killed with all its ranks.
"""
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from deadline import run_with_deadline
from metrics_checks import bytes_sent_per_step, scalars

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "experiments" / "examples"
SUMMARY = re.compile(
    r"rank (\d): (\d+) steps, (\d+) sparse bucket reductions, sent ([\d.]+)% of dense bytes, "
    r"loss ([\d.]+)(?: -> ([\d.]+))?"
)


def _torchrun(script: str, *args: str, timeout: float) -> dict[int, dict]:
    """Run an example on 2 ranks; its per-rank summaries by rank."""
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLES / script), *args]
    result = run_with_deadline(command, timeout=timeout, env=env, cwd=ROOT)
    output = result.stdout
    assert result.returncode == 0, f"{script} {' '.join(args)} exited {result.returncode}; output:\n{output[-4000:]}"
    summaries = {}
    for match in SUMMARY.finditer(output):
        rank, steps, sparse, percent, loss, last = match.groups()
        summaries[int(rank)] = dict(steps=int(steps), sparse=int(sparse), percent=float(percent), loss=float(loss),
                                    last=None if last is None else float(last))
    assert sorted(summaries) == [0, 1], f"expected a summary from ranks 0 and 1; output:\n{output[-4000:]}"
    return summaries


def _check_sparse(summaries: dict[int, dict], steps: int) -> None:
    for rank, s in summaries.items():
        # One DDP bucket (the model is small): 2 dense warm-up steps, then every step sparse.
        assert s["steps"] == steps and s["sparse"] == steps - 2, f"rank {rank}: {s}"
        assert s["percent"] < 10.0, f"rank {rank} sent {s['percent']}% of the dense bytes"


def _own_residuals(path: Path, rank: int) -> dict:
    state = torch.load(path, weights_only=True)
    residuals = {k: v for k, v in state.items() if ".residual." in k}
    assert residuals and all(k.startswith(f"rank{rank}.") for k in residuals)
    return {k.split(".", 1)[1]: v for k, v in residuals.items()}


@pytest.mark.timeout(60)
def test_plain_ddp(tmp_path):
    pytest.importorskip("tensorboard")
    summaries = _torchrun("plain_ddp.py", "--out", str(tmp_path), "--tensorboard", str(tmp_path / "tb"), timeout=50)
    steps = 4 * 4096 // 32 // 2  # 4 epochs of 64 batches per rank
    _check_sparse(summaries, steps=steps)
    # Rank 0's loss at every step, and the hook's figures of every 10 steps (the first 10 hold
    # the 2 dense warm-up steps; the model is one bucket).
    logged = scalars(tmp_path / "tb")
    assert [step for step, _ in logged["train/loss"]] == list(range(1, steps + 1))
    assert [(step, value) for step, value in logged["sparsecomm/steps"]] == [(s, s) for s in range(10, steps, 10)]
    numel = 32 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10  # plain_ddp.student()
    assert logged["sparsecomm/bytes_sent_per_step"] == [
        (s, pytest.approx(bytes_sent_per_step(numel, 0.01, s - 9, s))) for s in range(10, steps, 10)]
    assert {"sparsecomm/compression", "sparsecomm/residual_norm", "sparsecomm/density"} <= logged.keys()
    for rank, s in summaries.items():
        assert s["last"] < 0.75 * s["loss"], f"rank {rank}: loss {s['loss']} -> {s['last']}"
    # Every rank saved its own residuals, and they differ (different data per rank).
    rank0, rank1 = (_own_residuals(tmp_path / f"sparsecomm_rank{r}.pt", r) for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    assert all(not torch.equal(rank0[k], rank1[k]) for k in rank0)


@pytest.mark.slow  # CI time: tests/test_integrations_lightning.py tests the same callback's fit and resume
@pytest.mark.timeout(60)
def test_lightning_ddp(tmp_path):
    pytest.importorskip("lightning.pytorch")
    summaries = _torchrun("lightning_ddp.py", "--epochs", "1", "--out", str(tmp_path), timeout=50)
    _check_sparse(summaries, steps=4096 // 32 // 2)
    stored = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]["SparseCommCallback"]
    assert {k.split(".", 1)[0] for k in stored if ".residual." in k} == {"rank0", "rank1"}


@pytest.mark.slow  # CI time: two launches; tests/test_integrations_accelerate.py tests the same save and resume
@pytest.mark.timeout(90)
def test_accelerate_ddp_save_and_resume(tmp_path):
    pytest.importorskip("accelerate")
    _check_sparse(_torchrun("accelerate_ddp.py", "--epochs", "1", "--out", str(tmp_path), timeout=40), steps=64)
    saved = [_own_residuals(tmp_path / f"sparsecomm_topk_0_rank{r}.pt", r) for r in (0, 1)]
    # Resuming continues the step count: no second dense warm-up.
    _check_sparse(_torchrun("accelerate_ddp.py", "--epochs", "1", "--out", str(tmp_path), "--resume", timeout=40),
                  steps=128)
    resaved = [_own_residuals(tmp_path / f"sparsecomm_topk_0_rank{r}.pt", r) for r in (0, 1)]
    assert all(not torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    assert all(not torch.equal(saved[r][k], resaved[r][k]) for r in (0, 1) for k in saved[r])
