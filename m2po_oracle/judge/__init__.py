"""Judging one example: the checks, the tolerance policy, the equivalence comparator, the
contract a loss function answers to, the battery, the invalid-input probes and the coverage
of what an example could have caught."""
