"""The hook's option table: every ``TopKState`` setting written once, as a field of
:class:`~sparsecomm.hooks.config.TopKConfig` with an :class:`Option` in its metadata.

From the table come: the validation of each simple setting (:meth:`Option.check`), what
the ranks compare at the first hook call (``rank_agreement``), what a checkpoint must
match (``TopKConfig.checkpoint_dict``), the options a lab arm may set
(``lab.experiment.arm_spec.TOPK_OPTIONS``), and the options table of the docs
(:func:`markdown_table`; ``docs/options.md``, written by ``scripts/options_table.py`` and
checked against it by a test).
"""
import dataclasses
import math
import zlib


from sparsecomm.hooks.validation import VALUE_DTYPES, check_bool, check_choice, check_int, check_real, check_value_dtype

DTYPE_CHOICES = (None, *VALUE_DTYPES)  # a wire or memory dtype, or None


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting: how it is checked, what it means, and where it matters.

    ``kind``: "real" (in ``low``..``high``, each end open or closed), "int" (>= ``low``,
    <= ``high`` if given), "bool", "choice" (one of ``choices``), "dtype" (None or one of
    the wire's float dtypes), or "custom" (checked by ``TopKConfig.build`` itself;
    ``accepted`` says what it takes). A "choice" whose ``accepted`` is set is resolved by
    ``TopKConfig.build`` too (it depends on other settings). ``agree``: compared
    across ranks at the first hook call. ``arm``: a lab arm may set it. ``checkpoint``:
    "always", "wire" (with ``selector="chunk"`` or a compact wire), "if-set" (when not the
    default), or "never" (what travels, not what the memories hold).
    """

    doc: str
    kind: str = "custom"
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    accepted: str = ""
    condition: str = ""  # what else the value needs, as the docs say it after the range
    agree: bool = True
    arm: bool = True
    checkpoint: str = "always"

    def check(self, name: str, value):
        """``value`` checked (TypeError/ValueError naming ``name`` and the accepted range)."""
        if self.kind == "real":
            return check_real(name, value, self.low, self.high, low_open=self.low_open, high_open=self.high_open)
        if self.kind == "int":
            return check_int(name, value, int(self.low), None if self.high is None else int(self.high))
        if self.kind == "bool":
            return check_bool(name, value)
        if self.kind == "choice":
            return check_choice(name, value, self.choices)
        if self.kind == "dtype":
            return check_value_dtype(value, name=name)
        raise TypeError(f"{name} is checked by TopKConfig.build, not by its option")

    def accepted_text(self) -> str:
        """The accepted range as the docs show it (and what else it needs)."""
        return self._range_text() + (f"; {self.condition}" if self.condition else "")

    def _range_text(self) -> str:
        if self.accepted:
            return self.accepted
        if self.kind == "real":
            high = "inf" if self.high == math.inf else f"{self.high:g}"
            return f"a number in {'(' if self.low_open else '['}{self.low:g}, {high}{')' if self.high_open else ']'}"
        if self.kind == "int":
            return f"an integer >= {int(self.low)}" if self.high is None else \
                f"an integer in [{int(self.low)}, {int(self.high)}]"
        if self.kind == "bool":
            return "`True`, `False`"
        if self.kind == "choice":
            return ", ".join(_code(c) for c in self.choices)
        return ", ".join(_code(c) for c in DTYPE_CHOICES)


def _code(value) -> str:
    """A value as the docs show it: ``None``, ``"text"``, ``torch.float32``."""
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def option(default, doc: str, **spec):
    """A TopKConfig field whose metadata is its :class:`Option`."""
    return dataclasses.field(default=default, metadata={"option": Option(doc, **spec)})


def options(config_class) -> dict[str, Option]:
    """name -> Option of every field of ``config_class``, in field order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(config_class)}


def fingerprint(value) -> float:
    """A value no float64 holds (a list, a name) as one: the CRC-32 of its repr, equal on two
    ranks exactly when the values are (but for a collision, 1 in 2**32)."""
    return float(zlib.crc32(repr(value).encode()))


def agreement_value(name: str, spec: Option, value) -> float:
    """A setting as one float64 that is equal on two ranks exactly when the settings are."""
    if spec.kind in ("choice", "dtype"):
        return float(_choices(spec).index(value))
    if spec.kind == "custom":
        if name == "local_clip_norm":
            return -1.0 if value is None else float(value)
        to_list = getattr(value, "to_list", None)  # a density schedule; else a link name or None
        return fingerprint(to_list() if to_list is not None else value)
    return float(value)


def shown_value(name: str, spec: Option, value: float):
    """How an agreement value is shown in the error that names a setting the ranks disagree on."""
    if spec.kind in ("choice", "dtype"):
        choice = _choices(spec)[int(value)]
        return None if choice is None else str(choice) if spec.kind == "dtype" else choice
    if spec.kind == "custom":
        if name == "local_clip_norm":
            return None if value == -1.0 else int(value) if value.is_integer() else value
        return f"{name.replace('_', ' ')} #{int(value):08x}"
    return value if spec.kind == "real" else int(value)


def _choices(spec: Option) -> tuple:
    return DTYPE_CHOICES if spec.kind == "dtype" else spec.choices


def markdown_table(config_class) -> str:
    """The options table of the docs, one row per setting: name | default | accepted | meaning."""
    rows = ["| name | default | accepted | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(config_class):
        spec = field.metadata["option"]
        rows.append(f"| `{field.name}` | {_code(field.default)} | {spec.accepted_text()} | {spec.doc} |")
    return "\n".join(rows) + "\n"
