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


def assert_defaults_are_topk_dgc(runs: dict, rank: int, owner: str, *, sparse_calls: int) -> None:
    """``runs`` holds one rank's results of the same short fit with AdamW three times: with the
    integration's defaults ("defaults"), with the topk-dgc setting built by hand (AdamW
    ``betas=(0, 0.999)`` and ``momentum=0.9``: "by_hand") and with plain error feedback
    (``momentum=0``: "plain_ef"). Each: ``params`` (tensors in a fixed order), ``betas`` (per
    param group, read from the optimizer after the fit), the hook's ``momentum``, its
    ``sparse_calls`` and the OptimizerChangedWarning messages ``announced`` on this rank."""
    defaults, by_hand, plain = runs["defaults"], runs["by_hand"], runs["plain_ef"]
    assert defaults["sparse_calls"] == by_hand["sparse_calls"] == plain["sparse_calls"] == sparse_calls
    # AdamW steps without a first moment; the hook keeps a velocity of 0.9: the topk-dgc
    # setting built by hand, bit for bit, and not plain error feedback.
    assert defaults["betas"] and all(betas == (0.0, 0.999) for betas in defaults["betas"])
    assert defaults["momentum"] == 0.9
    assert all(torch.equal(a, b) for a, b in zip(defaults["params"], by_hand["params"], strict=True))
    assert plain["betas"] and all(betas == (0.9, 0.999) for betas in plain["betas"]) and plain["momentum"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(defaults["params"], plain["params"], strict=True))
    # Said once, on rank 0 only; nothing said when nothing changed.
    assert defaults["announced"] == ([
        f"{owner}: AdamW betas (0.9, 0.999) -> (0.0, 0.999): the hook's momentum correction (momentum=0.9) "
        "replaces AdamW's first moment (pass momentum=0 to keep the optimizer as it is)"
    ] if rank == 0 else [])
    assert by_hand["announced"] == plain["announced"] == []
