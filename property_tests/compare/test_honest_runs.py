"""A report states only what was observed; options are honoured or refused; a misbehaving
implementation (raising, dying, hanging, printing, not loading, interrupted) is a finding
with a report, never a crash or a false pass."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from m2po_oracle.call.runner import RunOptions
from m2po_oracle.cli.launch import open_runner
from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_INTERRUPTED, EXIT_UNUSABLE, main
from m2po_oracle.errors import UsageError
from m2po_oracle.report.html import render_html

STAND_INS = textwrap.dedent("""
    import os, sys
    from m2po_oracle.core.loss import m2po_loss

    def raises_inside(logp, behavior_logp, advantages, mask, *, tau):
        # A port whose arithmetic dereferences None: it never refuses anything on purpose.
        state = None
        return state.double()

    def dies(*args, **kwargs):
        os._exit(3)

    def chatty(logp, behavior_logp, advantages, mask, *, tau):
        for i in range(50):
            print(f"debug line {i}")
        print("warning on stderr", file=sys.stderr)
        return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)

    def chatty_native(logp, behavior_logp, advantages, mask, *, tau):
        os.write(1, b"native output\\n")
        return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)

    class PortValidationError(Exception):
        pass

    def own_error(logp, behavior_logp, advantages, mask, *, tau):
        if behavior_logp is None or not isinstance(tau, float) or tau != tau or tau < 0:
            raise PortValidationError("invalid input")
        return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)

    def slow(logp, behavior_logp, advantages, mask, *, tau):
        import os, time
        if os.environ.get("M2PO_TEST_CALLED"):  # tells a test that exploration has begun
            open(os.environ["M2PO_TEST_CALLED"], "a").close()
        time.sleep(0.2)
        return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)

    def imported_helper_only():
        return 1
""")


@pytest.fixture(scope="module")
def ports(tmp_path_factory):
    path = tmp_path_factory.mktemp("ports") / "stand_ins.py"
    path.write_text(STAND_INS)
    return path


def _json(path):
    return json.loads(path.read_text())


# --- reports list only what ran ----------------------------------------------------------------


def test_a_single_process_report_lists_only_its_own_checks(tmp_path):
    assert main(["compare", "--impl", "core", "--examples", "20", "--in-process", "--json", str(tmp_path / "r.json")]) == EXIT_EQUIVALENT
    names = [c["name"] for c in _json(tmp_path / "r.json")["checks"]]
    assert names and not [n for n in names if n.startswith(("distributed.", "trainer."))], names


def test_a_port_that_raises_inside_is_unusable_and_claims_no_pass(ports, tmp_path):
    code = main(
        [
            "compare",
            "--impl",
            f"{ports}:raises_inside",
            "--examples",
            "10",
            "--json",
            str(tmp_path / "r.json"),
            "--html",
            str(tmp_path / "r.html"),
        ]
    )
    assert code == EXIT_UNUSABLE
    data = _json(tmp_path / "r.json")
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    assert statuses.pop("call") == "fail" and set(statuses.values()) == {"not run"}, statuses
    assert data["validation"]["probes"] == [] and data["validation"]["not_run"]
    assert data["diagnosis"]["status"] == "not_run"
    html = (tmp_path / "r.html").read_text()
    assert "no divergence" not in html.lower() and "fails closed" not in html and ">pass<" not in html
    assert html.index('id="unusable-note"') < html.index('id="checks"')


def test_a_probe_crash_inside_the_port_is_not_a_rejection(ports):
    from m2po_oracle.call.isolation import InProcess
    from m2po_oracle.call.resolve import load_attribute

    # A port that crashes on valid input too: its crash on the probe says nothing about the
    # invalid input, so the probe is not run (neither rejected nor "crashed on invalid input").
    crashing = InProcess(load_attribute(f"{ports}:raises_inside")).probe("behavior_logp_missing")
    assert crashing.status == "not run" and "raises on the valid batch" in crashing.message and "AttributeError" in crashing.message
    own = load_attribute(f"{ports}:own_error")
    assert InProcess(own).probe("behavior_logp_missing").status == "crashed"
    assert InProcess(own, rejecting=("PortValidationError",)).probe("behavior_logp_missing").status == "rejected"


def test_validation_errors_names_a_ports_own_refusal(ports, tmp_path):
    argv = ["compare", "--impl", f"{ports}:own_error", "--examples", "5", "--json", str(tmp_path / "r.json")]
    main(argv)
    assert {p["status"] for p in _json(tmp_path / "r.json")["validation"]["probes"]} >= {"crashed"}
    main([*argv, "--validation-errors", "PortValidationError"])
    statuses = {p["probe"]: p["status"] for p in _json(tmp_path / "r.json")["validation"]["probes"]}
    assert statuses["behavior_logp_missing"] == "rejected" and statuses["negative_tau"] == "rejected"


# --- options are honoured or refused -------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, values, named",
    [
        ("core", {"in_process": True, "timeout": 5.0}, "--timeout"),
        ("core", {"topology": "dp=2", "adapter": "mask_only"}, "--adapter"),
        ("core", {"topology": "dp=2", "in_process": True}, "--in-process"),
        ("trainer", {"timeout": 5.0}, "--timeout"),
        ("trainer", {"adapter": "policy_loss"}, "--adapter"),
    ],
)
def test_an_option_a_runner_cannot_honour_is_a_usage_error(spec, values, named):
    from m2po_oracle.distributed.topology import Topology

    if "topology" in values:
        values = {**values, "topology": Topology.parse(values["topology"])}
    with pytest.raises(UsageError, match=named):
        open_runner(spec, RunOptions.from_values(values))


def test_the_cli_exits_2_on_an_unhonoured_option(capsys):
    assert main(["compare", "--impl", "core", "--in-process", "--timeout", "5"]) == EXIT_UNUSABLE
    assert "cannot honour --timeout" in capsys.readouterr().err


def test_compute_dtype_reaches_the_distributed_checks():
    from m2po_oracle.distributed.topology import Topology

    runner = open_runner(
        "core", RunOptions.from_values({"topology": Topology.parse("dp=2"), "dtype": "float32", "compute_dtype": "float64"})
    )
    assert runner.options.effective_compute_dtype == "float64"
    assert "--compute-dtype float64" in runner.replay_command(__import__("m2po_oracle.judge.validation", fromlist=["CLEAN"]).CLEAN)


# --- misbehaving implementations ---------------------------------------------------------------


def test_a_process_that_dies_on_every_call_stops_early(ports, tmp_path):
    started = time.monotonic()
    assert main(["compare", "--impl", f"{ports}:dies", "--json", str(tmp_path / "r.json")]) == EXIT_UNUSABLE
    data = _json(tmp_path / "r.json")
    assert data["examples"] == 5 and "died on each of the first 5 calls" in data["stopped_early"], data["stopped_early"]
    # Not shrunk (each smaller batch would only die too, in a fresh process), and it says so.
    (counterexample,) = data["counterexamples"]
    assert "died on every call" in counterexample["shrink_stopped"], counterexample["shrink_stopped"]
    assert time.monotonic() - started < 30


def test_after_two_timeouts_the_probes_are_not_run(tmp_path):
    path = tmp_path / "hang.py"
    path.write_text("import time\ndef hang(*a, **k):\n    time.sleep(600)\n")
    started = time.monotonic()
    assert main(["compare", "--impl", f"{path}:hang", "--timeout", "1", "--json", str(tmp_path / "r.json")]) == EXIT_UNUSABLE
    data = _json(tmp_path / "r.json")
    assert data["validation"]["probes"] == [] and "hangs" in data["validation"]["not_run"]
    assert time.monotonic() - started < 30, "the validation probes waited out the timeout"


def test_what_a_port_prints_is_captured_per_call_and_summarised(ports, tmp_path, capfd):
    assert main(["compare", "--impl", f"{ports}:chatty", "--examples", "4", "--json", str(tmp_path / "r.json")]) == EXIT_EQUIVALENT
    out = capfd.readouterr().out
    assert "debug line 7" not in out and "printed" in out  # the summary shows the first five lines only
    output = _json(tmp_path / "r.json")["implementation_output"]
    assert output["lines"] >= 4 * 51 and output["first_lines"][:2] == ["debug line 0", "debug line 1"]
    assert main(["compare", "--impl", f"{ports}:chatty_native", "--examples", "3", "--json", str(tmp_path / "n.json")]) == EXIT_EQUIVALENT
    assert "native output" in _json(tmp_path / "n.json")["implementation_output"]["first_lines"]
    assert "native output" not in capfd.readouterr().out.replace("| native output", ""), "fd-level output reached the terminal"
    # The worker comes from a forkserver started before capfd: read --show-output from a fresh process.
    shown = subprocess.run(
        [sys.executable, "-m", "m2po_oracle", "compare", "--impl", f"{ports}:chatty", "--examples", "1", "--show-output"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == EXIT_EQUIVALENT and "debug line 7" in shown.stdout + shown.stderr


# --- load errors --------------------------------------------------------------------------------


def test_a_syntax_error_is_reported_as_file_line_col_and_written(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def port(x):\n    return (x +\n")
    code = main(["compare", "--impl", f"{broken}:port", "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html")])
    assert code == EXIT_UNUSABLE
    err = capsys.readouterr().err
    assert f"{broken}:2:12: SyntaxError: '(' was never closed" in err and ", ('" not in err, err
    data = _json(tmp_path / "r.json")
    assert data["verdict"] == "unusable" and "SyntaxError" in data["load_error"] and data["checks"] == []
    assert "could not be loaded" in render_html(data)


def test_closest_matches_come_from_names_the_module_defines(ports, capsys):
    assert main(["compare", "--impl", f"{ports}:chaty"]) == EXIT_UNUSABLE
    err = capsys.readouterr().err
    assert "closest matches: chatty" in err
    assert main(["compare", "--impl", f"{ports}:m2po_los"]) == EXIT_UNUSABLE
    assert "m2po_loss" not in capsys.readouterr().err, "offered a name the module only imports"


# --- Ctrl-C -------------------------------------------------------------------------------------


def test_ctrl_c_writes_the_partial_report_and_exits_130(ports, tmp_path):
    report = tmp_path / "r.json"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "m2po_oracle",
            "compare",
            "--impl",
            f"{ports}:slow",
            "--examples",
            "500",
            "--json",
            str(report),
            "--html",
            str(tmp_path / "r.html"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "M2PO_TEST_CALLED": str(tmp_path / "called")},
        # As a terminal's shell starts it: SIGINT handled. A child inherits an ignored SIGINT, and
        # Python then installs no KeyboardInterrupt handler; an earlier test in the same xdist
        # worker left it ignored, so the run went on to all 500 examples and timed out.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Interrupt once exploration has begun (a fixed sleep raced a loaded machine's start-up), after a few 0.2 s calls.
    deadline = time.monotonic() + 180
    while not (tmp_path / "called").exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal does: the whole process group
    out, err = process.communicate(timeout=60)
    assert process.returncode == EXIT_INTERRUPTED, (out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    data = _json(report)
    assert data["verdict"] == "interrupted" and 0 < data["examples"] < 500
    assert (tmp_path / "r.html").is_file()


def test_exit_statuses_stay_documented():
    assert (EXIT_EQUIVALENT, EXIT_DIVERGENT, EXIT_UNUSABLE, EXIT_INTERRUPTED) == (0, 1, 2, 130)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: __import__("m2po_oracle.trainer.cases", fromlist=["TrainerCase"]).TrainerCase(
                seed=0, prompts=1, group_size=2, prompt_len=1, max_new_tokens=1, lags=(0,), staleness_lr=0.02, tau=0.04, split=(2,), cut=0
            ),
            "^cut: expected None or a positive integer",
        ),
        (lambda: RunOptions.from_values({"exmaples": 5}), r"^options: unknown option\(s\) \['exmaples'\]"),
    ],
)
def test_new_arguments_are_checked_with_their_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()
