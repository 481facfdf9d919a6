"""An option's default has one home (``call.options.RunOptions``): the flags' help states it
from there, and no help repeats a default by hand."""

from __future__ import annotations

import dataclasses

from m2po_oracle.call.options import RunOptions, run_defaults
from m2po_oracle.cli.options import COMPARE_OPTIONS, RUN_SETTINGS, Option


def test_every_help_states_the_runs_default_from_its_one_home():
    defaults = run_defaults()
    for option in COMPARE_OPTIONS:
        assert "(default " not in option.help, f"{option.flag}: the help repeats a default by hand"
        default = defaults[option.name]
        if default not in (None, False, ()):
            assert option.help_text.endswith(f"(default {default:g})" if isinstance(default, float) else f"(default {default})")
    assert not any("(default " in o.help for o in RUN_SETTINGS)


def test_a_changed_default_shows_in_the_help(monkeypatch):
    from m2po_oracle.cli import options

    monkeypatch.setitem(options.RUN_DEFAULTS, "examples", 40)
    examples = next(o for o in COMPARE_OPTIONS if o.name == "examples")
    assert examples.help_text.endswith("(default 40)")


def test_every_compare_option_has_a_field_of_the_run():
    names = {f.name for f in dataclasses.fields(RunOptions)} - {"given"}
    assert {o.name for o in COMPARE_OPTIONS} == names
    assert isinstance(COMPARE_OPTIONS[0], Option)
