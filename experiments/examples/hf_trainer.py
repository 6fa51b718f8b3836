"""Hugging Face Trainer with sparsecomm: a tiny random GPT-2 learns Python's help text, byte by byte.

    torchrun --standalone --nproc-per-node 2 experiments/examples/hf_trainer.py [--out DIR --save-steps 20 [--resume]]
    sparsecomm compare --script experiments/examples/hf_trainer.py --arms dense topk-dgc --steps 100

Tokens: the bytes of ``pydoc_data.topics`` (vocabulary 256, no download); the Trainer's
sampler gives every rank different windows. Standalone, the callback sparsifies at
``--density``; under the lab it registers the arm's hook (``run.apply``) and logs each
``eval_loss`` as ``val_loss``. Every checkpoint gets each rank's ``sparsecomm_rank<r>.pt``.
"""
import argparse
import gc
import tempfile

import pydoc_data.topics
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import sparsecomm.lab
from sparsecomm.integrations import SparseCommTrainerCallback  # sparsecomm (1/2)

WINDOW = 64


def byte_windows(data: torch.Tensor) -> list[dict]:
    """Consecutive WINDOW-byte pieces of ``data``, each its own language-modelling example."""
    return [{"input_ids": w, "labels": w} for w in data[:len(data) // WINDOW * WINDOW].view(-1, WINDOW)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps (the lab's --steps wins)")
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--density", type=float, default=0.01, help="standalone only; the lab's arm decides")
    parser.add_argument("--out", default=None, help="the Trainer's output_dir (default: a new temporary one)")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    args = parser.parse_args(argv)
    run = sparsecomm.lab.init()  # lab: arm and seed from the runner; standalone: dense, seed 0
    text = torch.tensor(list(" ".join(sorted(pydoc_data.topics.topics.values())).encode()), dtype=torch.long)
    split = len(text) * 9 // 10
    torch.manual_seed(run.seed)  # the same initial weights in every arm of a seed
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=WINDOW, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    # sparsecomm (2/2). Lab: the arm's hook via run.apply, and eval_loss -> run.log({"val_loss": ...}).
    callback = (SparseCommTrainerCallback.for_lab_run(run, metric="eval_loss", as_name="val_loss") if run.in_lab
                else SparseCommTrainerCallback(density=args.density))
    cpu = not torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=args.out or tempfile.mkdtemp(prefix="hf_trainer_"), max_steps=run.steps or args.max_steps,
        per_device_train_batch_size=16, per_device_eval_batch_size=32, learning_rate=2e-3,
        eval_strategy="steps", eval_steps=args.eval_steps, logging_steps=args.eval_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        seed=run.seed, data_seed=run.seed, use_cpu=cpu,
        report_to="none", disable_tqdm=True, log_level="warning",
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=byte_windows(text[:split]),
                      eval_dataset=byte_windows(text[split:split + 256 * WINDOW]), callbacks=[callback])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    stats = callback.hook_state.stats() if hasattr(callback.hook_state, "stats") else None  # None: dense arm
    sent = (f"{stats['sparse_calls']} sparse bucket reductions, sent {100 * stats['compression']:.1f}% of dense "
            "bytes") if stats else "dense"
    print(f"rank {training_args.process_index}: {trainer.state.global_step} steps, {sent}, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    run.finish()  # lab: the run's summary, for the runner (standalone: nothing)
    del trainer, callback, model
    gc.collect()  # the DDP model holds the process group in reference cycles: free it, then the group,
    if torch.distributed.is_initialized():  # or gloo's threads may abort the process at exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
