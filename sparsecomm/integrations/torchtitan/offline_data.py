"""Data for a torchtitan job with no download: Python's own help text
(``pydoc_data.topics``, shipped with Python) as a dataset of torchtitan's text data loader, and
a byte tokenizer (256 byte values, BOS, EOS) as a torchtitan tokenizer.

torchtitan's debug configs read ``tests/assets`` from its source tree, which its wheel does not
ship; these stand in for them, so the examples and tests run on a machine with no network.
"""
from dataclasses import dataclass

from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

DATASET = "pydoc_topics"
"""The dataset's name in torchtitan's ``DATASETS`` (``--dataloader.dataset pydoc_topics``)."""


def load_pydoc_topics(path: str):
    """Every help topic of ``pydoc_data.topics``, sorted by name: one document each (``path``,
    torchtitan's dataset path, is not read: the text ships with Python)."""
    import datasets
    from pydoc_data.topics import topics

    return datasets.Dataset.from_dict({"text": [topics[name] for name in sorted(topics)]})


def register_dataset() -> None:
    """Add the help text to torchtitan's datasets under :data:`DATASET` (idempotent). torchtitan
    finds datasets by name in that table; adding to it is how its docs add one."""
    DATASETS.setdefault(DATASET, DatasetConfig(path="pydoc_data.topics", loader=load_pydoc_topics,
                                               sample_processor=lambda sample: sample["text"]))


def use_offline_data(config):
    """``config`` (a torchtitan ``Trainer.Config``) reading :data:`DATASET` with
    :class:`ByteTokenizer`, validation off (its data set is a download). Returns it (changed
    in place)."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    register_dataset()
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset=DATASET)
    config.validator.enable = False
    return config


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as tokens 0-255, BOS 256, EOS 257: no vocabulary file to fetch."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    BOS, EOS = 256, 257

    def __init__(self, config: Config | None = None, **kwargs):
        # torchtitan builds tokenizers with tokenizer_path=<its assets path>: nothing to read here.
        super().__init__()
        self.bos_id, self.eos_id = self.BOS, self.EOS

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return [self.BOS] * add_bos + list(text.encode("utf-8")) + [self.EOS] * add_eos

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 258
