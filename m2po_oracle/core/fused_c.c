/* The core's CPU passes fused: each reads the batch once where torch operators need a
 * dozen passes. Built at install as an optional extension (m2po_oracle/core/fused.py checks
 * every argument and falls back to the torch operators when it is absent).
 *
 * Every result is the torch operators' to the last bit:
 *   - d, M2, the trust region and the loss's terms are the same IEEE operations in the
 *     same precision (compiled with -ffp-contract=off: no fused multiply-add);
 *   - the histogram adds each candidate's M2 to its bucket in index order, as the
 *     sequential scatter_add_ over the same values does.
 *
 * Arguments are raw addresses and sizes that fused.py has checked against the tensors;
 * nothing here allocates, and the GIL is released while the passes run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DIGIT_BITS 16
#define BUCKETS (1 << DIGIT_BITS)
/* Tokens per block: a block's M2 and histogram slots (12 KiB) stay in L1 between the
 * vectorised pass that computes them and the sequential histogram that reads them. */
#define BLOCK 1024

/* Histogram cells for non-candidates, after the BUCKETS cells: never read, spread by
 * position so that their additions do not chain on one cell. */
#define BANK 256

/* Input dtypes (fused.py's codes). */
enum { F64 = 0, F32 = 1, BF16 = 2 };

#if defined(M2PO_FUSED_ONE_TARGET)
/* One build for the compiler's own target flags (the tests build SSE2 and AVX2 this way,
 * to hold every clone to the same bits on a machine that would pick AVX-512). */
#define VECTOR_CLONES
#elif (defined(__x86_64__) || defined(_M_X64)) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
/* The elementwise passes in AVX-512 (x86-64-v4: its byte and word instructions make the
 * first level 1.45 -> 1.1 ms at 1M tokens beside AVX-512F alone) or AVX2 where the CPU has
 * them, SSE2 otherwise, chosen at load; the results are the same bits (no instruction
 * changes an IEEE operation). */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
/* Compilers without the x86-64-v4 level name. */
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

static inline double f64_at(const double *x, int64_t i) { return x[i]; }
static inline double f32_at(const float *x, int64_t i) { return (double)x[i]; }
static inline double bf16_at(const uint16_t *x, int64_t i) {
    uint32_t bits = (uint32_t)x[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return (double)value;
}
static inline float f32_of_f32(const float *x, int64_t i) { return x[i]; }
static inline float f32_of_bf16(const uint16_t *x, int64_t i) {
    uint32_t bits = (uint32_t)x[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint64_t bits_of(double x) { uint64_t b; memcpy(&b, &x, sizeof b); return b; }
static inline double double_of(uint64_t b) { double x; memcpy(&x, &b, sizeof x); return x; }
/* 1 for inf and NaN (exponent all ones), 0 otherwise: the carry out of the exponent. */
static inline uint64_t not_finite(double x) {
    return ((bits_of(x) & 0x7FF0000000000000ULL) + 0x0010000000000000ULL) >> 63;
}

/* One block of the first radix level: per token d = logp - behavior_logp in float64 (+0 on
 * padding), the trust region (sign(A) * d > 0), M2 = d * d and its top 16 bits; the
 * histogram slot is the digit for a candidate and a cell of the bank for any other token,
 * so that the histogram needs no branch. Also counts the candidates and valid tokens. */
#define DEFINE_LEVEL_BLOCK(NAME, T, AT)                                                             \
    VECTOR_CLONES static void NAME(const T *restrict logp, const T *restrict behavior,               \
                                   const T *restrict advantages, const uint8_t *restrict mask,       \
                                   int64_t n, double *restrict m2, int32_t *restrict slot,           \
                                   uint8_t *restrict trust, int16_t *restrict bucket,                \
                                   int64_t *restrict candidates, int64_t *restrict valid_tokens,     \
                                   uint64_t *restrict invalid) {                                     \
        int64_t count = 0, valid_count = 0;                                                          \
        uint64_t bad = 0;                                                                            \
        for (int64_t i = 0; i < n; i++) {                                                            \
            double l = AT(logp, i), b = AT(behavior, i), a = AT(advantages, i);                      \
            uint64_t valid = mask[i];                                                                \
            bad |= valid & (not_finite(l) | not_finite(b) | not_finite(a));                          \
            double d = double_of(bits_of(l - b) & (0 - valid));                                      \
            double sign = (double)((a > 0.0) - (a < 0.0));                                           \
            int64_t inside = sign * d > 0.0;                                                         \
            double square = d * d;                                                                   \
            int64_t digit = (int64_t)(bits_of(square) >> (64 - DIGIT_BITS));                         \
            m2[i] = square;                                                                          \
            slot[i] = (int32_t)(inside ? digit : BUCKETS + (i & (BANK - 1)));                        \
            trust[i] = (uint8_t)inside;                                                              \
            bucket[i] = (int16_t)digit;                                                              \
            count += inside;                                                                         \
            valid_count += (int64_t)valid;                                                           \
        }                                                                                            \
        *candidates += count;                                                                        \
        *valid_tokens += valid_count;                                                                \
        *invalid |= bad;                                                                             \
    }

DEFINE_LEVEL_BLOCK(level_block_f64, double, f64_at)
DEFINE_LEVEL_BLOCK(level_block_f32, float, f32_at)
DEFINE_LEVEL_BLOCK(level_block_bf16, uint16_t, bf16_at)

static int element_size(int dtype) { return dtype == F64 ? 8 : dtype == F32 ? 4 : 2; }

/* first_level(logp, behavior_logp, advantages, mask, n, dtype, cells, sums, counts, trust, bucket)
 * -> (candidates, valid tokens, all valid inputs finite). The histogram is built in
 * `cells` (BUCKETS + BANK cells of (sum, count), float64, zeroed here: one cache line per
 * token where two arrays would take two), then copied out to `sums` and `counts`
 * (BUCKETS float64 each). trust and bucket receive n values. */
static PyObject *first_level(PyObject *self, PyObject *args) {
    unsigned long long logp, behavior, advantages, mask, histogram_at, sums_at, counts_at, trust_at, bucket_at;
    long long n;
    int dtype;
    if (!PyArg_ParseTuple(args, "KKKKLiKKKKK", &logp, &behavior, &advantages, &mask, &n, &dtype,
                          &histogram_at, &sums_at, &counts_at, &trust_at, &bucket_at))
        return NULL;
    if (dtype != F64 && dtype != F32 && dtype != BF16) {
        PyErr_Format(PyExc_ValueError, "dtype: expected 0 (float64), 1 (float32) or 2 (bfloat16), got %d", dtype);
        return NULL;
    }
    double *histogram = (double *)(uintptr_t)histogram_at;
    double *sums = (double *)(uintptr_t)sums_at, *counts = (double *)(uintptr_t)counts_at;
    uint8_t *trust = (uint8_t *)(uintptr_t)trust_at;
    int16_t *bucket = (int16_t *)(uintptr_t)bucket_at;
    int64_t candidates = 0, valid = 0;
    uint64_t invalid = 0;
    const int width = element_size(dtype);
    Py_BEGIN_ALLOW_THREADS
    double m2[BLOCK];
    int32_t slot[BLOCK];
    memset(histogram, 0, sizeof(double) * 2 * (BUCKETS + BANK));
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t size = n - start < BLOCK ? n - start : BLOCK;
        const char *l = (const char *)(uintptr_t)logp + start * width;
        const char *b = (const char *)(uintptr_t)behavior + start * width;
        const char *a = (const char *)(uintptr_t)advantages + start * width;
        const uint8_t *m = (const uint8_t *)(uintptr_t)mask + start;
        if (dtype == F64)
            level_block_f64((const double *)l, (const double *)b, (const double *)a, m, size, m2, slot,
                            trust + start, bucket + start, &candidates, &valid, &invalid);
        else if (dtype == F32)
            level_block_f32((const float *)l, (const float *)b, (const float *)a, m, size, m2, slot,
                            trust + start, bucket + start, &candidates, &valid, &invalid);
        else
            level_block_bf16((const uint16_t *)l, (const uint16_t *)b, (const uint16_t *)a, m, size, m2,
                             slot, trust + start, bucket + start, &candidates, &valid, &invalid);
        /* In index order, one addition per token and bucket: scatter_add_'s order. */
        for (int64_t j = 0; j < size; j++) {
            double *cell = histogram + 2 * (int64_t)slot[j];
            cell[0] += m2[j];
            cell[1] += 1.0;
        }
    }
    for (int64_t b = 0; b < BUCKETS; b++) {
        sums[b] = histogram[2 * b];
        counts[b] = histogram[2 * b + 1];
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(LLO)", (long long)candidates, (long long)valid, invalid ? Py_False : Py_True);
}

/* The selection's finish over every token: keep = mask and (not a candidate, or a candidate
 * whose bucket is below `below`), and the positions of the candidates still to decide
 * (every candidate with `every_candidate`, else those in bucket `alive`) in index order.
 * Returns how many there were; at most `capacity` are written. */
VECTOR_CLONES static void finish_block(const int16_t *restrict bucket, const uint8_t *restrict trust,
                                       const uint8_t *restrict mask, int64_t n, int32_t below, int32_t alive,
                                       uint8_t every_candidate, uint8_t *restrict keep, uint8_t *restrict open) {
    for (int64_t i = 0; i < n; i++) {
        int32_t digit = bucket[i];
        uint8_t is_kept = digit < below, in_alive = digit == alive;
        keep[i] = mask[i] & ((uint8_t)(trust[i] ^ 1) | is_kept);
        open[i] = trust[i] & (every_candidate | in_alive);
    }
}

static PyObject *finish(PyObject *self, PyObject *args) {
    unsigned long long bucket_at, trust_at, mask_at, keep_at, alive_at;
    long long n, below, alive, capacity;
    int every_candidate;
    if (!PyArg_ParseTuple(args, "KKKLLLpKKL", &bucket_at, &trust_at, &mask_at, &n, &below, &alive,
                          &every_candidate, &keep_at, &alive_at, &capacity))
        return NULL;
    /* Buckets are int16: a bound outside that range compares the same as its clamp. */
    below = below < -32769 ? -32769 : below > 32768 ? 32768 : below;
    alive = alive < -32769 ? -32769 : alive > 32768 ? 32768 : alive;
    const int16_t *bucket = (const int16_t *)(uintptr_t)bucket_at;
    const uint8_t *trust = (const uint8_t *)(uintptr_t)trust_at, *mask = (const uint8_t *)(uintptr_t)mask_at;
    uint8_t *keep = (uint8_t *)(uintptr_t)keep_at;
    int64_t *positions = (int64_t *)(uintptr_t)alive_at;
    int64_t found = 0;
    Py_BEGIN_ALLOW_THREADS
    uint8_t open[BLOCK];
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t size = n - start < BLOCK ? n - start : BLOCK;
        finish_block(bucket + start, trust + start, mask + start, size, (int32_t)below, (int32_t)alive,
                     (uint8_t)every_candidate, keep + start, open);
        /* The tokens to decide are few (a bucket's, or at most SMALL candidates): eight
         * flags are tested at once, and only a word with one looks at its bytes, in index
         * order (whatever the machine's byte order). */
        for (int64_t j = 0; j < size; j += 8) {
            int64_t width = size - j < 8 ? size - j : 8;
            uint64_t word = 0;
            memcpy(&word, open + j, (size_t)width);
            if (!word)
                continue;
            for (int64_t k = j; k < j + width; k++) {
                if (open[k]) {
                    if (found < capacity)
                        positions[found] = start + k;
                    found++;
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)found);
}

/* The loss's terms before exp: ratio = logp - behavior_logp in the compute precision and
 * weight = A, both +0 where keep is False (bit masks: padding's NaN/inf never passes). */
#define DEFINE_TERMS_BLOCK(NAME, T, C, CBITS, AT)                                                  \
    VECTOR_CLONES static void NAME(const T *restrict logp, const T *restrict behavior,               \
                                   const T *restrict advantages, const uint8_t *restrict keep,       \
                                   int64_t n, C *restrict ratio, C *restrict weight) {               \
        for (int64_t i = 0; i < n; i++) {                                                            \
            CBITS kept = (CBITS)0 - (CBITS)keep[i];                                                  \
            C r = AT(logp, i) - AT(behavior, i), w = AT(advantages, i);                              \
            CBITS rb, wb;                                                                            \
            memcpy(&rb, &r, sizeof rb);                                                              \
            memcpy(&wb, &w, sizeof wb);                                                              \
            rb &= kept;                                                                              \
            wb &= kept;                                                                              \
            memcpy(&ratio[i], &rb, sizeof rb);                                                       \
            memcpy(&weight[i], &wb, sizeof wb);                                                      \
        }                                                                                            \
    }

DEFINE_TERMS_BLOCK(terms_f64, double, double, uint64_t, f64_at)
DEFINE_TERMS_BLOCK(terms_f32, float, float, uint32_t, f32_of_f32)
DEFINE_TERMS_BLOCK(terms_bf16, uint16_t, float, uint32_t, f32_of_bf16)

/* loss_terms(logp, behavior_logp, advantages, keep, n, dtype, ratio, weight): the compute
 * precision is float64 for float64 inputs, float32 otherwise. */
static PyObject *loss_terms(PyObject *self, PyObject *args) {
    unsigned long long logp, behavior, advantages, keep, ratio, weight;
    long long n;
    int dtype;
    if (!PyArg_ParseTuple(args, "KKKKLiKK", &logp, &behavior, &advantages, &keep, &n, &dtype, &ratio, &weight))
        return NULL;
    if (dtype != F64 && dtype != F32 && dtype != BF16) {
        PyErr_Format(PyExc_ValueError, "dtype: expected 0 (float64), 1 (float32) or 2 (bfloat16), got %d", dtype);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *k = (const uint8_t *)(uintptr_t)keep;
    if (dtype == F64)
        terms_f64((const double *)(uintptr_t)logp, (const double *)(uintptr_t)behavior,
                  (const double *)(uintptr_t)advantages, k, n, (double *)(uintptr_t)ratio, (double *)(uintptr_t)weight);
    else if (dtype == F32)
        terms_f32((const float *)(uintptr_t)logp, (const float *)(uintptr_t)behavior,
                  (const float *)(uintptr_t)advantages, k, n, (float *)(uintptr_t)ratio, (float *)(uintptr_t)weight);
    else
        terms_bf16((const uint16_t *)(uintptr_t)logp, (const uint16_t *)(uintptr_t)behavior,
                   (const uint16_t *)(uintptr_t)advantages, k, n, (float *)(uintptr_t)ratio, (float *)(uintptr_t)weight);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* first_cut(sums, counts, tau) -> (crossing, kept_sum, kept_count, tied_count): the first
 * level's cut from its histogram, as fast_selection.Descent.start().step(sums, counts, tau, 0)
 * finds it: cumulative sums and counts in bucket order (torch.cumsum's sequential additions,
 * then + 0.0 for the start's kept sum), the first bucket whose cumulative mean exceeds tau
 * (BUCKETS when none does), the cumulative sum and count of the buckets below it (all of
 * them when none crosses) and the count in bucket min(crossing, BUCKETS - 1). */
static PyObject *first_cut(PyObject *self, PyObject *args) {
    unsigned long long sums_at, counts_at;
    double tau;
    if (!PyArg_ParseTuple(args, "KKd", &sums_at, &counts_at, &tau))
        return NULL;
    const double *sums = (const double *)(uintptr_t)sums_at, *counts = (const double *)(uintptr_t)counts_at;
    const double start = 0.0; /* the start state's kept sum and count */
    double running_sum = 0.0, running_count = 0.0, below_sum = start, below_count = start;
    int64_t crossing = BUCKETS;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t b = 0; b < BUCKETS; b++) {
        running_sum += sums[b];
        running_count += counts[b];
        double cumulative_sum = running_sum + start, cumulative_count = running_count + start;
        if (cumulative_sum / cumulative_count > tau) {
            crossing = b;
            break;
        }
        below_sum = cumulative_sum;
        below_count = cumulative_count;
    }
    Py_END_ALLOW_THREADS
    double tied = counts[crossing < BUCKETS ? crossing : BUCKETS - 1];
    return Py_BuildValue("(Lddd)", (long long)crossing, below_sum, below_count, tied);
}

/* One stable LSD radix pass over (key, index) pairs by the key's byte `shift / 8`; skipped
 * (returns 0) when every key has the same byte there. */
static int radix_pass(const uint64_t *restrict from, uint64_t *restrict to, int64_t size, int shift) {
    int64_t start[256] = {0};
    for (int64_t i = 0; i < size; i++)
        start[(from[2 * i] >> shift) & 0xFF]++;
    for (int digit = 0; digit < 256; digit++)
        if (start[digit] == size)
            return 0;
    int64_t total = 0;
    for (int digit = 0; digit < 256; digit++) {
        int64_t count = start[digit];
        start[digit] = total;
        total += count;
    }
    for (int64_t i = 0; i < size; i++) {
        int64_t at = start[(from[2 * i] >> shift) & 0xFF]++;
        to[2 * at] = from[2 * i];
        to[2 * at + 1] = from[2 * i + 1];
    }
    return 1;
}

/* A block of M2 at given positions, as core._m2_at computes it (float64 d, squared). */
#define DEFINE_M2_AT(NAME, T, AT)                                                                  \
    static void NAME(const T *logp, const T *behavior, const int64_t *positions, int64_t size,     \
                     uint64_t *pairs) {                                                            \
        for (int64_t j = 0; j < size; j++) {                                                       \
            double d = AT(logp, positions[j]) - AT(behavior, positions[j]);                        \
            pairs[2 * j] = bits_of(d * d);                                                         \
            pairs[2 * j + 1] = (uint64_t)j;                                                        \
        }                                                                                          \
    }

DEFINE_M2_AT(m2_at_f64, double, f64_at)
DEFINE_M2_AT(m2_at_f32, float, f32_at)
DEFINE_M2_AT(m2_at_bf16, uint16_t, bf16_at)

/* sorted_cut(logp, behavior_logp, dtype, n, positions, size, kept_sum, kept_count, tau, pairs, keep)
 * -> (fits, kept_sum): the crossing bucket's cut by sorting, as
 * fast_selection.cut_of_crossing_bucket sorts it: the M2 of the tokens at `positions` (in
 * index order) sorted stably by their bit patterns, prefix sums (sequential, then
 * + kept_sum), the count of prefix means (sum / (position + kept_count)) <= tau, and the
 * first that many in sorted order kept: keep[positions[j]] is written for every j. Returns
 * that count and the kept sum (the prefix sum at it, or kept_sum when it is 0). `pairs`
 * holds 4 * size uint64 of scratch; a position outside 0 .. n - 1 is a ValueError before
 * anything is read or written. */
static PyObject *sorted_cut(PyObject *self, PyObject *args) {
    unsigned long long logp, behavior, positions_at, pairs_at, keep_at;
    long long n, size;
    int dtype;
    double kept_sum, kept_count, tau;
    if (!PyArg_ParseTuple(args, "KKiLKLdddKK", &logp, &behavior, &dtype, &n, &positions_at, &size, &kept_sum,
                          &kept_count, &tau, &pairs_at, &keep_at))
        return NULL;
    if (dtype != F64 && dtype != F32 && dtype != BF16) {
        PyErr_Format(PyExc_ValueError, "dtype: expected 0 (float64), 1 (float32) or 2 (bfloat16), got %d", dtype);
        return NULL;
    }
    const int64_t *positions = (const int64_t *)(uintptr_t)positions_at;
    uint64_t *pairs = (uint64_t *)(uintptr_t)pairs_at, *spare = pairs + 2 * size;
    uint8_t *keep = (uint8_t *)(uintptr_t)keep_at;
    for (int64_t j = 0; j < size; j++) {
        if (positions[j] < 0 || positions[j] >= n) {
            PyErr_Format(PyExc_ValueError, "positions: expected indices in 0 .. %lld, got %lld at %lld", n - 1,
                         (long long)positions[j], (long long)j);
            return NULL;
        }
    }
    int64_t fits = 0;
    double fitted_sum = kept_sum;
    Py_BEGIN_ALLOW_THREADS
    if (dtype == F64)
        m2_at_f64((const double *)(uintptr_t)logp, (const double *)(uintptr_t)behavior, positions, size, pairs);
    else if (dtype == F32)
        m2_at_f32((const float *)(uintptr_t)logp, (const float *)(uintptr_t)behavior, positions, size, pairs);
    else
        m2_at_bf16((const uint16_t *)(uintptr_t)logp, (const uint16_t *)(uintptr_t)behavior, positions, size, pairs);
    /* Least significant byte first, each pass stable: pairs end sorted by key, then index. */
    for (int shift = 0; shift < 64; shift += 8) {
        if (radix_pass(pairs, spare, size, shift)) {
            uint64_t *sorted = spare;
            spare = pairs;
            pairs = sorted;
        }
    }
    double running = 0.0;
    for (int64_t j = 0; j < size; j++) {
        running += double_of(pairs[2 * j]);
        double prefix = running + kept_sum;
        if (prefix / ((double)(j + 1) + kept_count) <= tau) {
            fits++;
        }
    }
    /* The kept sum is the prefix sum at the fits-th value (recomputed: prefix sums are not kept). */
    running = 0.0;
    for (int64_t j = 0; j < size; j++) {
        running += double_of(pairs[2 * j]);
        if (j == fits - 1)
            fitted_sum = running + kept_sum;
        keep[positions[pairs[2 * j + 1]]] = (uint8_t)(j < fits);
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Ld)", (long long)fits, fitted_sum);
}

static PyMethodDef methods[] = {
    {"first_level", first_level, METH_VARARGS, "The first radix level over every token (see fused.py)."},
    {"finish", finish, METH_VARARGS, "The selection's finish over every token (see fused.py)."},
    {"loss_terms", loss_terms, METH_VARARGS, "The loss's masked terms before exp (see fused.py)."},
    {"first_cut", first_cut, METH_VARARGS, "The first level's cut from its histogram (see fused.py)."},
    {"sorted_cut", sorted_cut, METH_VARARGS, "The crossing bucket's cut by sorting (see fused.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fused_c", "The core's CPU passes, fused (see fused.py).", -1, methods,
                                    NULL, NULL, NULL, NULL};

/* fused.py refuses an extension built from another version of these functions' arguments. */
#define INTERFACE 3

PyMODINIT_FUNC PyInit_fused_c(void) {
    PyObject *built = PyModule_Create(&module);
    if (built != NULL && PyModule_AddIntConstant(built, "INTERFACE", INTERFACE) < 0) {
        Py_DECREF(built);
        return NULL;
    }
    return built;
}
