"""The budget is read under one table of names, by ``--adapter``'s policy-loss config and by
``capture.watch`` alike: a port that names it ``M2_budget`` is read by both, or by neither."""

from __future__ import annotations

import inspect

import pytest

from m2po_oracle.adapters.families import BUDGET_NAMES, policy_loss_config
from m2po_oracle.capture.watch_reading import ALIASES, default_readers


@pytest.mark.parametrize("name", BUDGET_NAMES)
def test_a_budget_under_any_of_its_names_is_read_by_the_watch_and_carried_by_the_config(name):
    def port(logp, behavior_logp, advantages, mask, **budget):
        return None

    parameters = inspect.signature(port).parameters
    tau = default_readers("port", {**parameters, name: inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY)})["tau"]
    assert tau is not None and tau.read(None, (), {name: 0.25}, None) == 0.25
    config = policy_loss_config(0.25)
    assert getattr(config, name) == config.get(name) == config[name] == config.policy_loss[name] == 0.25


def test_the_adapters_read_the_budget_under_the_watchs_names():
    assert ALIASES["tau"] == BUDGET_NAMES
    assert {"tau", "budget", "m2_threshold", "M2_budget"} <= set(BUDGET_NAMES)
