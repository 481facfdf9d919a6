"""The fields of the compare report (``m2po-oracle compare --json``), key path by key path.

Built by :meth:`m2po_oracle.compare.report.CompareReport.to_json` (and ``options.dtype_why`` by
the command); the HTML report is rendered from it and nothing else. ``schema.py`` holds this
with the other records; ``property_tests/report/test_json_schema.py`` holds it to real runs.
"""

from __future__ import annotations

from m2po_oracle.report.fields import Declared, Field, FromDataclass

DISTRIBUTED = "distributed runs only (--topology)"
ADAPTED = "with --adapter only"
DIVERGENT = "a divergent run's diagnosis only"
#: The diagnosis of a run whose implementation could not be loaded has only status, examples_compared,
#: matches and closest.
LOADED = "absent where the implementation could not be loaded"


def _result(path: str, what: str) -> Field:
    return Field(path, "map of number", what, keys="`loss`, then each metric and count the result has "
                 "(`METRIC_FIELDS`, `COUNT_FIELDS` of `m2po_oracle.oracle.record`)")


def _batch(prefix: str) -> FromDataclass:
    grid = "array of array of number"
    return FromDataclass(prefix, "m2po_oracle.oracle.batch:Batch", {
        "logp": "log-probs of the current policy, [B, T]",
        "behavior_logp": "log-probs of the behaviour policy, [B, T]",
        "advantages": "advantages, [B, T]",
        "valid": "the loss mask, 1 on a valid token, 0 on padding, [B, T]",
        "tau": "the second-moment budget",
    }, types={"logp": grid, "behavior_logp": grid, "advantages": grid, "valid": "array of array of integer"})


def _collectives(path: str, what: str) -> tuple[Field, ...]:
    return (Field(path, "map of object", what, keys="a collective's kind (`all_reduce`, `all_gather`, ...)"),
            Field(f"{path}{{}}.calls", "integer", "calls of that kind"),
            Field(f"{path}{{}}.bytes", "integer", "bytes those calls sent from this rank"))


FIELDS: tuple[Declared, ...] = (
    Field("schema", "string", "the schema id"),
    Field("verdict", "string", "`equivalent`, `equivalent-with-accepted`, `divergent`, `accepted-deviation-fixed`, "
          "`unusable` or `interrupted` (exit status 0, 0, 1, 1, 2, 130)"),
    Field("implementation", "string", "the `--impl` spec"),
    Field("options", "object", "the options the run ran with"),
    Field("options.examples", "integer", "examples requested (`--examples`)"),
    Field("options.seed", "integer", "seed of the batch generator"),
    Field("options.dtype", "string", "dtype of the input tensors"),
    Field("options.compute_dtype", "string", "dtype the implementation computes its selection in"),
    Field("options.tau", "number or null", "the budget of every batch (`--tau`); null: drawn per batch"),
    Field("options.device", "string", "torch device of the input tensors"),
    Field("options.strict_validation", "boolean", "whether silently accepted invalid input counts as a divergence"),
    Field("options.dtype_why", "string", "why the runner chose the dtype",
          when="a trainer that computes in one dtype, run without --dtype"),
    Field("examples", "integer", "examples tried"),
    Field("example_unit", "string", "what one example is: `batches`, or `steps` for the trainer"),
    Field("duration_s", "number", "wall time in seconds"),
    Field("stopped_early", "string or null", "why exploration ended before the examples requested (timeouts, a "
          "process dying on every call, --max-failures); else null"),
    Field("load_error", "string or null", "why the implementation could not be loaded; else null"),
    Field("checks", "array of object", "the checks this run performs, in report order"),
    Field("checks[].name", "string", "the check's name (see the checks reference)"),
    Field("checks[].description", "string", "what it asserts"),
    Field("checks[].status", "string", "`pass`, `fail` or `not run` (a check that never ran claims nothing)"),
    Field("checks[].failures", "integer", "failing examples"),
    Field("checks[].ran", "integer", "examples it ran on"),
    Field("checks[].first_failure_at", "integer or null", "1-based number of the first failing example; null: none"),
    Field("checks[].exercised", "integer", "examples that could have failed it: its rule in "
          "`m2po_oracle.judge.coverage.EXERCISED` held where it ran, or it failed (a check without a rule, a "
          "distributed or trainer one, counts every example it ran on)"),
    Field("checks[].failure_rate_upper_95", "number or null", "one-sided 95% Clopper-Pearson upper bound on the "
          "failure rate over the exercised examples, `beta.ppf(0.95, failures + 1, exercised - failures)`, 1.0 when "
          "every one failed; null when none was exercised"),
    Field("coverage", "object", "what the examples tried were"),
    Field("coverage.examples", "integer", "examples tried"),
    Field("coverage.judged", "integer", "examples whose call returned a result"),
    Field("coverage.unmeasured", "integer", "judged examples whose batch features could not be computed",
          when="more than zero of them"),
    Field("coverage.families", "map of integer", "examples per strategy family, most first",
          keys="a family: `grpo`, `token_advantage`, `dyadic`, `ties`, `extreme`, `degenerate`, `scope`; `untagged` "
          "for a batch from elsewhere, `trainer_case` for a training step"),
    Field("coverage.features", "map of integer", "judged examples that hold each batch feature",
          keys="a feature of `m2po_oracle.judge.coverage.FEATURES` (see the checks reference)"),
    Field("coverage.feature_descriptions", "map of string", "when each feature holds", keys="a feature"),
    Field("coverage.exercised_when", "map of string", "the examples that exercise each check of the run",
          keys="a check's name"),
    Field("coverage.confidence", "number", "the confidence of `checks[].failure_rate_upper_95`"),
    Field("coverage.bound", "string", "what that bound is"),
    Field("counterexamples", "array of object", "one minimal failing example per distinct cause"),
    Field("counterexamples[].check", "string", "the check it was shrunk for"),
    Field("counterexamples[].cause", "string or null", "the deviations it demonstrates (`a + b`); null for an "
          "unexplained check"),
    Field("counterexamples[].checks", "array of string", "every failing check it shows"),
    Field("counterexamples[].summary", "string", "its first mismatch in one line"),
    Field("counterexamples[].replay", "string", "the command that replays it"),
    Field("counterexamples[].batch", "object", "the batch the implementation received"),
    _batch("counterexamples[].batch"),
    Field("counterexamples[].shape", "array of integer", "the batch's [B, T]"),
    Field("counterexamples[].tokens", "array of object", "one row per token (the first 512)"),
    Field("counterexamples[].tokens[].index", "array of integer", "the token's [row, column]"),
    Field("counterexamples[].tokens[].valid", "boolean", "whether it is a valid token"),
    Field("counterexamples[].tokens[].log_ratio", "number or null", "d = logp - behavior_logp; null on padding"),
    Field("counterexamples[].tokens[].advantage", "number", "its advantage"),
    Field("counterexamples[].tokens[].m2", "number or null", "its second moment d^2; null on padding"),
    Field("counterexamples[].tokens[].trust_region", "boolean", "whether it is a trust-region candidate"),
    Field("counterexamples[].tokens[].expected_keep", "boolean", "whether Algorithm 1 (the literal loop) keeps it"),
    Field("counterexamples[].tokens[].actual_keep", "boolean or null", "whether the implementation kept it; null "
          "without a result"),
    Field("counterexamples[].tokens[].expected_grad", "number", "the oracle's gradient on the implementation's own "
          "mask (what the gradient check compares with)"),
    Field("counterexamples[].tokens[].actual_grad", "number or null", "the implementation's gradient; null without "
          "one"),
    Field("counterexamples[].tokens_truncated", "boolean", "whether the batch has more tokens than `tokens` shows"),
    Field("counterexamples[].mismatches", "array of object", "every violated property on this example"),
    FromDataclass("counterexamples[].mismatches[]", "m2po_oracle.judge.equivalence:Mismatch", {
        "check": "the check that failed",
        "summary": "what differs, in one line",
        "field": "the result field compared (`loss`, `grad`, `keep`, a metric); empty where none",
        "index": "the token compared, where one is",
        "actual": "the implementation's value",
        "expected": "Algorithm 1's",
        "details": "more lines (a traceback, the values around it)",
    }, types={"index": "array of integer or null", "actual": "any", "expected": "any"}),
    _result("counterexamples[].expected", "Algorithm 1's loss and metrics"),
    _result("counterexamples[].expected_on_actual_mask", "the oracle's loss and metrics on the implementation's own "
            "mask (what the loss and metric checks compare with); empty without a result"),
    _result("counterexamples[].actual", "the implementation's loss and metrics; empty without a result"),
    Field("counterexamples[].removal_curve", "object", "Algorithm 1's removal curve on this batch"),
    Field("counterexamples[].removal_curve.tau", "number", "the budget"),
    Field("counterexamples[].removal_curve.prefix_means", "array of number", "mean M2 of the k smallest candidates, "
          "k = 1, 2, ... (the first 512)"),
    Field("counterexamples[].removal_curve.candidates", "integer", "trust-region candidates"),
    Field("counterexamples[].removal_curve.oracle_kept_min", "integer", "fewest candidates Algorithm 1 may keep (the "
          "rounding band of the compute dtype)"),
    Field("counterexamples[].removal_curve.oracle_kept_max", "integer", "most candidates Algorithm 1 may keep"),
    Field("counterexamples[].removal_curve.implementation_kept", "integer or null", "candidates the implementation "
          "kept; null without a result"),
    Field("counterexamples[].ranks", "array of object", "every rank's part of the step", when=DISTRIBUTED),
    Field("counterexamples[].ranks[].rank", "integer", "the global rank"),
    Field("counterexamples[].ranks[].coords", "object", "where it sits in the DP x CP x TP grid"),
    FromDataclass("counterexamples[].ranks[].coords", "m2po_oracle.distributed.topology:RankCoords", {
        "dp": "data-parallel rank", "cp": "context-parallel rank", "tp": "tensor-parallel rank"}),
    Field("counterexamples[].ranks[].rows", "array of integer", "the rows it was given: [start, stop)"),
    Field("counterexamples[].ranks[].keep", "array of array of integer or null", "the mask it returned (1: kept); "
          "null without a result"),
    Field("counterexamples[].ranks[].loss", "number or null", "the loss it returned; null without a result"),
    Field("counterexamples[].ranks[].metrics", "map of number", "the metrics it reported", keys="a metric's name"),
    *_collectives("counterexamples[].ranks[].collectives", "the collectives it called in this step"),
    Field("counterexamples[].ranks[].error", "string or null", "the error it raised; else null"),
    Field("counterexamples[].ranks[].stack", "string or null", "its stack, where it was still running at the "
          "deadline; else null"),
    Field("counterexamples[].trainer_case", "object", "the training step's input (the batch is what the trainer "
          "produced)", when="trainer runs only"),
    Field("counterexamples[].trainer_case.kind", "string", "`trainer_case`"),
    FromDataclass("counterexamples[].trainer_case", "m2po_oracle.trainer.cases:TrainerCase", {
        "seed": "seed of the step's model and rollouts",
        "prompts": "prompts in the step",
        "group_size": "completions per prompt",
        "prompt_len": "tokens per prompt",
        "max_new_tokens": "tokens per completion at most",
        "lags": "per prompt: optimizer steps its rollout worker is behind the current policy",
        "staleness_lr": "learning rate of the steps the stale workers missed",
        "tau": "the budget",
        "split": "rows per micro-batch",
        "cut": "when not null, tau is derived from the step so that Algorithm 1 removes that many trust-region tokens",
    }),
    Field("counterexamples[].trainer_case.trainer", "object", "what the step did", when="a step that ran to the end"),
    Field("counterexamples[].trainer_case.trainer.split", "array of integer", "rows per micro-batch"),
    Field("counterexamples[].trainer_case.trainer.loss", "number", "the step's loss"),
    Field("counterexamples[].trainer_case.trainer.rows", "integer", "rows of the rollout"),
    Field("counterexamples[].trainer_case.trainer.tokens", "integer", "valid tokens"),
    Field("counterexamples[].trainer_case.trainer.rewards", "array of number", "each completion's reward"),
    Field("counterexamples[].trainer_case.trainer.parameters", "integer", "the model's parameters"),
    Field("diagnosis", "object", "which known deviations reproduce the failures (see the diagnosis explanation)"),
    Field("diagnosis.status", "string", "`not_needed`, `not_run`, `matched`, `mostly_explained`, `partly_explained` "
          "or `no_known_variant`"),
    Field("diagnosis.examples_compared", "integer", "the examples the shares count"),
    Field("diagnosis.examples_searched", "integer", "the sample the search ran on", when=LOADED),
    Field("diagnosis.summary", "string", "the diagnosis in one line", when=LOADED),
    Field("diagnosis.components", "array of string", "the deviations of the best explanation, by name (a fitted value "
          "in the name: `clip_floors(0.2, 0.28)`)", when=LOADED),
    Field("diagnosis.by_check", "map of array of string", "the deviations that explain each failing check",
          keys="a failing check's name", when=LOADED),
    Field("diagnosis.shares", "map of object", "how much of each failing check the explanation reproduces",
          keys="an explained check's name", when=LOADED),
    Field("diagnosis.shares{}.components", "array of string", "the deviations it is explained by"),
    Field("diagnosis.shares{}.explained", "integer", "of the check's failing examples, those reproduced"),
    Field("diagnosis.shares{}.failing", "integer", "the check's failing examples"),
    Field("diagnosis.shares{}.contradicted", "integer", "passing examples the explanation gets wrong"),
    Field("diagnosis.shares{}.of", "integer", "the examples counted"),
    Field("diagnosis.shares{}.share", "number", "`explained / (failing + contradicted)`"),
    Field("diagnosis.residuals", "array of object", "what an explanation does not reproduce, grouped by the checks "
          "that leave the same examples", when=f"{LOADED}; items only where an explanation leaves some of a "
          "check's failing examples unreproduced"),
    Field("diagnosis.residuals[].checks", "array of string", "the checks"),
    Field("diagnosis.residuals[].unexplained", "boolean", "whether nothing known names them"),
    Field("diagnosis.residuals[].count", "integer", "the examples left"),
    Field("diagnosis.residuals[].contradicted", "integer", "of them, passing examples the explanation gets wrong"),
    Field("diagnosis.residuals[].features", "array of object", "the batch features they hold most, against how often "
          "each holds where the explanation reproduces the checks"),
    Field("diagnosis.residuals[].features[].feature", "string", "the feature"),
    Field("diagnosis.residuals[].features[].description", "string", "when it holds"),
    Field("diagnosis.residuals[].features[].residual", "integer", "residual examples that hold it"),
    Field("diagnosis.residuals[].features[].of", "integer", "residual examples"),
    Field("diagnosis.residuals[].features[].explained", "integer", "reproduced examples that hold it"),
    Field("diagnosis.residuals[].features[].explained_of", "integer", "reproduced examples"),
    Field("diagnosis.residuals[].shared", "array of string", "the features every one of them holds"),
    Field("diagnosis.residuals[].float32_fits", "integer or null", "of them, those the explanation reproduces at "
          "float32's tolerance; null where the run already judges at float32 or coarser"),
    Field("diagnosis.residuals[].explanation", "array of string", "what the residual is measured against ([]: "
          "Algorithm 1)"),
    Field("diagnosis.residuals[].counterexample", "object", "the smallest of them"),
    Field("diagnosis.residuals[].counterexample.batch", "object", "its batch"),
    _batch("diagnosis.residuals[].counterexample.batch"),
    Field("diagnosis.residuals[].counterexample.difference", "string", "its first difference from the explanation"),
    Field("diagnosis.residuals[].counterexample.replay", "string or null", "the command that replays it"),
    Field("diagnosis.unexplained", "array of string", "failing checks nothing explains (or explains on less than "
          "half)", when=LOADED),
    Field("diagnosis.matches", "array of object", "each deviation named, with its evidence"),
    Field("diagnosis.matches[].variant", "string", "its name"),
    Field("diagnosis.matches[].description", "string", "what the port does"),
    Field("diagnosis.matches[].source", "string", "where the deviation is seen in the wild"),
    Field("diagnosis.matches[].evidence", "string", "what reproduces it"),
    Field("diagnosis.matches[].checks", "array of string", "the failing checks it explains"),
    Field("diagnosis.matches[].unobserved", "array of string", "its effects the run could not observe (an adapter "
          "that builds the loss and gradient)", when="a deviation of one loss call (not a distributed or trainer one)"),
    Field("diagnosis.alternatives", "array of array of string", "explanations as small as the chosen one", when=LOADED),
    Field("diagnosis.alternatives_reason", "string", "why they stand side by side", when=DIVERGENT),
    Field("diagnosis.closest", "array of object", "leads: the explanation below the naming threshold for a check, "
          "then single variants agreeing somewhere", when="items only where a failing check is unexplained"),
    Field("diagnosis.closest[].variant", "string", "the deviations, `a + b`"),
    Field("diagnosis.closest[].description", "string", "what they do, or how far they reproduce the check"),
    Field("diagnosis.closest[].source", "string", "where the deviation is seen in the wild"),
    Field("diagnosis.closest[].agreed", "integer", "examples it agrees on"),
    Field("diagnosis.closest[].of", "integer", "examples compared"),
    Field("diagnosis.closest[].first_difference", "string", "its first difference from the port"),
    Field("diagnosis.closest[].check", "string", "the check it falls short on",
          when="a row for one check's explanation"),
    Field("diagnosis.findings", "array of object", "findings beside the deviations",
          when=f"{LOADED}; items only where the loss or gradient is NaN/inf on inputs finite on every valid token"),
    Field("diagnosis.findings[].kind", "string", "`non_finite_result`"),
    Field("diagnosis.findings[].checks", "array of string", "the checks it concerns"),
    Field("diagnosis.findings[].summary", "string", "the finding in one line"),
    Field("diagnosis.hints", "array of object", "options that would accept what the failures fit", when=LOADED),
    Field("diagnosis.hints[].checks", "array of string", "the checks"),
    Field("diagnosis.hints[].text", "string", "what their failures fit"),
    Field("diagnosis.hints[].option", "string", "the option"),
    Field("diagnosis.padding_leak", "object or null", "the evidence of a padding leak; else null",
          when=f"{LOADED}; an object only where `nan_padding_leak` is named"),
    FromDataclass("diagnosis.padding_leak", "m2po_oracle.explain.padding:PaddingLeak", {
        "fill": "the padding probe that showed it first on the smallest such batch",
        "where": "`loss`, `valid token` or `padding position`",
        "index": "the token, where a gradient is NaN/inf",
        "value": "the NaN/inf value, as Python writes it",
        "examples": "examples on which some padding made the result NaN/inf",
        "inputs": "the inputs whose padding alone does it; null: not probed",
    }, types={"value": "string"}),
    Field("diagnosis.padding_leak.text", "string", "the evidence in one sentence"),
    Field("accepted", "array of object", "the deviations the project accepts (`accept`, `--accept`)"),
    FromDataclass("accepted[]", "m2po_oracle.explain.deviations:Accepted", {
        "deviation": "its name", "reason": "why the project accepts it", "link": "where that is discussed"}),
    Field("accepted[].shown", "boolean", "whether it showed in this run"),
    Field("accepted[].checks", "array of string", "the failing checks it explains"),
    Field("strict_accept", "boolean", "whether an accepted deviation that no longer shows fails the run"),
    Field("validation", "object", "the invalid-input probes, reported apart from equivalence"),
    Field("validation.strict", "boolean", "whether a silently accepted invalid input fails the run"),
    Field("validation.not_run", "string or null", "why the probes were skipped; else null"),
    Field("validation.probes", "array of object", "one per probe"),
    FromDataclass("validation.probes[]", "m2po_oracle.judge.validation:ProbeResult", {
        "probe": "the probe's name (see the checks reference)",
        "description": "the invalid input",
        "status": "`rejected`, `warned`, `accepted`, `hung`, `crashed` or `not run`",
        "message": "what the port said (its exception or warning)",
        "expected": "`rejected`, or `warned` for a setting allowed with a warning",
    }),
    Field("implementation_output", "object", "what the implementation printed"),
    FromDataclass("implementation_output", "m2po_oracle.call.runner:CapturedOutput", {
        "first_lines": "the first lines", "lines": "lines printed, counted over every call"}),
    Field("topology", "object", "the world", when=DISTRIBUTED),
    FromDataclass("topology", "m2po_oracle.distributed.topology:Topology", {
        "dp": "data-parallel size", "cp": "context-parallel size", "tp": "tensor-parallel size"}),
    Field("topology.backend", "string", "the collective backend"),
    Field("collectives_per_step", "array of object", "per rank, the collectives of one step", when=DISTRIBUTED),
    Field("collectives_per_step[].rank", "integer", "the global rank"),
    Field("collectives_per_step[].coords", "object", "where it sits in the DP x CP x TP grid"),
    FromDataclass("collectives_per_step[].coords", "m2po_oracle.distributed.topology:RankCoords", {
        "dp": "data-parallel rank", "cp": "context-parallel rank", "tp": "tensor-parallel rank"}),
    *_collectives("collectives_per_step[].collectives", "the collectives it called"),
    Field("adapter", "object", "the port's calling convention", when=ADAPTED),
    Field("adapter.name", "string", "the adapter (see the adapters reference)"),
    Field("adapter.signature", "string", "the signature it calls"),
    Field("adapter.checked", "array of string", "what of the port's results is checked"),
    Field("adapter.supplies", "array of string", "the result fields the port computed in the run: its family's, less "
          "the metrics it never returned"),
    Field("adapter.builds", "map of string", "what the adapter computes itself, and how", keys="a result field"),
    Field("adapter.metrics_read", "map of string", "where in the port's return each metric was read",
          keys="a metric's name"),
    Field("adapter.not_run", "map of string", "the checks the adapter cannot run, each with why",
          keys="a check's name"),
    Field("adapter.bindings", "array of string", "the `--bind` texts"),
    Field("adapter.call", "string", "the call the port received"),
    Field("capture", "object", "where the run recorded its steps for `m2po-oracle audit`", when="with --capture only"),
    FromDataclass("capture", "m2po_oracle.call.runner:CaptureTarget", {
        "directory": "the capture directory", "steps": "optimizer steps recorded"}),
    Field("tolerances", "array of object", "the tolerance table (see the tolerances reference)"),
    Field("tolerances[].dtype", "string", "the input dtype"),
    Field("tolerances[].quantity", "string", "what is compared"),
    Field("tolerances[].rtol", "number", "relative tolerance"),
    Field("tolerances[].atol", "number", "absolute tolerance"),
    Field("environment", "object", "what the run ran on"),
    Field("environment.m2po_oracle", "string", "the toolkit's version"),
    Field("environment.python", "string", "Python's version"),
    Field("environment.torch", "string", "torch's version"),
    Field("environment.numpy", "string", "NumPy's version"),
    Field("environment.hypothesis", "string", "Hypothesis' version"),
    Field("environment.platform", "string", "the platform"),
    Field("environment.git_revision", "string or null", "the git revision of the working directory; null outside one"),
)
