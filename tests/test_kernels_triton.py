"""Triton kernels (:mod:`sparsecomm.ops.triton`) against the pure-torch oracle.

Every op is compared with :mod:`sparsecomm.ops.reference` on CPU tensors under the Triton
interpreter and, when a GPU is present, on CUDA tensors with compiled kernels. Comparisons
are bitwise (NaN-aware for sent values: any NaN matches any NaN) unless a comment says
otherwise. Residuals never hold NaN (a non-finite acc leaves +0, csrc/README.md): they are
compared bit for bit with no NaN allowed.

Interpreter mode: Triton 3.9 reads ``TRITON_INTERPRET`` when ``@triton.jit`` runs, i.e. when
a module defining kernels is imported, not when they are launched (triton.language's own jit
functions, tl.sum, tl.zeros, ..., are fixed when *triton* is first imported; the kernels use
none of them, so only the import of sparsecomm.ops.triton matters). Setting the variable at
the top of this file is not robust (another test may already have imported the package), so
:func:`_fresh_backend` imports a private copy of ``sparsecomm.ops.triton`` with the variable
set (CPU) or cleared (CUDA) and then restores ``sys.modules``, the environment and
``sparsecomm.ops.triton`` exactly as they were; the copy's kernels keep their mode. It checks
the mode it got, so a Triton that changed this behaviour fails loudly instead of silently
testing the wrong thing. No subprocess is needed.

The CUDA oracle runs on CPU copies of the inputs: torch's CUDA ``tensor.div(scalar)``
multiplies by the reciprocal, while the contract (and torch on CPU) divides.

The interpreter is slow, so sizes are small (1, 7, 1000, and ``MULTI``: 3 programs of the
default geometry, the last holding 3 entries, i.e. 2051 on CPU and 8195 on CUDA) and a few
tests force tiny blocks and a capped program count to exercise multi-program prefixes and
tile loops. The interpreter's time goes per launch, program and tile (a tile of 16 entries
costs about as much as one of 1024), not per element, so those tests use ``MANY`` = 117
entries in blocks of 16: 3 programs of 3, 3 and 2 tiles, the last tile holding 5 entries.
"""
import contextlib
import importlib
import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import sparsecomm.ops  # noqa: E402
from kernel_cases import (FP16_SATURATION, NARROW_WIRE_PAIRS, beyond_wire_range, check_fp16_saturation,  # noqa: E402
                          check_non_finite_rule, fp16_saturation_grad, topk_non_finite_cases, with_non_finite)
from sparsecomm.ops import reference  # noqa: E402

_PKG = "sparsecomm.ops.triton"
_MISSING = object()
# A size resolved per backend by _size: 3 programs of the default block, the last holding 3 entries.
MULTI = "multi"
# (n, k); k = MULTI: k = n.
SIZES_AND_KS = [(1, 1), (7, 1), (7, 7), (1000, 1), (1000, 10), (MULTI, 41), (MULTI, MULTI)]
# (grad dtype, wire dtype): each grad dtype with its own dtype and a different one.
DTYPE_PAIRS = [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16), (torch.float16, torch.bfloat16),
]
# (residual present, add_residual)
EF_MODES = [(True, True), (True, False), (False, False)]
# Entries for _small_programs: 8 tiles of 16 -> 3 programs of 3, 3, 2 tiles; the last tile holds 5.
MANY = 16 * 7 + 5
# The pairs the non-finite tests also run over many programs: every grad dtype and every wire
# dtype, a saturating wire among them. What the programs add (offsets from other programs'
# counts, programs past the capacity) is integer logic the dtypes do not enter; every pair
# runs the per-element rules at 1000 entries.
MANY_PROGRAM_PAIRS = [DTYPE_PAIRS[2], DTYPE_PAIRS[4], DTYPE_PAIRS[6]]
FLOAT_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _fresh_backend(interpret: bool):
    """A private import of sparsecomm.ops.triton whose kernels are interpreted (or compiled)."""
    import triton

    saved_modules = {name: sys.modules.pop(name) for name in list(sys.modules)
                     if name == _PKG or name.startswith(_PKG + ".")}
    saved_attr = sparsecomm.ops.__dict__.get("triton", _MISSING)
    saved_env = os.environ.get("TRITON_INTERPRET")
    knobs = getattr(triton, "knobs", None)
    saved_knob = knobs.runtime.__dict__.pop("interpret", _MISSING) if knobs is not None else _MISSING
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        module = importlib.import_module(_PKG)
    finally:
        for name in [name for name in sys.modules if name == _PKG or name.startswith(_PKG + ".")]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        if saved_attr is _MISSING:
            sparsecomm.ops.__dict__.pop("triton", None)
        else:
            sparsecomm.ops.triton = saved_attr
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_knob is not _MISSING:
            knobs.runtime.__dict__["interpret"] = saved_knob
    assert module.interpreting() == interpret, "Triton did not honour TRITON_INTERPRET at import time"
    return module


@pytest.fixture(scope="module", params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def backend(request):
    """(ops module, device): interpreter on CPU tensors, compiled kernels on CUDA (if present)."""
    ops = _fresh_backend(interpret=request.param == "cpu")
    usable, reason = ops.available(request.param)
    if not usable:
        pytest.skip(f"Triton backend unusable: {reason}")
    return ops, torch.device(request.param)


@pytest.fixture(scope="module")
def cpu_backend():
    return _fresh_backend(interpret=True)


def _radix(ops):
    """The backend copy's own radix module (geometry knobs live there)."""
    return ops.ef_topk_pack.__globals__["radix"]


def _size(ops, device, n):
    """``n``, or for ``MULTI`` 2 * block + 3 with the backend's default block (1024 interpreted, 4096 compiled)."""
    if n != MULTI:
        return n
    return 2 * _radix(ops).geometry(1, device)[0] + 3


@contextlib.contextmanager
def _small_programs(ops, block=16, max_programs=3):
    """Many programs with several tiles each, on small inputs (``MANY`` entries: 3 programs)."""
    with _radix(ops).geometry_override(block=block, max_programs=max_programs):
        yield


# --------------------------------------------------------------------------- helpers

def _assert_same(actual, expected, what="", nan_ok=True):
    """Bitwise equality, NaN-aware unless ``nan_ok`` is False (then any NaN fails); on the CPU."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        (what, actual.dtype, expected.dtype, actual.shape, expected.shape)
    if actual.is_floating_point():
        nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
        if not nan_ok:
            assert not bool(nan_a.any()) and not bool(nan_e.any()), f"{what}: NaN (not allowed here)"
        assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
        bits = FLOAT_BITS[actual.dtype]
        a, e = actual.view(bits)[~nan_a], expected.view(bits)[~nan_e]
        if not torch.equal(a, e):
            bad = (a != e).nonzero().flatten()[:5]
            raise AssertionError(f"{what}: {int((a != e).sum())} entries differ, e.g. "
                                 f"{actual[~nan_a][bad].tolist()} vs {expected[~nan_e][bad].tolist()}")
    else:
        assert torch.equal(actual, expected), f"{what}: differ"


def _by_index(indices, values):
    order = torch.sort(indices.cpu().long()).indices
    return indices.cpu()[order], values.cpu()[order]


def _grad(n, dtype, seed, kind="randn"):
    gen = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(n, generator=gen)
    elif kind == "ties":  # few distinct magnitudes: ties at every rank
        x = torch.randint(0, 4, (n,), generator=gen).float() * torch.randn(n, generator=gen).sign()
    elif kind == "equal":
        x = torch.full((n,), 0.75)
    elif kind == "nonfinite":
        x = torch.randn(n, generator=gen)
        for pos, value in zip(torch.randperm(n, generator=gen)[:9].tolist(),
                              [float("nan"), float("inf"), -float("inf")] * 3):
            x[pos] = value
    else:
        raise ValueError(kind)
    return x.to(dtype)


def _run_topk(ops, device, grad, residual, divisor, add_residual, k, wire_dtype, offset=0):
    """(triton outputs, reference outputs): indices, values, residual (None if no residual)."""
    out = []
    for impl, dev in ((ops.ef_topk_pack, device), (reference.ef_topk_pack, torch.device("cpu"))):
        res = None if residual is None else residual.clone().to(dev)
        idx = torch.full((k,), -1, dtype=torch.int32, device=dev)
        val = torch.full((k,), 7.0, dtype=wire_dtype, device=dev)
        g = grad.to(dev)
        impl(g, res, divisor, add_residual, k, idx, val, offset)
        _assert_same(g, grad.to(dev), "grad must not be modified")
        out.append((idx, val, res))
    return out


def _check_topk(ops, device, grad, residual, divisor, add_residual, k, wire_dtype, offset=0):
    (idx, val, res), (ridx, rval, rres) = _run_topk(ops, device, grad, residual, divisor, add_residual, k,
                                                     wire_dtype, offset)
    idx, val = _by_index(idx, val)
    ridx, rval = _by_index(ridx, rval)
    _assert_same(idx, ridx, "indices")
    _assert_same(val, rval, "values")
    if residual is not None:
        _assert_same(res, rres, "residual", nan_ok=False)
        # sent + residual == acc where acc is finite; +0 where it is not (sent or not).
        check_non_finite_rule(reference.compensated(grad, residual, divisor, add_residual), idx.long() - offset,
                              val, res)
    return idx, val


# --------------------------------------------------------------------------- ef_topk_pack

@pytest.mark.parametrize("grad_dtype,wire_dtype", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("n,k", SIZES_AND_KS)
def test_ef_topk_pack_matches_reference(backend, grad_dtype, wire_dtype, n, k):
    ops, device = backend
    n, k = _size(ops, device, n), _size(ops, device, k)
    assert _radix(ops).geometry(n, device)[2] == (3 if n > 1000 else 1)
    grad = _grad(n, grad_dtype, seed=n + k)
    residual = (0.5 * _grad(n, torch.float32, seed=n + k + 1)).to(grad_dtype)
    for has_residual, add_residual in EF_MODES:
        _check_topk(ops, device, grad, residual if has_residual else None, 3, add_residual, k, wire_dtype,
                    offset=11)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("kind", ["ties", "equal"])
def test_ef_topk_pack_ties_lowest_indices(backend, grad_dtype, kind):
    ops, device = backend
    n = 1000
    grad = _grad(n, grad_dtype, seed=5, kind=kind)
    residual = torch.zeros(n, dtype=grad_dtype)
    for k in (1, 10, 37, 500, 999, n):
        idx, _ = _check_topk(ops, device, grad, residual, 1, True, k, grad_dtype)
        if kind == "equal":
            assert idx.tolist() == list(range(k))


def test_ef_topk_pack_ties_at_kth_across_programs(backend):
    """Ties exactly at the k-th key spread over many programs and tiles: lowest indices win."""
    ops, device = backend
    n = MANY  # programs hold entries [0, 48), [48, 96), [96, 117); tiles of 16
    grad = _grad(n, torch.float32, seed=9)
    big = grad.abs().max().item() + 1
    tie_positions = [3, 16, 17, 40, 50, 80, 100, 116]
    for pos in tie_positions:  # 8 ties; the 5 entries above them are unique
        grad[pos] = -big if pos % 2 else big
    for i, pos in enumerate([10, 20, 60, 61, 115]):
        grad[pos] = big * (2 + i)
    with _small_programs(ops):
        for k in (5 + 1, 5 + 3, 5 + 8, 5 + 9):
            idx, _ = _check_topk(ops, device, grad, grad.clone().zero_(), 1, True, k, torch.float32)
            chosen = sorted(set(idx.tolist()) & set(tie_positions))
            assert chosen == tie_positions[:min(k - 5, 8)]


@pytest.mark.parametrize("grad_dtype,wire_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float32)],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_ef_topk_pack_nan_inf_selected_first(backend, grad_dtype, wire_dtype):
    ops, device = backend
    n = 1000
    grad = _grad(n, grad_dtype, seed=3, kind="nonfinite")
    residual = torch.zeros(n, dtype=grad_dtype)
    nonfinite = set((~torch.isfinite(grad)).nonzero().flatten().tolist())
    for k in (1, 3, 9, 10, 100):
        idx, _ = _check_topk(ops, device, grad, residual, 3, True, k, wire_dtype)
        assert len(nonfinite & set(idx.tolist())) == min(k, len(nonfinite))


def _non_finite_geometries(ops, grad_dtype, wire_dtype):
    """(n, geometry context): 1000 entries in one program; for MANY_PROGRAM_PAIRS also MANY in 3 programs."""
    yield 1000, contextlib.nullcontext()
    if (grad_dtype, wire_dtype) in MANY_PROGRAM_PAIRS:
        yield MANY, _small_programs(ops)


@pytest.mark.parametrize("grad_dtype,wire_dtype", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_ef_topk_pack_non_finite_acc_leaves_zero_residual(backend, grad_dtype, wire_dtype):
    """Inf/NaN are sent first and unchanged and leave +0 in the residual, sent or not (more
    of them than k: some are not sent); for MANY_PROGRAM_PAIRS also MANY entries over 3
    programs of several tiles."""
    ops, device = backend
    for n, programs in _non_finite_geometries(ops, grad_dtype, wire_dtype):
        with programs:
            for name, count, k in topk_non_finite_cases(n):
                grad = with_non_finite(n, grad_dtype, count, seed=count)
                residual = (0.1 * _grad(n, torch.float32, seed=1)).to(grad_dtype)
                idx, _ = _check_topk(ops, device, grad, residual, 3, True, k, wire_dtype, offset=2)
                acc = reference.compensated(grad, residual, 3, True)
                sent_non_finite = int((~torch.isfinite(acc[idx.long() - 2])).sum())
                assert sent_non_finite == min(k, int((~torch.isfinite(acc)).sum())), name


@pytest.mark.parametrize("grad_dtype,wire_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                   (torch.float16, torch.float16), (torch.float16, torch.bfloat16)],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_ef_topk_pack_subnormals(backend, grad_dtype, wire_dtype):
    """Tiny values: acc, wire values and residuals in the subnormal range round like torch."""
    ops, device = backend
    tiny = torch.finfo(grad_dtype).tiny
    grad = (_grad(1000, torch.float32, seed=8) * tiny * 4).to(grad_dtype)
    residual = (_grad(1000, torch.float32, seed=9) * tiny).to(grad_dtype)
    for k in (1, 100, 1000):
        _check_topk(ops, device, grad, residual, 3, True, k, wire_dtype)


def test_ef_topk_pack_many_programs(backend):
    """Same results with tiny blocks: 3 programs x several tiles (cross-program offsets); 64
    entries: 2 programs of 2 full tiles; 7: one program, one partial tile."""
    ops, device = backend
    with _small_programs(ops):
        for (grad_dtype, wire_dtype), (n, k) in [(DTYPE_PAIRS[1], (MANY, 10)), (DTYPE_PAIRS[3], (MANY, 41)),
                                                 (DTYPE_PAIRS[5], (MANY, MANY)), (DTYPE_PAIRS[6], (64, 7)),
                                                 (DTYPE_PAIRS[0], (7, 3))]:
            grad = _grad(n, grad_dtype, seed=k)
            residual = (0.5 * _grad(n, torch.float32, seed=k + 1)).to(grad_dtype)
            for has_residual, add_residual in EF_MODES:
                _check_topk(ops, device, grad, residual if has_residual else None, 3, add_residual, k, wire_dtype)


@pytest.mark.parametrize("grad_dtype,wire_dtype", NARROW_WIRE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_ef_topk_pack_saturates_on_narrow_wire(backend, grad_dtype, wire_dtype):
    ops, device = backend
    grad, k = beyond_wire_range(grad_dtype)
    residual = torch.zeros_like(grad)
    _, val = _check_topk(ops, device, grad, residual, 1, True, k, wire_dtype)
    limit = torch.finfo(wire_dtype).max
    finite = torch.isfinite(val.float())
    assert bool((val.float()[finite].abs() <= limit).all())
    assert int(torch.isinf(val.float()).sum()) == 4 and int(torch.isnan(val.float()).sum()) == 2


@pytest.mark.parametrize("dtype", list(FP16_SATURATION), ids=lambda d: str(d).replace("torch.", ""))
def test_ef_topk_pack_fp16_saturation_conserves_every_finite_acc(backend, dtype):
    """kernel_cases.FP16_SATURATION: each acc goes out as its hand-worked value, and sent +
    residual == acc up to float32's largest."""
    ops, device = backend
    acc, k = fp16_saturation_grad(dtype)
    residual = torch.zeros_like(acc, device=device)
    idx = torch.empty(k, dtype=torch.int32, device=device)
    val = torch.empty(k, dtype=torch.float16, device=device)
    ops.ef_topk_pack(acc.to(device), residual, 1.0, True, k, idx, val)
    check_fp16_saturation(acc, idx, val, residual)


def test_ef_topk_pack_rejects_bad_arguments(cpu_backend):
    ops = cpu_backend
    grad = torch.randn(10)
    idx, val = torch.empty(10, dtype=torch.int32), torch.empty(10)
    with pytest.raises(ValueError):
        ops.ef_topk_pack(grad, None, 1, False, 0, idx, val)
    with pytest.raises(ValueError):
        ops.ef_topk_pack(grad, None, 1, False, 11, idx, val)
    with pytest.raises(ValueError):
        ops.ef_topk_pack(grad, grad, 1, True, 3, idx, val)  # residual aliases grad
    with pytest.raises(ValueError):
        ops.ef_topk_pack(grad.double(), None, 1, False, 3, idx, val)
    with pytest.raises(ValueError):
        ops.ef_topk_pack(grad, None, 1, False, 3, idx.long(), val)
    with pytest.raises(ValueError):
        ops.ef_topk_pack(grad, None, 1, False, 3, idx[:2], val)


# --------------------------------------------------------------------------- unpack_add

def _gathered(rows, k, n, value_dtype, seed, pad_row=None, real_zero=False):
    """[rows, k] strided views into one byte buffer laid out like gathered payloads.

    Index 0 appears only where placed here: in ``pad_row`` as padding (index 0, value +0.0)
    repeated, and with ``real_zero`` also as one real entry of that row (value 1.5), which a
    racy or last-store-wins update would lose.
    """
    gen = torch.Generator().manual_seed(seed)
    row_bytes = -(-k * (4 + value_dtype.itemsize) // 8) * 8 + 8  # extra slack: rows are strided
    buffer = torch.zeros(rows, row_bytes, dtype=torch.uint8)
    indices = buffer[:, : 4 * k].view(torch.int32)
    values = buffer[:, 4 * k: 4 * k + k * value_dtype.itemsize].view(value_dtype)
    for r in range(rows):
        indices[r] = 1 + torch.randperm(n - 1, generator=gen)[:k].int()
        values[r] = torch.randn(k, generator=gen).to(value_dtype)
    values[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0]).to(value_dtype)
    if pad_row is not None:
        indices[pad_row, k // 2:] = 0
        values[pad_row, k // 2:] = 0
        if real_zero:
            indices[pad_row, 1] = 0
            values[pad_row, 1] = 1.5
    assert not indices.is_contiguous() and indices.stride(1) == 1
    return indices, values


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("rows", [2, 3])
def test_unpack_add_bitwise(backend, out_dtype, value_dtype, rows):
    ops, device = backend
    n, k = 1000, 300
    for real_zero in (False, True):
        indices, values = _gathered(rows, k, n, value_dtype, seed=rows, pad_row=rows - 1, real_zero=real_zero)
        start = torch.randn(n).to(out_dtype)
        # -0.0 where only padding lands (becomes +0.0), where a real -0.0 lands (stays -0.0),
        # where a real +0.0 lands (becomes +0.0) and where a nonzero value lands.
        start[0] = -0.0
        start[indices[0, 2:6].long()] = -0.0
        for zero_out in (True, False):
            out = start.clone().to(device)
            ops.unpack_add(indices.to(device), values.to(device), out, zero_out)
            expected = start.clone()
            reference.unpack_add(indices, values, expected, zero_out)
            _assert_same(out, expected, f"unpack_add zero_out={zero_out} real_zero={real_zero}")
            if not zero_out and not real_zero:
                assert expected[0].item() == 0 and not torch.signbit(expected[0])


def test_unpack_add_strided_device_views(backend):
    """Row views of one gathered device buffer (the all-gather output) are read in place."""
    ops, device = backend
    indices, values = _gathered(3, 50, 200, torch.bfloat16, seed=7)
    buffer = indices.untyped_storage()
    gathered = torch.empty(0, dtype=torch.uint8).set_(buffer).to(device)
    row_bytes = indices.stride(0) * 4
    rows = gathered.view(3, row_bytes)
    dev_indices = rows[:, : 4 * 50].view(torch.int32)
    dev_values = rows[:, 4 * 50: 4 * 50 + 100].view(torch.bfloat16)
    out = torch.empty(200, dtype=torch.float32, device=device)
    ops.unpack_add(dev_indices, dev_values, out)
    expected = torch.empty(200)
    reference.unpack_add(indices, values, expected)
    _assert_same(out, expected)


# --------------------------------------------------------------------------- GPU compilation without a GPU

def _sm90_specs(ops):
    """(kernel, signature types, constexprs, num_warps): one variant per kernel, bf16 grad and
    fp16 wire (saturation, integer bf16 rounding), the others with fp32 / fp16."""
    radix = _radix(ops)
    topk = ops.ef_topk_pack.__globals__
    unpack = ops.unpack_add.__globals__
    i32, f32 = "i32", "fp32"
    ef = dict(n=i32, divisor=f32, tiles=i32)
    return [
        (radix.hist1_kernel, dict(g_ptr="*bf16", r_ptr="*bf16", hist_ptr="*i32", **ef),
         dict(FROM_SRC=False, ADD_RESIDUAL=True, WRITE_RESIDUAL=True, BLOCK=4096), 8),
        (radix.hist_refine_kernel, dict(g_ptr="*fp16", src_ptr="*fp16", state_ptr="*i32", hist_ptr="*i32",
                                        blockhist_ptr="*i32", blockgt_ptr="*i32", **ef),
         dict(LEVEL=2, FROM_SRC=False, SKIP_IF_DONE=True, PER_BLOCK=False, BLOCK=4096), 8),
        (radix.hist_refine_kernel, dict(g_ptr="*bf16", src_ptr="*bf16", state_ptr="*i32", hist_ptr="*i32",
                                        blockhist_ptr="*i32", blockgt_ptr="*i32", **ef),
         dict(LEVEL=3, FROM_SRC=True, SKIP_IF_DONE=False, PER_BLOCK=True, BLOCK=4096), 8),
        *[(radix.select_kernel, dict(hist_ptr="*i32", state_ptr="*i32", k=i32), dict(LEVEL=level), 8)
          for level in (1, 2, 3)],
        (topk["_block_counts_kernel"], dict(state_ptr="*i32", blockhist_ptr="*i32", blockgt_ptr="*i32",
                                            counts_ptr="*i32", nprog=i32), {}, 1),
        (topk["_emit_kernel"], dict(g_ptr="*bf16", src_ptr="*bf16", state_ptr="*i32", counts_ptr="*i32",
                                    incl_ptr="*i32", idx_out_ptr="*i32", val_out_ptr="*fp16", n=i32, k=i32,
                                    divisor=f32, index_offset=i32, tiles=i32, nprog=i32),
         dict(FROM_SRC=True, WRITE_RESIDUAL=True, LIMIT=65504.0, BLOCK=4096), 8),
        (unpack["_add_row_kernel"], dict(idx_ptr="*i32", val_ptr="*bf16", out_ptr="*fp16", k=i32, n=i32),
         dict(BLOCK=1024), 4),
        (unpack["_plus_zero_kernel"], dict(idx_ptr="*i32", val_ptr="*fp32", out_ptr="*bf16", k=i32, n=i32,
                                           idx_row_stride=i32, val_row_stride=i32), dict(BLOCK=1024), 4),
    ]


def test_kernels_compile_for_sm90_without_a_gpu():
    """Every kernel goes through Triton's whole CUDA pipeline (TTIR, TTGIR, LLVM, PTX, ptxas
    cubin) for sm_90, so a GPU-only compile error shows up on CPU-only machines too."""
    import triton
    from triton.compiler import ASTSource

    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as error:  # pragma: no cover - a Triton without the NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend is unavailable: {error}")
    ops = _fresh_backend(interpret=False)
    target = GPUTarget("cuda", 90, 32)
    for kernel, types, constexprs, num_warps in _sm90_specs(ops):
        signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
        assert set(signature) == set(types) | set(constexprs), (kernel.__name__, signature)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                                  options={"num_warps": num_warps, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert "div.full" not in ptx and "div.approx" not in ptx, f"{kernel.__name__}: inexact division"
        assert ".ftz" not in ptx, f"{kernel.__name__}: flushes subnormals"


# --------------------------------------------------------------------------- no host synchronisation

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)")
def test_no_host_synchronisation_on_cuda():
    ops = _fresh_backend(interpret=False)
    device = torch.device("cuda")
    n, k = 100_000, 1000
    grad = torch.randn(n, device=device)
    residual = torch.zeros(n, device=device)
    idx = torch.empty(k, dtype=torch.int32, device=device)
    val = torch.empty(k, dtype=torch.bfloat16, device=device)
    # Warm up (compilation and the first launches may synchronise).
    ops.ef_topk_pack(grad, residual, 3, True, k, idx, val)
    ops.unpack_add(idx.view(1, k), val.view(1, k), grad.clone())
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.ef_topk_pack(grad, residual, 3, True, k, idx, val)
        ops.unpack_add(torch.stack([idx, idx]), torch.stack([val, val]), grad.clone(), True)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def test_import_without_triton_is_harmless(monkeypatch):
    """Without triton, importing works, available() says why, and calling raises ImportError."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    saved = {name: sys.modules.pop(name) for name in list(sys.modules)
             if name == _PKG or name.startswith(_PKG + ".")}
    saved_attr = sparsecomm.ops.__dict__.get("triton", _MISSING)
    try:
        module = importlib.import_module(_PKG)
        usable, reason = module.available()
        assert not usable and "triton" in reason
        with pytest.raises(ImportError, match="triton"):
            module.ef_topk_pack(torch.zeros(3), None, 1, False, 1, torch.empty(1, dtype=torch.int32),
                                torch.empty(1))
    finally:
        for name in [name for name in sys.modules if name == _PKG or name.startswith(_PKG + ".")]:
            del sys.modules[name]
        sys.modules.update(saved)
        if saved_attr is _MISSING:
            sparsecomm.ops.__dict__.pop("triton", None)
        else:
            sparsecomm.ops.triton = saved_attr
