"""CUDA kernels of the extension (``csrc/cuda/*.cu``) against the pure-torch oracle.

Every op runs as ``torch.ops.sparsecomm.<op>`` on CUDA tensors and is compared with
:mod:`sparsecomm.ops.reference` run on CPU copies of the inputs, so the oracle shares no
CUDA code path with the kernels (note that torch's CUDA ``tensor.div(python_scalar)``
multiplies by the reciprocal; the contract, torch on CPU and the kernels divide).
Comparisons are bitwise and NaN-aware for sent values (any NaN matches any NaN: GPU
arithmetic returns a canonical NaN, CPU arithmetic propagates payloads). Residuals never
hold NaN (a non-finite acc leaves +0, csrc/README.md): they are compared bit for bit with
no NaN allowed, and checked against the rule itself (kernel_cases.check_non_finite_rule).

The selected set must be exactly the oracle's (ties at the k-th magnitude: lowest indices);
the order inside a payload is unspecified, so payloads are compared after sorting by index.

NaN keys: the oracle's ``magnitude_key`` takes ``x.float()``, and torch's CPU half -> float
cast turns the same fp16 NaN into 0x7FC00000 in its vectorised loop but 0x7FFFFFFF in its
scalar tail loop (the last n % 16 entries of each thread's chunk), so on CPU fp16 NaNs are
ranked by position, not by index. On the GPU all NaNs of one tensor have one key (GPU
arithmetic returns one canonical NaN; the test data has a single NaN payload), so ties
among NaNs go to the lowest indices as the contract says. The tests give every NaN the key
0x7FFFFFFF in the oracle (an autouse fixture); that changes only the order among NaNs.

Skipped, with the reason, when there is no GPU or the extension has no CUDA kernels.
"""
import pytest
import torch

from sparsecomm.compress.packing import pack_into, payload_nbytes
from kernel_cases import (FP16_SATURATION, NARROW_WIRE_PAIRS, beyond_wire_range, check_fp16_saturation,
                          check_non_finite_rule, fp16_saturation_grad, topk_non_finite_cases, with_non_finite)
from sparsecomm.ops import payload_views, reference

OPS = ("ef_topk_pack", "unpack_add")  # ef_threshold_pack has a CPU kernel only (its caller runs on CPU)


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    try:
        import sparsecomm._C  # noqa: F401  (registers torch.ops.sparsecomm.*)
    except ImportError as error:
        return (f"sparsecomm._C cannot be imported ({error}); build it with "
                "USE_CUDA=1 SPARSECOMM_BUILD_EXT=1 pip install --no-build-isolation -e .")
    missing = []
    for op in OPS:
        try:
            present = torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsecomm::{op}", "CUDA")
        except RuntimeError:
            present = False
        if not present:
            missing.append(op)
    if missing:
        return f"sparsecomm._C has no CUDA kernel for {', '.join(missing)} (built without CUDA sources)"
    return None


_SKIP_REASON = _unavailable()
if _SKIP_REASON is not None:  # one skip for the module, not one per parametrised case
    pytest.skip(_SKIP_REASON, allow_module_level=True)

CUDA = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOAT_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
BIG = 2**24 + 1
# (divisor, add_residual, residual given, index_offset): the error-feedback variants.
EF_VARIANTS = [(1.0, True, True, 0), (3.0, True, True, 11), (3.0, False, True, 0), (3.0, False, False, 7)]


_ORACLE_MAGNITUDE_KEY = reference.magnitude_key


def _canonical_magnitude_key(x):
    """The oracle's key with one key for every NaN (see the module docstring)."""
    key = _ORACLE_MAGNITUDE_KEY(x)
    return torch.where(torch.isnan(x), torch.full_like(key, 0x7FFFFFFF), key)


@pytest.fixture(autouse=True)
def _canonical_nan_keys(monkeypatch):
    monkeypatch.setattr(reference, "magnitude_key", _canonical_magnitude_key)


def _ids(value):
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else str(value)


def _ops():
    return torch.ops.sparsecomm


def _assert_same(actual, expected, what="", nan_ok=True):
    """Bitwise equality on CPU; floating NaNs match any NaN, unless ``nan_ok`` is False (then any NaN fails)."""
    actual, expected = actual.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), f"{what}: differ at {torch.nonzero(actual != expected)[:10].flatten()}"
        return
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    if not nan_ok:
        assert not bool(nan_a.any()) and not bool(nan_e.any()), \
            f"{what}: NaN at {torch.nonzero(nan_a | nan_e)[:10].flatten()} (not allowed here)"
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ at {torch.nonzero(nan_a != nan_e)[:10].flatten()}"
    bits = FLOAT_BITS[actual.dtype]
    a, e = actual[~nan_a].view(bits), expected[~nan_e].view(bits)
    bad = torch.nonzero(a != e).flatten()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} values differ, first at {bad[:5].tolist()}: "
                              f"{actual[~nan_a][bad[:5]].tolist()} vs {expected[~nan_e][bad[:5]].tolist()}")


def _data(n, dtype, seed, kind="randn"):
    """(grad, residual) on CPU in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "randn":
        grad = torch.randn(n, generator=gen)
        residual = torch.randn(n, generator=gen) * 0.1
    elif kind == "ties":  # few distinct magnitudes, so the k-th is tied; the residual keeps them discrete
        grad = torch.randint(-4, 5, (n,), generator=gen) * 0.25
        residual = torch.randint(-2, 3, (n,), generator=gen) * 0.125
    elif kind == "equal":  # one magnitude everywhere
        grad = torch.full((n,), 0.5)
        residual = torch.full((n,), 0.25)
    elif kind == "zeros":  # mostly exact zeros (embedding-like gradients), residual zero
        grad = torch.randn(n, generator=gen)
        grad[torch.rand(n, generator=gen) < 0.9] = 0.0
        residual = torch.zeros(n)
    elif kind == "special":  # NaN, +-Inf, signed zeros, large finite (no saturation), tiny
        grad = torch.randn(n, generator=gen)
        grad[5::17] = float("inf")
        grad[9::17] = -float("inf")
        grad[3::19] = -0.0
        grad[7::23] = 0.0
        grad[11::29] = 6.0e4
        grad[13::31] = -1.0e-30
        grad[1::13] = float("nan")
        residual = torch.randn(n, generator=gen) * 0.1
    else:
        raise ValueError(kind)
    return grad.to(dtype), residual.to(dtype)


def _k_values(n):
    return sorted({1, max(1, n // 100), n})


# --------------------------------------------------------------------------- ef_topk_pack

def _run_topk(grad, residual, divisor, add_residual, k, wire_dtype, offset):
    """The CUDA op on device copies; returns (indices[:k], values[:k], residual) on CPU."""
    g = grad.to(CUDA, copy=True)
    r = residual.to(CUDA, copy=True) if residual is not None else None
    extra = 5
    idx = torch.full((k + extra,), -7, dtype=torch.int32, device=CUDA)
    val = torch.full((k + extra,), 123.0, dtype=wire_dtype, device=CUDA)
    _ops().ef_topk_pack(g, r, float(divisor), add_residual, k, idx, val, offset)
    _assert_same(g, grad, "grad must not be modified")
    assert bool((idx[k:] == -7).all()) and bool((val[k:] == 123.0).all()), "wrote beyond k"
    return idx[:k].cpu(), val[:k].cpu(), (r.cpu() if r is not None else None)


def _check_topk(grad, residual, divisor, add_residual, k, wire_dtype, offset=0):
    """CUDA op == oracle (set, values, residual) and sent + residual == acc."""
    ridx = torch.full((k,), -1, dtype=torch.int32)
    rval = torch.zeros(k, dtype=wire_dtype)
    rres = residual.clone() if residual is not None else None
    reference.ef_topk_pack(grad.clone(), rres, divisor, add_residual, k, ridx, rval, offset)
    idx, val, res = _run_topk(grad, residual, divisor, add_residual, k, wire_dtype, offset)
    order = torch.argsort(idx.long())
    _assert_same(idx[order], ridx, "indices (sorted)")  # the reference emits ascending indices
    _assert_same(val[order], rval, "values (by index)")
    if residual is not None:
        _assert_same(res, rres, "residual", nan_ok=False)
        # sent + residual == acc where acc is finite; +0 where it is not (sent or not).
        check_non_finite_rule(reference.compensated(grad, residual, divisor, add_residual), idx.long() - offset,
                              val, res)
    return idx, val


def _topk_cases():
    cases = []
    for n in (1, 7, 1000, 2**16 + 3):
        for k in _k_values(n):
            for kind in ("randn", "ties", "special"):
                cases.append((n, k, kind))
    return cases


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("wire_dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("n,k,kind", _topk_cases(), ids=lambda v: _ids(v))
def test_ef_topk_pack_matches_reference(grad_dtype, wire_dtype, n, k, kind):
    grad, residual = _data(n, grad_dtype, seed=n + k, kind=kind)
    for divisor, add_residual, has_residual, offset in EF_VARIANTS:
        _check_topk(grad, residual if has_residual else None, divisor, add_residual, k, wire_dtype, offset)


@pytest.mark.parametrize("grad_dtype,wire_dtype,kind,fraction", [
    (torch.float32, torch.float32, "randn", 0.01),     # candidate path
    (torch.bfloat16, torch.float16, "randn", 0.01),
    (torch.float16, torch.bfloat16, "special", 0.01),
    (torch.float32, torch.bfloat16, "ties", 0.01),     # candidate path, ties resolved by index levels
    (torch.float32, torch.float32, "equal", 0.01),     # boundary bin > candidate capacity: full path
    (torch.float32, torch.float16, "zeros", 0.2),      # the k-th is a zero: full path, index levels
    (torch.float32, torch.float32, "randn", 1.0),      # k == n
], ids=_ids)
def test_ef_topk_pack_large(grad_dtype, wire_dtype, kind, fraction):
    grad, residual = _data(BIG, grad_dtype, seed=1, kind=kind)
    k = max(1, int(BIG * fraction)) if fraction < 1 else BIG
    _check_topk(grad, residual, 3.0, True, k, wire_dtype)


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=_ids)
def test_ef_topk_pack_ties_take_lowest_indices(grad_dtype):
    n = 5000
    grad = torch.ones(n, dtype=grad_dtype)
    grad[4000] = 2.0  # one above the ties
    for k in (1, 2, 3, 37, 4096, 4097, n - 1):
        idx, _ = _check_topk(grad, torch.zeros_like(grad), 1.0, True, k, grad_dtype)
        expected = sorted([4000] + [i for i in range(n) if i != 4000][: k - 1])
        assert sorted(idx.tolist()) == expected


@pytest.mark.parametrize("grad_dtype,wire_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
                         ids=_ids)
def test_ef_topk_pack_nan_inf_selected_first(grad_dtype, wire_dtype):
    grad = torch.randn(3000).to(grad_dtype)
    grad[[10, 500, 2999]] = float("nan")
    grad[[3, 1500]] = float("inf")
    grad[7] = -float("inf")
    idx, _ = _check_topk(grad, torch.zeros_like(grad), 1.0, True, 6, wire_dtype)
    assert sorted(idx.tolist()) == [3, 7, 10, 500, 1500, 2999]
    idx, _ = _check_topk(grad, torch.zeros_like(grad), 1.0, True, 2, wire_dtype)
    assert sorted(idx.tolist()) == [10, 500]  # NaN above Inf; ties: lowest indices


# All NaN over 2^20 + 3 entries: the boundary bin holds more than the candidate list (2^20),
# so the full mode runs; 10,007 entries stay in candidate mode.
NON_FINITE_SIZES = [pytest.param(10_007, id="candidates"), pytest.param(2**20 + 3, id="full-if-all-nan")]


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("wire_dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("n", NON_FINITE_SIZES)
def test_ef_topk_pack_non_finite_acc_leaves_zero_residual(grad_dtype, wire_dtype, n):
    """Inf/NaN are sent first and unchanged and leave +0 in the residual, sent or not (more
    of them than k: the unsent ones are candidates the final pass does not select)."""
    for name, count, k in topk_non_finite_cases(n):
        grad = with_non_finite(n, grad_dtype, count, seed=count)
        residual = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1).to(grad_dtype)
        idx, _ = _check_topk(grad, residual, 3.0, True, k, wire_dtype, offset=5)
        acc = reference.compensated(grad, residual, 3.0, True)
        sent_non_finite = int((~torch.isfinite(acc[idx.long() - 5])).sum())
        assert sent_non_finite == min(k, int((~torch.isfinite(acc)).sum())), name


@pytest.mark.parametrize("grad_dtype,wire_dtype", NARROW_WIRE_PAIRS, ids=_ids)
def test_ef_topk_pack_saturates_on_narrow_wire(grad_dtype, wire_dtype):
    """Finite values beyond the wire's range saturate (bf16 -> fp16: in float), not to Inf."""
    grad, k = beyond_wire_range(grad_dtype)
    _, val = _check_topk(grad, torch.zeros_like(grad), 1.0, True, k, wire_dtype)
    limit = torch.finfo(wire_dtype).max
    wide = val.float()
    finite = torch.isfinite(wide)
    assert bool((wide[finite].abs() <= limit).all())
    assert int(torch.isinf(wide).sum()) == 4 and int(torch.isnan(wide).sum()) == 2


@pytest.mark.parametrize("dtype", list(FP16_SATURATION), ids=_ids)
def test_ef_topk_pack_fp16_saturation_conserves_every_finite_acc(dtype):
    """kernel_cases.FP16_SATURATION: each acc goes out as its hand-worked value, and sent +
    residual == acc up to float32's largest."""
    acc, k = fp16_saturation_grad(dtype)
    check_fp16_saturation(acc, *_run_topk(acc, torch.zeros_like(acc), 1.0, True, k, torch.float16, 0))


def test_ef_topk_pack_payload_is_deterministic():
    grad, residual = _data(300_000, torch.float32, seed=3, kind="ties")
    payloads = []
    for _ in range(2):
        idx, val, _ = _run_topk(grad, residual.clone(), 3.0, True, 3000, torch.float32, 0)
        payloads.append((idx, val))
    _assert_same(payloads[0][0], payloads[1][0], "indices, run to run")
    _assert_same(payloads[0][1], payloads[1][1], "values, run to run")


def test_ef_topk_pack_rejects_bad_arguments():
    grad = torch.randn(100, device=CUDA)
    residual = torch.zeros_like(grad)
    idx = torch.zeros(10, dtype=torch.int32, device=CUDA)
    val = torch.zeros(10, device=CUDA)
    op = _ops().ef_topk_pack
    with pytest.raises(RuntimeError, match="k must be"):
        op(grad, residual, 1.0, True, 0, idx, val, 0)
    with pytest.raises(RuntimeError, match="k must be"):
        op(grad, residual, 1.0, True, 101, idx, val, 0)
    with pytest.raises(RuntimeError, match="indices_out"):
        op(grad, residual, 1.0, True, 11, idx, val, 0)
    with pytest.raises(RuntimeError, match="needs a residual"):
        op(grad, None, 1.0, True, 5, idx, val, 0)
    with pytest.raises(RuntimeError, match="alias|overlap"):
        op(grad, grad, 1.0, True, 5, idx, val, 0)
    with pytest.raises(RuntimeError, match="int32"):
        op(grad, residual, 1.0, True, 5, idx.long(), val, 0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        op(grad.double(), None, 1.0, False, 5, idx, val, 0)
    with pytest.raises(RuntimeError, match="contiguous 1-D"):
        op(grad.view(10, 10), None, 1.0, False, 5, idx, val, 0)
    with pytest.raises(RuntimeError, match="index_offset"):
        op(grad, residual, 1.0, True, 5, idx, val, 2**31 - 50)


# --------------------------------------------------------------------------- unpack_add

def _gathered(rows, k, n, value_dtype, seed, pad_row=None, real_zero=False):
    """[rows, k] strided views into one all-gather-like byte buffer (sparsecomm.ops.payload_views)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = payload_nbytes(k, value_dtype)
    buffer = torch.zeros(rows * nbytes, dtype=torch.uint8)
    for r in range(rows):
        indices = 1 + torch.randperm(n - 1, generator=gen)[:k]
        values = torch.randn(k, generator=gen).to(value_dtype)
        if r == 0:
            values[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0]).to(value_dtype)
        if r == pad_row:  # threshold payload: (index 0, value +0) padding, repeated
            indices[k // 2:] = 0
            values[k // 2:] = 0
            if real_zero:  # and one real entry at index 0, which a racy update would lose
                indices[1] = 0
                values[1] = 1.5
        pack_into(buffer[r * nbytes:(r + 1) * nbytes], indices, values, k)
    return buffer


@pytest.mark.parametrize("out_dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("value_dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_unpack_add_matches_reference(out_dtype, value_dtype, rows):
    n, k = 1000, 300
    for real_zero in (False, True):
        buffer = _gathered(rows, k, n, value_dtype, seed=rows, pad_row=rows - 1, real_zero=real_zero)
        indices, values = payload_views(buffer, k, value_dtype)
        d_indices, d_values = payload_views(buffer.to(CUDA), k, value_dtype)
        assert d_indices.stride(0) * 4 == payload_nbytes(k, value_dtype) or rows == 1
        start = torch.randn(n).to(out_dtype)
        start[0] = -0.0  # only padding lands here: becomes +0.0 (unless the real entry does)
        start[indices[0, 2:6].long()] = -0.0
        for zero_out in (True, False):
            out = start.clone().to(CUDA)
            _ops().unpack_add(d_indices, d_values, out, zero_out)
            expected = start.clone()
            reference.unpack_add(indices, values, expected, zero_out)
            _assert_same(out, expected, f"unpack_add zero_out={zero_out} real_zero={real_zero}")


def test_unpack_add_large():
    n, k, rows = BIG, BIG // 100, 4
    gen = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)]).int()
    values = torch.randn(rows, k, generator=gen)
    out = torch.empty(n, device=CUDA)
    _ops().unpack_add(indices.to(CUDA), values.to(CUDA), out, True)
    expected = torch.empty(n)
    reference.unpack_add(indices, values, expected, True)
    _assert_same(out, expected, "unpack_add large")


# --------------------------------------------------------------------------- no host synchronisation

def _all_ops(grad, residual, indices, values, out, payload_idx, payload_val):
    k = indices.numel()
    _ops().ef_topk_pack(grad, residual, 3.0, True, k, indices, values, 0)
    _ops().unpack_add(payload_idx, payload_val, out, True)


def _sync_inputs(n=1 << 20, k=10_000, rows=3):
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).to(CUDA)
    residual = (torch.randn(n, generator=gen) * 0.1).to(CUDA)
    indices = torch.empty(k, dtype=torch.int32, device=CUDA)
    values = torch.empty(k, device=CUDA)
    out = torch.empty(n, device=CUDA)
    payload_idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)]).int().to(CUDA)
    payload_val = torch.randn(rows, k, generator=gen).to(CUDA)
    return grad, residual, indices, values, out, payload_idx, payload_val


def test_no_host_synchronisation():
    """torch's sync debug mode raises on any synchronising CUDA call made through c10."""
    inputs = _sync_inputs()
    _all_ops(*inputs)  # first call: lazy initialisation outside the checked region
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _all_ops(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def test_ops_capture_in_a_cuda_graph():
    """Stream capture fails on any host synchronisation or host read-back; replays must be exact."""
    grad, residual, indices, values, out, payload_idx, payload_val = _sync_inputs()
    start_residual = residual.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _all_ops(grad, residual, indices, values, out, payload_idx, payload_val)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k = indices.numel()
        _ops().ef_topk_pack(grad, residual, 3.0, True, k, indices, values, 0)
        _ops().unpack_add(payload_idx, payload_val, out, True)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        new_grad = torch.randn(grad.numel(), generator=gen)
        grad.copy_(new_grad)
        residual.copy_(start_residual)
        graph.replay()
        torch.cuda.synchronize()
        ridx = torch.empty(k, dtype=torch.int32)
        rval = torch.empty(k)
        rres = start_residual.cpu()
        reference.ef_topk_pack(new_grad, rres, 3.0, True, k, ridx, rval, 0)
        order = torch.argsort(indices.cpu().long())
        _assert_same(indices.cpu()[order], ridx, "graph replay: indices")
        _assert_same(values.cpu()[order], rval, "graph replay: values")
        _assert_same(residual, rres, "graph replay: residual")


# --------------------------------------------------------------------------- chunk_encode / chunk_decode_add
#
# selector="chunk" (csrc/cuda/chunk_encode.cu, chunk_decode_add.cu) against the reference
# (ChunkLayout.encode of the compensated acc; ChunkLayout.views + index_add_ per row) on CPU
# copies. Bitwise, except NaN bits: GPU arithmetic makes every NaN acc the canonical NaN,
# x86 keeps the operand's, so the fp32 / fp16 codes of a NaN and the decoded NaN values may
# differ in their bits (not in where they are). Everything else is compared byte for byte:
# the scales, the index region, the codes of the scaled codecs, the zero padding, indices,
# residual (never NaN).

from sparsecomm.compress.chunk_layout import ChunkLayout  # noqa: E402
from sparsecomm.compress.index_codecs import INDEX_CODECS  # noqa: E402
from sparsecomm.compress.value_codecs import FLOAT_CODECS, VALUE_CODECS  # noqa: E402

CHUNK_OPS = ("chunk_encode", "chunk_decode_add")
_CHUNK_MISSING = [op for op in CHUNK_OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsecomm::{op}",
                                                                                               "CUDA")]
needs_chunk_kernels = pytest.mark.skipif(bool(_CHUNK_MISSING),
                                         reason=f"sparsecomm._C has no CUDA kernel for {_CHUNK_MISSING}")

# (numel, chunk_size, density): partial last chunks with k_last < k_full, 4096-chunks (shared
# memory path), chunks above 8192 entries (acc re-read from global memory), k = 1, tiny
# chunks, everything sent, k beyond one emit tile (2048), one chunk of one entry.
CHUNK_GEOMETRIES = [
    (10_003, 4096, 0.01),   # 3 chunks, the last of 1811 entries: k_last 19 < k_full 41
    (10_003, 4096, 1e-5),   # k = 1 everywhere
    (70_001, 65_536, 0.001),  # the largest chunk (not cached), last chunk 4465 entries
    (30_000, 12_288, 0.2),  # not cached, k > one emit tile
    (5000, 4096, 0.5),      # k = 2048: a whole emit tile of ties and selections
    (1003, 64, 0.1),
    (300, 7, 0.5),          # chunks shorter than a warp; 3-bit chunk indices
    (64, 16, 1.0),          # everything sent
    (1, 2, 0.5),
]
CHUNK_PAIRS = [(i, v) for i in INDEX_CODECS for v in VALUE_CODECS]
# (divisor, add_residual, residual given)
CHUNK_EF = [(3.0, True, True), (1.0, False, True), (2.0, False, False)]


def _chunk_data(n: int, seed: int, nonfinite: bool) -> torch.Tensor:
    """randn with zeros, exact ties, subnormals (tests/test_kernels_chunk.py), optionally NaN/+-Inf."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator)
    draw = torch.rand(n, generator=generator)
    x[draw < 0.05] = 0.0
    x[(draw >= 0.05) & (draw < 0.07)] = 1.5
    x[(draw >= 0.07) & (draw < 0.08)] = -1.5
    x[(draw >= 0.08) & (draw < 0.09)] = 1e-40
    x[(draw >= 0.09) & (draw < 0.095)] = -3e-42
    if n >= 4200:
        x[4096:4200] = 0.0
    if nonfinite and n >= 8:
        x[[1, n // 2, n // 3, n - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan")])
    return x


def _chunk_args(layout):
    g = layout.geometry
    return (layout.chunk_size, g.k_full, g.k_last, INDEX_CODECS.index(layout.index_codec),
            VALUE_CODECS.index(layout.value_codec), layout.scale_group)


def _encode_reference(layout, grad, residual, divisor, add_residual):
    r = None if residual is None else residual.clone()
    payload = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    indices, decoded = reference.chunk_encode(grad.clone(), r, divisor, add_residual, layout, payload)
    return payload, indices, decoded, r


def _encode_cuda(layout, grad, residual, divisor, add_residual, payload_offset=0):
    """The CUDA op on device copies (the payload a view at ``payload_offset`` bytes into a
    garbage-filled buffer); returns CPU copies (payload, indices, decoded, residual)."""
    g = grad.to(CUDA, copy=True)
    r = None if residual is None else residual.to(CUDA, copy=True)
    buffer = torch.full((layout.nbytes + payload_offset + 8,), 0xAB, dtype=torch.uint8, device=CUDA)
    payload = buffer[payload_offset : payload_offset + layout.nbytes]
    indices, decoded = _ops().chunk_encode(g, r, float(divisor), add_residual, *_chunk_args(layout), payload)
    _assert_same(g, grad, "grad must not be modified")
    assert bool((buffer[:payload_offset] == 0xAB).all()) and bool((buffer[payload_offset + layout.nbytes:] == 0xAB).all()), \
        "wrote outside the payload"
    assert indices.device.type == "cuda" and decoded.device.type == "cuda"
    return payload.cpu(), indices.cpu(), decoded.cpu(), None if r is None else r.cpu()


def _assert_same_payload(layout, got, want, what):
    """Byte for byte, but for the bits of NaN codes of the float codecs (compared as values)."""
    value_start = layout.scale_bytes + layout.index_bytes
    value_end = value_start + layout.value_bytes
    _assert_same(got[:value_start], want[:value_start], f"{what}: scales and index region")
    _assert_same(got[value_end:], want[value_end:], f"{what}: zero padding")
    if layout.value_codec in FLOAT_CODECS:
        dtype = FLOAT_CODECS[layout.value_codec]
        _assert_same(got[value_start:value_end].clone().view(dtype), want[value_start:value_end].clone().view(dtype),
                     f"{what}: values")
    else:
        _assert_same(got[value_start:value_end], want[value_start:value_end], f"{what}: value codes")


def _check_chunk_encode(layout, grad, residual, divisor, add_residual, payload_offset=0, want=None):
    want = want if want is not None else _encode_reference(layout, grad, residual, divisor, add_residual)
    got = _encode_cuda(layout, grad, residual, divisor, add_residual, payload_offset)
    (p1, i1, d1, r1), (p2, i2, d2, r2) = got, want
    _assert_same_payload(layout, p1, p2, "payload")
    _assert_same(i1, i2, "indices")
    _assert_same(d1, d2, "decoded values")
    assert (r1 is None) == (r2 is None)
    if r1 is not None:
        _assert_same(r1, r2, "residual", nan_ok=False)
    return got, want


def _check_chunk_decode_add(layout, gathered, start, zero_out):
    want = start.clone()
    reference.chunk_decode_add(gathered, layout, want, zero_out)
    got = start.to(CUDA, copy=True)
    _ops().chunk_decode_add(gathered.to(CUDA), *_chunk_args(layout), got, zero_out)
    _assert_same(got, want, f"chunk_decode_add zero_out={zero_out}")


@needs_chunk_kernels
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("geometry", CHUNK_GEOMETRIES, ids=lambda g: "n={}-c={}-d={}".format(*g))
@pytest.mark.parametrize("index_codec,value_codec", CHUNK_PAIRS)
def test_chunk_encode_and_decode_add_match_the_reference(index_codec, value_codec, geometry, nonfinite):
    n, chunk_size, density = geometry
    layout = ChunkLayout(n, chunk_size, density, index_codec, value_codec)
    grad = _chunk_data(n, seed=n, nonfinite=nonfinite)
    residual = _chunk_data(n, seed=n + 1, nonfinite=False) * 0.1
    payloads, device_payloads = [], []
    for divisor, add_residual, has_residual in CHUNK_EF:
        got, want = _check_chunk_encode(layout, grad, residual if has_residual else None, divisor, add_residual)
        payloads.append(want[0])
        device_payloads.append(got[0])
    # Three ranks with different selections, several rows added in rank order, onto zeros or
    # onto what the bucket holds.
    for rows in (payloads, device_payloads):
        gathered = torch.cat(rows)
        for zero_out in (True, False):
            _check_chunk_decode_add(layout, gathered, torch.randn(n + 1)[1:], zero_out)
    _check_chunk_decode_add(layout, payloads[0], torch.randn(n), False)  # one row


@needs_chunk_kernels
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_codec,value_codec", [("rice", "fp32"), ("chunk", "bf16"), ("int32", "fp16"),
                                                     ("rice", "int4"), ("chunk", "sign")])
def test_chunk_decode_add_into_16_bit_buckets(index_codec, value_codec, out_dtype):
    layout = ChunkLayout(10_003, 4096, 0.01, index_codec, value_codec)
    rows = []
    for seed in range(3):
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(_chunk_data(10_003, seed, False) * 100, None, 1.0, False, layout, payload)
        rows.append(payload)
    gathered = torch.cat(rows)
    for zero_out in (True, False):
        _check_chunk_decode_add(layout, gathered, torch.randn(10_003).to(out_dtype), zero_out)


@needs_chunk_kernels
@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("chunk", "fp32"), ("int32", "sign")])
@pytest.mark.parametrize("payload_offset", [1, 2, 3])
def test_chunk_encode_into_an_unaligned_payload(index_codec, value_codec, payload_offset):
    """A payload view at an odd byte offset (not 4-byte aligned): encoded through an aligned
    scratch buffer, nothing written outside the view."""
    layout = ChunkLayout(10_003, 4096, 0.01, index_codec, value_codec)
    grad = _chunk_data(10_003, 5, True)
    _check_chunk_encode(layout, grad, grad * 0.25, 3.0, True, payload_offset=payload_offset)


@needs_chunk_kernels
def test_chunk_encode_fp16_saturation_conserves_every_finite_acc():
    """kernel_cases.FP16_SATURATION's float32 accs (the kernel's dtype) on the fp16 value codec."""
    acc, k = fp16_saturation_grad(torch.float32)
    n = acc.numel()
    layout = ChunkLayout(n, n, k / n, "chunk", "fp16")
    _, indices, decoded, residual = _encode_cuda(layout, acc, torch.zeros(n), 1.0, True)
    check_fp16_saturation(acc, indices, decoded, residual)


@needs_chunk_kernels
def test_chunk_encode_ties_take_the_lowest_indices():
    layout = ChunkLayout(3 * 4096, 4096, 0.01, "chunk", "fp32")
    grad = torch.zeros(3 * 4096)
    grad[4096:8192] = -2.0  # one chunk all ties, one all zeros, one of two tie classes
    grad[8192::2] = 1.0
    grad[8193::2] = -1.0
    (_, indices, _, _), _ = _check_chunk_encode(layout, grad, None, 1.0, False)
    k = layout.geometry.k_full
    assert torch.equal(indices, torch.cat([torch.arange(k), 4096 + torch.arange(k), 8192 + torch.arange(k)]))


@needs_chunk_kernels
@pytest.mark.parametrize("value_codec", ["fp32", "int4", "sign", "fp8"])
@pytest.mark.parametrize("index_codec", INDEX_CODECS)
def test_chunk_encode_large(index_codec, value_codec):
    """2^24 + 1 entries (4097 chunks of 4096, the last of 1 entry): compared with the native
    CPU kernel (bit-identical to the reference, tests/test_kernels_chunk.py), which is faster."""
    from sparsecomm.ops import native

    layout = ChunkLayout(BIG, 4096, 0.01, index_codec, value_codec)
    grad, residual = _chunk_data(BIG, 7, True), _chunk_data(BIG, 8, False) * 0.1
    r = residual.clone()
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    indices, decoded = native.chunk_encode(grad, r, 3.0, True, layout, payload)
    got, _ = _check_chunk_encode(layout, grad, residual, 3.0, True, want=(payload, indices, decoded, r))
    gathered = torch.cat([payload, got[0], payload])
    want = torch.randn(BIG)
    out = want.to(CUDA, copy=True)
    native.chunk_decode_add(gathered, layout, want, False)
    _ops().chunk_decode_add(gathered.to(CUDA), *_chunk_args(layout), out, False)
    _assert_same(out, want, "chunk_decode_add large")


@needs_chunk_kernels
def test_chunk_encode_is_deterministic():
    layout = ChunkLayout(300_000, 4096, 0.01, "rice", "int4")
    grad, residual = _data(300_000, torch.float32, seed=3, kind="ties")
    first = _encode_cuda(layout, grad, residual, 3.0, True)
    second = _encode_cuda(layout, grad, residual, 3.0, True)
    for a, b, what in zip(first, second, ("payload", "indices", "decoded", "residual")):
        _assert_same(a, b, f"{what}, run to run")


@needs_chunk_kernels
def test_chunk_ops_reject_bad_arguments():
    layout = ChunkLayout(1000, 100, 0.1, "chunk", "int8")
    args = _chunk_args(layout)
    grad = torch.zeros(1000, device=CUDA)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=CUDA)
    encode, decode = _ops().chunk_encode, _ops().chunk_decode_add
    with pytest.raises(RuntimeError, match="payload must be"):
        encode(grad, None, 1.0, False, *args, payload[:-8])
    with pytest.raises(RuntimeError, match="float32"):
        encode(grad.half(), None, 1.0, False, *args, payload)
    with pytest.raises(RuntimeError, match="needs a residual"):
        encode(grad, None, 1.0, True, *args, payload)
    with pytest.raises(RuntimeError, match="may not alias"):
        encode(grad, grad, 1.0, True, *args, payload)
    with pytest.raises(RuntimeError, match="divisor"):
        encode(grad, None, 0.0, False, *args, payload)
    with pytest.raises(RuntimeError, match="value_codec"):
        encode(grad, None, 1.0, False, *args[:4], 8, payload)
    with pytest.raises(RuntimeError, match="k_full"):
        encode(grad, None, 1.0, False, 100, 101, 1, 1, 4, payload)
    with pytest.raises(RuntimeError, match="chunk_size"):
        encode(grad, None, 1.0, False, 1, 1, 1, 1, 4, payload)
    with pytest.raises(RuntimeError, match="device"):
        encode(grad, None, 1.0, False, *args, payload.cpu())
    with pytest.raises(RuntimeError, match="gathered must be"):
        decode(payload[:-1], *args, torch.zeros(1000, device=CUDA), True)
    with pytest.raises(RuntimeError, match="one device"):
        decode(payload.cpu(), *args, torch.zeros(1000, device=CUDA), True)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        decode(payload, *args, torch.zeros(1000, device=CUDA, dtype=torch.float64), True)


@needs_chunk_kernels
@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign"),
                                                     ("rice", "fp16")])
def test_chunk_ops_opcheck(index_codec, value_codec):
    layout = ChunkLayout(10_003, 4096, 0.01, index_codec, value_codec)
    args = _chunk_args(layout)
    # Finite data: opcheck compares the outputs of repeated runs, and NaN != NaN there.
    grad = _chunk_data(10_003, 0, False).to(CUDA)
    residual = _chunk_data(10_003, 1, False).to(CUDA)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=CUDA)
    encode_args = (grad, residual, 3.0, True, *args, payload)
    torch.library.opcheck(torch.ops.sparsecomm.chunk_encode.default, encode_args)
    torch.ops.sparsecomm.chunk_encode(*encode_args)
    gathered = torch.cat([payload, payload])
    torch.library.opcheck(torch.ops.sparsecomm.chunk_decode_add.default,
                          (gathered, *args, torch.zeros(10_003, device=CUDA), True))
    torch.library.opcheck(torch.ops.sparsecomm.chunk_decode_add.default,
                          (gathered, *args, torch.ones(10_003, device=CUDA, dtype=torch.bfloat16), False))


@needs_chunk_kernels
def test_chunk_ops_capture_in_a_cuda_graph():
    """No host synchronisation: the ops capture in a CUDA graph, and replays are exact."""
    n = 1 << 20
    layout = ChunkLayout(n, 4096, 0.01, "rice", "int4")
    args = _chunk_args(layout)
    gen = torch.Generator().manual_seed(0)
    start_residual = (torch.randn(n, generator=gen) * 0.1)
    grad = torch.randn(n, generator=gen).to(CUDA)
    residual = start_residual.to(CUDA)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=CUDA)
    gathered = torch.empty(2 * layout.nbytes, dtype=torch.uint8, device=CUDA)
    out = torch.empty(n, device=CUDA)

    def step():
        indices, decoded = _ops().chunk_encode(grad, residual, 3.0, True, *args, payload)
        gathered[: layout.nbytes].copy_(payload)
        gathered[layout.nbytes:].copy_(payload)
        _ops().chunk_decode_add(gathered, *args, out, True)
        return indices, decoded

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indices, decoded = step()
    for seed in (1, 2):
        new_grad = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        grad.copy_(new_grad)
        residual.copy_(start_residual)
        graph.replay()
        torch.cuda.synchronize()
        want_payload, want_indices, want_decoded, want_residual = _encode_reference(layout, new_grad, start_residual,
                                                                                    3.0, True)
        _assert_same(payload, want_payload, "graph replay: payload")
        _assert_same(indices, want_indices, "graph replay: indices")
        _assert_same(decoded, want_decoded, "graph replay: decoded")
        _assert_same(residual, want_residual, "graph replay: residual", nan_ok=False)
        want_out = torch.empty(n)
        reference.chunk_decode_add(torch.cat([want_payload, want_payload]), layout, want_out, True)
        _assert_same(out, want_out, "graph replay: decode_add")


@needs_chunk_kernels
def test_chunk_decode_add_of_a_corrupt_payload_trips_a_device_assert():
    """An index outside its chunk: the entry is skipped and a device assert fires (the CPU
    operator raises instead; on CUDA that would need a host synchronisation). In a
    subprocess: the assert leaves the CUDA context unusable."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        import sparsecomm._C  # noqa: F401
        from sparsecomm.compress.chunk_layout import ChunkLayout
        from sparsecomm.ops import reference
        layout = ChunkLayout(1000, 100, 0.1, "int32", "fp32")
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(torch.randn(1000), None, 1.0, False, layout, payload)
        payload[:4] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # index 2^31 - 1
        guard = torch.zeros(3000, device="cuda")
        out = guard[1000:2000]
        torch.ops.sparsecomm.chunk_decode_add(payload.cuda(), 100, 10, 10, 0, 0, 0, out, True)
        try:
            torch.cuda.synchronize()
        except RuntimeError as error:
            print("RAISED", "corrupt payload" in str(error) or "device-side assert" in str(error))
        else:
            print("NOT RAISED")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "RAISED True" in result.stdout, result.stdout + result.stderr[-3000:]
