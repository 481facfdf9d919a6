"""Calling an implementation: resolving ``--impl`` to a loss function, running it in a worker
process or in this one, the runner interface every world answers to, and the negative
controls (implementations with one planted bug each)."""
