"""Emulated links: names parse or fail clearly; namespaces are built, really shape the
traffic, and are always torn down (normal exit, exception, SIGTERM, Ctrl-C, a failed run);
a real paired run over an emulated link labels its ledger with the link.

The namespace tests need root, iproute2 and kernel support; they skip with the reason otherwise.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparsecomm.lab.experiment import launch, runner
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.named import digits_quick
from sparsecomm.links import parse_link
from sparsecomm.links.spec import link_name
from sparsecomm.links import netns
from sparsecomm.links.netns import EmulatedNetwork, LinkEmulationError, check_emulation_possible
from sparsecomm.lab.results import load_runs
from network_namespaces import emulation_unavailable, network_namespaces_lock

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _no_other_networks():
    """No other test of the suite builds a network while one of these runs (or counts them)."""
    with network_namespaces_lock():
        yield


_UNAVAILABLE = emulation_unavailable()
needs_emulation = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"link emulation unavailable: {_UNAVAILABLE}")


def _ours() -> set[str]:
    return set(netns.namespaces())


def _veths() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("text, rate, latency", [
    ("loopback", None, 0.0), ("1gbit", 1e9, 0.0), ("10GBit", 1e10, 0.0), ("2.5gbit", 2.5e9, 0.0),
    ("100mbit@1ms", 1e8, 1e-3), ("1gbit@100us", 1e9, 1e-4),
])
def test_link_names_parse(text, rate, latency):
    link = parse_link(text)
    assert (link.rate_bits_per_s, link.latency_s) == (rate, latency)
    assert link.emulated == (rate is not None)


@pytest.mark.parametrize("text", ["1gb", "fast", "", "0kbit", "20tbit", "1gbit@", "1gbit@20s", "-1gbit", None])
def test_bad_link_names_say_what_is_accepted(text):
    with pytest.raises(ValueError, match="link"):
        parse_link(text)


@pytest.mark.parametrize("bits, name", [
    (4.1e8, "410mbit"), (1.2e9, "1.2gbit"), (9.9e8, "990mbit"), (1e3, "1kbit"), (2.5e4, "25kbit"), (1e13, "10tbit"),
])
def test_link_name_is_what_parse_link_reads_back(bits, name):
    assert link_name(bits) == name
    assert parse_link(name).rate_bits_per_s == pytest.approx(bits, rel=1e-12)


@pytest.mark.parametrize("bits", [999.0, 2e13])
def test_link_name_refuses_a_rate_no_link_takes(bits):
    with pytest.raises(ValueError, match="between 1kbit and 10tbit"):
        link_name(bits)


def test_config_validates_the_link_before_any_launch():
    with pytest.raises(ValueError, match="experiment config: link must be 'loopback' or a rate"):
        digits_quick().with_overrides(link="1 gigabit")
    with pytest.raises(ValueError, match="max_restarts must be 0 with an emulated link"):
        digits_quick().with_overrides(link="1gbit", max_restarts=1)
    # The link changes timings, hence the run.
    base = digits_quick()
    assert base.run_hash("dense", 0) != base.with_overrides(link="1gbit").run_hash("dense", 0)


def test_compare_refuses_a_bad_link_before_running(tmp_path, capsys):
    from sparsecomm.lab.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--experiment", "digits-quick", "--link", "1gb", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "link must be 'loopback' or a rate such as '1gbit'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_missing_privileges_or_tools_are_named(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None)
    with pytest.raises(LinkEmulationError) as error:
        check_emulation_possible(parse_link("1gbit"))
    assert "root" in str(error.value) and "`ip`" in str(error.value) and "`tc`" in str(error.value)
    check_emulation_possible(parse_link("loopback"))  # loopback needs nothing


@needs_emulation
def test_network_connects_the_ranks_shapes_traffic_and_leaves_nothing_behind():
    from sparsecomm.links.probe import stream_throughput

    before = _ours()
    link = parse_link("20mbit")
    with EmulatedNetwork(link, 3) as network:
        assert set(network.ranks) | {network.switch} <= _ours()
        nbytes = 1 << 20
        started = time.perf_counter()
        rate = stream_throughput(network, nbytes)
        took = time.perf_counter() - started
        # A lower bound only (a busy machine can only be slower): 1 MiB cannot cross a
        # 20 Mb/s link faster than the rate allows, minus tbf's 64 KiB bucket.
        assert took >= (nbytes - 64 * 1024) * 8 / link.rate_bits_per_s * 0.95
        assert rate <= link.rate_bits_per_s * 1.1
        # Rank 2 reaches rank 0 through the switch too.
        ping = subprocess.run(network.command(2, [sys.executable, "-c", textwrap.dedent(f"""
            import socket; socket.create_connection(("{network.address(0)}", 9), timeout=5)""")]),
            capture_output=True, text=True, timeout=30)
        assert "Connection refused" in ping.stderr  # reached the host; nothing listens on port 9
    assert _ours() == before
    assert network.tag.replace("-", "x") not in _veths()


@needs_emulation
def test_network_is_torn_down_after_an_exception():
    before = _ours()
    with pytest.raises(ZeroDivisionError):
        with EmulatedNetwork(parse_link("1gbit"), 2):
            assert len(_ours()) == len(before) + 3
            1 / 0
    assert _ours() == before


@needs_emulation
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_network_is_torn_down_when_the_process_is_signalled(sig):
    before = _ours()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import faulthandler, signal, time
        faulthandler.register(signal.SIGUSR1)  # the test asks where it is stuck if it does not exit
        # Ctrl-C's handler, as an interactive process has: a job started in the background
        # (CI under nohup, cron) inherits SIGINT ignored, and the signal would do nothing.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from sparsecomm.links import parse_link
        from sparsecomm.links.netns import EmulatedNetwork
        with EmulatedNetwork(parse_link("1gbit"), 2):
            print("up", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "up"
    assert len(_ours()) == len(before) + 3
    holder.send_signal(sig)
    try:
        holder.wait(timeout=30)
    except subprocess.TimeoutExpired:
        holder.send_signal(signal.SIGUSR1)
        time.sleep(1)
        holder.kill()
        pytest.fail(f"the process did not exit within 30 s of {sig.name}; its stacks:\n{holder.communicate()[1]}")
    assert _ours() == before


@needs_emulation
def test_a_killed_process_leaves_stale_namespaces_that_are_found_and_removed():
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from sparsecomm.links import parse_link
        from sparsecomm.links.netns import EmulatedNetwork
        with EmulatedNetwork(parse_link("1gbit"), 2):
            print("up", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "up"
    holder.kill()  # SIGKILL: no chance to clean up
    holder.wait(timeout=30)
    stale = set(netns.stale_namespaces())
    assert len([n for n in stale if n.startswith(f"{netns.NAMESPACE_PREFIX}{holder.pid}-")]) == 3
    # The next network removes them before building its own.
    with EmulatedNetwork(parse_link("1gbit"), 2) as network:
        assert not netns.stale_namespaces() and not stale & _ours()
        assert set(network.ranks) <= _ours()
    assert not stale & _ours()


@needs_emulation
def test_latency_needs_netem_and_says_so_or_works():
    try:
        with EmulatedNetwork(parse_link("1gbit@1ms"), 2) as network:
            assert network.ranks
    except LinkEmulationError as error:
        assert "netem" in str(error) and "without '@latency'" in str(error)
    assert not [n for n in _ours() if n.startswith(f"{netns.NAMESPACE_PREFIX}{os.getpid()}-")]


def _tiny_config(tmp_path, **overrides) -> ExperimentConfig:
    return digits_quick().with_overrides(name="links", arms=("dense", "topk-ef"), seeds=(0,), steps=20,
                                         eval_every=10, link="100mbit", **overrides)


@needs_emulation
def test_a_failing_rank_inside_the_network_is_recorded_and_the_network_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_worker_arguments",
                        lambda *args: ["-c", "import os, sys; print('RuntimeError: rank', os.environ['RANK']); "
                                             "sys.exit(3 if os.environ['RANK'] == '1' else 0)"])
    before = _ours()
    run_dir = runner.run_experiment(_tiny_config(tmp_path).with_overrides(arms=("dense",)), tmp_path,
                                    progress=lambda line: None)
    (run,) = load_runs(run_dir)
    assert run.status == "failed" and "exit code 3" in run.error
    assert _ours() == before


@pytest.fixture(scope="module")
def link_frontier(tmp_path_factory):
    """One real paired experiment over an emulated 100 Mb/s link, run by ``sparsecomm frontier``
    (digits-quick, dense + topk-ef at density 0.05, seed 0, 20 steps: 2 launches); both tests
    below read it. (The frontier runs each density's experiment with runner.run_experiment.)"""
    from sparsecomm.lab import frontier

    if _UNAVAILABLE is not None:
        pytest.skip(f"link emulation unavailable: {_UNAVAILABLE}")
    root = tmp_path_factory.mktemp("link-frontier")
    with network_namespaces_lock():
        before = _ours()
        code = frontier.main(["--experiment", "digits-quick", "--densities", "0.05", "--arms", "topk-ef", "--seeds",
                              "0", "--steps", "20", "--link", "100mbit", "--out", str(root / "runs"),
                              "--plots", str(root / "plots")])
        after = _ours()
    return {"code": code, "root": root, "namespaces_before": before, "namespaces_after": after}


@needs_emulation
def test_paired_run_over_an_emulated_link_end_to_end(link_frontier):
    """Real gloo traffic over a 100 Mb/s link: dense's step pays for its bytes, top-k's does not."""
    from sparsecomm.lab import ledger

    assert link_frontier["code"] == 0
    (run_dir,) = (link_frontier["root"] / "runs").glob("digits-quick-100mbit-frontier-d*")
    runs = {r.arm: r for r in load_runs(run_dir)}
    assert sorted(runs) == ["dense", "topk-ef"]
    assert {r.status for r in runs.values()} == {"ok"}, [r.error for r in runs.values()]
    assert link_frontier["namespaces_after"] == link_frontier["namespaces_before"]
    dense = runs["dense"]
    # Dense allreduces its whole buffer every step; at 100 Mb/s that takes at least this long
    # (a lower bound, whatever else the machine is doing; tbf's 64 KiB bucket allowed for).
    floor = (dense.bytes_dense_per_step - 64 * 1024) * 8 / 1e8
    assert floor > 0.005 and dense.median_step_seconds >= floor
    text = ledger.format_ledger(ledger.build_ledger(run_dir))
    assert "all measured @100mbit: ranks linked by an emulated 100mbit link" in " ".join(text.split())


@needs_emulation
def test_frontier_over_an_emulated_link_keeps_its_own_files(link_frontier):
    runs = link_frontier["root"] / "runs"
    assert link_frontier["code"] == 0
    assert (runs / "digits-quick-100mbit-frontier.json").exists()
    config = json.loads(next(runs.glob("digits-quick-100mbit-frontier-d*/experiment.json")).read_text())
    assert config["config"]["link"] == "100mbit"
    assert link_frontier["namespaces_after"] == link_frontier["namespaces_before"]
