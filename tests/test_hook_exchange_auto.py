"""exchange="auto": the cost model's choice per bucket, worked by hand, and obeyed by the hook."""
import pytest
import torch

import sparsecomm
from ddp_models import rank_data
from rank_processes import run_on_ranks
from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.pipeline import exchange_choice


def _config(link, **settings):
    return TopKConfig.build(density=1 / 64, selector="chunk", index_codec="chunk", exchange="auto", link=link,
                            **settings)


def test_modelled_seconds_worked_by_hand():
    # 8 chunks of 4096, 64 entries each: 512 x (12-bit index + fp32 value) = 768 + 2048 = 2816 bytes,
    # and every payload, owner message and reply and index set sealed with 8 bytes (wire_checksum);
    # the shared-index allreduce sums one more value, the ranks' verdicts on the index set.
    costs = exchange_choice.modelled_seconds(_config("1gbit@100us"), 8 * 4096, 1 / 64, torch.float32,
                                             torch.float32, 4, 512)
    rate, alpha = 1e9 / 8, 1e-4
    assert costs["allgather"] == pytest.approx(3 * alpha + 3 * 2824 / rate)
    assert costs["owner"] == pytest.approx(2 * 3 * alpha + 2 * 3 * 712 / rate)  # 2 chunks (704 B) per owner
    assert costs["shared-index"] == pytest.approx(2 * (alpha + 776 / rate) + 6 * alpha + 1.5 * 2052 / rate)
    assert costs["dense"] == pytest.approx(6 * alpha + 1.5 * 8 * 4096 * 4 / rate)
    assert min(costs, key=costs.get) == "allgather"  # latency dominates: the fewest messages
    slow = exchange_choice.modelled_seconds(_config("1mbit"), 8 * 4096, 1 / 64, torch.float32, torch.float32, 4, 512)
    assert min(slow, key=slow.get) == "owner"  # bytes dominate: 4272 B against 4630 (shared) and 8472


def test_candidates_follow_the_settings():
    assert exchange_choice.candidates(_config(None)) == ("allgather", "owner", "shared-index")
    quantized = TopKConfig.build(selector="chunk", value_codec="int4", exchange="auto")
    assert exchange_choice.candidates(quantized) == ("allgather", "owner")  # an allreduce cannot sum int4 codes
    exact = TopKConfig.build(exchange="auto")
    assert exchange_choice.candidates(exact) == ("allgather", "owner", "shared-index")
    sampled = TopKConfig.build(selector="sampled", exchange="auto")
    assert exchange_choice.candidates(sampled) == ("allgather",)


@pytest.mark.parametrize("settings,message", [
    ({"link": "1gbit"}, "exchange='auto'"),
    ({"exchange": "auto", "link": "fast"}, "link"),
    ({"exchange": "auto", "link": "loopback"}, "no known rate"),
    ({"exchange": "auto", "selector": "random"}, "random-k always allreduces"),
])
def test_bad_links_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        sparsecomm.TopKState(**settings)


def _auto(rank, world_size, link):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 128, bias=False), bucket_cap_mb=25)
    state = sparsecomm.register_topk_hook(ddp, density=1 / 64, selector="chunk", chunk_size=4096,
                                          index_codec="chunk", exchange="auto", link=link, verify_conservation=True)
    for x in rank_data(rank, 4, (4, 256)):
        ddp(x).square().sum().backward()
    stats = state.stats()
    return {name: stats[name] for name in ("sparse_calls", "allgather_calls", "owner_calls", "shared_index_calls",
                                           "fallback_calls")}


@pytest.mark.parametrize("link,chosen", [("1mbit", "owner_calls"), ("10gbit@1ms", "allgather_calls")])
def test_the_hook_sends_each_bucket_the_chosen_way(link, chosen):
    for counts in run_on_ranks(_auto, link, world_size=4):
        assert counts[chosen] == counts["sparse_calls"] == 2, counts  # 4 steps, 2 of warm-up
        assert sum(counts[name] for name in ("allgather_calls", "owner_calls", "shared_index_calls")) == 2
