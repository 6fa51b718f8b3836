"""PyTorch Lightning DDP training with sparsecomm: one callback (the marked lines).

    torchrun --standalone --nproc-per-node 2 experiments/examples/lightning_ddp.py --out DIR
    torchrun --standalone --nproc-per-node 2 experiments/examples/lightning_ddp.py --out DIR --resume

(``python experiments/examples/lightning_ddp.py`` works too: Lightning then starts the
second process itself.) The same teacher/student task as ``plain_ddp.py``, trained with
AdamW; Lightning's DistributedSampler gives every rank different samples. The callback's
defaults move AdamW's first moment into the hook (betas (0.9, 0.999) -> (0.0, 0.999), said
at start-up). ``--out`` saves a checkpoint with every rank's hook state in it; ``--resume``
continues from it for ``--epochs`` more epochs. ``--dense`` trains without sparsecomm (the
baseline). ``--tensorboard DIR`` gives the Trainer a TensorBoardLogger there: the callback's
default ``log_every="auto"`` then writes the hook's figures to it every ``log_every_n_steps``
(10) steps, beside the loss. The last line per rank gives ``final loss``: the mean training loss
of both ranks over the last quarter of the steps.
"""
import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from plain_ddp import student, teacher_dataset
from sparsecomm.dist import shutdown
from sparsecomm.integrations import SparseCommCallback  # sparsecomm (1/2)

LR = 3e-3


class Student(pl.LightningModule):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = student()
        self.losses = []  # this rank's training loss, every step

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(teacher_dataset(4096), batch_size=32, shuffle=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--dense", action="store_true", help="no sparsecomm: the dense baseline")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/last.ckpt at the end")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/last.ckpt")
    parser.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                        help="log the loss and the hook's figures with a TensorBoardLogger writing to DIR")
    args = parser.parse_args(argv)

    pl.seed_everything(args.seed, verbose=False)  # also seeds the DistributedSampler's shuffle
    sparse = SparseCommCallback(density=args.density)  # sparsecomm (2/2)
    checkpoint = args.out / "last.ckpt" if args.out is not None else None
    # A checkpoint saved after fit() records the number of finished epochs.
    done_epochs = torch.load(checkpoint, weights_only=True)["epoch"] if args.resume else 0
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),  # under torchrun: its process count
        strategy="ddp",
        callbacks=[] if args.dense else [sparse],
        max_epochs=done_epochs + args.epochs,
        # The callback writes the hook's figures to the Trainer's loggers (none: nothing).
        logger=TensorBoardLogger(args.tensorboard, name="", version="") if args.tensorboard else False,
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    module = Student(args.seed)
    trainer.fit(module, ckpt_path=checkpoint if args.resume else None)
    if checkpoint is not None:
        # On every rank: the callback gathers all ranks' residuals into rank 0's file.
        trainer.save_checkpoint(checkpoint, weights_only=False)
    loss = float(trainer.callback_metrics["loss"])
    final = trainer.strategy.reduce(torch.stack(module.losses[-len(module.losses) // 4:]).mean(), reduce_op="mean")
    if args.dense:
        sent = f"{trainer.global_step} steps, dense"
    else:
        stats = sparse.state.stats()
        sent = (f"{stats['steps']} steps, {stats['sparse_calls']} sparse bucket reductions, "
                f"sent {100 * stats['compression']:.1f}% of dense bytes")
    print(f"rank {trainer.global_rank}: {sent}, loss {loss:.3f}, final loss {float(final):.4f}", flush=True)


if __name__ == "__main__":
    main()
    # After main() returned (its trainer and DDP model are unreachable): tear the process
    # group down now, not at interpreter exit where gloo can abort the process.
    shutdown()
