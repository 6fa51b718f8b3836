"""The option table (sparsecomm/hooks/state/settings.py, the fields of TopKConfig) against what is
derived from it or must say the same: TopKState's signature and docstring, the docs table,
the lab's arm options, rank agreement and the checkpoint's settings."""
import inspect
import re
from pathlib import Path

import pytest
import torch

from sparsecomm import TopKState
from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.state.settings import markdown_table, options
from sparsecomm.hooks.state.rank_agreement import _COMPARED
from sparsecomm.lab.experiment.arm_spec import TOPK_OPTIONS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "options.md"
TABLE = options(TopKConfig)
# TopKState keywords that are not settings of the config: what the state is bound to.
STATE_ONLY = {"process_group", "module", "grad_scaler"}


def test_the_docs_table_is_the_one_the_code_generates():
    text = DOCS.read_text()
    assert markdown_table(TopKConfig) in text, (
        "docs/options.md differs from the option table: rewrite it with `python scripts/options_table.py`")


def test_topk_state_takes_every_option_with_the_tables_default():
    parameters = inspect.signature(TopKState.__init__).parameters
    keywords = {name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords - STATE_ONLY == set(TABLE)
    for name in TABLE:
        assert parameters[name].default == getattr(TopKConfig, name), name
        # density_schedule and budget are resolved when the state is built (budget None: "model" where it applies)
        resolved = {"density_schedule": TopKState().config.density_schedule, "budget": "model"}
        assert getattr(TopKState(), name) == resolved.get(name, getattr(TopKConfig, name))


def test_topk_state_docstring_names_every_option():
    doc = TopKState.__doc__
    missing = [name for name in TABLE if not re.search(rf"``{name}(``|=)|^\s+{name}:", doc, re.MULTILINE)]
    assert not missing


def test_every_choice_option_refuses_a_value_outside_its_choices_naming_it():
    for name, spec in TABLE.items():
        if spec.kind == "choice" and not spec.accepted:
            with pytest.raises(ValueError, match=name):
                TopKState(**{name: "no-such-choice"})


@pytest.mark.parametrize("name", [n for n, s in TABLE.items() if s.kind in ("real", "int")])
def test_numeric_options_refuse_values_below_their_range(name):
    spec = TABLE[name]
    below = spec.low if spec.low_open else spec.low - 1
    with pytest.raises(ValueError, match=name):
        TopKState(**{name: type(getattr(TopKConfig, name))(below)})


def test_what_is_derived_from_the_table():
    # The lab's arm options: every option but the run's seed and the overflow rule.
    assert set(TOPK_OPTIONS) == set(TABLE) - {"seed", "on_overflow"}
    # The ranks compare every setting but the audit switch.
    assert set(_COMPARED) == set(TABLE) - {"verify_conservation"}
    # A checkpoint holds what the memories depend on; the wire's settings only for a compact wire.
    plain = set(TopKConfig.build().checkpoint_dict())
    assert plain == {"density", "density_schedule", "error_feedback", "momentum", "nesterov", "local_clip_norm",
                     "warmup_steps", "selector", "value_dtype", "seed", "k_scope", "budget"}
    compact = TopKConfig.build(selector="chunk", value_codec="int4", exchange="owner").checkpoint_dict()
    assert set(compact) == plain | {"chunk_size", "index_codec", "value_codec", "exchange"}
    assert TopKConfig.build(value_dtype=torch.bfloat16).checkpoint_dict()["value_dtype"] == "torch.bfloat16"
