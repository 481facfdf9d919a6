"""Judging one example: the checks, the tolerance policy, the equivalence comparator, the
contract a loss function answers to, the battery, the invalid-input probes, the coverage
of what an example could have caught, and the reading of a logged metric as its
micro-batches' values averaged with equal weight."""
