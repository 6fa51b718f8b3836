"""ParameterMemory: per-parameter tensors stored bucket-contiguously, keyed by name.

Checks that a new bucket starts at zero, that each parameter name keeps its own values
when DDP's bucket layout changes (split, merge, reorder, dtype change), that an unchanged
layout reuses the same flat tensor, that a layout whose sizes do not add up is refused,
and that state_dict / load_state_dict round-trip and invalidate the cached flat tensors.
All comparisons are exact.
"""
import pytest
import torch

from sparsecomm.hooks.state.memories import ParameterMemory

NUMELS = {"a": 2, "b": 3, "c": 4, "d": 1}


def _bucket(memory, index, names, dtype=torch.float32):
    numels = tuple(NUMELS[n] for n in names)
    like = torch.empty(sum(numels), dtype=dtype)
    return memory.bucket_tensor(index, tuple(names), numels, like)


def _fill(memory, index, names):
    """Give every name distinct values: name 'a' -> 100, 101, ...; 'b' -> 200, ..."""
    flat = _bucket(memory, index, names)
    for name, view in zip(names, flat.split([NUMELS[n] for n in names])):
        base = 100 * (ord(name) - ord("a") + 1)
        view.copy_(torch.arange(base, base + NUMELS[name], dtype=flat.dtype))
    return flat


def _values(name, dtype=torch.float32):
    base = 100 * (ord(name) - ord("a") + 1)
    return torch.arange(base, base + NUMELS[name], dtype=dtype)


def _assert_names_hold_their_values(memory, names, dtype=torch.float32):
    for name in names:
        assert torch.equal(memory.get(name), _values(name, dtype)), name


def test_new_bucket_starts_at_zero_shaped_like_buffer():
    memory = ParameterMemory()
    like = torch.randn(5, dtype=torch.float64)
    flat = memory.bucket_tensor(0, ("a", "b"), (2, 3), like)
    assert flat.shape == like.shape and flat.dtype == like.dtype
    assert torch.equal(flat, torch.zeros(5, dtype=torch.float64))
    assert len(memory) == 2 and "a" in memory and "b" in memory and "c" not in memory
    assert memory.names() == ["a", "b"]


def test_entries_are_views_of_the_flat_tensor():
    memory = ParameterMemory()
    flat = _fill(memory, 0, ("a", "b", "c"))
    _assert_names_hold_their_values(memory, "abc")
    flat[0] = -1.0  # an in-place bucket update is the entry update
    assert memory.get("a")[0].item() == -1.0


def test_same_layout_reuses_the_flat_tensor():
    memory = ParameterMemory()
    flat = _fill(memory, 0, ("a", "b"))
    again = _bucket(memory, 0, ("a", "b"))
    assert again is flat
    _assert_names_hold_their_values(memory, "ab")


def test_values_survive_a_bucket_split():
    memory = ParameterMemory()
    _fill(memory, 0, ("a", "b", "c"))
    first = _bucket(memory, 0, ("a",))
    second = _bucket(memory, 1, ("b", "c"))
    assert torch.equal(first, _values("a"))
    assert torch.equal(second, torch.cat([_values("b"), _values("c")]))
    _assert_names_hold_their_values(memory, "abc")
    # The entries now live in the new flat tensors.
    second[0] = -5.0
    assert memory.get("b")[0].item() == -5.0


def test_values_survive_a_merge_and_a_reorder():
    memory = ParameterMemory()
    _fill(memory, 0, ("a",))
    _fill(memory, 1, ("b", "c"))
    merged = _bucket(memory, 0, ("c", "a", "b"))
    assert torch.equal(merged, torch.cat([_values("c"), _values("a"), _values("b")]))
    _assert_names_hold_their_values(memory, "abc")
    reordered = _bucket(memory, 0, ("b", "c", "a"))
    assert reordered is not merged
    assert torch.equal(reordered, torch.cat([_values("b"), _values("c"), _values("a")]))
    _assert_names_hold_their_values(memory, "abc")


def test_bucket_indices_swapped():
    memory = ParameterMemory()
    _fill(memory, 0, ("a", "b"))
    _fill(memory, 1, ("c",))
    new0 = _bucket(memory, 0, ("c",))
    new1 = _bucket(memory, 1, ("b", "a"))
    assert torch.equal(new0, _values("c"))
    assert torch.equal(new1, torch.cat([_values("b"), _values("a")]))
    _assert_names_hold_their_values(memory, "abc")


def test_new_name_in_a_changed_layout_starts_at_zero():
    memory = ParameterMemory()
    _fill(memory, 0, ("a", "b"))
    flat = _bucket(memory, 0, ("a", "d", "b"))
    assert torch.equal(flat, torch.cat([_values("a"), torch.zeros(1), _values("b")]))


def test_dtype_change_casts_values():
    memory = ParameterMemory()
    flat32 = _fill(memory, 0, ("a", "b"))
    flat32.add_(0.5)  # 200.5 and up need 9 significant bits: bf16 (8 bits) rounds them
    expected = flat32.to(torch.bfloat16)
    assert not torch.equal(expected.float(), flat32)  # the cast is visible
    flat16 = _bucket(memory, 0, ("a", "b"), dtype=torch.bfloat16)
    assert flat16.dtype == torch.bfloat16
    assert torch.equal(flat16, expected)
    assert memory.get("a").dtype == torch.bfloat16
    assert _bucket(memory, 0, ("a", "b"), dtype=torch.bfloat16) is flat16


def test_numel_mismatch_raises():
    memory = ParameterMemory()
    with pytest.raises(ValueError, match="bucket 3"):
        memory.bucket_tensor(3, ("a", "b"), (2, 3), torch.empty(6))
    assert len(memory) == 0  # nothing half-registered


def test_state_dict_is_a_copy_by_name():
    memory = ParameterMemory()
    flat = _fill(memory, 0, ("b", "a"))
    sd = memory.state_dict()
    assert list(sd) == ["a", "b"]
    assert torch.equal(sd["a"], _values("a")) and torch.equal(sd["b"], _values("b"))
    flat.zero_()
    assert torch.equal(sd["a"], _values("a"))  # not a view of the live tensor


def test_state_dict_round_trip_into_a_different_layout():
    source = ParameterMemory()
    _fill(source, 0, ("a", "b", "c"))
    target = ParameterMemory()
    target.load_state_dict(source.state_dict())
    assert target.names() == ["a", "b", "c"]
    _assert_names_hold_their_values(target, "abc")
    flat0 = _bucket(target, 0, ("c",))
    flat1 = _bucket(target, 1, ("b", "a"))
    assert torch.equal(flat0, _values("c"))
    assert torch.equal(flat1, torch.cat([_values("b"), _values("a")]))


def test_load_state_dict_invalidates_cached_flats_and_copies_input():
    memory = ParameterMemory()
    cached = _fill(memory, 0, ("a", "b"))
    loaded = {"a": torch.full((2,), 7.0), "b": torch.full((3,), -7.0).reshape(1, 3)}
    memory.load_state_dict(loaded)
    loaded["a"].zero_()  # the memory holds its own copy
    flat = _bucket(memory, 0, ("a", "b"))
    assert flat is not cached
    assert torch.equal(flat, torch.tensor([7.0, 7.0, -7.0, -7.0, -7.0]))
    cached.fill_(123.0)  # the old flat tensor no longer feeds any entry
    assert torch.equal(memory.get("a"), torch.full((2,), 7.0))


def test_load_state_dict_replaces_all_entries():
    memory = ParameterMemory()
    _fill(memory, 0, ("a", "b"))
    memory.load_state_dict({"c": torch.ones(4)})
    assert memory.names() == ["c"]
    assert "a" not in memory


def test_clear():
    memory = ParameterMemory()
    cached = _fill(memory, 0, ("a",))
    memory.clear()
    assert len(memory) == 0
    flat = _bucket(memory, 0, ("a",))
    assert flat is not cached
    assert torch.equal(flat, torch.zeros(2))


def test_returning_to_an_old_layout_rebuilds_from_the_entries():
    # Regression: layout A -> B -> A used to hand back A's stale flat tensor for bucket 1,
    # losing what was written in layout B and detaching later writes from the entries.
    memory = ParameterMemory()
    _fill(memory, 0, ("a",))
    _fill(memory, 1, ("b",))
    merged = _bucket(memory, 0, ("a", "b"))
    merged += 10
    _bucket(memory, 0, ("a",))
    b_again = _bucket(memory, 1, ("b",))
    assert torch.equal(b_again, _values("b") + 10)
    b_again += 1
    assert torch.equal(memory.get("b"), _values("b") + 11)  # writes reach the entry


def test_same_names_with_other_sizes_raises_instead_of_reusing():
    memory = ParameterMemory()
    memory.bucket_tensor(0, ("a",), (4,), torch.zeros(4))
    with pytest.raises(ValueError, match="'a' has 5 elements but its stored entry has 4"):
        memory.bucket_tensor(0, ("a",), (5,), torch.zeros(5))
