"""Hugging Face Accelerate DDP training with sparsecomm: the two marked lines.

    torchrun --standalone --nproc-per-node 2 experiments/examples/accelerate_ddp.py --out DIR
    torchrun --standalone --nproc-per-node 2 experiments/examples/accelerate_ddp.py --out DIR --resume

(``accelerate launch --num_processes 2 experiments/examples/accelerate_ddp.py`` works
too.) The same teacher/student task as ``plain_ddp.py``, trained with AdamW; the prepared
DataLoader gives every process different samples. The helper's defaults move AdamW's first
moment into the hook (betas (0.9, 0.999) -> (0.0, 0.999), said at start-up). ``--out``
saves ``accelerator.save_state(DIR)``, which then holds one hook-state file per process;
``--resume`` loads it first. ``--dense`` trains without sparsecomm (the baseline).
``--tensorboard DIR`` starts Accelerate's TensorBoard tracker in ``DIR/accelerate_ddp``: the
loss every step and, with ``log_every=10``, the hook's figures every 10 steps, both through
``accelerator.log``. The last line per process gives ``final loss``: the mean training loss of
both processes over the last quarter of the steps.
"""
import argparse
from pathlib import Path

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader

from plain_ddp import student, teacher_dataset
from sparsecomm.dist import shutdown
from sparsecomm.integrations import register_topk_hook_accelerate  # sparsecomm (1/2)

LR = 3e-3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--dense", action="store_true", help="no sparsecomm: the dense baseline")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument("--out", type=Path, default=None, help="accelerator.save_state(DIR) at the end")
    parser.add_argument("--resume", action="store_true", help="accelerator.load_state(DIR) first")
    parser.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                        help="log the loss and the hook's figures with Accelerate's TensorBoard tracker in DIR")
    args = parser.parse_args(argv)

    # Without cpu=True, Accelerate on a machine without GPUs runs every process alone
    # (DistributedType.NO, no DDP); with it, MULTI_CPU over gloo.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with="tensorboard" if args.tensorboard else None,
                              project_dir=args.tensorboard)
    if args.tensorboard is not None:
        accelerator.init_trackers("accelerate_ddp")
    torch.manual_seed(args.seed)
    model = student()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(teacher_dataset(4096), batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if not args.dense:
        state = register_topk_hook_accelerate(accelerator, model, density=args.density,  # sparsecomm (2/2)
                                              log_every=10 if args.tensorboard else None)
    if args.resume:
        accelerator.load_state(args.out)  # after registering: restores this process's residuals too

    losses = []
    first_step = 0 if args.dense else state.step  # a resumed hook goes on counting where it stopped
    for _ in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
            if args.tensorboard is not None:
                accelerator.log({"train/loss": loss.item()}, step=first_step + len(losses))

    if args.out is not None:
        accelerator.save_state(args.out)  # every process writes sparsecomm_topk_0_rank{r}.pt
    final = accelerator.reduce(torch.stack(losses[-len(losses) // 4:]).mean(), reduction="mean")
    if args.dense:
        sent = f"{len(losses)} steps, dense"
    else:
        stats = state.stats()
        sent = (f"{stats['steps']} steps, {stats['sparse_calls']} sparse bucket reductions, "
                f"sent {100 * stats['compression']:.1f}% of dense bytes")
    print(f"rank {accelerator.process_index}: {sent}, loss {loss.item():.3f}, final loss {float(final):.4f}",
          flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
    # After main() returned (its trainer and DDP model are unreachable): tear the process
    # group down now, not at interpreter exit where gloo can abort the process.
    shutdown()
