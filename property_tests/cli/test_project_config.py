"""m2po-oracle in a port's own CI: [tool.m2po-oracle], accepted deviations, CLI conventions."""

from __future__ import annotations

import json
import textwrap

import pytest

from m2po_oracle.call.controls import control
from m2po_oracle.cli.config import parse_section
from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE, main
from m2po_oracle.compare.explore import Exploration
from m2po_oracle.compare.search import run_compare
from m2po_oracle.errors import UsageError

#: Caught on the first examples of seed 0 (loss and gradient), diagnosed exactly.
DEVIATION = "kept_count_denominator"


def _project(tmp_path, monkeypatch, section: str) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'port'\nversion = '0'\n\n[tool.m2po-oracle]\n" + textwrap.dedent(section))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"exmaples": 10}, "unknown key 'exmaples'; closest matches: examples"),
        ({"examples": "many"}, "examples: expected a positive integer"),
        ({"dtype": "float8"}, "dtype: expected one of"),
        ({"in-process": "yes"}, "in-process: expected true or false"),
        ({"accept": [{"deviation": "clamped_log_rati"}]}, "unknown deviation 'clamped_log_rati'; closest matches: clamped_log_ratio"),
        ({"accept": [{"deviation": DEVIATION, "why": "x"}]}, "unknown key(s) ['why']"),
        ({"accept": "clamped_log_ratio"}, "accept: expected a list of tables"),
        ({"bind": 3}, "bind: expected a list of"),
    ],
)
def test_a_bad_configuration_names_the_key_and_what_was_expected(section, named):
    with pytest.raises(UsageError, match=None) as raised:
        parse_section(section)
    assert named in str(raised.value), raised.value


def test_the_configuration_converts_like_the_flags():
    project = parse_section(
        {
            "impl": "port.py:f",
            "examples": 30,
            "compute-dtype": "float32",
            "bind": {"budget": "M2_budget", "miniclip_low": None},
            "accept": [DEVIATION],
            "strict": False,
            "topology": "dp=2",
        }
    )
    assert project.impl == "port.py:f" and project.values["examples"] == 30 and project.values["compute_dtype"] == "float32"
    assert project.values["bind"] == ("budget=M2_budget", "miniclip_low=None")
    assert str(project.values["topology"]) == "dp=2,cp=1,tp=1" and not project.strict
    assert project.merged({"examples": 5, "seed": None})["examples"] == 5  # a flag overrides the file


def test_plain_compare_reads_the_project_and_accepts_its_deviation(tmp_path, monkeypatch, capsys):
    _project(
        tmp_path,
        monkeypatch,
        f"""\
        impl = "control:{DEVIATION}"
        examples = 30
        in-process = true
        accept = [{{deviation = "{DEVIATION}", reason = "token-mean over kept tokens", link = "https://example.org/1"}}]
        """,
    )
    assert main(["compare", "--json", "r.json"]) == EXIT_EQUIVALENT
    out = capsys.readouterr().out
    assert "verdict: equivalent-with-accepted" in out and f"accepted: {DEVIATION} (token-mean over kept tokens)" in out
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["verdict"] == "equivalent-with-accepted" and record["accepted"][0]["shown"] and "loss" in record["accepted"][0]["checks"]


def test_an_accepted_deviation_that_no_longer_shows_fails_unless_not_strict(tmp_path, monkeypatch, capsys):
    _project(
        tmp_path,
        monkeypatch,
        f"""\
        impl = "core"
        examples = 20
        in-process = true
        accept = [{{deviation = "{DEVIATION}", reason = "was there"}}]
        """,
    )
    assert main(["compare", "-q"]) == EXIT_DIVERGENT
    assert f"accepted deviation {DEVIATION} no longer shows" in capsys.readouterr().out
    (tmp_path / "pyproject.toml").write_text((tmp_path / "pyproject.toml").read_text() + "strict = false\n")
    assert main(["compare", "-q"]) == EXIT_EQUIVALENT


def test_a_failure_no_accepted_deviation_explains_stays_divergent(capsys):
    assert (
        main(["compare", "--impl", "control:strict_stop", "--in-process", "--examples", "60", "--accept", DEVIATION, "-q"])
        == EXIT_DIVERGENT
    )
    out = capsys.readouterr().out
    assert "FAIL selection.minimal" in out and "(strict_stop)" in out and "verdict: divergent" in out


def test_the_plugin_reads_the_project_and_reports_accepted_deviations_as_xfail(pytester):
    pytester.makepyprojecttoml(f"""\
        [tool.m2po-oracle]
        impl = "control:{DEVIATION}"
        examples = 30
        in-process = true
        accept = [{{deviation = "{DEVIATION}", reason = "token-mean over kept tokens"}}, {{deviation = "strict_stop", reason = "gone"}}]
        """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rxf")
    outcomes = result.parseoutcomes()
    assert outcomes.get("xfailed", 0) >= 3, outcomes  # loss, gradient and the accept item itself
    assert outcomes.get("failed") == 1, outcomes  # strict_stop no longer shows
    result.stdout.fnmatch_lines(["*accept:strict_stop*", "*no longer shows*remove it from accept*"])


def test_checks_narrows_the_run_and_a_pattern_matching_nothing_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert (
        main(["compare", "--impl", "core", "--in-process", "--examples", "10", "--checks", "selection.*,loss", "--json", str(path)])
        == EXIT_EQUIVALENT
    )
    names = [c["name"] for c in json.loads(path.read_text())["checks"]]
    assert names == [
        "call",
        "selection.keep_only_valid",
        "selection.only_trust_region_masked",
        "selection.budget",
        "selection.minimal",
        "selection.largest_removed_first",
        "loss",
    ]
    assert main(["compare", "--impl", "core", "--in-process", "--checks", "selectoin.*"]) == EXIT_UNUSABLE
    assert "matches none of this run's checks" in capsys.readouterr().err


def test_exitfirst_stops_at_the_first_failing_example(tmp_path):
    path = tmp_path / "r.json"
    assert (
        main(["compare", "--impl", f"control:{DEVIATION}", "--in-process", "--examples", "200", "-x", "--no-shrink", "--json", str(path)])
        == EXIT_DIVERGENT
    )
    record = json.loads(path.read_text())
    assert record["examples"] == max(c["first_failure_at"] or 0 for c in record["checks"]) and "--max-failures 1" in record["stopped_early"]


def test_no_shrink_reports_the_first_failing_example_and_skip_validation_says_so(monkeypatch):
    from m2po_oracle.compare import shrink

    monkeypatch.setattr(shrink, "shrink_to_minimal", lambda *a, **k: pytest.fail("--no-shrink must not shrink"))
    report = run_compare(control(DEVIATION).fn, DEVIATION, examples=20, exploration=Exploration(shrink=False, skip_validation=True))
    assert report.counterexamples and report.validation == [] and report.validation_not_run == "skipped (--skip-validation)"


def test_failing_examples_replay_first_from_the_hypothesis_database(tmp_path):
    database = str(tmp_path / "db")
    first = run_compare(control("strict_stop").fn, "strict_stop", examples=200, exploration=Exploration(database=database))
    assert first.tallies["selection.minimal"].first_failure_at > 1
    again = run_compare(control("strict_stop").fn, "strict_stop", examples=200, exploration=Exploration(database=database))
    assert again.tallies["selection.minimal"].first_failure_at == 1


def test_version_and_help_state_defaults_exit_codes_and_an_example(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("m2po-oracle ")
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = capsys.readouterr().out
    assert "exit status:" in text and "equivalent-with-accepted" in text and "example:" in text and "default 500" in text
