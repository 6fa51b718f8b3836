"""Shared pieces of the Triton kernels: dtype helpers, magnitude keys, radix passes, checks.

Magnitude key (see csrc/README.md): ``bits(float32(|x|))``, i.e. ``bits(float32(x)) &
0x7FFFFFFF`` as int32, so NaN > Inf > every finite value under int32 comparison. The k-th
largest key is found by a radix select over three digits::

    level 1: key >> 19            12 bits, 4096 bins
    level 2: (key >> 7) & 0xFFF   12 bits, 4096 bins
    level 3: key & 0x7F            7 bits,  128 bins

Each level is one read pass over the data (a per-program ``tl.histogram`` accumulated into a
global histogram with masked atomics) and one single-program "select" kernel that finds the
bin holding the k-th key and stores the result in a small int32 ``state`` tensor on the
device. Later kernels read that state; nothing is copied to the host, so a call launches a
fixed sequence of kernels with grid sizes that depend on ``n`` only.

State layout (int32, ``STATE_SLOTS`` entries), one group of four per level::

    [4*(L-1) + 0]  prefix    digits selected so far (minus 1 once ``done``)
    [4*(L-1) + 1]  krem      rank of the k-th key inside the selected bin
    [4*(L-1) + 2]  done      the selection is complete (no need to refine further)
    [4*(L-1) + 3]  (unused, 0)
    [8], [9]                 (after level 3) kth key K and ``need``: how many entries with
                             key == K are selected (the lowest indices)

"done" trick: when a whole bin is taken (rank == bin count) the selection is
"every key whose digits so far are > prefix - 1"; the next levels extend that prefix with
all-ones digits, so the final state is (K, need=0) meaning "key > K".

Interpreter notes (``TRITON_INTERPRET=1``, Triton 3.9): its float32 -> bfloat16 cast
truncates instead of rounding to nearest even and it mishandles bf16 subnormals, so every
bf16 conversion here is done with integer bit operations (:func:`to_f32`,
:func:`from_f32`); they compile to a few integer ops on a GPU and match torch bit for bit.
Block & scalar-bool ``&`` yields an int32 mask in the interpreter (rejected by tl.load), so
masks are built from block comparisons only (e.g. ``n = tl.where(done == 0, n, 0)``).
"""
import torch
import triton
import triton.language as tl

KEY_MASK = 0x7FFFFFFF
NAN_KEY = 0x7F800001  # every NaN's key, just above Inf (see magnitude_key)
BINS12 = 4096
BINS7 = 128
STATE_SLOTS = 16
# Offsets (int32 elements) in the per-call workspace; the head [0, ZEROED) is zeroed per call.
OFF_H1 = 0
OFF_H2 = OFF_H1 + BINS12
OFF_H3 = OFF_H2 + BINS12
OFF_STATE = OFF_H3 + BINS7
ZEROED = OFF_STATE + STATE_SLOTS

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT32_MAX = 2**31 - 1

# Launch geometry. A program handles ``tiles`` consecutive tiles of ``block`` elements; the
# program count is capped (a few waves of the GPU) so per-program partial results stay small.
# Tests may override these (see :func:`geometry_override`).
_GEOMETRY = {"block": None, "max_programs": None}
NUM_WARPS = 8
# Every launch passes enable_fp_fusion=False: no a*b+c contraction, so every float operation
# rounds exactly as the contract (and torch) spells it.


def interpreting() -> bool:
    """Whether this module's kernels run in the Triton interpreter (decided when it was imported)."""
    return type(hist1_kernel).__name__ == "InterpretedFunction"


def _sm_count(device: torch.device) -> int:
    return _sm_count_cached(device.index if device.index is not None else torch.cuda.current_device())


_SM_COUNTS: dict[int, int] = {}


def _sm_count_cached(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def geometry(n: int, device: torch.device) -> tuple[int, int, int]:
    """(block, tiles per program, number of programs) for ``n`` elements on ``device``."""
    on_gpu = device.type == "cuda" and not interpreting()
    block = _GEOMETRY["block"] or (4096 if on_gpu else 1024)
    max_programs = _GEOMETRY["max_programs"] or (4 * _sm_count(device) if on_gpu else 1 << 20)
    num_tiles = max(1, triton.cdiv(n, block))
    tiles = triton.cdiv(num_tiles, max_programs)
    return block, tiles, triton.cdiv(num_tiles, tiles)


class geometry_override:
    """Context manager forcing a block size / program cap (tests: many programs, tile loops)."""

    def __init__(self, block: int | None = None, max_programs: int | None = None):
        if block is not None and (block < 16 or block & (block - 1)):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        self._new = {"block": block, "max_programs": max_programs}

    def __enter__(self):
        self._old = dict(_GEOMETRY)
        _GEOMETRY.update(self._new)
        return self

    def __exit__(self, *exc):
        _GEOMETRY.update(self._old)


def _align4(x: int) -> int:
    return (x + 3) // 4 * 4


def regions(ws: torch.Tensor, n_programs: int) -> dict[str, torch.Tensor]:
    """Views of the workspace: h1, h2, h3, state (zeroed per call); counts [2 x P], blockgt [P],
    blockhist [P x 128] (per-program results, fully overwritten). Each starts 16-byte aligned
    (fewer pointer-alignment specialisations of the compiled kernels)."""
    counts = ZEROED
    blockgt = counts + _align4(2 * n_programs)
    blockhist = blockgt + _align4(n_programs)
    return {"h1": ws[OFF_H1:], "h2": ws[OFF_H2:], "h3": ws[OFF_H3:], "state": ws[OFF_STATE:ZEROED],
            "counts": ws[counts:counts + 2 * n_programs], "blockgt": ws[blockgt:blockgt + n_programs],
            "blockhist": ws[blockhist:]}


def workspace(n_programs: int, per_block: bool, device: torch.device) -> torch.Tensor:
    """int32 scratch: histograms + state (zeroed by one memset), then per-program results."""
    size = ZEROED + _align4(2 * n_programs) + _align4(n_programs) + (BINS7 * n_programs if per_block else 0)
    ws = torch.empty(size, dtype=torch.int32, device=device)
    ws[:ZEROED].zero_()
    return ws


def wire_limit(grad_dtype: torch.dtype, wire_dtype: torch.dtype) -> float:
    """Saturation limit of the wire cast (0.0: none), as ``to_wire_dtype`` decides it."""
    if wire_dtype == grad_dtype or torch.finfo(wire_dtype).max >= torch.finfo(grad_dtype).max:
        return 0.0
    return float(torch.finfo(wire_dtype).max)


# --------------------------------------------------------------------------- checks

def check_vectors(name: str, grad: torch.Tensor, **tensors) -> None:
    """Contract checks shared by the pack ops (raised before any work)."""
    for arg, tensor in {"grad": grad, **tensors}.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"{name}: {arg} must be a contiguous 1-D tensor, got shape {tuple(tensor.shape)}")
        if tensor.device != grad.device:
            raise ValueError(f"{name}: {arg} is on {tensor.device}, grad on {grad.device}")
    if grad.dtype not in GRAD_DTYPES:
        raise ValueError(f"{name}: grad dtype must be one of {GRAD_DTYPES}, got {grad.dtype}")
    if grad.numel() > INT32_MAX:
        raise ValueError(f"{name}: grad has {grad.numel()} elements; int32 indices allow {INT32_MAX}")
    residual = tensors.get("residual")
    if residual is not None:
        if residual.numel() != grad.numel() or residual.dtype != grad.dtype:
            raise ValueError(f"{name}: residual must match grad ({grad.numel()} x {grad.dtype}), "
                             f"got {residual.numel()} x {residual.dtype}")
        if residual.numel() and residual.data_ptr() == grad.data_ptr():
            raise ValueError(f"{name}: residual may not alias grad")
    indices_out, values_out = tensors.get("indices_out"), tensors.get("values_out")
    if indices_out is not None and indices_out.dtype != torch.int32:
        raise ValueError(f"{name}: indices_out must be int32, got {indices_out.dtype}")
    if values_out is not None and values_out.dtype not in WIRE_DTYPES:
        raise ValueError(f"{name}: values_out dtype must be one of {WIRE_DTYPES}, got {values_out.dtype}")
    outputs = [t for t in (indices_out, values_out) if t is not None and t.numel()]
    for out in outputs:
        for other in [grad, residual]:
            if other is not None and other.numel() and overlap(out, other):
                raise ValueError(f"{name}: outputs may not alias grad or residual")
    if len(outputs) == 2 and overlap(*outputs):
        raise ValueError(f"{name}: indices_out and values_out may not overlap")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses a (non-empty, non-negatively strided) tensor touches."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_index_offset(name: str, n: int, index_offset: int) -> None:
    if index_offset < 0 or index_offset + max(n - 1, 0) > INT32_MAX:
        raise ValueError(f"{name}: index_offset {index_offset} + n {n} does not fit int32 indices")


# --------------------------------------------------------------------------- device helpers
#
# The kernels call no ``@triton.jit`` function of triton.language.standard (tl.sum, tl.cumsum,
# tl.zeros, ...): those are compiled-or-interpreted according to TRITON_INTERPRET when
# *triton* is first imported, so using them would tie interpreter runs to the import order.
# Builtins (tl.reduce, tl.associative_scan, tl.full, ...) work either way. tl.sum/tl.cumsum's
# own combine function is reused so that the interpreter takes its numpy fast path.

_SUM_COMBINE = getattr(getattr(tl, "standard", None), "_sum_combine", None)
if _SUM_COMBINE is None:  # pragma: no cover - a Triton without it: correct, just slower to interpret
    @triton.jit
    def _SUM_COMBINE(a, b):
        return a + b


@triton.jit
def block_sum(x):
    """Sum over a 1-D block (int32 in, int32 out)."""
    return tl.reduce(x, 0, _SUM_COMBINE)


@triton.jit
def block_cumsum(x, REVERSE: tl.constexpr = False):
    """Inclusive prefix sum over a 1-D block (suffix sum with REVERSE)."""
    return tl.associative_scan(x, 0, _SUM_COMBINE, reverse=REVERSE)


@triton.jit
def to_f32(x):
    """Exact widening to float32 (bf16 by bit shift: the interpreter's cast is unreliable)."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def from_f32(x, DTYPE: tl.constexpr):
    """float32 -> DTYPE, round to nearest even (bf16: torch's rounding, NaN -> 0x7FC0)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = tl.where(is_nan, 0x7FC0, rounded)
        y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float32:
        y = x
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def magnitude_key(x32):
    """int32 key ordering by magnitude: NaN > Inf > finite (x32 is float32); one key for every NaN."""
    return tl.minimum(x32.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7F800001)


@triton.jit
def emit_entries(idx_out_ptr, val_out_ptr, src_ptr, slot, offs, index_offset, a32, key, sel, valid,
                 T: tl.constexpr, V: tl.constexpr, LIMIT: tl.constexpr, WRITE_RESIDUAL: tl.constexpr):
    """Store the selected entries at ``slot`` (index + offset, wire value); the residual keeps acc - sent.

    The residual (which holds acc at every other ``valid`` entry) becomes +0 wherever acc is
    +-Inf or NaN, sent or not: Inf - Inf = NaN kept there would rank first and be sent again
    on every later step. Both operands are zeroed before the subtraction, so no NaN is formed.
    """
    wire = to_wire(a32, key, T, V, LIMIT)
    tl.store(idx_out_ptr + slot, (offs + index_offset).to(tl.int32), mask=sel)
    tl.store(val_out_ptr + slot, wire, mask=sel)
    if WRITE_RESIDUAL:
        finite = key < 0x7F800000
        sent = tl.where(finite, to_f32(from_f32(to_f32(wire), T)), 0.0)
        remainder = tl.where(finite, a32, 0.0) - sent
        tl.store(src_ptr + offs, from_f32(remainder, T), mask=sel | (valid & (key >= 0x7F800000)))


@triton.jit
def to_wire(a32, key, T: tl.constexpr, VDTYPE: tl.constexpr, LIMIT: tl.constexpr):
    """Wire value of float32 ``a32``, acc of dtype T: cast to VDTYPE; a finite value beyond
    +-LIMIT goes out as +-s, LIMIT rounded down to a multiple of acc's ulp in T, so that acc - s
    is exact in T (``error_feedback.to_wire_dtype``)."""
    if LIMIT > 0:
        over = (a32 > LIMIT) | (a32 < -LIMIT)
        over = over & (key < 0x7F800000)  # finite only: +-Inf and NaN pass through
        limit = tl.full(a32.shape, LIMIT, tl.float32)
        # ulp: acc's exponent bits less T's mantissa width (LIMIT's in the other lanes: no Inf/NaN arithmetic)
        exponent = tl.where(over, key, limit.to(tl.int32, bitcast=True)) & 0x7F800000
        ulp = (exponent - (T.fp_mantissa_width << 23)).to(tl.float32, bitcast=True)
        # floor of the quotient (exact, in [0, 2^24)) by the conversion to int32, which truncates
        # (tl.floor would compile to an instruction that flushes subnormals)
        s = tl.math.div_rn(limit, ulp).to(tl.int32).to(tl.float32) * ulp
        a32 = tl.where(over, tl.where(a32 > 0, s, -s), a32)
    return from_f32(a32, VDTYPE)


@triton.jit
def compensate(g_ptr, r_ptr, offs, mask, divisor, ADD_RESIDUAL: tl.constexpr):
    """acc = T(float(g) / float(divisor)) [then T(float(acc) + float(r))], T = grad's dtype."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    g32 = to_f32(g)
    acc = from_f32(tl.math.div_rn(g32, tl.full(g32.shape, divisor, tl.float32)), g.dtype)
    if ADD_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        acc = from_f32(to_f32(acc) + to_f32(r), g.dtype)
    return acc


@triton.jit
def load_acc(g_ptr, src_ptr, offs, mask, divisor, FROM_SRC: tl.constexpr):
    """The compensated value: stored in ``src_ptr`` (FROM_SRC) or recomputed from grad."""
    if FROM_SRC:
        acc = tl.load(src_ptr + offs, mask=mask, other=0.0)
    else:
        acc = compensate(g_ptr, src_ptr, offs, mask, divisor, False)
    return acc


# --------------------------------------------------------------------------- radix passes

@triton.jit
def hist1_kernel(g_ptr, r_ptr, hist_ptr, n, divisor, tiles,
                 FROM_SRC: tl.constexpr, ADD_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Level-1 histogram (key >> 19). Fused error feedback unless FROM_SRC (then r_ptr = x).

    With WRITE_RESIDUAL, ``acc`` is stored into r_ptr (the residual), so later passes read
    one tensor instead of recomputing from grad (+ residual).
    """
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * tiles * BLOCK
    h = tl.full([4096], 0, tl.int32)
    for t in range(tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        if FROM_SRC:
            acc = tl.load(r_ptr + offs, mask=m, other=0.0)
        else:
            acc = compensate(g_ptr, r_ptr, offs, m, divisor, ADD_RESIDUAL)
            if WRITE_RESIDUAL:
                tl.store(r_ptr + offs, acc, mask=m)
        key = magnitude_key(to_f32(acc))
        h += tl.histogram(key >> 19, 4096, mask=m)
    tl.atomic_add(hist_ptr + tl.arange(0, 4096), h, mask=h > 0, sem="relaxed")


@triton.jit
def hist_refine_kernel(g_ptr, src_ptr, state_ptr, hist_ptr, blockhist_ptr, blockgt_ptr, n, divisor, tiles,
                       LEVEL: tl.constexpr, FROM_SRC: tl.constexpr, SKIP_IF_DONE: tl.constexpr,
                       PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of the level-2 or level-3 digit among keys matching the selected prefix.

    Reads the prefix (and the done flag) written by the previous select kernel. With
    SKIP_IF_DONE, a finished selection masks every load off (no memory traffic). With
    PER_BLOCK (level 3 of exact top-k), each program also stores its own 128-bin histogram
    and its count of keys whose prefix is above the selected one: the emit pass turns them
    into per-program output offsets without another read of the data.
    """
    SHIFT: tl.constexpr = 19 if LEVEL == 2 else 7
    DSHIFT: tl.constexpr = 7 if LEVEL == 2 else 0
    DMASK: tl.constexpr = 0xFFF if LEVEL == 2 else 0x7F
    NBINS: tl.constexpr = 4096 if LEVEL == 2 else 128
    prefix = tl.load(state_ptr + 4 * (LEVEL - 2))
    done = tl.load(state_ptr + 4 * (LEVEL - 2) + 2)
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * tiles * BLOCK
    h = tl.full([NBINS], 0, tl.int32)
    gt = tl.full([], 0, tl.int32)
    if SKIP_IF_DONE:
        n = tl.where(done == 0, n, 0)  # finished: every lane masked off, nothing is read
    for t in range(tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        acc = load_acc(g_ptr, src_ptr, offs, m, divisor, FROM_SRC)
        key = magnitude_key(to_f32(acc))
        high = key >> SHIFT
        h += tl.histogram((key >> DSHIFT) & DMASK, NBINS, mask=m & (high == prefix))
        if PER_BLOCK:
            gt += block_sum((m & (high > prefix)).to(tl.int32))
    tl.atomic_add(hist_ptr + tl.arange(0, NBINS), h, mask=h > 0, sem="relaxed")
    if PER_BLOCK:
        tl.store(blockhist_ptr + pid * NBINS + tl.arange(0, NBINS), h)
        tl.store(blockgt_ptr + pid, gt)


@triton.jit
def select_kernel(hist_ptr, state_ptr, k, LEVEL: tl.constexpr):
    """One program: find the bin of the k-th largest key at this level; update the state.

    Levels 1-2 store (prefix, krem, done); level 3 stores the k-th key ``K`` and ``need``
    (entries with key == K to take, lowest indices first).
    """
    NBINS: tl.constexpr = 128 if LEVEL == 3 else 4096
    BITS: tl.constexpr = 7 if LEVEL == 3 else 12
    if LEVEL == 1:
        prefix_in = tl.full([], 0, tl.int32)
        krem_in = tl.full([], 0, tl.int32) + k
        done_in = tl.full([], 0, tl.int32)
    else:
        prefix_in = tl.load(state_ptr + 4 * (LEVEL - 2))
        krem_in = tl.load(state_ptr + 4 * (LEVEL - 2) + 1)
        done_in = tl.load(state_ptr + 4 * (LEVEL - 2) + 2)
    bins = tl.arange(0, NBINS)
    h = tl.load(hist_ptr + bins)
    at_or_above = block_cumsum(h, REVERSE=True)
    above = at_or_above - h
    hit = (above < krem_in) & (at_or_above >= krem_in)
    b = block_sum(tl.where(hit, bins, 0))
    a = block_sum(tl.where(hit, above, 0))
    hb = block_sum(tl.where(hit, h, 0))
    krem = krem_in - a
    prefix = (prefix_in << BITS) | b
    finished = done_in != 0
    out = state_ptr + 4 * (LEVEL - 1)
    if LEVEL < 3:
        full = krem == hb
        now_done = finished | full
        prefix_out = tl.where(finished, (prefix_in << BITS) | (NBINS - 1),
                              tl.where(full, prefix - 1, prefix))
        tl.store(out, prefix_out)
        tl.store(out + 1, tl.where(now_done, 0, krem))
        tl.store(out + 2, now_done.to(tl.int32))
        tl.store(out + 3, 0)
    else:
        kth = tl.where(finished, (prefix_in << BITS) | (NBINS - 1), prefix)
        need = tl.where(finished, 0, krem)
        tl.store(state_ptr + 8, kth)
        tl.store(state_ptr + 9, need)


def radix_select(g: torch.Tensor, src: torch.Tensor, ws: torch.Tensor, n: int, k: int, divisor: float,
                 *, from_src: bool, add_residual: bool, write_residual: bool, per_block: bool, block: int,
                 tiles: int, nprog: int) -> None:
    """Launch the three histogram passes and select kernels (results in the workspace state).

    ``src`` is the tensor later passes read (the residual holding ``acc``, or ``x``); when
    not ``from_src`` the compensation is recomputed from ``g`` (no residual).
    """
    views = regions(ws, nprog)
    state, blockgt, blockhist = views["state"], views["blockgt"], views["blockhist"]
    grid = (nprog,)
    hist1_kernel[grid](g, src, views["h1"], n, divisor, tiles, FROM_SRC=from_src, ADD_RESIDUAL=add_residual,
                       WRITE_RESIDUAL=write_residual, BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=False)
    from_src_later = from_src or write_residual
    select_kernel[(1,)](views["h1"], state, k, LEVEL=1, num_warps=NUM_WARPS, enable_fp_fusion=False)
    hist_refine_kernel[grid](g, src, state, views["h2"], blockhist, blockgt, n, divisor, tiles, LEVEL=2,
                             FROM_SRC=from_src_later, SKIP_IF_DONE=True, PER_BLOCK=False, BLOCK=block,
                             num_warps=NUM_WARPS, enable_fp_fusion=False)
    select_kernel[(1,)](views["h2"], state, k, LEVEL=2, num_warps=NUM_WARPS, enable_fp_fusion=False)
    hist_refine_kernel[grid](g, src, state, views["h3"], blockhist, blockgt, n, divisor, tiles, LEVEL=3,
                             FROM_SRC=from_src_later, SKIP_IF_DONE=not per_block, PER_BLOCK=per_block,
                             BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=False)
    select_kernel[(1,)](views["h3"], state, k, LEVEL=3, num_warps=4, enable_fp_fusion=False)

