"""Where an experiment's runs execute: one after another in this process (no cluster), or as
jobs through submitit, on this machine (``local``) or on a SLURM cluster (``slurm``).

The settings are the config's ``cluster`` field (a JSON object of these fields) and the
``--cluster``/``--parallel``/... arguments of ``compare``, ``frontier`` and ``scale``. They
change where and how many runs train at once, never what a run computes: they are not part
of the run hash, so a run trained one way is reused by the other.
"""
from dataclasses import asdict, dataclass, field, fields

KINDS = ("local", "slurm")
DEFAULT_LOCAL_TIME_MIN = 7 * 24 * 60
"""A local job's time limit when none is given: a week (submitit's own default, 2 minutes,
would kill most runs). The run's stall timeout still ends a run that hangs."""
DEFAULT_SLURM_TIME_MIN = 60
RESERVED_SLURM_KEYS = ("array", "output", "error", "signal", "open-mode", "nodes", "ntasks-per-node",
                       "gpus-per-node", "partition", "time", "job-name", "wckey")
"""sbatch options sparsecomm sets itself: refused in ``slurm`` (free-form), each named by the
setting that controls it, or fixed because the job protocol needs it."""


def _check(ok: bool, name: str, accepted: str, value) -> None:
    if not ok:
        raise ValueError(f"cluster.{name} must be {accepted}, got {value!r}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, kw_only=True)
class ClusterSettings:
    kind: str
    """"local": each run is a job started as a local process group (submitit's LocalExecutor);
    "slurm": each run is one element of a SLURM job array (submitit's SlurmExecutor)."""
    parallel: int | None = None
    """At most this many runs at once; local default 1, SLURM default: every run of the array
    (SLURM's ``%N`` array throttle)."""
    nodes: int = 1
    """Nodes per run (SLURM). A run on several nodes starts one torchrun per node, joined by a
    c10d rendezvous on the first node; world_size = nodes x ranks per node."""
    tasks_per_node: int | None = None
    """Ranks per node (each a process under torchrun); default world_size / nodes."""
    gpus_per_node: int | None = None
    """GPUs to request per node (SLURM ``--gpus-per-node``); with it, one rank per GPU."""
    partition: str | None = None
    time_min: int | None = None
    """A job's time limit in minutes; a run that reaches it is requeued (up to 3 times) and
    resumes from its latest checkpoint. Default: 60 on SLURM, a week locally."""
    slurm: dict = field(default_factory=dict)
    """Further sbatch options, KEY -> VALUE (e.g. {"account": "ml", "qos": "high",
    "exclusive": true}), passed to submitit as ``slurm_additional_parameters``."""

    def __post_init__(self):
        _check(self.kind in KINDS, "kind", f"one of {KINDS}", self.kind)
        _check(self.parallel is None or _positive_int(self.parallel), "parallel", "an integer >= 1", self.parallel)
        _check(_positive_int(self.nodes), "nodes", "an integer >= 1", self.nodes)
        _check(self.kind == "slurm" or self.nodes == 1, "nodes", "1 with kind 'local' (one machine)", self.nodes)
        _check(self.tasks_per_node is None or _positive_int(self.tasks_per_node), "tasks_per_node",
               "an integer >= 1", self.tasks_per_node)
        _check(self.gpus_per_node is None or _positive_int(self.gpus_per_node), "gpus_per_node",
               "an integer >= 1", self.gpus_per_node)
        _check(self.gpus_per_node is None or self.tasks_per_node is None or self.tasks_per_node == self.gpus_per_node,
               "tasks_per_node", f"equal to gpus_per_node ({self.gpus_per_node}: one rank per GPU) when both are given",
               self.tasks_per_node)
        _check(self.partition is None or (isinstance(self.partition, str) and self.partition.strip() != ""),
               "partition", "a non-empty string", self.partition)
        _check(self.kind == "slurm" or self.partition is None, "partition", "unset with kind 'local'", self.partition)
        _check(self.time_min is None or _positive_int(self.time_min), "time_min", "an integer >= 1 (minutes)",
               self.time_min)
        _check(isinstance(self.slurm, dict) and all(isinstance(k, str) and k for k in self.slurm), "slurm",
               "a JSON object of sbatch option -> value", self.slurm)
        _check(self.kind == "slurm" or not self.slurm, "slurm", "empty with kind 'local'", self.slurm)
        taken = sorted(k for k in self.slurm if k.replace("_", "-") in RESERVED_SLURM_KEYS)
        _check(not taken, "slurm", f"free of the options sparsecomm sets itself {list(RESERVED_SLURM_KEYS)} "
               f"(use the settings nodes, tasks_per_node, gpus_per_node, partition, time_min)", taken)

    @property
    def time_limit_min(self) -> int:
        if self.time_min is not None:
            return self.time_min
        return DEFAULT_SLURM_TIME_MIN if self.kind == "slurm" else DEFAULT_LOCAL_TIME_MIN

    def ranks_per_node(self, world_size: int) -> int:
        return self.gpus_per_node or self.tasks_per_node or world_size // self.nodes

    def check_world_size(self, world_size: int) -> None:
        """ValueError unless the runs' ranks fill the nodes exactly."""
        per_node = self.ranks_per_node(world_size)
        if self.nodes * per_node != world_size:
            raise ValueError(f"cluster: world_size ({world_size}) must equal nodes ({self.nodes}) x ranks per node "
                             f"({per_node}, from {'gpus_per_node' if self.gpus_per_node else 'tasks_per_node' if self.tasks_per_node else 'world_size / nodes'})")

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, {})}

    @classmethod
    def from_dict(cls, raw) -> "ClusterSettings":
        if not isinstance(raw, dict):
            raise ValueError(f"cluster must be a JSON object of cluster settings, got {raw!r}")
        known = sorted(f.name for f in fields(cls))
        unknown = sorted(set(raw) - set(known), key=str)
        if unknown:
            raise ValueError(f"unknown cluster keys {unknown}; accepted keys: {known}")
        if "kind" not in raw:
            raise ValueError(f"cluster.kind is required, one of {KINDS}")
        return cls(**raw)
