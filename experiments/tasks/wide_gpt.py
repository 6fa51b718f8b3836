"""A wider byte-level GPT on Python's docs, with few samples per step: communication-bound.

    sparsecomm compare --config experiments/configs/wide-gpt-1gbit.json

The default task's model (0.25M parameters) sends 1 MB of gradient per step, so on a 1 Gb/s
link a dense step waits ~20% of its time. This one (4 layers, width 320, ~5M parameters,
20 MB of fp32 gradient per step) with 4 windows of 32 bytes per rank per step computes
little and sends a lot: dense waits on the link most of its step, which is the setting
gradient compression is for. The same text, windows and validation set as ``pydoc-gpt``.
"""
from sparsecomm.lab.tasks.pydoc_gpt import PydocGPT
from sparsecomm.lab.tasks.tiny_gpt import GPTConfig

WIDE = GPTConfig(num_layers=4, width=320, num_heads=4, context=32)


def make_task() -> PydocGPT:
    return PydocGPT(WIDE)
