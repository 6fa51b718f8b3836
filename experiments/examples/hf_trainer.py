"""Hugging Face Trainer with sparsecomm: a tiny random GPT-2 learns Python's help text, byte by byte.

    torchrun --standalone --nproc-per-node 2 experiments/examples/hf_trainer.py [--out DIR --save-steps 20 [--resume]]
    sparsecomm compare --script experiments/examples/hf_trainer.py --arms dense topk-dgc --steps 100

Tokens: the bytes of ``pydoc_data.topics`` (vocabulary 256, no download); the Trainer's
sampler gives every rank different windows. The Trainer's default optimizer, AdamW.
Standalone, the callback sparsifies at ``--density`` (default: the callback's, 0.03) with its
other defaults (AdamW's first moment moved into the hook: betas (0.9, 0.999) -> (0.0, 0.999),
said at start-up), or ``--dense`` trains without it (the baseline); under the lab it
registers the arm's hook (``run.apply``) and logs each ``eval_loss`` as ``val_loss``. Every
checkpoint gets each rank's ``sparsecomm_rank<r>.pt``. The last line per rank gives ``final loss``: the mean of
the training losses the Trainer logged (each over both ranks) in the last quarter of the steps;
the last step's is always logged (the Trainer logs every ``--logging-steps``, so a run of
fewer steps, or one that ends between two logs, would otherwise have none there).
``--tensorboard DIR`` reports to TensorBoard there (``report_to=["tensorboard"]``); standalone,
the callback's ``log_every="auto"`` adds the hook's figures to every training log.
"""
import argparse
import gc
import os
import tempfile

import pydoc_data.topics
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import sparsecomm
import sparsecomm.lab
from sparsecomm.integrations import SparseCommTrainerCallback  # sparsecomm (1/2)

WINDOW = 64


class LogTheLastStep(TrainerCallback):
    """Log the training loss at the last step too, as the Trainer evaluates there: the final
    loss then always has a logged loss in the last quarter of the steps."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True
        return control


def byte_windows(data: torch.Tensor) -> list[dict]:
    """Consecutive WINDOW-byte pieces of ``data``, each its own language-modelling example."""
    return [{"input_ids": w, "labels": w} for w in data[:len(data) // WINDOW * WINDOW].view(-1, WINDOW)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps (the lab's --steps wins)")
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--density", type=float, default=None,
                        help="standalone only (default: the callback's); the lab's arm decides")
    parser.add_argument("--dense", action="store_true", help="standalone only: no sparsecomm, the dense baseline")
    parser.add_argument("--seed", type=int, default=None, help="standalone only: initial weights and data order")
    parser.add_argument("--logging-steps", type=int, default=10, help="log the training loss every N steps")
    parser.add_argument("--out", default=None, help="the Trainer's output_dir (default: a new temporary one)")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="report the Trainer's logs (and, standalone, the hook's figures) to TensorBoard in DIR")
    args = parser.parse_args(argv)
    run = sparsecomm.lab.init(args.seed)  # lab: arm and seed from the runner; standalone: --seed (default 0)
    text = torch.tensor(list(" ".join(sorted(pydoc_data.topics.topics.values())).encode()), dtype=torch.long)
    split = len(text) * 9 // 10
    torch.manual_seed(run.seed)  # the same initial weights in every arm of a seed
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=WINDOW, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    # sparsecomm (2/2). Lab: the arm's hook via run.apply, and eval_loss -> run.log({"val_loss": ...}).
    if run.in_lab:
        callback = SparseCommTrainerCallback.for_lab_run(run, metric="eval_loss", as_name="val_loss")
    else:
        callback = None if args.dense else SparseCommTrainerCallback(  # density None: its default
            density=args.density, log_every="auto" if args.tensorboard else None)
    if args.tensorboard is not None:
        os.environ["TENSORBOARD_LOGGING_DIR"] = args.tensorboard  # where the Trainer's TensorBoardCallback writes
    cpu = not torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=args.out or tempfile.mkdtemp(prefix="hf_trainer_"), max_steps=run.steps or args.max_steps,
        per_device_train_batch_size=16, per_device_eval_batch_size=32, learning_rate=2e-3,
        eval_strategy="steps", eval_steps=args.eval_steps, logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        seed=run.seed, data_seed=run.seed, use_cpu=cpu,
        report_to=["tensorboard"] if args.tensorboard else "none", disable_tqdm=True, log_level="warning",
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=byte_windows(text[:split]),
                      eval_dataset=byte_windows(text[split:split + 256 * WINDOW]),
                      callbacks=[LogTheLastStep(), *([callback] if callback else [])])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    logged = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    final = [loss for step, loss in logged if step > trainer.state.global_step * 3 / 4]
    state = callback.state if callback else None  # None: dense; under the lab, what the arm registered
    if isinstance(state, sparsecomm.TopKState):
        stats = state.stats()
        sent = (f"{stats['sparse_calls']} sparse bucket reductions, sent {100 * stats['compression']:.1f}% of dense "
                "bytes")
    else:
        sent = "dense" if state is None else type(state).__name__
    print(f"rank {training_args.process_index}: {trainer.state.global_step} steps, {sent}, "
          f"loss {logged[0][1]:.3f} -> {logged[-1][1]:.3f}, final loss {sum(final) / len(final):.4f}", flush=True)
    run.finish()  # lab: the run's summary, for the runner (standalone: nothing)
    del trainer, callback, model
    gc.collect()  # the DDP model holds the process group in reference cycles: free it, then the group,
    if torch.distributed.is_initialized():  # or gloo's threads may abort the process at exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
