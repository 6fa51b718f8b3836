"""What every framework integration must show after a short fit and a resume, per rank."""
import torch


def assert_sparse_then_restored(result: dict, rank: int, *, steps: int, more_steps: int, density: float) -> None:
    """``result`` holds the rank's hook stats after ``steps`` steps, the residuals saved then
    and restored on resume, and the stats after ``more_steps`` more steps."""
    stats = result["stats"]
    # After the 2 dense warm-up steps every reduction was sparse (the hook really ran).
    assert stats["steps"] == steps and stats["warmup_calls"] == 2
    assert stats["sparse_calls"] == steps - 2 and stats["fallback_calls"] == 0
    # k = ceil(density * numel): at most one entry per bucket above the density.
    assert stats["effective_density"] <= density + stats["sparse_calls"] / stats["elements_sparse"]
    assert stats["bytes_sent"] < 0.4 * stats["bytes_dense"]  # dense warm-up + 4 steps at ~2%
    # The resume restored this rank's own residuals bit for bit (not rank 0's) and the step
    # counter, and went on sparse with no new warm-up.
    assert result["restored_step"] == steps
    assert result["restored"].keys() == result["saved"].keys()
    assert all(k.startswith(f"rank{rank}.") for k in result["restored"])
    for key, saved in result["saved"].items():
        assert torch.equal(result["restored"][key], saved), f"rank {rank}: {key} not restored bit for bit"
    resumed = result["resumed_stats"]
    assert resumed["steps"] == steps + more_steps
    assert resumed["warmup_calls"] == 2 and resumed["sparse_calls"] == steps + more_steps - 2
