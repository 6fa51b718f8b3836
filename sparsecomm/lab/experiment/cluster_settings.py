"""Where an experiment's runs execute: one after another in this process (no cluster), or as
jobs through submitit, on this machine (``local``) or on a SLURM cluster (``slurm``).

The settings are the config's ``cluster`` field (a JSON object of these fields) and the
``--cluster``/``--parallel``/... arguments of ``compare``, ``frontier`` and ``scale``. They
change where and how many runs train at once, never what a run computes: they are not part
of the run hash, so a run trained one way is reused by the other.
"""
import re
from dataclasses import asdict, dataclass, field, fields

KINDS = ("local", "slurm")
DEFAULT_LOCAL_TIME_MIN = 7 * 24 * 60
"""A local job's time limit when none is given: a week (submitit's own default, 2 minutes,
would kill most runs). The run's stall timeout still ends a run that hangs."""
DEFAULT_SLURM_TIME_MIN = 60
MAX_TIME_MIN = 365 * 24 * 60
"""The longest time limit accepted: 365 days (SLURM takes minutes; an unbounded number would
be refused by sbatch, or overflow its 32 bits, only once the jobs are submitted)."""
RESERVED_SLURM_KEYS = ("array", "output", "error", "signal", "open-mode", "nodes", "ntasks", "ntasks-per-node",
                       "gpus", "gpus-per-node", "partition", "time", "job-name", "wckey")
"""sbatch options sparsecomm sets itself: refused in ``slurm`` (free-form), each named by the
setting that controls it, or fixed because the job protocol needs it (one task per node:
``ntasks``; GPUs per node: ``gpus``)."""
SLURM_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
"""An sbatch option's name, without its dashes (``_`` is written ``-``)."""


def slurm_option_problem(key, value, settings: str) -> str | None:
    """Why ``key=value`` cannot be a free-form sbatch option, or None; ``settings`` says where
    to set a reserved one instead. Each option becomes a line ``#SBATCH --key=value`` of the
    job's script: a newline (or another control character) would start a line of its own, a
    shell command or a directive past these checks; and sbatch takes any unambiguous beginning
    of an option for the option (``sig`` for ``signal``), so a key that begins a reserved one
    is refused with it."""
    if not isinstance(key, str) or SLURM_KEY.fullmatch(key) is None:
        return (f"{key!r} is not an sbatch option name (letters, digits, '-' and '_', starting with a letter, "
                "without the leading dashes)")
    option = key.replace("_", "-")
    reserved = next((name for name in RESERVED_SLURM_KEYS if name.startswith(option)), None)
    if reserved == option:
        return f"{key} is set by sparsecomm itself (see {settings})"
    if reserved is not None:
        return (f"{key} begins {reserved}, which sparsecomm sets itself (sbatch takes the beginning of an option for "
                f"the option; see {settings})")
    if value is True or (isinstance(value, int) and not isinstance(value, bool)):
        return None
    if not isinstance(value, str) or not value or not value.isprintable():
        return (f"the value of {key} must be true (a flag), an integer or non-empty printable text (no newline, "
                f"tab or other control character), got {value!r}")
    return None


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
        _check(self.partition is None or (isinstance(self.partition, str) and self.partition.strip() != ""
                                          and self.partition.isprintable()),
               "partition", "a non-empty string of printable characters", self.partition)
        _check(self.kind == "slurm" or self.partition is None, "partition", "unset with kind 'local'", self.partition)
        _check(self.time_min is None or (_positive_int(self.time_min) and self.time_min <= MAX_TIME_MIN), "time_min",
               f"an integer from 1 to {MAX_TIME_MIN} (minutes: at most 365 days)", self.time_min)
        _check(isinstance(self.slurm, dict), "slurm", "a JSON object of sbatch option -> value", self.slurm)
        _check(self.kind == "slurm" or not self.slurm, "slurm", "empty with kind 'local'", self.slurm)
        for key, value in self.slurm.items():
            problem = slurm_option_problem(key, value, "the settings nodes, tasks_per_node, gpus_per_node, partition, "
                                                       "time_min")
            if problem is not None:
                raise ValueError(f"cluster.slurm: {problem}")

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
