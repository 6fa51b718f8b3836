"""transport="mpi": the MPI Iallgatherv transport alone and inside DDP, under mpiexec -n 2.

The argument checks run in this process (no MPI started). The rest runs two scripts under
``mpiexec -n 2`` once per module (tests/mpi_scripts/), each rank on different data, and
asserts on what every rank reported:

- the transport gathers variable counts per rank (including zero) back to back in rank
  order, for float32 and bfloat16, with several requests in flight, into the caller's
  buffer (no copy), and rejects inconsistent arguments;
- exact top-k over MPI trains to the same parameters as over c10d, bit for bit (same
  payload bytes, same unpack order), and so does the owner exchange (Alltoallv);
- the sampled selector over MPI sends a different number of entries per rank, every
  reduced bucket is the rank-order sum of what the ranks sent, and replicas agree;
- misuse (wrong world, permuted ranks, non-default group) fails on every rank alike.
"""
import json
import os
import pickle
import sys

import pytest

from mpi_launch import run_mpiexec
from sparsecomm import TopKState
from sparsecomm.hooks.state.settings import FIELDS as CONFIG_FIELDS

pytestmark = pytest.mark.timeout(120)

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts")


def _reports(tmp_path_factory, script):
    out_dir = tmp_path_factory.mktemp(script.removesuffix(".py"))
    run_mpiexec([os.path.join(SCRIPTS, script), str(out_dir)], num_ranks=2, timeout=90)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def transport_reports(tmp_path_factory):
    return _reports(tmp_path_factory, "transport.py")


@pytest.fixture(scope="module")
def misuse_reports(tmp_path_factory):
    return _reports(tmp_path_factory, "misuse.py")


# ----- argument checks, in this process ---------------------------------------------------


def test_transport_rejected_lists_choices():
    with pytest.raises(ValueError, match=r"transport must be one of 'c10d', 'mpi'; got 'nccl'"):
        TopKState(transport="nccl")


def test_mpi_transport_without_mpi4py_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # find_spec now reports it missing
    with pytest.raises(ValueError, match=r"transport='mpi' needs mpi4py.*'c10d', 'mpi'"):
        TopKState(transport="mpi")


def test_mpi_transport_with_random_selector_is_refused():
    pytest.importorskip("mpi4py", reason="the check for mpi4py comes first")
    with pytest.raises(ValueError, match="selector='random'.*transport='c10d'"):
        TopKState(transport="mpi", selector="random")


def test_transport_in_stats_not_in_config_and_pickled():
    pytest.importorskip("mpi4py", reason="transport='mpi' needs mpi4py")
    state = TopKState(transport="mpi", selector="sampled")
    assert state.stats()["transport"] == "mpi"
    assert TopKState().stats()["transport"] == "c10d"
    # Checkpoints stay interchangeable between transports: the config does not name it.
    assert state.config.checkpoint_dict() == TopKState(selector="sampled").config.checkpoint_dict()
    copy = pickle.loads(pickle.dumps(state))
    assert copy.transport == "mpi" and copy.mpi is None


def test_pickle_from_before_transports_loads_as_c10d():
    state = TopKState()
    saved = state.__getstate__()
    # A pickle of that time: the settings were flat fields of the state, and had no transport.
    config = saved.pop("config")
    saved |= {name: getattr(config, name) for name in CONFIG_FIELDS if name != "transport"}
    del saved["mpi"]
    restored = TopKState.__new__(TopKState)
    restored.__setstate__(saved)
    assert restored.transport == "c10d" and restored.mpi is None


# ----- the transport alone, under mpiexec -------------------------------------------------


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_variable_counts_gather_in_rank_order(transport_reports, dtype):
    for rank, report in enumerate(transport_reports):
        result = report["transport"][dtype]
        assert result["gathered"] == result["expected"], (rank, result)
        assert result["shares_recv_memory"] and result["tail_untouched"], (rank, result)
    assert transport_reports[0]["transport"]["torch.float32"]["counts"] == [0, 5]


def test_requests_in_flight_complete_with_their_own_data(transport_reports):
    for report in transport_reports:
        assert report["transport"]["in_flight_equal"] == [True] * 4


def test_transport_rejects_inconsistent_arguments(transport_reports):
    errors = transport_reports[1]["transport"]["errors"]
    assert errors["count_mismatch"] == "counts[1]=2 but this rank sends 3 elements"
    assert errors["recv_too_small"] == "recv holds 5 elements, the counts add up to 6"
    assert errors["wrong_number_of_counts"] == "counts must have one entry per rank (2), got 1"
    assert errors["dtype_mismatch"] == "recv dtype torch.float64 differs from send dtype torch.float32"


# ----- inside DDP, under mpiexec ----------------------------------------------------------


def test_exact_topk_over_mpi_equals_c10d_bitwise(transport_reports):
    for rank, report in enumerate(transport_reports):
        exact = report["training"]["exact"]
        assert exact["transport"] == "mpi" and exact["sparse_calls"] > 0
        # Bitwise: both transports deliver the same gathered bytes; the unpack is shared.
        assert exact["params_equal"], (rank, exact["max_abs_diff"])
        assert exact["losses_c10d"] == exact["losses_mpi"]


def test_owner_exchange_over_mpi_equals_c10d_bitwise(transport_reports):
    for rank, report in enumerate(transport_reports):
        owner = report["training"]["owner"]
        assert owner["owner_calls"] == owner["sparse_calls"] > 0
        # Alltoallv + Iallgatherv carry the bytes all_to_all_single + all_gather carry.
        assert owner["params_equal"], (rank, owner["max_abs_diff"])
        assert owner["losses_c10d"] == owner["losses_mpi"]


def test_sampled_over_mpi_sends_different_counts_per_rank(transport_reports):
    counts = [report["training"]["sampled"]["counts"] for report in transport_reports]
    assert counts[0].keys() == counts[1].keys() and counts[0]
    differing = [key for key in counts[0] if counts[0][key] != counts[1][key]]
    assert differing, counts  # threshold estimates differ per rank, so the counts do
    for report in transport_reports:
        stats = report["training"]["sampled"]["stats"]
        # The capacity k caps every count: never more than the declared density.
        assert 0 < stats["effective_density"] <= stats["density"] * 1.01


def test_sampled_over_mpi_reduces_exactly_what_ranks_sent(transport_reports):
    for rank, report in enumerate(transport_reports):
        sampled = report["training"]["sampled"]
        assert sampled["buckets_checked"] > 0
        assert sampled["mismatched_buckets"] == [], rank
        assert sampled["replicas_equal"], rank
        assert sampled["fused_equals_observed"], rank


# ----- misuse, under mpiexec --------------------------------------------------------------


@pytest.mark.parametrize("case, error, words", [
    ("init_mismatch", "RuntimeError", ["MPI COMM_WORLD has rank", "WORLD_SIZE=3", "MASTER_ADDR"]),
    ("size_mismatch", "ValueError", ["transport='mpi'", "2 process(es)", "has 1", "transport='c10d'"]),
    ("non_default_group", "ValueError", ["default process group", "transport='c10d'"]),
    ("rank_permutation", "ValueError", ["[1, 0]", "transport='c10d'"]),
])
def test_misuse_fails_on_every_rank(misuse_reports, case, error, words):
    for rank, report in enumerate(misuse_reports):
        assert report[case] is not None, (rank, case)
        kind, message = report[case]
        assert kind == error, (rank, message)
        for word in words:
            assert word in message, (rank, word, message)


def test_failed_first_call_leaves_nothing_pending(misuse_reports):
    assert [report["pending_after_error"] for report in misuse_reports] == [0, 0]
