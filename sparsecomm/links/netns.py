"""Emulated links: one Linux network namespace per rank, joined through a switch, shaped with tc.

Layout for ``world_size`` ranks (``N`` = a name unique to this process and network)::

    namespace sparsecomm-N-r0: eth0 10.213.0.1/24 --veth-- port scN-0 --+
    namespace sparsecomm-N-r1: eth0 10.213.0.2/24 --veth-- port scN-1 --+-- bridge (namespace sparsecomm-N-sw)
    ...

Every rank's link is shaped in both directions with a token-bucket filter (``tbf``) at the
link's rate: egress of the rank's ``eth0`` (what the rank sends) and egress of its switch
port (what it receives), like a full-duplex NIC on a switch. A latency (``1gbit@100us``)
adds a ``netem`` delay in front of each shaper, when the kernel has ``sch_netem``.

Addresses exist only inside the namespaces this class creates, so they cannot clash with
the machine's own networks, and the same subnet is reused by every network. Teardown
deletes the namespaces, which deletes their interfaces with them; it runs on normal exit,
on exceptions, on Ctrl-C and on SIGTERM (turned into an exception while the network
exists). :func:`stale_namespaces` lists namespaces that a killed process (SIGKILL) left
behind, and :func:`remove_stale_namespaces` deletes those whose creator is gone.

Needs root, ``ip`` and ``tc`` (iproute2), and network namespaces in the kernel;
:func:`check_emulation_possible` says which is missing before anything is created.
"""
import itertools
import os
import shutil
import signal
import subprocess
import threading
from contextlib import contextmanager

from sparsecomm.links.spec import Link

NAMESPACE_PREFIX = "sparsecomm-"
SUBNET = "10.213.0"
INTERFACE = "eth0"
STORE_PORT = 29500  # rank 0's TCPStore, inside rank 0's namespace: no clash with anything outside
_QUEUE_LATENCY = "20ms"  # how long tbf may queue a packet before dropping it
_counter = itertools.count()


class LinkEmulationError(RuntimeError):
    """The link cannot be emulated here (not root, no iproute2, no kernel support, ...)."""


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LinkEmulationError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.stdout.strip()}")


def _burst_bytes(rate_bits_per_s: float) -> int:
    # tbf's bucket: what the rate delivers in 1 ms, at least 64 KiB. Smaller buckets run
    # the link below its rate (timer granularity): a bulk TCP stream measured 0.62 Gb/s
    # through 1gbit with 16 KiB, 0.90 with 64 KiB, 0.96 with 128 KiB (= 1 ms); 8.7 Gb/s
    # through 10gbit with 256 KiB, 9.3 with 1.25 MB (= 1 ms). The price: after an idle
    # moment, up to 1 ms worth of bytes passes at the unshaped speed.
    return int(max(64 * 1024, rate_bits_per_s / 8 * 1e-3))


def check_emulation_possible(link: Link) -> None:
    """Raise LinkEmulationError naming what is missing to emulate ``link`` on this machine."""
    if not link.emulated:
        return
    missing = []
    if os.geteuid() != 0:
        missing.append("root (emulated links create network namespaces; run as root, or use --link loopback)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (package iproute2)")
    if missing:
        raise LinkEmulationError(f"cannot emulate link {link}: missing " + "; ".join(missing))


class EmulatedNetwork:
    """Namespaces and shaped links for ``world_size`` ranks; a context manager.

    ``command(rank, argv)`` wraps a command to run inside rank's namespace; rank r's
    address is ``address(r)`` on interface ``INTERFACE``.
    """

    def __init__(self, link: Link, world_size: int):
        if not link.emulated:
            raise ValueError(f"link {link} is not emulated: nothing to build (use it without EmulatedNetwork)")
        if not (isinstance(world_size, int) and 2 <= world_size <= 250):
            raise ValueError(f"world_size must be an integer in [2, 250], got {world_size!r}")
        self.link, self.world_size = link, world_size
        self.tag = f"{os.getpid()}-{next(_counter)}"
        self.switch = f"{NAMESPACE_PREFIX}{self.tag}-sw"
        self.ranks = [f"{NAMESPACE_PREFIX}{self.tag}-r{r}" for r in range(world_size)]
        self._created: list[str] = []

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def command(self, rank: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ranks[rank], *argv]

    def _port(self, rank: int) -> str:
        return f"sc{self.tag.replace('-', 'x')}p{rank}"[:15]  # interface names: at most 15 characters

    def _shape(self, namespace: str, device: str) -> None:
        rate = f"{self.link.rate_bits_per_s:.0f}bit"
        tbf = ["tbf", "rate", rate, "burst", str(_burst_bytes(self.link.rate_bits_per_s)), "latency", _QUEUE_LATENCY]
        tc = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device]
        if self.link.latency_s == 0:
            _run(*tc, "root", "handle", "1:", *tbf)
            return
        try:
            _run(*tc, "root", "handle", "1:", "netem", "delay", f"{self.link.latency_s * 1e6:.0f}us")
        except LinkEmulationError as error:
            raise LinkEmulationError(
                f"link {self.link} has a latency, which needs tc's netem qdisc (kernel module sch_netem); "
                f"this kernel refused it ({error}). Use the link without '@latency'.") from error
        _run(*tc, "parent", "1:1", "handle", "10:", *tbf)

    def up(self) -> "EmulatedNetwork":
        check_emulation_possible(self.link)
        remove_stale_namespaces()  # left behind by a SIGKILLed run: nothing can still use them
        try:
            self._add_namespace(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for rank, namespace in enumerate(self.ranks):
                self._add_namespace(namespace)
                port = self._port(rank)
                # Create the pair inside the switch namespace: no interface ever exists in ours.
                _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", INTERFACE,
                     "netns", namespace)
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
                _run("ip", "-n", namespace, "addr", "add", f"{self.address(rank)}/24", "dev", INTERFACE)
                _run("ip", "-n", namespace, "link", "set", INTERFACE, "up")
                _run("ip", "-n", namespace, "link", "set", "lo", "up")
                self._shape(namespace, INTERFACE)
                self._shape(self.switch, port)
        except BaseException:
            self.down()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def down(self) -> None:
        """Delete every namespace this network created (their interfaces go with them)."""
        while self._created:
            name = self._created.pop()
            _delete_namespace(name)

    def __enter__(self) -> "EmulatedNetwork":
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        if _in_main_thread():
            signal.signal(signal.SIGTERM, _raise_on_sigterm)
        try:
            return self.up()
        except BaseException:
            self._restore_sigterm()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if _in_main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through __exit__, which tears the network down


def namespaces() -> list[str]:
    """Names of this machine's network namespaces that sparsecomm created."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(NAMESPACE_PREFIX)]


def stale_namespaces() -> list[str]:
    """sparsecomm namespaces whose creating process no longer exists (it was SIGKILLed)."""
    stale = []
    for name in namespaces():
        pid = name[len(NAMESPACE_PREFIX):].split("-")[0]
        if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
            stale.append(name)
    return stale


def _delete_namespace(name: str) -> None:
    """Delete one namespace; its interfaces go with it (a missing one is no error)."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def remove_stale_namespaces() -> list[str]:
    removed = stale_namespaces()
    for name in removed:
        _delete_namespace(name)
    return removed


@contextmanager
def maybe_emulated(link: Link, world_size: int):
    """An EmulatedNetwork for an emulated link, None for loopback."""
    if not link.emulated:
        yield None
        return
    with EmulatedNetwork(link, world_size) as network:
        yield network
