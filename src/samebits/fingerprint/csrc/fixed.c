/* Block fixed point of the invariant gradient reduction (samebits.invariant), on the CPU.
 *
 * The torch implementation in src/samebits/invariant/_fixed.py is the definition; these three
 * passes give the same bits (and the same inexact count) with no temporaries:
 *   samebits_fixed_exponents:  block exponents, the MAX over k buffers of micro-batch gradients;
 *   samebits_fixed_encode_sum: encode k buffers and add them into one int64 buffer (plus the
 *                              number of elements that did not encode exactly);
 *   samebits_fixed_decode:     int64 sums (plus the partial sums a reduce-scatter received) to fp32,
 *                              rounded once (the subnormal path included);
 *   samebits_fixed_reduce:     the three above fused, where every contribution is here (one
 *                              rank, or the owner of its rows): one read of the k buffers, one
 *                              write of fp32, the int64 sums kept in a piece on the stack;
 *   samebits_fixed_peaks,
 *   samebits_fixed_square_sums: the clipping norm's largest |x| and int64 sums of scaled squares
 *                              per tensor (samebits.invariant._norm, one pass a tensor each).
 * Each buffer is (num_blocks, block_size) row-major.  Loaded with ctypes (no Python API), built
 * by setup.py as its own library (samebits.invariant._libfixed), so that adding it never
 * changes the digest library's interface.
 *
 * Speed: every pass is one read of its inputs and one write of its output.  The loops are plain
 * C compiled three times (target_clones: AVX-512, AVX2, baseline x86-64), the loader picks the
 * widest the CPU runs; AVX-512DQ converts fp32/int64 eight lanes at a time.  Blocks are split
 * over OpenMP threads (num_threads from torch's budget; 1 enters no parallel region).  Integer
 * sums and the count are exact, so the thread count never changes a bit.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "native.h"

/* The interface _fixed_native.py expects (a library of another version is refused there). */
#define SAMEBITS_FIXED_ABI_VERSION 4 /* 2: decode adds received partial sums; 3: square sums; 4: reduce, peaks */

#define EXPONENT_MIN (-128)
#define EXPONENT_NONFINITE 127
#define SCALE_MAX 126 /* the largest fp32 power of two used as a scale on the fp32 path */

#if SAMEBITS_X86
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CLONES
#endif

/* Fewer elements than this in a call run on the calling thread (a team costs tens of us). */
static const int64_t PARALLEL_MIN_ELEMENTS = 1 << 18;

static inline float pow2f(int e) /* exact 2**e for e in [-126, 127] */
{
    uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline double pow2d(int e) /* exact 2**e for e in [-1022, 1023] */
{
    uint64_t u = (uint64_t)(e + 1023) << 52;
    double d;
    memcpy(&d, &u, 8);
    return d;
}

static inline int threads_for(int64_t elements, int num_threads)
{
    return elements >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
}

/* _fixed.block_exponents of a block whose largest |x| has the bits `peak` (x & 0x7fffffff):
 * frexp's exponent (peak < 2**e), EXPONENT_MIN for zero, clamped, and EXPONENT_NONFINITE for
 * inf and nan (their bits are the largest, so a MAX over bits finds them). */
static inline int8_t exponent_of_bits(uint32_t peak)
{
    if (peak >= 0x7f800000u)
        return EXPONENT_NONFINITE;
    if (peak == 0)
        return EXPONENT_MIN;
    int biased = (int)(peak >> 23), e;
    if (biased)
        e = biased - 126; /* 1.m * 2**(b - 127) < 2**(b - 126) */
    else
        e = (32 - __builtin_clz(peak)) - 149; /* subnormal: mantissa * 2**-149 */
    if (e < EXPONENT_MIN)
        e = EXPONENT_MIN;
    if (e > EXPONENT_NONFINITE - 1)
        e = EXPONENT_NONFINITE - 1;
    return (int8_t)e;
}

CLONES static uint32_t peak_bits(const uint32_t *x, int64_t n, uint32_t peak)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = x[i] & 0x7fffffffu;
        peak = a > peak ? a : peak;
    }
    return peak;
}

/* block_size 1: each element is its own block, exponents straight from the bits. */
CLONES static void exponents_flat(uint64_t num_buffers, const uint32_t *const *buffers, int64_t begin,
                                  int64_t end, int8_t *out)
{
    for (int64_t i = begin; i < end; i++) {
        uint32_t peak = 0;
        for (uint64_t j = 0; j < num_buffers; j++) {
            uint32_t a = buffers[j][i] & 0x7fffffffu;
            peak = a > peak ? a : peak;
        }
        out[i] = exponent_of_bits(peak);
    }
}

SAMEBITS_EXPORT int samebits_fixed_abi_version(void) { return SAMEBITS_FIXED_ABI_VERSION; }

SAMEBITS_EXPORT int samebits_fixed_has_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* out[b] = exponent of block b over every buffer (num_buffers pointers to fp32 buffers). */
SAMEBITS_EXPORT void samebits_fixed_exponents(uint64_t num_buffers, const uint64_t *data_ptrs, int64_t num_blocks,
                                              int64_t block_size, int8_t *out, int num_threads)
{
    const uint32_t *buffers[num_buffers ? num_buffers : 1];
    for (uint64_t j = 0; j < num_buffers; j++)
        buffers[j] = (const uint32_t *)(uintptr_t)data_ptrs[j];
    int threads = threads_for(num_blocks * block_size * (int64_t)num_buffers, num_threads);
    if (block_size == 1) {
        const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t begin = 0; begin < num_blocks; begin += chunk)
            exponents_flat(num_buffers, buffers, begin, begin + chunk < num_blocks ? begin + chunk : num_blocks, out);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < num_blocks; b++) {
        uint32_t peak = 0;
        for (uint64_t j = 0; j < num_buffers; j++)
            peak = peak_bits(buffers[j] + b * block_size, block_size, peak);
        out[b] = exponent_of_bits(peak);
    }
}

/* One row on the fp32 path: q = round_half_even(x * scale), exact in fp32 (|q| <= 2**62). */
CLONES static int64_t encode_row_f32(const float *x, int64_t n, float scale, int64_t *out, int add)
{
    int64_t inexact = 0;
    if (add) {
        for (int64_t i = 0; i < n; i++) {
            float s = x[i] * scale, r = nearbyintf(s);
            inexact += r != s;
            out[i] += (int64_t)r;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float s = x[i] * scale, r = nearbyintf(s);
            inexact += r != s;
            out[i] = (int64_t)r;
        }
    }
    return inexact;
}

/* A non-finite block encodes as zeros, but the reference still counts its elements that the
 * fp32 path (at the clamped shift) would round: nan always, finite elements with low bits. */
static int64_t count_nonfinite_row(const float *x, int64_t n, float scale)
{
    int64_t inexact = 0;
    for (int64_t i = 0; i < n; i++) {
        float s = x[i] * scale;
        inexact += nearbyintf(s) != s;
    }
    return inexact;
}

/* Tiny blocks (shift > 126): scaled in float64, where 2**shift and the product are exact. */
static int64_t encode_row_f64(const float *x, int64_t n, double scale, int64_t *out, int add)
{
    int64_t inexact = 0;
    for (int64_t i = 0; i < n; i++) {
        double s = (double)x[i] * scale, r = nearbyint(s);
        inexact += r != s;
        out[i] = (add ? out[i] : 0) + (int64_t)r;
    }
    return inexact;
}

static int64_t encode_block(uint64_t num_buffers, const float *const *buffers, int64_t offset, int64_t n, int exponent,
                            int bits, int64_t *out)
{
    int64_t inexact = 0;
    int shift = bits - (exponent < EXPONENT_NONFINITE - 1 ? exponent : EXPONENT_NONFINITE - 1);
    if (exponent == EXPONENT_NONFINITE) {
        for (uint64_t j = 0; j < num_buffers; j++)
            inexact += count_nonfinite_row(buffers[j] + offset, n, pow2f(shift));
        memset(out, 0, (size_t)n * sizeof(int64_t));
    } else if (shift > SCALE_MAX) {
        for (uint64_t j = 0; j < num_buffers; j++)
            inexact += encode_row_f64(buffers[j] + offset, n, pow2d(shift), out, j > 0);
    } else {
        for (uint64_t j = 0; j < num_buffers; j++)
            inexact += encode_row_f32(buffers[j] + offset, n, pow2f(shift), out, j > 0);
    }
    return inexact;
}

/* block_size 1: the scale varies per element, taken from the exponent's bits. */
CLONES static int64_t encode_flat(uint64_t num_buffers, const float *const *buffers, int64_t begin, int64_t end,
                                  const int8_t *exponents, int bits, int64_t *out)
{
    int64_t inexact = 0;
    for (int64_t i = begin; i < end; i++) {
        int e = exponents[i], shift = bits - (e < EXPONENT_NONFINITE - 1 ? e : EXPONENT_NONFINITE - 1);
        if (e == EXPONENT_NONFINITE || shift > SCALE_MAX) {
            inexact += encode_block(num_buffers, buffers, i, 1, e, bits, out + i);
            continue;
        }
        float scale = pow2f(shift);
        int64_t q = 0;
        for (uint64_t j = 0; j < num_buffers; j++) {
            float s = buffers[j][i] * scale, r = nearbyintf(s);
            inexact += r != s;
            q += (int64_t)r;
        }
        out[i] = q;
    }
    return inexact;
}

/* out = sum over the buffers of their encodings; returns the number of inexact elements. */
SAMEBITS_EXPORT int64_t samebits_fixed_encode_sum(uint64_t num_buffers, const uint64_t *data_ptrs, int64_t num_blocks,
                                                  int64_t block_size, const int8_t *exponents, int bits, int64_t *out,
                                                  int num_threads)
{
    const float *buffers[num_buffers ? num_buffers : 1];
    for (uint64_t j = 0; j < num_buffers; j++)
        buffers[j] = (const float *)(uintptr_t)data_ptrs[j];
    int threads = threads_for(num_blocks * block_size * (int64_t)num_buffers, num_threads);
    int64_t inexact = 0;
    if (block_size == 1) {
        const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(+ : inexact)
        for (int64_t begin = 0; begin < num_blocks; begin += chunk)
            inexact += encode_flat(num_buffers, buffers, begin, begin + chunk < num_blocks ? begin + chunk : num_blocks,
                                   exponents, bits, out);
        return inexact;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(+ : inexact)
    for (int64_t b = 0; b < num_blocks; b++)
        inexact += encode_block(num_buffers, buffers, b * block_size, block_size, exponents[b], bits,
                                out + b * block_size);
    return inexact;
}

CLONES static void decode_row_f32(const int64_t *sums, int64_t n, float scale, float *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = (float)sums[i] * scale; /* int64 -> fp32 rounds to nearest even, the scale is exact */
}

/* _fixed._decode_wide: a result below 2**-126 is rounded on the integer to the subnormal grid
 * 2**(shift - 149) first (half to even), so the conversions after are exact: one rounding. */
static float decode_wide(int64_t sum, int shift)
{
    int grid = shift - 149 > 0 ? shift - 149 : 0;
    int limit = shift - 126 < 0 ? 0 : (shift - 126 > 62 ? 62 : shift - 126);
    int64_t magnitude = sum < 0 ? -sum : sum;
    if (grid > 0 && magnitude < ((int64_t)1 << limit)) {
        int64_t kept = sum >> grid; /* floor (arithmetic shift) */
        int64_t rest = sum - (int64_t)((uint64_t)kept << grid);
        int64_t half = (int64_t)1 << (grid - 1);
        int64_t up = rest > half || (rest == half && (kept & 1));
        sum = (int64_t)((uint64_t)(kept + up) << grid);
    }
    return (float)((double)(float)sum * pow2d(-shift));
}

static void decode_block(const int64_t *sums, int64_t n, int exponent, int bits, float *out)
{
    int shift = bits - (exponent < EXPONENT_NONFINITE - 1 ? exponent : EXPONENT_NONFINITE - 1);
    if (exponent == EXPONENT_NONFINITE) {
        const uint32_t nan_bits = 0x7fc00000u; /* float("nan") as fp32, what the reference writes */
        for (int64_t i = 0; i < n; i++)
            memcpy(out + i, &nan_bits, 4);
    } else if (shift > SCALE_MAX) {
        for (int64_t i = 0; i < n; i++)
            out[i] = decode_wide(sums[i], shift);
    } else {
        decode_row_f32(sums, n, pow2f(-shift), out);
    }
}

/* block_size 1: the scale varies per element. */
CLONES static void decode_flat(const int64_t *sums, int64_t n, const int8_t *exponents, int bits, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        int e = exponents[i], shift = bits - (e < EXPONENT_NONFINITE - 1 ? e : EXPONENT_NONFINITE - 1);
        if (e == EXPONENT_NONFINITE || shift > SCALE_MAX)
            decode_block(sums + i, 1, e, bits, out + i);
        else
            out[i] = (float)sums[i] * pow2f(-shift);
    }
}

/* Elements added up from the addends at a time, in a buffer on the stack (32 KiB: in L1/L2). */
#define PIECE 4096

/* tmp = sums + every addend, elements [offset, offset + n) (int64 addition wraps: exact, as in
 * torch, since the true sum fits). */
CLONES static void add_up(const int64_t *sums, uint64_t num_addends, const int64_t *const *addends, int64_t offset,
                          int64_t n, int64_t *tmp)
{
    for (int64_t i = 0; i < n; i++)
        tmp[i] = sums[offset + i];
    for (uint64_t j = 0; j < num_addends; j++) {
        const int64_t *a = addends[j] + offset;
        for (int64_t i = 0; i < n; i++)
            tmp[i] = (int64_t)((uint64_t)tmp[i] + (uint64_t)a[i]);
    }
}

/* out = the fp32 values of int64 block sums (num_blocks, block_size) with their exponents.  The
 * num_addends buffers at addend_ptrs (partial sums a reduce-scatter received; the same shape)
 * are added to the sums first, in the same pass, so the full sum is never written. */
SAMEBITS_EXPORT void samebits_fixed_decode(const int64_t *sums, uint64_t num_addends, const uint64_t *addend_ptrs,
                                           int64_t num_blocks, int64_t block_size, const int8_t *exponents, int bits,
                                           float *out, int num_threads)
{
    const int64_t *addends[num_addends ? num_addends : 1];
    for (uint64_t j = 0; j < num_addends; j++)
        addends[j] = (const int64_t *)(uintptr_t)addend_ptrs[j];
    int64_t total = num_blocks * block_size;
    int threads = threads_for(total * (int64_t)(1 + num_addends), num_threads);
    if (block_size == 1) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t begin = 0; begin < total; begin += PIECE) {
            int64_t n = begin + PIECE < total ? PIECE : total - begin, tmp[num_addends ? PIECE : 1];
            const int64_t *values = sums + begin;
            if (num_addends) {
                add_up(sums, num_addends, addends, begin, n, tmp);
                values = tmp;
            }
            decode_flat(values, n, exponents + begin, bits, out + begin);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < num_blocks; b++) {
        for (int64_t begin = 0; begin < block_size; begin += PIECE) { /* a block decodes elementwise: any cut */
            int64_t n = begin + PIECE < block_size ? PIECE : block_size - begin, tmp[num_addends ? PIECE : 1];
            int64_t offset = b * block_size + begin;
            const int64_t *values = sums + offset;
            if (num_addends) {
                add_up(sums, num_addends, addends, offset, n, tmp);
                values = tmp;
            }
            decode_block(values, n, exponents[b], bits, out + offset);
        }
    }
}

/* block_size 1, elements [begin, end) a strip at a time (its values on the stack): loops over
 * the elements without a branch, which the compiler vectorizes; the rare elements (inf or nan,
 * or a nonzero peak below the fp32 scale's range, subnormal peaks among them) are redone
 * after, one by one, by the blocks' own paths.  A zero peak takes the fp32 path at the
 * clamped scale: the same +0.0 and no inexact count as the float64 path gives it. */
#define STRIP 512

typedef union {
    uint32_t bits;
    float value;
} f32_bits;

CLONES static int64_t reduce_flat(uint64_t num_buffers, const float *const *buffers, int64_t begin, int64_t end,
                                  int bits, float *out, int64_t *nonfinite)
{
    int64_t inexact = 0;
    for (int64_t first = begin; first < end; first += STRIP) {
        const int64_t n = first + STRIP < end ? STRIP : end - first;
        uint32_t peak[STRIP];
        int32_t rare[STRIP];
        f32_bits scale[STRIP], unscale[STRIP];
        int64_t q[STRIP];
        for (int64_t i = 0; i < n; i++)
            peak[i] = 0;
        for (uint64_t j = 0; j < num_buffers; j++) {
            const uint32_t *x = (const uint32_t *)(const void *)(buffers[j] + first);
            for (int64_t i = 0; i < n; i++) {
                uint32_t a = x[i] & 0x7fffffffu;
                peak[i] = a > peak[i] ? a : peak[i];
            }
        }
        int32_t num_rare = 0;
        for (int64_t i = 0; i < n; i++) { /* exponent_of_bits for normal peaks; the rest is rare or zero */
            uint32_t p = peak[i];
            int32_t e = (int32_t)(p >> 23) - 126;
            e = e > EXPONENT_NONFINITE - 1 ? EXPONENT_NONFINITE - 1 : e;
            int32_t shift = bits - e;
            int32_t is_rare = (p != 0) & ((p >= 0x7f800000u) | (p < 0x00800000u) | (shift > SCALE_MAX));
            shift = (p == 0) | (shift > SCALE_MAX) ? SCALE_MAX : shift;
            rare[i] = is_rare;
            num_rare += is_rare;
            scale[i].bits = (uint32_t)(shift + 127) << 23;
            unscale[i].bits = (uint32_t)(127 - shift) << 23;
            q[i] = 0;
        }
        for (uint64_t j = 0; j < num_buffers; j++) {
            const float *x = buffers[j] + first;
            for (int64_t i = 0; i < n; i++) {
                float v = rare[i] ? 0.0f : x[i]; /* a rare element's value waits for its own path */
                float s = v * scale[i].value, r = nearbyintf(s);
                inexact += r != s;
                q[i] += (int64_t)r;
            }
        }
        for (int64_t i = 0; i < n; i++)
            out[first + i] = (float)q[i] * unscale[i].value;
        for (int64_t i = 0; num_rare && i < n; i++) {
            if (!rare[i])
                continue;
            int e = exponent_of_bits(peak[i]);
            int64_t sum = 0;
            *nonfinite += e == EXPONENT_NONFINITE;
            inexact += encode_block(num_buffers, buffers, first + i, 1, e, bits, &sum);
            decode_block(&sum, 1, e, bits, out + first + i);
        }
    }
    return inexact;
}

/* out = the decoded sum of the k buffers' encodings at their MAX block exponents: what
 * samebits_fixed_exponents, samebits_fixed_encode_sum and samebits_fixed_decode give in turn,
 * bit for bit, in one pass.  Returns the inexact count; *nonfinite_blocks gets the number of
 * blocks holding inf or nan. */
SAMEBITS_EXPORT int64_t samebits_fixed_reduce(uint64_t num_buffers, const uint64_t *data_ptrs, int64_t num_blocks,
                                              int64_t block_size, int bits, float *out, int64_t *nonfinite_blocks,
                                              int num_threads)
{
    const float *buffers[num_buffers ? num_buffers : 1];
    for (uint64_t j = 0; j < num_buffers; j++)
        buffers[j] = (const float *)(uintptr_t)data_ptrs[j];
    int threads = threads_for(num_blocks * block_size * (int64_t)num_buffers, num_threads);
    int64_t inexact = 0, nonfinite = 0;
    if (block_size == 1) {
        const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(+ : inexact, nonfinite)
        for (int64_t begin = 0; begin < num_blocks; begin += chunk)
            inexact += reduce_flat(num_buffers, buffers, begin, begin + chunk < num_blocks ? begin + chunk : num_blocks,
                                   bits, out, &nonfinite);
        *nonfinite_blocks = nonfinite;
        return inexact;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(+ : inexact, nonfinite)
    for (int64_t b = 0; b < num_blocks; b++) {
        uint32_t peak = 0;
        for (uint64_t j = 0; j < num_buffers; j++)
            peak = peak_bits((const uint32_t *)(const void *)(buffers[j] + b * block_size), block_size, peak);
        int e = exponent_of_bits(peak);
        nonfinite += e == EXPONENT_NONFINITE;
        for (int64_t begin = 0; begin < block_size; begin += PIECE) { /* elementwise once the exponent is known */
            int64_t n = begin + PIECE < block_size ? PIECE : block_size - begin, tmp[PIECE];
            int64_t offset = b * block_size + begin;
            inexact += encode_block(num_buffers, buffers, offset, n, e, bits, tmp);
            decode_block(tmp, n, e, bits, out + offset);
        }
    }
    *nonfinite_blocks = nonfinite;
    return inexact;
}

/* _norm.sharded_grad_norm's per-tensor peaks: out[t] = the largest |x| of tensor t as fp32 bits
 * (x & 0x7fffffff; nan above inf, as its bits are), 0 for an empty tensor: the MAX is exact. */
SAMEBITS_EXPORT CLONES void samebits_fixed_peaks(uint64_t num_tensors, const uint64_t *tensor_ptrs, const int64_t *numels,
                                                 uint32_t *out)
{
    for (uint64_t t = 0; t < num_tensors; t++)
        out[t] = peak_bits((const uint32_t *)(uintptr_t)tensor_ptrs[t], numels[t], 0);
}

/* _norm.sharded_grad_norm's per-tensor sums: for tensor t (numels[t] fp32 elements at
 * tensor_ptrs[t]), the int64 sum of round-half-even(x * x * scales[t]) in float64 (x * x is exact,
 * scales are powers of two), inf and nan taken as 0, as the torch path computes it (square,
 * multiply, nan_to_num, round, int64, sum).  The sum is exact, so threads change no bit. */
SAMEBITS_EXPORT CLONES void samebits_fixed_square_sums(uint64_t num_tensors, const uint64_t *tensor_ptrs,
                                                       const int64_t *numels, const double *scales, int64_t *out,
                                                       int num_threads)
{
    for (uint64_t t = 0; t < num_tensors; t++) {
        const float *x = (const float *)(uintptr_t)tensor_ptrs[t];
        const int64_t n = numels[t];
        const double scale = scales[t];
        int64_t sum = 0;
        int threads = threads_for(n, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            double v = (double)x[i] * (double)x[i] * scale;
            sum += isfinite(v) ? (int64_t)nearbyint(v) : 0;
        }
        out[t] = sum;
    }
}
