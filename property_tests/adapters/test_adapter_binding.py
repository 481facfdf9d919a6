"""``--bind KEY=VALUE``: where each role goes, where each result comes back, and a usage
error naming the port's signature when a binding does not fit it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m2po_oracle.adapters import Config, bind, map_metric_name, parse_value, policy_loss_config
from m2po_oracle.adapters.binding import METRIC_SOURCES
from m2po_oracle.cli.main import EXIT_UNUSABLE, main
from m2po_oracle.errors import UsageError

PORTS = Path(__file__).resolve().parents[2] / "fixtures" / "ports"
#: Every role's value as its own name in angle brackets: what a parameter got shows which role it was.
ROLES = ("logp", "behavior_logp", "advantages", "mask", "budget", "log_ratio", "ppo_kl", "m2po_mask", "cu_seqlens", "lengths")


def called_with(adapter: str, port, bindings: tuple[str, ...] = (), **values) -> dict:
    """What ``port`` (which returns its locals) receives from ``adapter`` under ``bindings``."""
    return bind(port, adapter, bindings)(**{role: f"<{role}>" for role in ROLES}, **values)


def release(
    old_log_prob, log_prob, advantages, response_mask, M2_budget, miniclip_low=None, miniclip_high=None, loss_agg_mode="token-mean"
):
    return dict(locals())


def release_renamed(old, new, adv, mask, m2_budget, clip_ratio_c):
    return dict(locals())


def registry(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
    return dict(locals())


def registry_cfg(old_log_prob, log_prob, advantages, response_mask, agg, cfg):
    return dict(locals())


def positional_only(a, b, c, d, /):
    return {"args": (a, b, c, d)}


def with_kwargs(log_ratio, advantages, mask, tau, **options):
    return dict(locals())


BINDINGS = [
    # (adapter, port, bindings, the parameters that must receive these values)
    (
        "verl_release",
        release,
        (),
        {
            "old_log_prob": "<behavior_logp>",
            "log_prob": "<logp>",
            "response_mask": "<mask>",
            "M2_budget": "<budget>",
            "loss_agg_mode": "token-mean",
        },
    ),
    ("verl_release", release, ("miniclip_low=None",), {"miniclip_low": None}),
    (
        "verl_release",
        release,
        ("miniclip_low=0.3", "loss_agg_mode=seq-mean-token-sum", "budget=M2_budget"),
        {"miniclip_low": 0.3, "loss_agg_mode": "seq-mean-token-sum", "M2_budget": "<budget>"},
    ),
    # No parameter of the family's names: by the family's positions; optional constants dropped.
    (
        "verl_release",
        release_renamed,
        ("clip_ratio_c=3.0",),
        {"old": "<behavior_logp>", "new": "<logp>", "adv": "<advantages>", "m2_budget": "<budget>", "clip_ratio_c": 3.0},
    ),
    ("verl_release", release_renamed, ("clip_ratio_c=3.0", "logp=old", "behavior_logp=1"), {"old": "<logp>", "new": "<behavior_logp>"}),
    ("mask_only", positional_only, (), {"args": ("<log_ratio>", "<advantages>", "<mask>", "<budget>")}),
    ("mask_only", with_kwargs, ("clip=0.2",), {"tau": "<budget>", "options": {"clip": 0.2}}),
]


@pytest.mark.parametrize("adapter, port, bindings, expected", BINDINGS, ids=lambda x: getattr(x, "__name__", None))
def test_each_role_reaches_the_parameter_the_binding_names(adapter, port, bindings, expected):
    received = called_with(adapter, port, bindings)
    assert {name: received[name] for name in expected} == expected


@pytest.mark.parametrize(
    "port, bindings, where",
    [
        (registry, (), ("policy_loss", "m2_budget")),  # the default: config.policy_loss.m2_budget (and the usual names)
        (registry, ("budget=config.actor.m2po.budget",), ("actor", "m2po", "budget")),
        (registry_cfg, (), ("policy_loss", "m2_budget")),  # by position: the config's path follows the parameter that takes it
    ],
)
def test_the_budget_goes_inside_the_config_where_bound(port, bindings, where):
    received = called_with("policy_loss", port, bindings, config=policy_loss_config(0.5))
    config = received.get("config", received.get("cfg"))
    value = config
    for part in where:
        value = getattr(value, part)
    assert value == "<budget>" and config.policy_loss.get("m2_budget") in ("<budget>", 0.5) and config["tau"] == 0.5


def config_only(old_log_prob, log_prob, advantages, response_mask, config):
    """A port that reads every setting from its config (config.loss_agg_mode, config.miniclip_low)."""
    return dict(locals())


def test_settings_and_a_family_constant_go_inside_an_argument():
    """--bind config.miniclip_low=0.3 sets a value inside the config the port receives, and
    --bind loss_agg_mode=config.loss_agg_mode moves the family's constant there (a port with
    no loss_agg_mode parameter was a usage error); a setting inside a parameter the port
    does not have is one too."""
    bindings = ("loss_agg_mode=config.loss_agg_mode", "config.miniclip_low=0.3", "config.clip.high=None")
    received = called_with("policy_loss", config_only, bindings, config=policy_loss_config(0.5))
    config = received["config"]
    assert config.loss_agg_mode == "token-mean" and config.miniclip_low == 0.3 and config.clip.high is None
    assert config.policy_loss.m2_budget == "<budget>" and "loss_agg_mode" not in received
    call = bind(config_only, "policy_loss", bindings)
    assert "config.loss_agg_mode='token-mean'" in call.describe_call() and "config.miniclip_low=0.3" in call.describe_call()
    with pytest.raises(UsageError, match="no parameter 'loss_agg_mode'"):
        bind(config_only, "policy_loss", ())
    with pytest.raises(UsageError, match="no parameter 'cfg' to hold the setting miniclip_low"):
        bind(config_only, "policy_loss", ("loss_agg_mode=config.loss_agg_mode", "cfg.miniclip_low=0.3"))


def test_outputs_are_read_where_bound_and_metrics_mapped_to_our_names():
    call = bind(lambda log_ratio, advantages, mask, tau: None, "mask_only", ("keep=1", "metrics=0.logged", "m2_after=2"))
    returned = ({"logged": {"actor/m2po_masked_fraction": 0.25, "M2_now": 0.5, "M2_after": 9.0, "pg_clipfrac": 1.0}}, "the mask", 0.125)
    assert call.read(returned, "keep") == "the mask"
    # Each metric says where in the return it was read (the port's own name included).
    assert call.metrics(returned) == {
        "masked_fraction": 0.25,
        "m2_before": 0.5,
        "m2_after": 0.125,
        METRIC_SOURCES: {
            "masked_fraction": "[0]['logged']['actor/m2po_masked_fraction']",
            "m2_before": "[0]['logged']['M2_now']",
            "m2_after": "[2]",
        },
    }
    plain = bind(lambda log_ratio, advantages, mask, tau: None, "mask_only")
    assert plain.read("bare", "keep") == "bare" and plain.read({"keep": "k", "m2_before": 1.0}, "keep") == "k"
    # A returned mapping is its own metrics.
    assert plain.metrics({"keep": "k", "m2_before": 1.0}) == {"m2_before": 1.0, METRIC_SOURCES: {"m2_before": "['m2_before']"}}
    assert plain.metrics({"keep": "k"}) == {}
    with pytest.raises(TypeError, match=r"keep: expected at \[0\]"):
        plain.read({"loss": 1}, "keep")


@pytest.mark.parametrize(
    "key, ours",
    [
        ("actor/m2po_masked_fraction", "masked_fraction"),
        ("m2po/m2_before", "m2_before"),
        ("M2_now", "m2_before"),
        ("m2po/M2", "m2_before"),
        ("valid_count", "valid_count"),
        ("M2_after", None),
        ("pg_clipfrac", None),
        (3, None),
    ],
)
def test_metric_names_are_mapped_only_where_the_meaning_is_ours(key, ours):
    assert map_metric_name(key) == ours


@pytest.mark.parametrize(
    "text, value",
    [
        ("None", None),
        ("0.3", 0.3),
        ("3", 3),
        ("'a b'", "a b"),
        ("token-mean", "token-mean"),
        ("[1, 2]", [1, 2]),
        ("config.policy_loss.m2_budget", "config.policy_loss.m2_budget"),
    ],
)
def test_values_are_python_literals_else_strings(text, value):
    assert parse_value(text) == value


def test_the_config_reads_as_attributes_get_items_and_membership():
    config = Config(a=1, nested=Config(b=2))
    assert config.a == 1 and config.get("a") == 1 and config["nested"]["b"] == 2 and "a" in config and config.get("missing", 7) == 7


def spec(port: str) -> str:
    return str(PORTS / port)


USAGE_ERRORS = [
    # (argv after "compare --impl", what stderr must say)
    (
        [spec("verl_release.py:compute_policy_loss"), "--adapter", "verl_release", "--bind", "budget=M2_budgt"],
        [
            "bind budget=M2_budgt: the port has no parameter 'M2_budgt'",
            "compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, M2_budget",
        ],
    ),
    (
        [spec("verl_release.py:compute_policy_loss_v2"), "--adapter", "verl_release"],
        [
            "parameter(s) 'clip_ratio_c' would receive nothing",
            "compute_policy_loss_v2(old_log_prob, log_prob, advantages, response_mask, m2_budget, clip_ratio_c",
        ],
    ),
    (
        [spec("verl_release.py:compute_policy_loss"), "--adapter", "verl_release", "--bind", "nope=1"],
        ["'nope' is neither a role of adapter verl_release"],
    ),
    (
        [spec("mask_only.py:select_mask_reordered"), "--adapter", "mask_only"],
        [
            "budget: the port has no parameter 'tau'",
            "already takes <advantages>",
            "select_mask_reordered(mask, log_ratio, budget, advantages)",
        ],
    ),
    ([spec("per_token_loss.py:m2po_per_token_loss"), "--adapter", "per_token_loss", "--bind", "budget=9"], ["has 5 positional parameters"]),
    (
        [spec("per_token_loss.py:m2po_per_token_loss"), "--adapter", "per_token_loss", "--bind", "keep=1", "--bind", "keep=0"],
        ["keep is bound twice"],
    ),
    ([spec("packed.py:packed_m2po"), "--adapter", "packed", "--bind", "budget"], ["expected KEY=VALUE"]),
    ([spec("packed.py:packed_m2po"), "--adapter", "packed", "--bind", "loss=.x"], ["expected where loss is in the return"]),
    (["core", "--bind", "budget=tau"], ["give --adapter NAME too"]),
    (["core", "--topology", "dp=2", "--bind", "budget=tau"], ["cannot honour", "--bind"]),
    (["trainer", "--bind", "budget=tau"], ["cannot honour", "--bind"]),
]


@pytest.mark.parametrize("argv, says", USAGE_ERRORS, ids=lambda x: x[-1] if isinstance(x, list) and x and "=" in x[-1] else None)
def test_a_wrong_binding_is_a_usage_error_naming_the_signature(argv, says, capsys):
    assert (
        main(
            ["compare", "--impl", *argv, "--examples", "2", "--in-process"]
            if "--topology" not in argv and argv[0] != "trainer"
            else ["compare", "--impl", *argv]
        )
        == EXIT_UNUSABLE
    )
    err = capsys.readouterr().err
    for text in says:
        assert text in err, err


def test_a_binding_outside_the_return_is_a_finding_naming_it(tmp_path):
    report = tmp_path / "r.json"
    argv = [
        "compare",
        "--impl",
        spec("per_token_loss.py:m2po_per_token_loss"),
        "--adapter",
        "per_token_loss",
        "--bind",
        "keep=5",
        "--examples",
        "3",
        "--in-process",
        "--json",
        str(report),
    ]
    assert main(argv) == EXIT_UNUSABLE  # every call fails: nothing but 'call' ran
    (counterexample,) = json.loads(report.read_text())["counterexamples"]
    assert "keep: expected at [5] of the return (--bind keep=5); got a tuple of 3 elements" in counterexample["mismatches"][0]["summary"]


def test_bind_resolves_once_before_any_call():
    with pytest.raises(UsageError, match="the port.s signature is"):
        bind(lambda a, b: None, "mask_only")


def test_the_plugin_takes_bindings_and_refuses_a_wrong_one(pytester):
    bad = pytester.runpytest_inprocess(
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "--m2po-impl",
        spec("verl_release.py:compute_policy_loss"),
        "--m2po-adapter",
        "verl_release",
        "--m2po-bind",
        "budget=M2_budgt",
        "--m2po-in-process",
    )
    bad.stdout.fnmatch_lines(["*usage error*bind budget=M2_budgt: the port has no parameter 'M2_budgt'*compute_policy_loss(old_log_prob*"])


def release_with_floors(
    old_log_prob, log_prob, advantages, response_mask, M2_budget, miniclip_low=0.3, miniclip_high=0.5, loss_agg_mode="token-mean"
):
    return dict(locals())


def test_an_unbound_optional_constant_leaves_the_port_its_own_default():
    """The release ships floors 0.3 / 0.5 as defaults: unbound, they are not overridden (they were: None)."""
    received = called_with("verl_release", release_with_floors, ())
    assert (received["miniclip_low"], received["miniclip_high"]) == (0.3, 0.5), received
    received = called_with("verl_release", release_with_floors, ("miniclip_low=None", "miniclip_high=None"))
    assert (received["miniclip_low"], received["miniclip_high"]) == (None, None), received
