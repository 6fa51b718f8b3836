"""Measure what a link really carries: one bulk TCP stream from rank 0 to rank 1.

The shaped rate is a setting; this is the measurement that says whether traffic between
the ranks really crosses the shaped link, and at what rate (TCP and tbf overheads
included). Used by ``experiments/bench_links.py`` and the link tests.
"""
import subprocess
import sys
import time

from sparsecomm.links.netns import EmulatedNetwork

_PORT = 29411
# The receiver reports the bytes and the seconds from the first byte to the end of the stream.
_RECEIVER = f"""
import socket, sys, time
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", {_PORT}))
server.listen(1)
print("listening", flush=True)
conn, _ = server.accept()
received, first = 0, None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    if first is None:
        first = time.perf_counter()
    received += len(chunk)
print(received, time.perf_counter() - first, flush=True)
"""
_SENDER = """
import socket, sys
total = int(sys.argv[2])
conn = socket.create_connection((sys.argv[1], {port}))
block = bytes(1 << 20)
sent = 0
while sent < total:
    n = min(len(block), total - sent)
    conn.sendall(block[:n])
    sent += n
conn.close()
""".format(port=_PORT)


def stream_throughput(network: EmulatedNetwork | None, nbytes: int = 32 << 20, timeout_s: float = 120.0) -> float:
    """Bits per second of one TCP stream of ``nbytes`` from rank 0 to rank 1 (loopback: None network)."""
    def inside(rank: int, argv: list[str]) -> list[str]:
        return network.command(rank, argv) if network is not None else argv

    receiver = subprocess.Popen(inside(1, [sys.executable, "-c", _RECEIVER]), stdout=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "listening":
            raise RuntimeError("link probe: the receiver did not start")
        destination = network.address(1) if network is not None else "127.0.0.1"
        started = time.perf_counter()
        subprocess.run(inside(0, [sys.executable, "-c", _SENDER, destination, str(nbytes)]), check=True,
                       timeout=timeout_s)
        out, _ = receiver.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - started)))
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    received, seconds = out.split()
    if int(received) != nbytes:
        raise RuntimeError(f"link probe: sent {nbytes} bytes, received {received}")
    return int(received) * 8 / float(seconds)
