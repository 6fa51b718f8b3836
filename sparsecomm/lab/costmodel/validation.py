"""Validation: predict the per-arm step of a run measured on an emulated link from another
run's compute and compress plus the model (``sparsecomm project RUN_DIR --against OTHER``)."""
from dataclasses import dataclass, replace
from pathlib import Path

from sparsecomm.lab.costmodel.inputs import RunInputs, measured_alpha_s, read_run
from sparsecomm.lab.costmodel.projection import project_arm
from sparsecomm.lab.costmodel.scenario import Scenario, make_scenario
from sparsecomm.lab.results.quantity import Quantity
from sparsecomm.links.spec import parse_link


@dataclass(frozen=True)
class ValidationRow:
    arm: str
    predicted: Quantity  # modelled
    measured_step_s: float
    measured_comm_wait_s: float

    @property
    def relative_error(self) -> float:
        return (self.predicted.value - self.measured_step_s) / self.measured_step_s


@dataclass(frozen=True)
class Validation:
    source: RunInputs
    other: RunInputs
    scenario: Scenario
    rows: tuple[ValidationRow, ...]


def validate(source_dir: str | Path, other_dir: str | Path, *, alpha_us: float | None = None,
             overlap: bool = False, unpack_adds_per_s: float | None = None,
             alpha_from_run: bool = False) -> Validation:
    """Predict ``other_dir``'s per-arm step from ``source_dir``'s compute/compress + the model.

    The model is evaluated at the other run's link (its config ``link``) and world size.
    The source's own comm wait is dropped (on loopback it is the whole communication time
    at an unknown rate), as in every projection.
    """
    source, other = read_run(source_dir), read_run(other_dir)
    link = parse_link(other.link)
    if not link.emulated:
        raise ValueError(f"{other_dir}: measured on link {other.link!r}, whose rate is unknown: nothing to predict "
                         "(validate against a run with an emulated link, e.g. --link 1gbit)")
    scenario = make_scenario(other.world_size, link, alpha_us=alpha_us, overlap=overlap,
                             unpack_adds_per_s=unpack_adds_per_s)
    if alpha_from_run:
        alpha = measured_alpha_s(source)
        if alpha is None:
            raise ValueError(f"{source_dir}: --alpha-from-run needs a top-k arm to measure the per-message cost from")
        scenario = replace(scenario, alpha_s=alpha,
                           alpha_source="measured in the source run: its smallest sparse arm's comm wait less "
                                        "unpack, per message (this machine's fixed cost per collective)")
    rows = []
    for arm in source.arms:
        measured = other.arm(arm.arm)
        if measured is None:
            continue
        rows.append(ValidationRow(arm.arm, project_arm(arm, source, scenario).step, measured.step_s,
                                  measured.comm_wait_s))
    if not rows:
        raise ValueError(f"{source_dir} and {other_dir} share no arm")
    return Validation(source, other, scenario, tuple(rows))

