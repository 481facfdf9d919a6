"""Benchmarks: the selection and the forward against sorting and one streaming pass, the
audit of a 16M-token step, the host syncs of a forward, and what recording costs."""
