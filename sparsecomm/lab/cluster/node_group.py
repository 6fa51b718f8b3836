"""A run whose ranks span several nodes: one torchrun per node, joined by a c10d rendezvous.

The job has one task per node (SLURM starts them with ``srun``). The first node's torchrun
hosts the rendezvous store; every node's torchrun starts ``ranks_per_node`` ranks, and the
rendezvous numbers them 0 .. world_size - 1. The rendezvous id is the job's (array element
and requeue count included), so the nodes of one attempt meet each other and never an
earlier attempt's leftovers; it is also the launch id every process of the run carries.
"""
from dataclasses import dataclass

RENDEZVOUS_PORT_BASE = 29400
"""torchrun's c10d default port; a job adds its id modulo RENDEZVOUS_PORTS, so two runs of one
array on the same first node do not collide."""
RENDEZVOUS_PORTS = 1000


@dataclass(frozen=True)
class NodeGroup:
    nodes: int
    ranks_per_node: int
    first_node: str
    """Host name of the node that hosts the rendezvous (the job's first node)."""
    run_id: str
    node: int
    """This node's index in the job, 0 .. nodes - 1."""

    @property
    def port(self) -> int:
        digits = "".join(c for c in self.run_id if c.isdigit()) or "0"
        return RENDEZVOUS_PORT_BASE + int(digits) % RENDEZVOUS_PORTS

    def torchrun_arguments(self) -> list[str]:
        # is_host says who serves the store (torchrun would otherwise guess from the host name,
        # which fails where several "nodes" share a host, as in tests).
        return [f"--nnodes={self.nodes}", f"--nproc-per-node={self.ranks_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.first_node}:{self.port}", f"--rdzv-id={self.run_id}",
                f"--rdzv-conf=is_host={int(self.node == 0)}"]
