"""The frontier's points: one paired experiment per density (and value codec), named after it,
each sparse arm judged against that experiment's dense runs; the dense runs, which neither
the density nor the wire changes, run once per seed and are reused by the other points."""
from dataclasses import dataclass
from pathlib import Path

from sparsecomm.lab.experiment.config import ARM_NAMES
from sparsecomm.lab.sweep import UNAVAILABLE, run_point

SPARSE_ARMS = tuple(arm for arm in ARM_NAMES if arm.startswith("topk-"))


@dataclass(frozen=True)
class FrontierPoint:
    arm: str
    density: float
    verdict: str
    mean_loss_diff: float | None  # arm - dense, final validation loss, paired seeds
    steps_to_target: float | None  # median over seeds; None if not reached in some seed
    time_to_target_s: float | None
    bytes_per_step: float | None
    run_dir: str
    failed: int = 0  # this arm's runs that did not finish (any status but "ok")
    dense_failed: int = 0  # the same for dense at this density
    not_ok: str = ""  # their statuses, e.g. "arm: 1 interrupted; dense: 2 failed"
    value_codec: str | None = None  # swept with --value-codecs (None: the experiment's own)

    @property
    def label(self) -> str:
        """The arm, with the value codec when the frontier sweeps codecs."""
        return self.arm if self.value_codec is None else f"{self.arm} {self.value_codec}"


def _density_name(base: str, density: float | str) -> str:
    """The name of a frontier's experiment at ``density`` (a number, or a glob pattern)."""
    return f"{base}-frontier-d{density if isinstance(density, str) else format(density, 'g')}"


def _wire_parts(config, value_codec: str | None) -> list[str]:
    """The wire settings that are not the default, e.g. ["chunk", "rice", "int4"]."""
    parts = []
    if config.selector != "exact":
        parts.append(config.selector + ("" if config.chunk_size == 4096 else str(config.chunk_size)))
    if config.index_codec != "int32":
        parts.append(config.index_codec)
    if (value_codec or config.value_codec) is not None:
        parts.append(value_codec or config.value_codec)
    if config.exchange != "allgather":
        parts.append(config.exchange)
    return parts


def _experiment_name(config, density: float, value_codec: str | None) -> str:
    """``<base>-frontier-d<density>``, then the wire where it is not the default (so frontiers
    over different wires keep apart), e.g. ``...-d0.01-chunk-rice-int4``."""
    return "-".join([_density_name(config.name, density), *_wire_parts(config, value_codec)])


def frontier_stem(config, value_codecs) -> str:
    """Name of the frontier's summary and plot folder: ``<base>[-<wire>][-codecs]-frontier``."""
    parts = _wire_parts(config, value_codecs[0] if len(value_codecs) == 1 else None)
    return "-".join([config.name, *parts, *(["codecs"] if len(value_codecs) > 1 else []), "frontier"])


def point_config(config, density: float, arms, value_codec: str | None):
    """The experiment behind the points of one (density, value codec)."""
    overrides = {"value_codec": value_codec} if value_codec is not None else {}
    return config.with_overrides(arms=("dense", *arms), density=density,
                                 name=_experiment_name(config, density, value_codec), **overrides)


def _reuse_dense_runs(target, base_name: str, out_root: Path) -> None:
    """Copy finished dense runs from sibling frontier experiments (other densities and
    wires) into ``target`` when they are the same runs: the same run hash, which neither
    the density nor the wire settings enter for dense."""
    import shutil

    from sparsecomm.lab.experiment.files import private_directory
    from sparsecomm.lab.experiment.run_records import finished_ok, run_directory

    for seed in target.seeds:
        expected = target.run_hash("dense", seed)
        wanted = run_directory(target, out_root, "dense", seed)
        if wanted.exists():
            continue
        for done in sorted(out_root.glob(f"{_density_name(base_name, '*')}/runs/{wanted.name}")):
            if finished_ok(done, expected):
                private_directory(wanted.parent, out_root)  # never through a planted link
                shutil.copytree(done, wanted)
                break


def run_frontier(config, densities, arms, out_root: Path, value_codecs=(None,)) -> list[FrontierPoint]:
    """One paired experiment per density (and value codec); returns a point per (arm, density, codec)."""
    points = []
    for density, value_codec in [(d, c) for d in densities for c in value_codecs]:
        per_density = point_config(config, density, arms, value_codec)
        _reuse_dense_runs(per_density, config.name, out_root)
        codec_text = "" if value_codec is None else f", value codec {value_codec}"
        print(f"frontier: density {density:g}{codec_text}: {len(per_density.arms)} arms x {len(per_density.seeds)} "
              "seeds", flush=True)
        outcome = run_point(per_density, out_root)
        if not outcome.available:
            points += [FrontierPoint(arm, density, UNAVAILABLE, None, None, None, None, str(outcome.run_dir),
                                     **outcome.failures(arm), value_codec=value_codec) for arm in arms]
            continue
        for result in outcome.report.arms:
            entry = outcome.ledger.arm(result.arm)
            points.append(FrontierPoint(
                arm=result.arm,
                density=density,
                verdict=result.equivalence.verdict,
                mean_loss_diff=result.equivalence.mean_diff,
                steps_to_target=entry.steps_to_target.value,
                time_to_target_s=entry.time_to_target.value,
                bytes_per_step=entry.bytes_per_step.value,
                run_dir=str(outcome.run_dir),
                **outcome.failures(result.arm),
                value_codec=value_codec,
            ))
    return points


def sparsest_equivalent(points: list[FrontierPoint]) -> dict[str, FrontierPoint | None]:
    """Per arm (and value codec), the lowest density whose verdict is equivalent (or better)."""
    best: dict[str, FrontierPoint | None] = {}
    for point in points:
        best.setdefault(point.label, None)
        if point.verdict in ("equivalent", "better"):
            if best[point.label] is None or point.density < best[point.label].density:
                best[point.label] = point
    return best
