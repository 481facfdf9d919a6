"""Explaining a failure: the registry of known deviations, their variants of Algorithm 1, the
search for the smallest set that reproduces the failing examples (fitting, shares, padding
leaks) and the diagnosis that names only what the data reproduces."""
