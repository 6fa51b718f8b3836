"""Python's own reference documentation (``pydoc_data.topics``) as a byte stream.

About 465k characters of English prose and code that ship with every CPython, so a
language model can train on real text with no download. The topics are joined in sorted
key order and encoded as UTF-8 bytes; the last 10% is held out for validation.
"""
import torch

VAL_FRACTION = 0.1


def load_pydoc_bytes() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) uint8 tensors of the concatenated topics."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    split = int(len(data) * (1 - VAL_FRACTION))
    return data[:split].clone(), data[split:].clone()
