/* Body sums of the samebits tensor digest, on the CPU (see docs/digest.md for the spec).
 *
 * For each buffer of L bytes, zero-padded to W = ceil(L/8) little-endian uint64 words:
 *     S = sum_{j<W} mix2(w_j + (j+1)*G)  mod 2^64          (digest version 2)
 * Headers are computed in Python (they need only metadata); the final mix D = fmix64(H ^ S) is
 * in Python for single digests and here for a Recorder's whole step (samebits_finalize_into).
 *
 * Loaded with ctypes, so this file uses no Python API: ctypes releases the GIL for the call.
 * Built by setup.py as a setuptools Extension (a plain shared library with a Python-style name).
 *
 * Speed: mix2 is five rounds of one 32x32->64 multiply, one xor and one swap of the 32-bit
 * halves, i.e. vpmuludq + vpxor + vpshufd per round.  GCC does not vectorize a widening 32x32
 * multiply into vpmuludq (it emulates a full 64-bit multiply with three), so the hot loop is
 * written with intrinsics, once per instruction set: AVX-512F, AVX2, and SSE2 (every x86-64);
 * the best one for the running CPU is picked once at load time.  A shipped build never depends
 * on the build machine's CPU.  The AVX2 and AVX-512 loops read four parts of the buffer at once
 * (STREAMS, below) to keep DRAM busy from one core.  Other architectures get the plain C loop.  Inputs above
 * PARALLEL_MIN_BYTES are split into chunks summed by OpenMP threads; wrapping addition is
 * associative and commutative, so the result does not depend on the thread count or order.
 */

#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "native.h"

/* The interface _native.py expects; a library of another ABI version is refused there.
 * 1: digest version 1.  2: mix2 replaced fmix64 in the body (digest version 2).
 * 3: samebits_body_sum_with added (digest version 2).  4: samebits_finalize_into added. */
#define SAMEBITS_ABI_VERSION 4

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL; /* G: the per-position offset step */

/* mix2's round keys: even (so that x -> x ^ low32(x * K) is a bijection of the low half) 32-bit
 * constants, the golden ratio and the murmur3 / xxHash32 primes with their low bit cleared. */
#define MIX_KEY_0 0x9E3779B8u
#define MIX_KEY_1 0x85EBCA6Au
#define MIX_KEY_2 0xC2B2AE34u
#define MIX_KEY_3 0x27D4EB2Eu
#define MIX_KEY_4 0x165667B0u

/* Bytes ahead of the current position that the vector loops prefetch: the loop spends ~20
 * vector instructions per 32 bytes, which fills the reorder buffer before the hardware
 * prefetcher has enough loads in flight to keep up with DRAM.  Measured on Zen 3: +30-40%. */
#define PREFETCH_BYTES 4096

/* The AVX2 and AVX-512 loops read STREAMS parts of a buffer at once, one 64-byte line of each
 * per iteration, each prefetched STREAM_PREFETCH_BYTES ahead.  One sequential stream leaves
 * DRAM bandwidth unused on one core (a plain load loop reads ~10% slower than torch's sum(),
 * which also reads several rows at once); four streams keep more misses in flight and give the
 * hardware prefetchers four streams to follow.  Measured on Zen 3, 256 MiB, 1 thread:
 * 0.92x -> 1.1x of sum() (benchmarks/RESULTS.md).  The sum is the same: each word keeps its
 * own position term, and the terms are added modulo 2^64 in another order. */
#define STREAMS 4
#define STREAM_PREFETCH_BYTES 2048

static inline uint64_t mix_round(uint64_t x, uint32_t key)
{
    x ^= (uint64_t)(uint32_t)x * key; /* high half ^= high32(lo*K), low half ^= low32(lo*K) */
    return (x >> 32) | (x << 32);     /* swap the halves */
}

static inline uint64_t mix2(uint64_t x)
{
    x = mix_round(x, MIX_KEY_0);
    x = mix_round(x, MIX_KEY_1);
    x = mix_round(x, MIX_KEY_2);
    x = mix_round(x, MIX_KEY_3);
    return mix_round(x, MIX_KEY_4);
}

/* Plain C: other architectures, and the words after the last whole vector. */
static uint64_t sum_words_portable(const unsigned char *p, uint64_t num_words, uint64_t offset)
{
    uint64_t s = 0;
    for (uint64_t i = 0; i < num_words; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8); /* unaligned-safe load */
        s += mix2(w + offset);
        offset += GOLDEN; /* (j+1)*G as a running sum: the same bits, no multiply */
    }
    return s;
}

#if SAMEBITS_X86
/* One round on 2/4/8 words at once: vpmuludq multiplies the low halves, vpshufd 0xB1 swaps the
 * 32-bit halves of every 64-bit lane. */
#define ROUND_128(x, k) x = _mm_shuffle_epi32(_mm_xor_si128(x, _mm_mul_epu32(x, k)), 0xB1)
#define ROUND_256(x, k) x = _mm256_shuffle_epi32(_mm256_xor_si256(x, _mm256_mul_epu32(x, k)), 0xB1)
#define ROUND_512(x, k) x = _mm512_shuffle_epi32(_mm512_xor_si512(x, _mm512_mul_epu32(x, k)), 0xB1)

/* The loops below (sum_words_*, and sum_lines_* for the tail that the streams leave) return
 * the sum over the first *done words, num_words rounded down to their step; the caller adds the
 * rest with sum_words_portable.  mix_line_* mixes one 64-byte line for the tail loops. */

/* mix2 of the 8 words of one 64-byte line at p, whose offsets (j+1)*G are the lanes of o. */
__attribute__((target("avx512f"), always_inline)) static inline __m512i mix_line_avx512(
    const unsigned char *p, __m512i o)
{
    __m512i x = _mm512_add_epi64(_mm512_loadu_si512((const void *)p), o);
    ROUND_512(x, _mm512_set1_epi64(MIX_KEY_0));
    ROUND_512(x, _mm512_set1_epi64(MIX_KEY_1));
    ROUND_512(x, _mm512_set1_epi64(MIX_KEY_2));
    ROUND_512(x, _mm512_set1_epi64(MIX_KEY_3));
    ROUND_512(x, _mm512_set1_epi64(MIX_KEY_4));
    return x;
}

/* One stream: the tail that the STREAMS loop leaves (under STREAMS lines); not inlined, so
 * that benchmarks/digest_mca/run.sh finds it. */
__attribute__((target("avx512f"), noinline)) static uint64_t sum_lines_avx512(const unsigned char *p,
                                                                   uint64_t num_words,
                                                                   uint64_t offset,
                                                                   uint64_t *done)
{
    const __m512i step = _mm512_set1_epi64((long long)(8 * GOLDEN));
    __m512i o = _mm512_add_epi64(
        _mm512_set1_epi64((long long)offset),
        _mm512_set_epi64((long long)(7 * GOLDEN), (long long)(6 * GOLDEN), (long long)(5 * GOLDEN),
                         (long long)(4 * GOLDEN), (long long)(3 * GOLDEN), (long long)(2 * GOLDEN),
                         (long long)GOLDEN, 0));
    __m512i s = _mm512_setzero_si512();
    uint64_t i = 0;
    for (; i + 8 <= num_words; i += 8) {
        _mm_prefetch((const char *)(p + 8 * i + PREFETCH_BYTES), _MM_HINT_T0);
        s = _mm512_add_epi64(s, mix_line_avx512(p + 8 * i, o));
        o = _mm512_add_epi64(o, step);
    }
    *done = i;
    return (uint64_t)_mm512_reduce_add_epi64(s);
}

/* STREAMS streams of `per` words each (a multiple of 8), then the rest with one stream. */
__attribute__((target("avx512f"))) static uint64_t sum_words_avx512(const unsigned char *p,
                                                                   uint64_t num_words,
                                                                   uint64_t offset,
                                                                   uint64_t *done)
{
    const uint64_t per = num_words / (8 * STREAMS) * 8;
    const __m512i step = _mm512_set1_epi64((long long)(8 * GOLDEN));
    const __m512i lanes =
        _mm512_set_epi64((long long)(7 * GOLDEN), (long long)(6 * GOLDEN), (long long)(5 * GOLDEN),
                         (long long)(4 * GOLDEN), (long long)(3 * GOLDEN), (long long)(2 * GOLDEN),
                         (long long)GOLDEN, 0);
    const unsigned char *q[STREAMS];
    __m512i o[STREAMS];
    for (int k = 0; k < STREAMS; k++) {
        q[k] = p + 8 * per * k;
        o[k] = _mm512_add_epi64(_mm512_set1_epi64((long long)(offset + per * k * GOLDEN)), lanes);
    }
    const __m512i k0 = _mm512_set1_epi64(MIX_KEY_0), k1 = _mm512_set1_epi64(MIX_KEY_1),
                  k2 = _mm512_set1_epi64(MIX_KEY_2), k3 = _mm512_set1_epi64(MIX_KEY_3),
                  k4 = _mm512_set1_epi64(MIX_KEY_4);
    __m512i s = _mm512_setzero_si512();
    for (uint64_t i = 0; i < per; i += 8) {
        __m512i x[STREAMS]; /* each round on all streams' lines together, as in the AVX2 loop */
        for (int k = 0; k < STREAMS; k++) {
            _mm_prefetch((const char *)(q[k] + 8 * i + STREAM_PREFETCH_BYTES), _MM_HINT_T0);
            x[k] = _mm512_add_epi64(_mm512_loadu_si512((const void *)(q[k] + 8 * i)), o[k]);
            o[k] = _mm512_add_epi64(o[k], step);
        }
        for (int k = 0; k < STREAMS; k++)
            ROUND_512(x[k], k0);
        for (int k = 0; k < STREAMS; k++)
            ROUND_512(x[k], k1);
        for (int k = 0; k < STREAMS; k++)
            ROUND_512(x[k], k2);
        for (int k = 0; k < STREAMS; k++)
            ROUND_512(x[k], k3);
        for (int k = 0; k < STREAMS; k++)
            ROUND_512(x[k], k4);
        for (int k = 0; k < STREAMS; k++)
            s = _mm512_add_epi64(s, x[k]);
    }
    uint64_t start = STREAMS * per, rest = 0;
    uint64_t t = sum_lines_avx512(p + 8 * start, num_words - start, offset + start * GOLDEN, &rest);
    *done = start + rest;
    return (uint64_t)_mm512_reduce_add_epi64(s) + t;
}

/* mix2 of the 8 words of one 64-byte line at p (two vectors), summed; the offsets (j+1)*G of
 * the first vector's words are the lanes of o, the second's are 4*G further. */
__attribute__((target("avx2"), always_inline)) static inline __m256i mix_line_avx2(
    const unsigned char *p, __m256i o)
{
    const __m256i k0 = _mm256_set1_epi64x(MIX_KEY_0), k1 = _mm256_set1_epi64x(MIX_KEY_1),
                  k2 = _mm256_set1_epi64x(MIX_KEY_2), k3 = _mm256_set1_epi64x(MIX_KEY_3),
                  k4 = _mm256_set1_epi64x(MIX_KEY_4);
    __m256i x = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)p), o);
    __m256i y = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + 32)),
                                 _mm256_add_epi64(o, _mm256_set1_epi64x((long long)(4 * GOLDEN))));
    ROUND_256(x, k0);
    ROUND_256(y, k0);
    ROUND_256(x, k1);
    ROUND_256(y, k1);
    ROUND_256(x, k2);
    ROUND_256(y, k2);
    ROUND_256(x, k3);
    ROUND_256(y, k3);
    ROUND_256(x, k4);
    ROUND_256(y, k4);
    return _mm256_add_epi64(x, y);
}

/* The lanes' offsets within a vector of 4 words: 0, G, 2G, 3G. */
#define LANES_256                                                                          \
    _mm256_set_epi64x((long long)(3 * GOLDEN), (long long)(2 * GOLDEN), (long long)GOLDEN, 0)

/* One stream: the tail that the STREAMS loop leaves (under STREAMS lines); not inlined, so
 * that benchmarks/digest_mca/run.sh finds it. */
__attribute__((target("avx2"), noinline)) static uint64_t sum_lines_avx2(const unsigned char *p,
                                                               uint64_t num_words, uint64_t offset,
                                                               uint64_t *done)
{
    const __m256i step = _mm256_set1_epi64x((long long)(8 * GOLDEN));
    __m256i o = _mm256_add_epi64(_mm256_set1_epi64x((long long)offset), LANES_256);
    __m256i s = _mm256_setzero_si256();
    uint64_t i = 0;
    for (; i + 8 <= num_words; i += 8) {
        _mm_prefetch((const char *)(p + 8 * i + PREFETCH_BYTES), _MM_HINT_T0);
        s = _mm256_add_epi64(s, mix_line_avx2(p + 8 * i, o));
        o = _mm256_add_epi64(o, step);
    }
    *done = i;
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, s);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/* STREAMS streams of `per` words each (a multiple of 8), then the rest with one stream. */
__attribute__((target("avx2"))) static uint64_t sum_words_avx2(const unsigned char *p,
                                                               uint64_t num_words, uint64_t offset,
                                                               uint64_t *done)
{
    const uint64_t per = num_words / (8 * STREAMS) * 8;
    const __m256i step = _mm256_set1_epi64x((long long)(8 * GOLDEN));
    const __m256i lanes = LANES_256;
    const unsigned char *q[STREAMS];
    __m256i o[STREAMS];
    for (int k = 0; k < STREAMS; k++) {
        q[k] = p + 8 * per * k;
        o[k] = _mm256_add_epi64(_mm256_set1_epi64x((long long)(offset + per * k * GOLDEN)), lanes);
    }
    const __m256i k0 = _mm256_set1_epi64x(MIX_KEY_0), k1 = _mm256_set1_epi64x(MIX_KEY_1),
                  k2 = _mm256_set1_epi64x(MIX_KEY_2), k3 = _mm256_set1_epi64x(MIX_KEY_3),
                  k4 = _mm256_set1_epi64x(MIX_KEY_4);
    const __m256i half = _mm256_set1_epi64x((long long)(4 * GOLDEN));
    __m256i s = _mm256_setzero_si256();
    for (uint64_t i = 0; i < per; i += 8) {
        /* All 2 * STREAMS vectors go through each round together: independent multiplies to
         * overlap (on Zen 3 +15% over mixing one line at a time). */
        __m256i x[2 * STREAMS];
        for (int k = 0; k < STREAMS; k++) {
            _mm_prefetch((const char *)(q[k] + 8 * i + STREAM_PREFETCH_BYTES), _MM_HINT_T0);
            x[2 * k] = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(q[k] + 8 * i)), o[k]);
            x[2 * k + 1] = _mm256_add_epi64(
                _mm256_loadu_si256((const __m256i *)(q[k] + 8 * i + 32)), _mm256_add_epi64(o[k], half));
            o[k] = _mm256_add_epi64(o[k], step);
        }
        for (int v = 0; v < 2 * STREAMS; v++)
            ROUND_256(x[v], k0);
        for (int v = 0; v < 2 * STREAMS; v++)
            ROUND_256(x[v], k1);
        for (int v = 0; v < 2 * STREAMS; v++)
            ROUND_256(x[v], k2);
        for (int v = 0; v < 2 * STREAMS; v++)
            ROUND_256(x[v], k3);
        for (int v = 0; v < 2 * STREAMS; v++)
            ROUND_256(x[v], k4);
        for (int v = 0; v < 2 * STREAMS; v++)
            s = _mm256_add_epi64(s, x[v]);
    }
    uint64_t start = STREAMS * per, rest = 0;
    uint64_t t = sum_lines_avx2(p + 8 * start, num_words - start, offset + start * GOLDEN, &rest);
    *done = start + rest;
    uint64_t lanes4[4];
    _mm256_storeu_si256((__m256i *)lanes4, s);
    return lanes4[0] + lanes4[1] + lanes4[2] + lanes4[3] + t;
}

static uint64_t sum_words_sse2(const unsigned char *p, uint64_t num_words, uint64_t offset,
                               uint64_t *done)
{
    const __m128i k0 = _mm_set1_epi64x(MIX_KEY_0), k1 = _mm_set1_epi64x(MIX_KEY_1),
                  k2 = _mm_set1_epi64x(MIX_KEY_2), k3 = _mm_set1_epi64x(MIX_KEY_3),
                  k4 = _mm_set1_epi64x(MIX_KEY_4);
    const __m128i step = _mm_set1_epi64x((long long)(2 * GOLDEN));
    __m128i o = _mm_add_epi64(_mm_set1_epi64x((long long)offset),
                              _mm_set_epi64x((long long)GOLDEN, 0));
    __m128i s = _mm_setzero_si128();
    uint64_t i = 0;
    for (; i + 4 <= num_words; i += 4) {
        __m128i x = _mm_add_epi64(_mm_loadu_si128((const __m128i *)(p + 8 * i)), o);
        o = _mm_add_epi64(o, step);
        __m128i y = _mm_add_epi64(_mm_loadu_si128((const __m128i *)(p + 8 * i + 16)), o);
        o = _mm_add_epi64(o, step);
        ROUND_128(x, k0);
        ROUND_128(y, k0);
        ROUND_128(x, k1);
        ROUND_128(y, k1);
        ROUND_128(x, k2);
        ROUND_128(y, k2);
        ROUND_128(x, k3);
        ROUND_128(y, k3);
        ROUND_128(x, k4);
        ROUND_128(y, k4);
        s = _mm_add_epi64(s, _mm_add_epi64(x, y));
    }
    *done = i;
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, s);
    return lanes[0] + lanes[1];
}

typedef uint64_t (*sum_words_fn)(const unsigned char *, uint64_t, uint64_t, uint64_t *);
static sum_words_fn sum_words_vector = sum_words_sse2; /* SSE2 is part of every x86-64 */
static const char *variant_name = "sse2";

/* Picks the widest vector loop the running CPU supports, once, when the library is loaded
 * (before any thread can call in). */
__attribute__((constructor)) static void pick_variant(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        sum_words_vector = sum_words_avx512;
        variant_name = "avx512f";
    } else if (__builtin_cpu_supports("avx2")) {
        sum_words_vector = sum_words_avx2;
        variant_name = "avx2";
    }
}
#endif /* SAMEBITS_X86 */

/* Sum over num_words full words starting at p, whose first word has index first_word. */
static uint64_t sum_full_words(const unsigned char *p, uint64_t num_words, uint64_t first_word)
{
    uint64_t offset = (first_word + 1) * GOLDEN;
#if SAMEBITS_X86
    uint64_t done = 0;
    uint64_t s = sum_words_vector(p, num_words, offset, &done);
    return s + sum_words_portable(p + 8 * done, num_words - done, offset + done * GOLDEN);
#else
    return sum_words_portable(p, num_words, offset);
#endif
}

SAMEBITS_EXPORT int samebits_digest_abi_version(void) { return SAMEBITS_ABI_VERSION; }

/* Which vector loop the loader picked, for benchmarks and bug reports. */
SAMEBITS_EXPORT const char *samebits_digest_isa(void)
{
#if SAMEBITS_X86
    return variant_name;
#else
    return "portable";
#endif
}

SAMEBITS_EXPORT int samebits_digest_has_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Body sum of one buffer as if its first word had index first_word (the tail word, if any, is
 * zero-padded).  Exported so tests can check the 64-bit position arithmetic of huge tensors
 * without allocating them. */
SAMEBITS_EXPORT uint64_t samebits_body_sum_at(const void *data, uint64_t num_bytes,
                                              uint64_t first_word)
{
    const unsigned char *p = (const unsigned char *)data;
    uint64_t num_full = num_bytes / 8;
    uint64_t s = num_full ? sum_full_words(p, num_full, first_word) : 0;
    if (num_bytes % 8) {
        uint64_t w = 0;
        memcpy(&w, p + 8 * num_full, num_bytes % 8);
        s += mix2(w + (first_word + num_full + 1) * GOLDEN);
    }
    return s;
}

/* For tests: the body sum with one named loop ("portable", "sse2", "avx2", "avx512f") instead
 * of the one picked at load time, so that every loop the CPU can run is checked, not only the
 * widest.  Returns 0 (and leaves *out alone) when this build or CPU lacks that loop. */
SAMEBITS_EXPORT int samebits_body_sum_with(const char *isa, const void *data, uint64_t num_bytes,
                                           uint64_t first_word, uint64_t *out)
{
    const unsigned char *p = (const unsigned char *)data;
    uint64_t num_full = num_bytes / 8, offset = (first_word + 1) * GOLDEN, done = 0, s;
    if (strcmp(isa, "portable") == 0) {
        s = sum_words_portable(p, num_full, offset);
        done = num_full;
    }
#if SAMEBITS_X86
    else if (strcmp(isa, "sse2") == 0)
        s = sum_words_sse2(p, num_full, offset, &done);
    else if (strcmp(isa, "avx2") == 0 && __builtin_cpu_supports("avx2"))
        s = sum_words_avx2(p, num_full, offset, &done);
    else if (strcmp(isa, "avx512f") == 0 && __builtin_cpu_supports("avx512f"))
        s = sum_words_avx512(p, num_full, offset, &done);
#endif
    else
        return 0;
    s += sum_words_portable(p + 8 * done, num_full - done, offset + done * GOLDEN);
    if (num_bytes % 8) {
        uint64_t w = 0;
        memcpy(&w, p + 8 * num_full, num_bytes % 8);
        s += mix2(w + (first_word + num_full + 1) * GOLDEN);
    }
    *out = s;
    return 1;
}

#ifdef _OPENMP
/* Below this many bytes in a call, no thread team is started: one thread reads 4 MiB in about
 * 170 us, while waking a sleeping team costs tens of us and, on a machine whose cores are busy
 * with other processes, the join can wait milliseconds for a descheduled thread. */
static const uint64_t PARALLEL_MIN_BYTES = 4ULL << 20;
/* Work unit handed to a thread: big enough to amortise scheduling, small enough to balance. */
static const uint64_t CHUNK_WORDS = 1ULL << 16; /* 512 KiB */

static uint64_t num_chunks_of(uint64_t num_bytes)
{
    uint64_t num_words = num_bytes / 8 + (num_bytes % 8 != 0);
    return (num_words + CHUNK_WORDS - 1) / CHUNK_WORDS;
}

/* Sum over words [first_word, end_word) of a buffer of num_bytes bytes. */
static uint64_t sum_word_range(const unsigned char *data, uint64_t num_bytes, uint64_t first_word,
                               uint64_t end_word)
{
    uint64_t end_byte = 8 * end_word < num_bytes ? 8 * end_word : num_bytes;
    return samebits_body_sum_at(data + 8 * first_word, end_byte - 8 * first_word, first_word);
}
#endif

/* Body sums of num_tensors buffers in one call: out_sums[i] = S(data_ptrs[i], num_bytes[i]).
 *
 * All buffers share one thread team: each is cut into CHUNK_WORDS chunks, threads take chunks
 * dynamically and add their partial sums into out_sums[i] atomically.  num_threads comes from
 * the caller (torch.get_num_threads(), or 1 in a forked child), so we never use more threads
 * than torch is allowed to, and with 1 OpenMP is never entered at all.
 */
SAMEBITS_EXPORT void samebits_body_sums(uint64_t num_tensors, const uint64_t *data_ptrs,
                                        const uint64_t *num_bytes, uint64_t *out_sums,
                                        int num_threads)
{
#ifdef _OPENMP
    uint64_t total_bytes = 0, total_chunks = 0;
    for (uint64_t i = 0; i < num_tensors; i++) {
        total_bytes += num_bytes[i];
        total_chunks += num_chunks_of(num_bytes[i]);
    }
    if (num_threads > 1 && total_bytes >= PARALLEL_MIN_BYTES && total_chunks > 1) {
        for (uint64_t i = 0; i < num_tensors; i++)
            out_sums[i] = 0;
        /* Chunks are numbered across all buffers in order; each thread keeps a cursor (buffer,
         * its first chunk number) that only moves forward while its chunk numbers grow. */
        int64_t num_chunks = (int64_t)total_chunks;
#pragma omp parallel num_threads(num_threads)
        {
            uint64_t tensor = 0, tensor_first_chunk = 0; /* per-thread cursor */
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < num_chunks; c++) {
                uint64_t chunk = (uint64_t)c;
                if (chunk < tensor_first_chunk) { /* rewind (dynamic schedule is not monotonic) */
                    tensor = 0;
                    tensor_first_chunk = 0;
                }
                for (;;) {
                    uint64_t n = num_chunks_of(num_bytes[tensor]);
                    if (chunk < tensor_first_chunk + n)
                        break;
                    tensor_first_chunk += n;
                    tensor++;
                }
                uint64_t first_word = (chunk - tensor_first_chunk) * CHUNK_WORDS;
                const unsigned char *data = (const unsigned char *)(uintptr_t)data_ptrs[tensor];
                uint64_t s = sum_word_range(data, num_bytes[tensor], first_word,
                                            first_word + CHUNK_WORDS);
#pragma omp atomic
                out_sums[tensor] += s;
            }
        }
        return;
    }
#else
    (void)num_threads;
#endif
    for (uint64_t i = 0; i < num_tensors; i++)
        out_sums[i] = samebits_body_sum_at((const void *)(uintptr_t)data_ptrs[i], num_bytes[i], 0);
}

/* fmix64 of the spec (MurmurHash3's finalizer): the header's and the final mix. */
static inline uint64_t fmix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* The digests of a Recorder's step, written into its encoded records: for k < n,
 *     D_k = fmix64(headers[k] ^ sums[sum_indices[k]])
 * goes little endian into out[offsets[k] .. offsets[k] + 8), after out is copied from
 * template[0 .. num_bytes) (the step's records with the digests left zero).  One call per step
 * in place of a dozen numpy operations (stream/_encoder.py, step templates). */
SAMEBITS_EXPORT void samebits_finalize_into(const unsigned char *template, uint64_t num_bytes, uint64_t n,
                                            const uint64_t *sums, const int64_t *sum_indices,
                                            const uint64_t *headers, const int64_t *offsets,
                                            unsigned char *out)
{
    memcpy(out, template, num_bytes);
    for (uint64_t k = 0; k < n; k++) {
        uint64_t d = fmix64(headers[k] ^ sums[sum_indices[k]]);
        unsigned char *at = out + offsets[k];
        for (int b = 0; b < 8; b++) /* little endian whatever the host */
            at[b] = (unsigned char)(d >> (8 * b));
    }
}
