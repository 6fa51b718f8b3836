"""The figures of a 2-rank hook job in TensorBoard event files and in an offline W&B run, read
back with their own readers (TensorBoard's EventAccumulator; the offline run's record file).

The job: a Linear(16, 8) (136 entries, one bucket) at density 0.05, so k = 7 and a sparse step
sends one payload of 7 int32 indices and 7 float32 values plus an 8-byte seal (64 bytes) and
receives the other rank's; a warm-up step allreduces the 544-byte bucket. Figures every 2 steps:
steps 1-2 are the warm-up, 3-4 and 5-6 sparse. The residual norm is checked against the
residuals as the state hands them out (``state_dict()``), summed here.
"""
import glob
import json
import math
import os
import struct

import pytest
import torch

from rank_processes import run_on_ranks

STEPS, EVERY, DENSITY = 6, 2, 0.05
NUMEL = 16 * 8 + 8
K = math.ceil(DENSITY * NUMEL)
PAYLOAD = K * (4 + 4) + 8


def _worker(rank, world_size, tb_dir, wandb_dir):
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=wandb_dir, WANDB_SILENT="true")
    import sparsecomm
    from sparsecomm.metrics import CallableSink, MetricsLogger, TensorBoardSink, WandbSink

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 8))
    state = sparsecomm.register_topk_hook(ddp, density=DENSITY, budget="bucket", momentum=0)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    norms = {}  # step -> the residual norm worked out from the state dict, when the figures were written

    def residual_norm(figures, step):
        residuals = [v for k, v in state.state_dict().items() if ".residual." in k]
        norms[step] = math.sqrt(sum(float(x) ** 2 for r in residuals for x in r.double()))

    run = None
    if rank == 0:  # W&B runs where the logger writes; WandbSink() finds it as wandb.run
        import wandb

        run = wandb.init(project="sparsecomm-test", mode="offline", dir=wandb_dir)
    # Every rank builds the same logger; only rank 0 writes (and creates files).
    metrics = MetricsLogger(state, every=EVERY, sinks=[TensorBoardSink(tb_dir), WandbSink(),
                                                       CallableSink(residual_norm)])
    generator = torch.Generator().manual_seed(rank)  # every rank its own data
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        x = torch.randn(4, 16, generator=generator)
        torch.nn.functional.mse_loss(ddp(x), x[:, :8]).backward()
        optimizer.step()
        metrics.step(step)
    metrics.close()
    if run is not None:
        run.finish()
    return norms


def _wandb_history(wandb_dir) -> list[dict]:
    """The history rows of the offline run: its ``run-<id>.wandb`` file is a LevelDB-style log
    (a 7-byte header, then 32 KiB blocks of records, each a 7-byte header: checksum, length,
    type (1 full, 2 first, 3 middle, 4 last)) of protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data, position, records, pieces = open(path, "rb").read(), 7, [], b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(pieces + chunk)
            pieces = b""
        elif kind in (2, 3):
            pieces += chunk
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


@pytest.mark.timeout(120)
def test_tensorboard_and_wandb_hold_the_hooks_figures(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir, wandb_dir = tmp_path / "tb", tmp_path / "wandb"
    wandb_dir.mkdir()
    norms, rank1_norms = run_on_ranks(_worker, str(tb_dir), str(wandb_dir), timeout=100)
    assert sorted(norms) == [2, 4, 6] and rank1_norms == {}  # rank 1 neither reads nor writes
    expected = {  # per window of 2 steps: warm-up, sparse, sparse
        "sparsecomm/bytes_sent_per_step": [4 * NUMEL, PAYLOAD, PAYLOAD],
        "sparsecomm/bytes_received_per_step": [4 * NUMEL, PAYLOAD, PAYLOAD],  # ring: 2 (p-1)/p = 1 at p = 2
        "sparsecomm/bytes_dense_per_step": [4 * NUMEL] * 3,
        "sparsecomm/compression": [1.0, PAYLOAD / (4 * NUMEL), PAYLOAD / (4 * NUMEL)],
        "sparsecomm/effective_density": [K / NUMEL, K / NUMEL],  # no sparse reduction in the warm-up
        "sparsecomm/steps": [2, 4, 6],
        "sparsecomm/density": [DENSITY] * 3,
        "sparsecomm/skipped_steps": [0, 0, 0],
        "sparsecomm/residual_norm": [norms[2], norms[4], norms[6]],
    }
    (event_file,) = glob.glob(str(tb_dir / "events.out.tfevents.*"))  # one writer: rank 0's
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, values in expected.items():
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [2, 4, 6][-len(values):], tag
        assert [s.value for s in scalars] == pytest.approx(values, rel=1e-6), tag  # stored as float32
    assert norms[6] > 0
    rows = [row for row in _wandb_history(str(wandb_dir)) if "sparsecomm/steps" in row]
    assert [row["_step"] for row in rows] == [2, 4, 6]
    for tag, values in expected.items():
        assert [row[tag] for row in rows if tag in row] == pytest.approx(values, rel=1e-6), tag
