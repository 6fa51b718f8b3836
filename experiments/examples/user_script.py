"""Your own DDP training script in a paired dense-vs-sparse experiment: the lines marked
``# lab``.

    sparsecomm compare --script experiments/examples/user_script.py --arms dense topk-dgc --steps 200
    torchrun --standalone --nproc-per-node 2 experiments/examples/user_script.py   # standalone: plain dense

The runner launches the script once per (arm, seed) under torchrun; ``sparsecomm.lab.init()``
tells it which arm and seed it is. ``run.apply`` registers the arm's comm hook and returns
the optimizer the arm needs; ``run.log`` records the metric the verdicts compare. Everything
else is a plain PyTorch DDP loop: a small MLP classifies the labels a fixed random "teacher"
network gives generated inputs (no download); DistributedSampler gives every rank different
samples, and its seed (the run's) fixes the data order, the same in every arm.
"""
import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import sparsecomm.lab  # lab
from sparsecomm.dist import init_distributed

INPUTS, CLASSES = 32, 10


def teacher_data(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)  # the same data in every run
    x = torch.randn(num_samples, INPUTS, generator=generator)
    w1, w2 = torch.randn(INPUTS, 64, generator=generator), torch.randn(64, CLASSES, generator=generator)
    return TensorDataset(x, (torch.tanh(x @ w1) @ w2).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (the lab's --steps wins)")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    init_distributed("gloo")  # torchrun's variables, or mpiexec's (compare --launcher mpiexec)
    run = sparsecomm.lab.init()  # lab: arm, seed and run directory from the runner
    torch.manual_seed(run.seed)  # lab: the same initial weights in every arm of a seed
    steps = run.steps or args.steps
    data = teacher_data(4096 + 1024)
    train_set, (val_inputs, val_labels) = TensorDataset(*data[:4096]), data[4096:]
    sampler = DistributedSampler(train_set, seed=run.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(INPUTS, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, CLASSES)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    optimizer = run.apply(model, optimizer)  # lab: the arm's hook, and the optimizer it needs
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.eval_every == 0 or step == steps:
                with torch.no_grad(), run.evaluating():  # lab: the synced weights, for arms that train locally
                    logits = model.module(val_inputs)
                    val_loss = F.cross_entropy(logits, val_labels).item()
                    val_accuracy = (logits.argmax(dim=1) == val_labels).float().mean().item()
                # lab: --metric picks which of these the verdicts compare (val_loss by default)
                run.log({"val_loss": val_loss, "val_accuracy": val_accuracy, "train_loss": loss.item()}, step=step)
            if step == steps:
                break
        epoch += 1
    if dist.get_rank() == 0:
        print(f"{run.arm} seed {run.seed}: {steps} steps, final val loss {val_loss:.4f}")
    run.finish()  # lab: the run's summary, for the runner
    del model, optimizer
    gc.collect()  # the DDP model holds the group through reference cycles: free it before the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
