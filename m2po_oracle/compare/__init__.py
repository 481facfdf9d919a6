"""The search for a counterexample: exploring examples through a runner, tallying the checks,
shrinking one minimal counterexample per cause, the example database, and the compare
report with its JSON builder."""
