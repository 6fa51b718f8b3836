"""Fault injection: single bit flips (and arbitrary values) where SDC strikes.

The monitors are only as good as the faults they are shown to catch, so the tests and
``experiments/bench_monitors.py`` inject the faults the reliability reference names
(section 6, rows E1-E5): a bit flip in a parameter after the optimizer step, in the local
gradient before compression, in the error-feedback residual, in a value of the payload
about to be sent, or in the reduced gradient one rank received. Injectors act at one
chosen (step, rank), once, and record what they did, so a test can assert the fault
really happened and what it changed.

Bit numbering is the IEEE-754 layout of the element: for float32 bit 31 is the sign,
bits 30-23 the exponent (bit 30 its top bit: flipping it multiplies a value of magnitude
< 1 by 2**128, turns one in [1, 2) into Inf or NaN, and divides a larger one by 2**128)
and bits 22-0 the mantissa; for float16 15 / 14-10 /
9-0; for bfloat16 15 / 14-7 / 6-0. Flipping the same bit twice restores the value
exactly, which lets a test undo an injected fault.
"""
import sys

import torch

from sparsecomm.monitor.payload_view import locate, offset_of, payload_layout

TARGETS = ("parameter", "gradient", "payload", "residual", "reduced")
_STAGE = {"gradient": "gradient", "residual": "packed", "payload": "packed", "reduced": "reduced"}
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(tensor: torch.Tensor, flat_index: int, bit: int) -> tuple[float | int, float | int]:
    """Flip bit ``bit`` of element ``flat_index`` of ``tensor`` in place; (old, new) values.

    Works for any dtype whose element is 1, 2, 4 or 8 bytes (float32, float16, bfloat16,
    float64, integer and uint8 payload buffers) by viewing the element as an integer of the
    same size and XOR-ing ``1 << bit``; ``flat_index`` counts in row-major order, whatever
    the strides.
    """
    if tensor.dtype == torch.bool:
        raise TypeError("flip_bit: bool tensors have no bit layout to flip")
    bits = tensor.element_size() * 8
    if not 0 <= bit < bits:
        raise ValueError(f"flip_bit: bit must be in [0, {bits}) for {tensor.dtype}, got {bit}")
    if not 0 <= flat_index < tensor.numel():
        raise IndexError(f"flip_bit: flat_index {flat_index} outside a tensor of {tensor.numel()} elements")
    word_dtype = _WORD_DTYPES[tensor.element_size()]
    words = tensor.detach() if tensor.dtype == word_dtype else tensor.detach().view(word_dtype)
    position = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tensor.shape)) if tensor.dim() else ()
    element = words[position] if position else words
    # The top bit of a signed word is its sign: XOR with the negative power of two.
    mask = -(1 << bit) if bit == bits - 1 and word_dtype != torch.uint8 else 1 << bit
    before = tensor.detach()[position].item() if position else tensor.detach().item()
    element.bitwise_xor_(torch.tensor(mask, dtype=word_dtype, device=tensor.device))
    after = tensor.detach()[position].item() if position else tensor.detach().item()
    return before, after


class _Injector:
    """One fault at one (step, rank), fired once; see the subclasses."""

    # Never reads acc (a payload's layout comes with the event): the hook keeps the fused
    # kernel it would run without the injector, so a fault is injected into the path measured.
    needs_acc = False

    def __init__(self, target: str, *, step: int, rank: int | None, index: int = 0, name: str | None = None, state=None):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        self.target = target
        self.step = step
        self.rank = rank
        self.index = index
        self.name = name
        self.state = state
        self.injected: list[dict] = []

    @property
    def fired(self) -> bool:
        return bool(self.injected)

    def _corrupt(self, tensor: torch.Tensor, flat_index: int) -> tuple:
        raise NotImplementedError

    def _describe(self) -> dict:
        raise NotImplementedError

    def _due(self, step: int, rank: int) -> bool:
        return not self.fired and step == self.step and (self.rank is None or rank == self.rank)

    # ----- training loop: parameters -----------------------------------------------------

    def maybe_inject_parameters(self, module: torch.nn.Module, step: int, rank: int) -> bool:
        """Corrupt the chosen parameter if this is the chosen (step, rank); call it after
        ``optimizer.step()``. True if it fired now."""
        if self.target != "parameter" or not self._due(step, rank):
            return False
        named = dict(module.named_parameters())
        name = self.name if self.name is not None else next(iter(named))
        if name not in named:
            raise KeyError(f"{type(self).__name__}: module has no parameter {name!r}")
        with torch.no_grad():
            before, after = self._corrupt(named[name].data, self.index)
        self._log(step, rank, parameter=name, element=self.index, before=before, after=after)
        return True

    # ----- hook observer: gradient, residual, payload, reduced --------------------------

    def __call__(self, event) -> None:
        if self.target == "parameter" or event.stage != _STAGE[self.target] or not self._due(event.step, event.rank):
            return
        tensors = event.tensors
        if self.target == "payload" and not event.dense and not tensors["payload"].is_floating_point():
            self._corrupt_packed(event)
            return
        tensor = tensors["payload" if self.target == "payload" else self.target]
        if tensor is None:
            return  # no residual (error feedback off or still in warm-up): wait
        if self.target == "payload" and not event.dense:  # random-k: values in selection order
            flat = int(tensors["indices"][self.index])
            self._inject_flat(event, tensor, self.index, flat)
            return
        offset = 0 if self.name is None else offset_of(event.names, event.numels, self.name)
        if offset is None:
            return  # the chosen parameter is in another bucket
        self._inject_flat(event, tensor, offset + self.index, offset + self.index)

    def _inject_flat(self, event, tensor, position: int, flat: int) -> None:
        before, after = self._corrupt(tensor, position)
        parameter, element = locate(event.names, event.numels, flat)
        self._log(event.step, event.rank, bucket_index=event.bucket_index, dense=event.dense,
                  parameter=parameter, element=element, before=before, after=after)

    def _corrupt_packed(self, event) -> None:
        """Corrupt the ``index``-th value inside the packed top-k payload bytes."""
        tensors = event.tensors
        payload, acc, indices = tensors["payload"], tensors["acc"], tensors["indices"]
        position = self.index
        if self.name is not None:  # the first selected entry that belongs to that parameter
            start = offset_of(event.names, event.numels, self.name)
            if start is None:
                return
            inside = ((indices >= start) & (indices < start + dict(zip(event.names, event.numels))[self.name])).nonzero()
            if inside.numel() == 0:
                return  # nothing of that parameter selected this time: wait
            position = int(inside[0])
        layout = payload_layout(payload, acc, indices, self.state, event)
        value_dtype = layout.value_dtype
        first_byte = layout.value_byte_offset(position)
        before_bytes = payload[first_byte : first_byte + value_dtype.itemsize].clone()
        self._corrupt_bytes(payload, first_byte, value_dtype)
        after_bytes = payload[first_byte : first_byte + value_dtype.itemsize].clone()
        parameter, element = locate(event.names, event.numels, int(indices[position]))
        self._log(event.step, event.rank, bucket_index=event.bucket_index, dense=False, parameter=parameter,
                  element=element, payload_position=position,
                  before=before_bytes.view(value_dtype).item(), after=after_bytes.view(value_dtype).item())

    def _corrupt_bytes(self, payload: torch.Tensor, first_byte: int, value_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def _log(self, step, rank, **what) -> None:
        self.injected.append({"target": self.target, "step": step, "rank": rank, **self._describe(), **what})


class BitFlipInjector(_Injector):
    """Flip one bit at one (step, rank): in a parameter, gradient, residual or payload value.

    Targets and where they act:

    - ``"parameter"``: call :meth:`maybe_inject_parameters` after ``optimizer.step()``;
      flips ``name`` (default: the first parameter) at element ``index``.
    - ``"gradient"``: hook stage ``gradient``, the local bucket gradient before
      compression; element ``index`` of parameter ``name`` (default: of the bucket).
    - ``"residual"``: hook stage ``packed``, the new residual (after selection, before
      the conservation check and the send).
    - ``"payload"``: hook stage ``packed``, a value about to be sent: on the top-k path
      the ``index``-th value inside the packed bytes (at byte ``4*k + index*value_size``;
      with ``name``, the first selected entry of that parameter), on the random-k path
      the ``index``-th value, on the dense path element ``index`` of the buffer.
    - ``"reduced"``: hook stage ``reduced``, the averaged bucket this rank received (after
      the collective, before DDP copies it into ``.grad``); element ``index`` of parameter
      ``name`` (default: of the bucket).

    Args:
        target: one of :data:`TARGETS`.
        step: hook step (``event.step``) or, for parameters, the caller's step.
        rank: the rank to corrupt; None corrupts every rank.
        bit: bit number in the element (see the module docstring).
        index, name: which element (see above).
        state: the TopKState, for the wire dtype of payload values (default: the
            bucket's dtype).

    Usage::

        injector = BitFlipInjector("gradient", step=30, rank=1, bit=30)
        state.add_observer(injector)       # before the guards, so they see the fault
        ...
        injector.injected   # [{'target': 'gradient', 'step': 30, 'rank': 1, 'bit': 30, ...}]
    """

    def __init__(self, target: str, *, step: int, rank: int | None, bit: int, index: int = 0,
                 name: str | None = None, state=None):
        super().__init__(target, step=step, rank=rank, index=index, name=name, state=state)
        self.bit = bit

    def _corrupt(self, tensor, flat_index):
        return flip_bit(tensor, flat_index, self.bit)

    def _corrupt_bytes(self, payload, first_byte, value_dtype):
        if not 0 <= self.bit < value_dtype.itemsize * 8:
            raise ValueError(f"bit {self.bit} outside a {value_dtype} value")
        assert sys.byteorder == "little", "payload byte offsets assume a little-endian host"
        flip_bit(payload, first_byte + self.bit // 8, self.bit % 8)

    def _describe(self):
        return {"bit": self.bit}


class ValueInjector(_Injector):
    """Overwrite one element with ``value`` (e.g. NaN or Inf) at one (step, rank).

    Same targets and arguments as :class:`BitFlipInjector`, with ``value`` instead of
    ``bit``. Used for the NaN/Inf guard tests: a bit flip rarely produces a NaN.
    """

    def __init__(self, target: str, *, step: int, rank: int | None, value: float, index: int = 0,
                 name: str | None = None, state=None):
        super().__init__(target, step=step, rank=rank, index=index, name=name, state=state)
        self.value = value

    def _corrupt(self, tensor, flat_index):
        flat = tensor.view(-1) if tensor.is_contiguous() else None
        if flat is None:
            raise ValueError("ValueInjector needs a contiguous tensor")
        before = flat[flat_index].item()
        flat[flat_index] = self.value
        return before, flat[flat_index].item()

    def _corrupt_bytes(self, payload, first_byte, value_dtype):
        replacement = torch.tensor([self.value], dtype=value_dtype).view(torch.uint8)
        payload[first_byte : first_byte + value_dtype.itemsize] = replacement.to(payload.device)

    def _describe(self):
        return {"value": self.value}
