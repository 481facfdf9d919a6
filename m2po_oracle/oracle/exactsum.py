"""``math.fsum`` of a float64 array, vectorised: the same correctly rounded sum, ~10x faster.

``math.fsum`` returns the sum of its inputs correctly rounded, which the oracle relies on
(its loss and metrics must not depend on summation order), but it walks a Python iterator
at ~90 ns per value: 1.4 s for one sum over a 16M-token step. Here every finite float64
``x = (-1)^s * m * 2^(e - 1075)`` (m a 53-bit integer, e the biased exponent, 1 for
subnormals) is split into ``m = hi * 2^26 + lo``; per chunk of 2^18 values, ``np.bincount``
adds the signed ``hi`` and ``lo`` per exponent. Every partial sum there is an integer below
2^45 (2^18 values under 2^27), so float64 adds them exactly. The per-exponent totals are
then combined as Python integers (exact) and divided by a power of two once, which CPython
rounds correctly (half to even, subnormals included). The result is the exact sum rounded
once: ``math.fsum``'s result, bit for bit.

``math.fsum`` itself still decides every case where its behaviour is more than a rounded
sum: non-finite inputs (inf, nan, ``inf - inf`` raises), inputs large enough that a partial
sum could overflow (it raises), and a sum that is exactly zero (the sign of zero).
"""

from __future__ import annotations

import math

import numpy as np

_CHUNK = 1 << 18
_BUCKETS = 4096  # sign bit and 11 exponent bits
_MANTISSA = (1 << 52) - 1
_LOW_BITS = 26


def fsum(values: np.ndarray) -> float:
    """``math.fsum(values.ravel())``: the correctly rounded sum of a float64 array."""
    x = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    if x.size < 64:
        return math.fsum(x)
    hi_sums = np.zeros(_BUCKETS, dtype=np.int64)
    lo_sums = np.zeros(_BUCKETS, dtype=np.int64)
    for start in range(0, x.size, _CHUNK):
        bits = x[start : start + _CHUNK].view(np.int64)
        bucket = (bits >> 52) & 0xFFF  # sign and biased exponent: the magnitudes are added per bucket
        exponents = bucket & 0x7FF
        if int(exponents.max()) == 0x7FF:  # inf or nan: fsum's own rules
            return math.fsum(x)
        mantissa = bits & _MANTISSA
        if int(exponents.min()) == 0:  # zeros or subnormals: no implicit bit, scaled like exponent 1
            mantissa |= (exponents != 0).astype(np.int64) << 52
            bucket += exponents == 0
        else:
            mantissa |= 1 << 52
        hi_sums += np.bincount(bucket, weights=(mantissa >> _LOW_BITS).astype(np.float64), minlength=_BUCKETS).astype(np.int64)
        lo_sums += np.bincount(bucket, weights=(mantissa & ((1 << _LOW_BITS) - 1)).astype(np.float64), minlength=_BUCKETS).astype(np.int64)
    used = np.flatnonzero((hi_sums != 0) | (lo_sums != 0)).tolist()
    exponents_used = [e & 0x7FF for e in used]
    # fsum raises "intermediate overflow" when a partial sum overflows, even if the total
    # would not: wherever the magnitudes (each < 2^(e - 1022)) could add up to 2^1023, it decides.
    if used and max(exponents_used) - 1022 + x.size.bit_length() >= 1023:
        return math.fsum(x)
    total, lowest = 0, min(exponents_used, default=0)
    for e in used:
        exponent, negative = e & 0x7FF, e >> 11
        magnitude = ((int(hi_sums[e]) << _LOW_BITS) + int(lo_sums[e])) << (exponent - lowest)
        total += -magnitude if negative else magnitude
    if total == 0:  # exactly zero: the sign of zero is fsum's rule, on a stand-in with the same zeros
        signs = np.signbit(x[x == 0])
        stand_in = ([1.0, -1.0] if np.count_nonzero(x) else []) + ([-0.0] if signs.any() else []) + ([0.0] if not signs.all() else [])
        return math.fsum(stand_in)
    shift = lowest - 1075
    return float(total << shift) if shift >= 0 else total / (1 << -shift)
