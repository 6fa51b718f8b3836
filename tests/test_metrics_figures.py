"""CommFigures against figures worked out here: a 3-rank gloo hook run, and a 2-rank averager run.

The hook's job is built so that everything it does can be written out in this file: two
parameters whose loss is ``(w * c_r).sum()``, so the gradient of rank r is its own constant
``c_r`` at every step. The oracle below runs plain top-k with error feedback on those
constants (``acc = c_r / p + residual``, the ``k`` largest entries sent, the rest kept), counts
the bytes from ``k`` and the bucket's size (an all-gather of ``k`` int32 indices and ``k``
float32 values plus an 8-byte seal per rank; a ring allreduce of the whole bucket in warm-up)
and the ages of the entries waiting. One step is skipped (``skip_step()``): it ran and sent, so
its bytes count, and the hook's memories went back, so it repeats the same step.
"""
import math

import pytest
import torch

from rank_processes import run_on_ranks

N_W, N_B = 70, 30  # the two parameters' sizes: one bucket of 100 entries
DENSITY, WARMUP = 0.1, 2
K = math.ceil(DENSITY * (N_W + N_B))
SEAL = 8  # bytes of the wire checksum after each payload
ITERATIONS, SKIPPED, EVERY = 12, 7, 3  # iteration 7 is skipped; figures every 3 optimizer steps
WINDOW_KEYS = {"bytes_sent_per_step", "bytes_received_per_step", "bytes_dense_per_step", "compression",
               "effective_density", "skipped_steps"}


def _constants(rank: int) -> torch.Tensor:
    """Rank r's gradient at every step (different on every rank), laid out as [w, b]."""
    return torch.randn(N_W + N_B, generator=torch.Generator().manual_seed(100 + rank)) * (1 + rank)


def _hook_worker(rank, world_size):
    import sparsecomm
    from sparsecomm.metrics import CallableSink, CommFigures, MetricsLogger
    from sparsecomm.monitor import StalenessMonitor

    class Vectors(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(N_W))
            self.b = torch.nn.Parameter(torch.zeros(N_B))

        def forward(self, c):
            return (self.w * c[:N_W]).sum() + (self.b * c[N_W:]).sum()

    ddp = torch.nn.parallel.DistributedDataParallel(Vectors())
    state = sparsecomm.register_topk_hook(ddp, density=DENSITY, warmup_steps=WARMUP, budget="bucket", momentum=0)
    state.add_observer(StalenessMonitor(1000))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    written = []
    metrics = MetricsLogger(state, every=EVERY, sinks=[CallableSink(lambda f, s: written.append((s, f)))], prefix="",
                            rank_zero_only=False)

    class ReadsMidStep:
        """An observer that reads while the bucket is on its way (the packed stage)."""
        needs_acc = False

        def __init__(self):
            self.tracker, self.refusals = CommFigures(state), []

        def __call__(self, event):
            if event.stage == "packed":
                try:
                    self.tracker.read()
                except RuntimeError as error:
                    self.refusals.append(str(error))

    c = _constants(rank)
    steps_taken, probe, after_load = 0, None, []
    for iteration in range(ITERATIONS):
        if iteration == 4:
            probe = ReadsMidStep()
            state.add_observer(probe)
        optimizer.zero_grad()
        ddp(c).backward()
        if iteration == 4:
            state.remove_observer(probe)
        if iteration == SKIPPED:
            state.skip_step()
            continue
        optimizer.step()
        steps_taken += 1
        metrics.step(steps_taken)
        if iteration == 9:  # a load between two reads: the next read has no window, the one after has
            reloaded = CommFigures(state)
            state.load_state_dict(state.state_dict())
        if iteration >= 10:
            after_load.append(reloaded.read())
    return dict(written=written, refusals=probe.refusals, after_load=after_load, stats=state.stats())


def _oracle(rank: int, world_size: int) -> list[dict]:
    """Per iteration: the counters it adds and, after it, the residual and the oldest age."""
    c = _constants(rank)
    n = c.numel()
    payload = K * (4 + 4) + SEAL
    residual, ages, hook_step, rows = torch.zeros(n), torch.zeros(n, dtype=torch.int64), 0, []
    for iteration in range(ITERATIONS):
        if hook_step < WARMUP:  # dense: everything sent, nothing kept
            new_residual, new_ages = torch.zeros(n), torch.zeros(n, dtype=torch.int64)
            row = dict(sent=4 * n, received=round(2 * (world_size - 1) * 4 * n / world_size), dense=4 * n,
                       elements_sent=0, elements_sparse=0)
        else:
            acc = c / world_size + residual
            sent = torch.topk(acc.abs(), K).indices
            new_residual = acc.clone()
            new_residual[sent] = 0
            new_ages = ages + 1
            new_ages[new_residual == 0] = 0
            row = dict(sent=payload, received=(world_size - 1) * payload, dense=4 * n, elements_sent=K,
                       elements_sparse=n)
        if iteration != SKIPPED:  # a skipped step's memories go back: the next iteration repeats it
            residual, ages, hook_step = new_residual, new_ages, hook_step + 1
        rows.append(dict(row, residual_norm=float(torch.linalg.vector_norm(residual.double())),
                         max_age=int(ages.max()), steps=hook_step))
    return rows


def _window(rows: list[dict], first: int, last: int) -> dict:
    """The figures of iterations first..last (inclusive) as the oracle counts them."""
    part = rows[first:last + 1]
    total = {key: sum(r[key] for r in part) for key in ("sent", "received", "dense", "elements_sent",
                                                         "elements_sparse")}
    figures = {"bytes_sent_per_step": total["sent"] / len(part), "bytes_received_per_step": total["received"] / len(part),
               "bytes_dense_per_step": total["dense"] / len(part), "compression": total["sent"] / total["dense"],
               "skipped_steps": float(first <= SKIPPED <= last), "steps": float(rows[last]["steps"]),
               "density": DENSITY, "residual_norm": rows[last]["residual_norm"],
               "residual_max_age": float(rows[last]["max_age"])}
    if total["elements_sparse"]:
        figures["effective_density"] = total["elements_sent"] / total["elements_sparse"]
    return figures


@pytest.mark.timeout(120)
def test_hook_figures_match_a_run_worked_out_by_hand():
    world_size = 3
    results = run_on_ranks(_hook_worker, world_size=world_size, timeout=100)
    # Iterations, and the optimizer steps after them (iteration 7 took none): a write at
    # steps 3, 6, 9, after iterations 2, 5 and 9; the third window holds the skipped
    # iteration and the one that repeats it (where the skip is counted).
    windows = [(0, 2, 3), (3, 5, 6), (6, 9, 9)]
    for rank, result in enumerate(results):
        rows = _oracle(rank, world_size)
        assert [step for step, _ in result["written"]] == [step for _, _, step in windows]
        for (first, last, step), (_, figures) in zip(windows, result["written"]):
            expected = _window(rows, first, last)
            assert figures.keys() == expected.keys(), f"rank {rank}, step {step}"
            for name, value in expected.items():
                assert figures[name] == pytest.approx(value, rel=1e-6), f"rank {rank}, step {step}: {name}"
        assert result["stats"]["skipped_steps"] == 1 and result["stats"]["sparse_calls"] == ITERATIONS - WARMUP
        # Every rank kept its own residual: the figures differ between ranks.
        assert results[0]["written"][-1][1]["residual_norm"] != results[1]["written"][-1][1]["residual_norm"]
        # A read while the bucket's collective is in flight is refused, naming what to do.
        assert result["refusals"] and "1 collective(s) in flight" in result["refusals"][0]
        assert "read between steps, after optimizer.step()" in result["refusals"][0]
        # After load_state_dict replaced the counters: no window, then a window of one step.
        first, second = result["after_load"]
        assert not WINDOW_KEYS & first.keys() and {"steps", "density", "residual_norm"} <= first.keys()
        assert second == pytest.approx({**_window(rows, 11, 11), "residual_max_age": second["residual_max_age"]})


def _averager_worker(rank, world_size, period, steps):
    import sparsecomm
    from sparsecomm.metrics import CommFigures

    torch.manual_seed(0)
    model = torch.nn.Linear(12, 5)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    averager = sparsecomm.SparseDeltaAverager(ddp, period=period, density=0.1, selector="exact", index_codec="int32",
                                              value_codec=None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    figures = CommFigures(averager)
    generator = torch.Generator().manual_seed(rank)  # every rank its own data
    reads = []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        x = torch.randn(8, 12, generator=generator)
        torch.nn.functional.mse_loss(ddp(x), x[:, :5]).backward()
        optimizer.step()
        averager.step()
        if step % 3 == 0:
            error = averager.error.double()
            reads.append((figures.read(), math.sqrt(sum(float(e) ** 2 for e in error))))
    return dict(reads=reads, numel=sum(p.numel() for p in model.parameters()))


@pytest.mark.timeout(90)
def test_averager_figures_match_its_syncs_worked_out_by_hand():
    period, steps = 2, 9
    for result in run_on_ranks(_averager_worker, period, steps, timeout=80):
        numel = result["numel"]
        k = math.ceil(0.1 * numel)
        payload = k * (4 + 4) + SEAL  # one all-gathered payload of the whole model per sync
        # Reads after steps 3, 6, 9: syncs at steps 2, 4, 6, 8, so 1, 2, 1 syncs in the windows.
        for (figures, error_norm), syncs in zip(result["reads"], (1, 2, 1)):
            expected = {"bytes_sent_per_step": syncs * payload / 3, "bytes_received_per_step": syncs * payload / 3,
                        "bytes_dense_per_step": syncs * 4 * numel / 3, "compression": payload / (4 * numel),
                        "effective_density": k / numel, "syncs": float(syncs), "density": 0.1,
                        "residual_norm": error_norm}
            assert figures.keys() == expected.keys() | {"steps"}
            assert figures == pytest.approx({**expected, "steps": figures["steps"]}, rel=1e-6)
        assert [figures["steps"] for figures, _ in result["reads"]] == [3.0, 6.0, 9.0]
