"""``ef_topk_pack``: fused error feedback + exact top-k + packing, every implementation against
the pure-torch reference (sparsecomm/ops/reference.py, the oracle; implementations:
tests/kernel_implementations.py).

The selected set must be exactly the oracle's (ties at the k-th magnitude: lowest indices);
the order inside a payload is unspecified, so payloads are compared sorted by index. Sent
values are compared bitwise, NaN-aware (any NaN matches any NaN); residuals never hold NaN (a
non-finite acc leaves +0, csrc/README.md): they are compared bit for bit with no NaN allowed,
and checked against the rule itself (kernel_cases.check_non_finite_rule). Nothing is written
past the k-th slot of the outputs, and grad is not modified.

NaN keys on CUDA: the oracle's ``magnitude_key`` takes ``x.float()``, and torch's CPU half ->
float cast turns the same fp16 NaN into 0x7FC00000 in its vectorised loop but 0x7FFFFFFF in its
scalar tail loop (the last n % 16 entries of each thread's chunk), so on CPU fp16 NaNs are
ranked by position, not by index. On the GPU all NaNs of one tensor have one key (GPU
arithmetic returns one canonical NaN; the test data has a single NaN payload), so ties among
NaNs go to the lowest indices as the contract says. The CUDA tests give every NaN the key
0x7FFFFFFF in the oracle (:func:`_one_key_per_nan_on_cuda`); that changes only the order among
NaNs.

Triton sizes are small (the interpreter is slow): 1, 7, 1000, and ``MULTI``: 3 programs of the
default geometry, the last holding 3 entries (2051 interpreted, 8195 compiled); a few tests
force tiny blocks and a capped program count to exercise multi-program prefixes and tile
loops. The interpreter's time goes per launch, program and tile (a tile of 16 entries costs
about as much as one of 1024), not per element, so those tests use ``MANY`` = 117 entries in
blocks of 16: 3 programs of 3, 3 and 2 tiles, the last tile holding 5 entries.
"""
import contextlib

import pytest
import torch
from kernel_cases import (FP16_SATURATION, INF, NAN, NARROW_WIRE_PAIRS, beyond_wire_range, check_fp16_saturation,
                          check_non_finite_rule, ef_inputs, fp16_saturation_grad, topk_non_finite_cases,
                          with_non_finite)
from kernel_implementations import (CUDA, REFERENCE, CpuLevelTests, LevelCase,
                                    assert_no_host_synchronisation, assert_same, assert_triton_kernels_compile_for_sm90,
                                    capture_in_a_cuda_graph, dtype_id, implementation_cases, implementations)

from sparsecomm.ops import reference

OP = "ef_topk_pack"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = [(g, v) for g in DTYPES for v in DTYPES]
SAMPLED = 2**20 + 3  # buckets from 2^20 entries take the sampled one-pass strategy (csrc/cpu/sampled_candidates.h)
# A size resolved per Triton backend by _size: 3 programs of the default block, the last holding 3 entries.
MULTI = "multi"
# Entries for _small_programs: 8 tiles of 16 -> 3 programs of 3, 3, 2 tiles; the last tile holds 5.
MANY = 16 * 7 + 5
# (grad dtype, wire dtype) for Triton: each grad dtype with its own dtype and a different one.
TRITON_PAIRS = [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16), (torch.float16, torch.bfloat16),
]
# (divisor, add_residual, residual given, index_offset): the error-feedback variants of each family.
EF_VARIANTS = {
    "cpu": [(3.0, True, True, 5), (2.0, False, True, 5), (1.0, False, False, 5)],
    "triton": [(3.0, True, True, 11), (3.0, False, True, 11), (3.0, False, False, 11)],
    "cuda": [(1.0, True, True, 0), (3.0, True, True, 11), (3.0, False, True, 0), (3.0, False, False, 7)],
}
_ORACLE_MAGNITUDE_KEY = reference.magnitude_key


def _canonical_magnitude_key(x):
    """The oracle's key with one key for every NaN (see the module docstring)."""
    key = _ORACLE_MAGNITUDE_KEY(x)
    return torch.where(torch.isnan(x), torch.full_like(key, 0x7FFFFFFF), key)


@pytest.fixture(autouse=True)
def _one_key_per_nan_on_cuda(request, monkeypatch):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("impl") is CUDA:
        monkeypatch.setattr(reference, "magnitude_key", _canonical_magnitude_key)


def _k_values(n):
    return sorted({1, max(1, n // 100), n})


# --------------------------------------------------------------------------- running and checking


def run_topk(impl, grad, residual, divisor, add_residual, k, wire_dtype, offset=0):
    """``impl``'s ef_topk_pack on copies of the inputs on its device: (indices, values) sorted
    by index and the residual (None without one), on the CPU. Outputs hold 5 slots more than k,
    which must stay as they were; grad must not change."""
    device = impl.device
    g = grad.to(device, copy=True)
    r = None if residual is None else residual.to(device, copy=True)
    indices = torch.full((k + 5,), -7, dtype=torch.int32, device=device)
    values = torch.full((k + 5,), 123.0, dtype=wire_dtype, device=device)
    impl.ops.ef_topk_pack(g, r, divisor, add_residual, k, indices, values, offset)
    assert_same(g, grad, "grad must not be modified")
    assert bool((indices[k:] == -7).all()) and bool((values[k:] == 123.0).all()), "wrote beyond k"
    order = torch.argsort(indices[:k].cpu().long())
    return indices[:k].cpu()[order], values[:k].cpu()[order], None if r is None else r.cpu()


def check_topk(impl, grad, residual, divisor, add_residual, k, wire_dtype, offset=0, rule=True):
    """``impl`` == the oracle on CPU copies (set, values by index, residual) and, with ``rule``,
    sent + residual == acc where acc is finite, +0 where it is not (sent or not). Returns the
    (indices, values) sorted by index."""
    indices, values, new_residual = run_topk(impl, grad, residual, divisor, add_residual, k, wire_dtype, offset)
    want = run_topk(REFERENCE, grad, residual, divisor, add_residual, k, wire_dtype, offset)
    assert_same(indices, want[0], "indices (sorted)")
    assert_same(values, want[1], "values (by index)")
    if residual is not None:
        assert_same(new_residual, want[2], "residual", nan_ok=False)
        if rule:
            check_non_finite_rule(reference.compensated(grad, residual, divisor, add_residual), indices.long() - offset,
                                  values, new_residual)
    return indices, values


# --------------------------------------------------------------------------- Triton geometry


def _radix(ops):
    """The Triton backend copy's own radix module (geometry knobs live there)."""
    return ops.ef_topk_pack.__globals__["radix"]


def _size(impl, n):
    """``n``, or for ``MULTI`` 2 * block + 3 with the backend's default block (1024 interpreted, 4096 compiled)."""
    if n != MULTI:
        return n
    return 2 * _radix(impl.ops).geometry(1, impl.device)[0] + 3


@contextlib.contextmanager
def _small_programs(impl, block=16, max_programs=3):
    """Many programs with several tiles each, on small inputs (``MANY`` entries: 3 programs)."""
    with _radix(impl.ops).geometry_override(block=block, max_programs=max_programs):
        yield


# --------------------------------------------------------------------------- against the oracle


@pytest.mark.parametrize("impl,grad_dtype,wire_dtype,n,k,kind", implementation_cases(OP, {
    "cpu": [(g, v, n, k, "randn") for g, v in PAIRS for n in (1, 7, 1000, 2**16 + 3) for k in _k_values(n)],
    "triton": [(g, v, n, k, "randn") for g, v in TRITON_PAIRS
               for n, k in [(1, 1), (7, 1), (7, 7), (1000, 1), (1000, 10), (MULTI, 41), (MULTI, MULTI)]],
    "cuda": [(g, v, n, k, kind) for g, v in PAIRS for n in (1, 7, 1000, 2**16 + 3) for k in _k_values(n)
             for kind in ("randn", "ties", "special")],
}))
def test_matches_the_reference(impl, grad_dtype, wire_dtype, n, k, kind):
    n, k = _size(impl, n), _size(impl, k)
    if impl.family == "triton":  # MULTI takes 3 programs
        assert _radix(impl.ops).geometry(n, impl.device)[2] == (3 if n > 1000 else 1)
    grad, residual = ef_inputs(n, grad_dtype, seed=n + k, kind=kind)
    for divisor, add_residual, has_residual, offset in EF_VARIANTS[impl.family]:
        check_topk(impl, grad, residual if has_residual else None, divisor, add_residual, k, wire_dtype, offset)


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("n", (1000, 2**24 + 1))
def test_large_buckets_with_ties_and_non_finite_values(impl, n):
    for kind in ("nonfinite", "ties"):
        grad, residual = ef_inputs(n, torch.float32, seed=1, kind=kind)
        for k in (1, max(1, n // 100)):
            indices, _ = check_topk(impl, grad, residual, 2.0, True, k, torch.float32, rule=False)
            if kind == "nonfinite" and k >= 3:  # NaN and +-Inf are sent first, never kept back
                assert {1, n // 2, n - 2} <= set(indices.tolist())


@pytest.mark.parametrize("impl,grad_dtype,wire_dtype,kind,fraction", implementation_cases(OP, {"cuda": [
    (torch.float32, torch.float32, "randn", 0.01),     # candidate path
    (torch.bfloat16, torch.float16, "randn", 0.01),
    (torch.float16, torch.bfloat16, "special", 0.01),
    (torch.float32, torch.bfloat16, "ties", 0.01),     # candidate path, ties resolved by index levels
    (torch.float32, torch.float32, "equal", 0.01),     # boundary bin > candidate capacity: full path
    (torch.float32, torch.float16, "zeros", 0.2),      # the k-th is a zero: full path, index levels
    (torch.float32, torch.float32, "randn", 1.0),      # k == n
]}))
def test_cuda_paths_on_large_buckets(impl, grad_dtype, wire_dtype, kind, fraction):
    n = 2**24 + 1
    grad, residual = ef_inputs(n, grad_dtype, seed=1, kind=kind)
    k = max(1, int(n * fraction)) if fraction < 1 else n
    check_topk(impl, grad, residual, 3.0, True, k, wire_dtype)


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("with_residual", (True, False))
def test_sampled_bound_that_fails_falls_back_to_the_exact_passes(impl, with_residual):
    # Buckets of >= 2^20 entries first guess a key bound from 65,536 strided samples
    # (positions j * n // 65536). Put large values exactly there: the guess claims far more
    # large entries than exist (fewer than k reach the bound), so the kernel must fall back.
    n, samples = 2**23 + 5, 2**16
    grad, residual = ef_inputs(n, torch.float32, seed=7)
    grad[torch.arange(samples) * n // samples] = 100.0
    k = n // 100  # > samples: the large values alone cannot fill the payload
    check_topk(impl, grad, residual if with_residual else None, 2.0, with_residual, k, torch.float32, rule=False)


# --------------------------------------------------------------------------- non-finite acc: sent first, +0 left


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu"))
@pytest.mark.parametrize("dtype,value_dtype", PAIRS, ids=dtype_id)
def test_non_finite_acc_worked_by_hand(impl, dtype, value_dtype):
    """The rule checked by hand (every value here is exact in every dtype)."""
    def topk(acc, k):
        indices, values, residual = run_topk(impl, torch.tensor(acc, dtype=dtype), torch.zeros(len(acc), dtype=dtype),
                                             1.0, True, k, value_dtype)
        return indices.tolist(), values.float().tolist(), residual.float().view(torch.int32).tolist()

    def plus(values):  # +0.0 and -0.0 differ here
        return torch.tensor(values).view(torch.int32).tolist()

    indices, values, residual = topk([INF, 1.0], 1)  # Inf - Inf would leave NaN behind
    assert indices == [0] and values == [INF] and residual == plus([0.0, 1.0])
    indices, values, residual = topk([NAN, -INF, 2.0, 3.0], 1)  # -Inf not sent: +0 all the same
    assert indices == [0] and values[0] != values[0] and residual == plus([0.0, 0.0, 2.0, 3.0])
    indices, values, residual = topk([2.0, -INF, 3.0, INF], 3)  # both Inf sent, then the largest finite
    assert indices == [1, 2, 3] and values == [-INF, 3.0, INF] and residual == plus([2.0, 0.0, 0.0, 0.0])
    indices, values, residual = topk([NAN] * 4, 2)  # all-NaN bucket: the lowest indices, nothing kept
    assert indices == [0, 1] and residual == plus([0.0] * 4)


# CPU: 10,007 entries take the two-pass strategy; 2^20 + 3 at density < 4% the sampled one-pass
# strategy (an all-NaN bucket overflows its slabs and falls back to the two passes from the
# residual). fp32 -> fp32 runs the AVX-512 paths where built with them. Every pair runs at
# 10,007; at 2^20 + 3 the pairs that take every branch of the one-pass code (fp32 -> fp32
# vector loops, the scalar loop for the others) with every grad dtype and every wire dtype,
# narrower wires among them. CUDA: 10,007 entries stay in candidate mode; all NaN over 2^20 + 3
# entries makes the boundary bin hold more than the candidate list (2^20), so the full mode
# runs. Triton: 1000 entries in one program; for three pairs (every grad dtype and every wire
# dtype, a saturating wire among them) also MANY entries over 3 programs of several tiles: what
# the programs add (offsets from other programs' counts, programs past the capacity) is integer
# logic the dtypes do not enter.
LARGE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
               (torch.float16, torch.float32)]


@pytest.mark.parametrize("impl,grad_dtype,wire_dtype,n", implementation_cases(OP, {
    "cpu": [(g, v, 10_007) for g, v in PAIRS] + [(g, v, SAMPLED) for g, v in LARGE_PAIRS],
    "triton": [(g, v, 1000) for g, v in TRITON_PAIRS] + [(g, v, MANY) for g, v in
                                                          (TRITON_PAIRS[2], TRITON_PAIRS[4], TRITON_PAIRS[6])],
    "cuda": [(g, v, n) for g, v in PAIRS for n in (10_007, SAMPLED)],
}))
def test_non_finite_acc_is_sent_first_and_leaves_zero_residual(impl, grad_dtype, wire_dtype, n):
    """Inf/NaN are sent first and unchanged and leave +0 in the residual, sent or not (more
    of them than k: some are not sent)."""
    programs = _small_programs(impl) if n == MANY else contextlib.nullcontext()
    with programs:
        for name, count, k in topk_non_finite_cases(n):
            grad = with_non_finite(n, grad_dtype, count, seed=count)
            residual = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1).to(grad_dtype)
            indices, _ = check_topk(impl, grad, residual, 3.0, True, k, wire_dtype, offset=5)
            acc = reference.compensated(grad, residual, 3.0, True)
            sent_non_finite = int((~torch.isfinite(acc[indices.long() - 5])).sum())
            assert sent_non_finite == min(k, int((~torch.isfinite(acc)).sum())), name  # selected first


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
@pytest.mark.parametrize("grad_dtype,wire_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float32)], ids=dtype_id)
def test_nan_and_inf_are_selected_first(impl, grad_dtype, wire_dtype):
    n = 1000
    grad, _ = ef_inputs(n, grad_dtype, seed=3, kind="scattered")
    residual = torch.zeros(n, dtype=grad_dtype)
    nonfinite = set((~torch.isfinite(grad)).nonzero().flatten().tolist())
    for k in (1, 3, 9, 10, 100):
        indices, _ = check_topk(impl, grad, residual, 3, True, k, wire_dtype)
        assert len(nonfinite & set(indices.tolist())) == min(k, len(nonfinite))


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "cuda"))
@pytest.mark.parametrize("grad_dtype,wire_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
                         ids=dtype_id)
def test_nan_ranks_above_inf_and_ties_go_to_the_lowest_indices(impl, grad_dtype, wire_dtype):
    grad = torch.randn(3000).to(grad_dtype)
    grad[[10, 500, 2999]] = NAN
    grad[[3, 1500]] = INF
    grad[7] = -INF
    indices, _ = check_topk(impl, grad, torch.zeros_like(grad), 1.0, True, 6, wire_dtype)
    assert sorted(indices.tolist()) == [3, 7, 10, 500, 1500, 2999]
    indices, _ = check_topk(impl, grad, torch.zeros_like(grad), 1.0, True, 2, wire_dtype)
    assert sorted(indices.tolist()) == [10, 500]  # NaN above Inf; ties: lowest indices


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu"))
def test_every_nan_has_one_key_so_the_lower_index_wins(impl):
    nan_bits = torch.tensor([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001], dtype=torch.int64)
    grad = torch.zeros(8)
    grad[[6, 5, 3, 1]] = nan_bits.to(torch.int32).view(torch.float32)  # four NaNs, different payloads
    indices, _, _ = run_topk(impl, grad, torch.zeros(8), 1.0, True, 2, torch.float32)
    assert indices.tolist() == [1, 3]


# --------------------------------------------------------------------------- ties


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_conserves_and_breaks_ties_by_lower_index(impl):
    grad = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0])
    indices, values, new_residual = run_topk(impl, grad, torch.zeros(6), 1.0, True, 3, torch.float16)
    assert indices.tolist() == [1, 2, 4]  # four entries of magnitude 2: the lowest three indices
    sent = torch.zeros(6)
    sent[indices.long()] = values.float()
    assert torch.equal(sent + new_residual, grad)


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", ["ties", "equal"])
def test_ties_at_the_kth_take_the_lowest_indices(impl, grad_dtype, kind):
    n = 1000
    grad, _ = ef_inputs(n, grad_dtype, seed=5, kind=kind)
    residual = torch.zeros(n, dtype=grad_dtype)
    for k in (1, 10, 37, 500, 999, n):
        indices, _ = check_topk(impl, grad, residual, 1, True, k, grad_dtype)
        if kind == "equal":
            assert indices.tolist() == list(range(k))


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "cuda"))
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=dtype_id)
def test_ties_below_one_larger_entry_take_the_lowest_indices(impl, grad_dtype):
    n = 5000
    grad = torch.ones(n, dtype=grad_dtype)
    grad[4000] = 2.0  # one above the ties
    for k in (1, 2, 3, 37, 4096, 4097, n - 1):
        indices, _ = check_topk(impl, grad, torch.zeros_like(grad), 1.0, True, k, grad_dtype)
        assert indices.tolist() == sorted([4000] + [i for i in range(n) if i != 4000][: k - 1])


@pytest.mark.parametrize("impl", implementations(OP, "triton"))
def test_triton_ties_at_the_kth_across_programs(impl):
    """Ties exactly at the k-th key spread over many programs and tiles: lowest indices win."""
    n = MANY  # programs hold entries [0, 48), [48, 96), [96, 117); tiles of 16
    grad, _ = ef_inputs(n, torch.float32, seed=9)
    big = grad.abs().max().item() + 1
    tie_positions = [3, 16, 17, 40, 50, 80, 100, 116]
    for pos in tie_positions:  # 8 ties; the 5 entries above them are unique
        grad[pos] = -big if pos % 2 else big
    for i, pos in enumerate([10, 20, 60, 61, 115]):
        grad[pos] = big * (2 + i)
    with _small_programs(impl):
        for k in (5 + 1, 5 + 3, 5 + 8, 5 + 9):
            indices, _ = check_topk(impl, grad, grad.clone().zero_(), 1, True, k, torch.float32)
            chosen = sorted(set(indices.tolist()) & set(tie_positions))
            assert chosen == tie_positions[:min(k - 5, 8)]


@pytest.mark.parametrize("impl", implementations(OP, "triton"))
def test_triton_many_programs(impl):
    """Same results with tiny blocks: 3 programs x several tiles (cross-program offsets); 64
    entries: 2 programs of 2 full tiles; 7: one program, one partial tile."""
    with _small_programs(impl):
        for (grad_dtype, wire_dtype), (n, k) in [(TRITON_PAIRS[1], (MANY, 10)), (TRITON_PAIRS[3], (MANY, 41)),
                                                 (TRITON_PAIRS[5], (MANY, MANY)), (TRITON_PAIRS[6], (64, 7)),
                                                 (TRITON_PAIRS[0], (7, 3))]:
            grad, residual = ef_inputs(n, grad_dtype, seed=k)
            for divisor, add_residual, has_residual, _ in EF_VARIANTS["triton"]:
                check_topk(impl, grad, residual if has_residual else None, divisor, add_residual, k, wire_dtype)


# --------------------------------------------------------------------------- narrow wires, subnormals


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
@pytest.mark.parametrize("grad_dtype,wire_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                   (torch.float16, torch.float16), (torch.float16, torch.bfloat16)],
                         ids=dtype_id)
def test_subnormals_round_like_torch(impl, grad_dtype, wire_dtype):
    """Tiny values: acc, wire values and residuals in the subnormal range round like torch."""
    tiny = torch.finfo(grad_dtype).tiny
    grad = (ef_inputs(1000, torch.float32, seed=8)[0] * tiny * 4).to(grad_dtype)
    residual = (ef_inputs(1000, torch.float32, seed=9)[0] * tiny).to(grad_dtype)
    for k in (1, 100, 1000):
        check_topk(impl, grad, residual, 3, True, k, wire_dtype)


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton", "cuda"))
@pytest.mark.parametrize("grad_dtype,wire_dtype", NARROW_WIRE_PAIRS, ids=dtype_id)
def test_saturates_on_a_narrow_wire(impl, grad_dtype, wire_dtype):
    """Finite values beyond the wire's range saturate (bf16 -> fp16: in float), not to Inf."""
    grad, k = beyond_wire_range(grad_dtype)
    _, values = check_topk(impl, grad, torch.zeros_like(grad), 1, True, k, wire_dtype)
    wide = values.float()
    finite = torch.isfinite(wide)
    assert bool((wide[finite].abs() <= torch.finfo(wire_dtype).max).all())
    assert int(torch.isinf(wide).sum()) == 4 and int(torch.isnan(wide).sum()) == 2


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_values_beyond_fp16_saturate_on_the_wire_and_the_excess_stays(impl, dtype):
    # 7e4 and -1e5 (bf16: 70144 and -99840, ulp 512) go out as 65504 (fp32: ulp 2^-7) or
    # 65024 (127 x 512, exact in bf16), not Inf; Inf stays Inf.
    grad = torch.tensor([7e4, -1e5, 1.0, INF], dtype=dtype)
    indices, values, residual = run_topk(impl, grad, torch.zeros(4, dtype=dtype), 1.0, True, 3, torch.float16)
    sent = {torch.float32: 65504.0, torch.bfloat16: 65024.0}[dtype]
    assert indices.tolist() == [0, 1, 3] and values.tolist() == [sent, -sent, INF]
    assert residual.tolist() == [grad[0].item() - sent, grad[1].item() + sent, 1.0, 0.0]


SATURATION_SIZES = {"reference": ("hand-worked", SAMPLED), "cpu": ("hand-worked", SAMPLED), "triton": ("hand-worked",),
                    "cuda": ("hand-worked",)}


@pytest.mark.parametrize("impl,dtype,n", implementation_cases(OP, {
    family: [(dtype, n) for dtype in FP16_SATURATION for n in sizes] for family, sizes in SATURATION_SIZES.items()}))
def test_fp16_saturation_conserves_every_finite_acc(impl, dtype, n):
    """kernel_cases.FP16_SATURATION: each acc goes out as its hand-worked value, and sent +
    residual == acc up to float32's largest; on the CPU also in a bucket of 2^20 + 3 (its
    sampled one pass). Every CPU level: TestEveryCpuLevel."""
    grad, k = fp16_saturation_grad(dtype)
    n = grad.numel() if n == "hand-worked" else n
    acc = torch.cat([grad, torch.randn(n - grad.numel(), generator=torch.Generator().manual_seed(n)).to(dtype)])
    check_fp16_saturation(acc, *run_topk(impl, acc, torch.zeros(n, dtype=dtype), 1.0, True, k, torch.float16))


# --------------------------------------------------------------------------- one implementation's own properties


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_results_do_not_depend_on_the_thread_count(impl):
    grad, residual = ef_inputs(3_000_001, torch.float32, seed=2)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            residual_copy = residual.clone()
            indices = torch.empty(30_000, dtype=torch.int32)
            values = torch.empty(30_000)
            impl.ops.ef_topk_pack(grad, residual_copy, 2.0, True, 30_000, indices, values, 0)
            results.append((indices, values, residual_copy))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:  # same bytes, same order
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_payload_is_deterministic(impl):
    grad, residual = ef_inputs(300_000, torch.float32, seed=3, kind="ties")
    device = impl.device
    payloads = []
    for _ in range(2):
        indices = torch.empty(3000, dtype=torch.int32, device=device)
        values = torch.empty(3000, device=device)
        impl.ops.ef_topk_pack(grad.to(device), residual.to(device), 3.0, True, 3000, indices, values, 0)
        payloads.append((indices.cpu(), values.cpu()))
    assert_same(payloads[0][0], payloads[1][0], "indices, run to run")
    assert_same(payloads[0][1], payloads[1][1], "values, run to run")


_INT32 = torch.int32


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("call, message", [
    (lambda f: f(torch.ones(5), None, 1.0, False, 6, torch.empty(6, dtype=_INT32), torch.empty(6), 0),
     "k must be in \\[1, 5\\], got 6"),
    (lambda f: f(torch.ones(5), None, 1.0, False, 2, torch.empty(2), torch.empty(2), 0),
     "indices_out must be a contiguous 1-D int32 tensor"),
    (lambda f: f(torch.ones(5), None, 1.0, True, 2, torch.empty(2, dtype=_INT32), torch.empty(2), 0),
     "add_residual=True needs a residual"),
    (lambda f: f(torch.ones(5, dtype=torch.float64), None, 1.0, False, 2, torch.empty(2, dtype=_INT32),
                 torch.empty(2), 0), "dtype must be float32, bfloat16 or float16"),
    (lambda f: f(torch.ones(5), torch.ones(4), 1.0, True, 2, torch.empty(2, dtype=_INT32), torch.empty(2), 0),
     "residual must be a contiguous 1-D tensor matching grad"),
    (lambda f: (lambda grad: f(grad, grad, 1.0, True, 2, torch.empty(2, dtype=_INT32), torch.empty(2), 0))(
        torch.ones(5)), "residual may not alias grad"),
])
def test_cpu_rejects_bad_arguments_with_the_accepted_range(impl, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(impl.ops.ef_topk_pack)


@pytest.mark.parametrize("impl", implementations(OP, "triton")[:1])  # the interpreter: the checks run on the host
def test_triton_rejects_bad_arguments(impl):
    op = impl.ops.ef_topk_pack
    grad = torch.randn(10)
    idx, val = torch.empty(10, dtype=torch.int32), torch.empty(10)
    with pytest.raises(ValueError):
        op(grad, None, 1, False, 0, idx, val)
    with pytest.raises(ValueError):
        op(grad, None, 1, False, 11, idx, val)
    with pytest.raises(ValueError):
        op(grad, grad, 1, True, 3, idx, val)  # residual aliases grad
    with pytest.raises(ValueError):
        op(grad.double(), None, 1, False, 3, idx, val)
    with pytest.raises(ValueError):
        op(grad, None, 1, False, 3, idx.long(), val)
    with pytest.raises(ValueError):
        op(grad, None, 1, False, 3, idx[:2], val)


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_rejects_bad_arguments(impl):
    device = impl.device
    grad = torch.randn(100, device=device)
    residual = torch.zeros_like(grad)
    idx = torch.zeros(10, dtype=torch.int32, device=device)
    val = torch.zeros(10, device=device)
    op = torch.ops.sparsecomm.ef_topk_pack
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


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_opcheck(impl):
    grad, residual = ef_inputs(1000, torch.float32, seed=6)  # finite: opcheck compares repeated runs, NaN != NaN
    torch.library.opcheck(torch.ops.sparsecomm.ef_topk_pack.default,
                          (grad, residual.clone(), 2.0, True, 10, torch.empty(10, dtype=torch.int32), torch.empty(10),
                           0))


def _sync_inputs(device, n=1 << 20, k=10_000, rows=3):
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).to(device)
    residual = (torch.randn(n, generator=gen) * 0.1).to(device)
    indices = torch.empty(k, dtype=torch.int32, device=device)
    values = torch.empty(k, device=device)
    out = torch.empty(n, device=device)
    payload_idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)]).int().to(device)
    payload_val = torch.randn(rows, k, generator=gen).to(device)
    return grad, residual, indices, values, out, payload_idx, payload_val


@pytest.mark.parametrize("impl", implementations(OP, "cuda") + implementations(OP, "triton")[1:])
def test_no_host_synchronisation(impl):
    grad, residual, indices, values, *_ = _sync_inputs(impl.device)
    assert_no_host_synchronisation(lambda: impl.ops.ef_topk_pack(grad, residual, 3.0, True, indices.numel(), indices,
                                                                 values, 0))


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_ops_capture_in_a_cuda_graph(impl):
    """Stream capture (ef_topk_pack, then unpack_add) fails on any host synchronisation or host
    read-back; replays must be exact."""
    grad, residual, indices, values, out, payload_idx, payload_val = _sync_inputs(impl.device)
    start_residual = residual.clone()
    k = indices.numel()

    def step():
        torch.ops.sparsecomm.ef_topk_pack(grad, residual, 3.0, True, k, indices, values, 0)
        torch.ops.sparsecomm.unpack_add(payload_idx, payload_val, out, True)

    graph, _ = capture_in_a_cuda_graph(step)
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
        assert_same(indices.cpu()[order], ridx, "graph replay: indices")
        assert_same(values.cpu()[order], rval, "graph replay: values")
        assert_same(residual, rres, "graph replay: residual")


def _sm90_specs(ops):
    """(kernel, signature types, constexprs, num_warps): one variant per radix and ef_topk_pack
    kernel, bf16 grad and fp16 wire (saturation, integer bf16 rounding), the others with fp32 / fp16."""
    radix = _radix(ops)
    topk = ops.ef_topk_pack.__globals__
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
    ]


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    assert_triton_kernels_compile_for_sm90(_sm90_specs)


# --------------------------------------------------------------------------- every CPU level

OFFSET = 5


def _topk_case(grad, residual, divisor, add_residual, k, value_dtype):
    def run(ops):
        r = None if residual is None else residual.clone()
        indices = torch.full((k,), -1, dtype=torch.int32)
        values = torch.empty(k, dtype=value_dtype)
        ops.ef_topk_pack(grad, r, divisor, add_residual, k, indices, values, OFFSET)
        return [indices, values] + ([] if r is None else [r])
    return run


def cpu_level_cases() -> dict[str, LevelCase]:
    """Fixed-seed calls at every CPU level: odd sizes (the 8- and 16-lane loops end in scalar
    tails), NaN and +-Inf among the values, every dtype pair at one size, a bucket of 2^20 + 3
    for the sampled one-pass strategy, and kernel_cases.FP16_SATURATION's accs, whose outputs
    are also checked against the hand-worked values."""
    cases = {}
    for n in (1, 7, 1003, 65_537, SAMPLED):
        for dtype, value_dtype in PAIRS if n == 1003 else [(torch.float32, torch.float32)]:
            grad, residual = ef_inputs(n, dtype, seed=n, kind="nonfinite")
            for k in _k_values(n) if n < SAMPLED else (n // 100,):
                for divisor, add_residual, r in ((3.0, True, residual), (2.0, False, None)):
                    name = f"ef_topk_pack n={n} {dtype}->{value_dtype} k={k} residual={r is not None}"
                    cases[name] = LevelCase(_topk_case(grad, r, divisor, add_residual, k, value_dtype), unordered=True)
    for dtype in FP16_SATURATION:
        grad, k = fp16_saturation_grad(dtype)
        for n in (grad.numel(), SAMPLED):
            acc = torch.cat([grad, torch.randn(n - grad.numel(), generator=torch.Generator().manual_seed(n)).to(dtype)])

            def check(outputs, acc=acc):
                indices, values, residual = outputs
                check_fp16_saturation(acc, indices.long() - OFFSET, values, residual)

            cases[f"fp16 saturation n={n} {dtype}"] = LevelCase(
                _topk_case(acc, torch.zeros(n, dtype=dtype), 1.0, True, k, torch.float16), unordered=True, check=check)
    return cases


class TestEveryCpuLevel(CpuLevelTests):
    cases = cpu_level_cases
