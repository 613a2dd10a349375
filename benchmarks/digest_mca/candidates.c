/* Phase-1 candidates for digest version 2, timed by time_loops.py (docs/digest.md, "Why").
 * fmix_v1:      the version-1 body loop (fmix64, GCC-vectorised: 3 vpmuludq per 64-bit multiply).
 * u64_sum:      a plain wrapping sum of the words (the memory-bound floor for C).
 * mix2_*:       the version-2 mixer (5 rounds of vpmuludq, vpxor, vpshufd), AVX2 intrinsics,
 *               two vectors per iteration, without / with a software prefetch N bytes ahead.
 * feistel4:     4 Feistel rounds with F(h) = low32(p ^ p >> 32), p = h*K (a rejected candidate:
 *               needs 4 rounds for full avalanche and more instructions per round). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#define G 0x9E3779B97F4A7C15ULL
static inline uint64_t fmix64(uint64_t x)
{
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}
uint64_t fmix_v1(const unsigned char *p, uint64_t n)
{
    uint64_t s = 0, o = G;
    for (uint64_t i = 0; i < n; i++) { uint64_t w; memcpy(&w, p + 8 * i, 8); s += fmix64(w + o); o += G; }
    return s;
}
uint64_t u64_sum(const unsigned char *p, uint64_t n)
{
    uint64_t s = 0;
    for (uint64_t i = 0; i < n; i++) { uint64_t w; memcpy(&w, p + 8 * i, 8); s += w; }
    return s;
}
static const uint32_t K[5] = {0x9E3779B8u, 0x85EBCA6Au, 0xC2B2AE34u, 0x27D4EB2Eu, 0x165667B0u};
#define ROUND(x, k) x = _mm256_shuffle_epi32(_mm256_xor_si256(x, _mm256_mul_epu32(x, k)), 0xB1)
#define MIX2(NAME, PREFETCH)                                                                      \
    __attribute__((target("avx2"))) uint64_t NAME(const unsigned char *p, uint64_t n)             \
    {                                                                                             \
        __m256i o = _mm256_add_epi64(_mm256_set1_epi64x(G), _mm256_set_epi64x(3 * G, 2 * G, G, 0)); \
        __m256i step = _mm256_set1_epi64x(4 * G), s = _mm256_setzero_si256(), k[5];              \
        for (int r = 0; r < 5; r++) k[r] = _mm256_set1_epi64x(K[r]);                              \
        for (uint64_t i = 0; i + 8 <= n; i += 8) {                                                \
            if (PREFETCH) _mm_prefetch((const char *)(p + 8 * i + PREFETCH), _MM_HINT_T0);        \
            __m256i x = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + 8 * i)), o);    \
            o = _mm256_add_epi64(o, step);                                                        \
            __m256i y = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + 8 * i + 32)), o); \
            o = _mm256_add_epi64(o, step);                                                        \
            for (int r = 0; r < 5; r++) { ROUND(x, k[r]); ROUND(y, k[r]); }                       \
            s = _mm256_add_epi64(s, _mm256_add_epi64(x, y));                                      \
        }                                                                                         \
        uint64_t t[4]; _mm256_storeu_si256((__m256i *)t, s); return t[0] + t[1] + t[2] + t[3];    \
    }
MIX2(mix2_no_prefetch, 0)
MIX2(mix2_prefetch_2k, 2048)
MIX2(mix2_prefetch_4k, 4096)
MIX2(mix2_prefetch_8k, 8192)
__attribute__((target("avx2"))) uint64_t feistel4(const unsigned char *p, uint64_t n)
{
    __m256i o = _mm256_add_epi64(_mm256_set1_epi64x(G), _mm256_set_epi64x(3 * G, 2 * G, G, 0));
    __m256i step = _mm256_set1_epi64x(4 * G), s = _mm256_setzero_si256(), m = _mm256_set1_epi64x(0xffffffffu), q;
    for (uint64_t i = 0; i + 4 <= n; i += 4) {
        __m256i x = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + 8 * i)), o);
        o = _mm256_add_epi64(o, step);
        for (int r = 0; r < 4; r++) {
            __m256i k = _mm256_set1_epi64x(K[r] | 1);
            if (r % 2 == 0) {  /* hi ^= F(lo) */
                q = _mm256_mul_epu32(x, k);
                x = _mm256_xor_si256(x, _mm256_slli_epi64(_mm256_xor_si256(q, _mm256_srli_epi64(q, 32)), 32));
            } else {           /* lo ^= F(hi) */
                q = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), k);
                x = _mm256_xor_si256(x, _mm256_and_si256(m, _mm256_xor_si256(q, _mm256_srli_epi64(q, 32))));
            }
        }
        s = _mm256_add_epi64(s, x);
    }
    uint64_t t[4]; _mm256_storeu_si256((__m256i *)t, s); return t[0] + t[1] + t[2] + t[3];
}

/* Phase 2 (issue 16): memory-level parallelism.  S streams: the buffer cut into S parts, one
 * 64-byte line of each per iteration, every round on all 2*S vectors together.  Not the same
 * sums as a one-stream loop unless `mix` is on (then each word gets its (j+1)*G: the digest).
 * load_Ns:      plain wrapping sum of the words (what one core's DRAM can feed, by stream count).
 * mix2_Ns_Pk:   mix2, prefetch P KiB ahead in each stream (the shipped loop is mix2_4s_2k).
 * rot4_4s_2k:   a rejected 4-round mixer (rotations 32, 8, 32 between rounds, none after the
 *               last; 11 instructions a vector against 15): same avalanche in tests, ~15% faster
 *               in cache, but a new digest version for ~4% in DRAM. */
#define R16(x, k) _mm256_xor_si256(x, _mm256_mul_epu32(x, k))
static const uint64_t STEP[1] = {8 * G};
#define STREAM_LOOP(NAME, S, PREFETCH, ROUNDS)                                                    \
    __attribute__((target("avx2"))) uint64_t NAME(const unsigned char *p, uint64_t n)             \
    {                                                                                             \
        const uint64_t per = n / (8 * S) * 8;                                                     \
        const __m256i step = _mm256_set1_epi64x(STEP[0]), half = _mm256_set1_epi64x(4 * G);       \
        const __m256i rot8 = _mm256_setr_epi8(1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15, 8, \
                                              1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15, 8); \
        __m256i o[S], s = _mm256_setzero_si256(), k[5];                                           \
        for (int r = 0; r < 5; r++) k[r] = _mm256_set1_epi64x(K[r]);                              \
        for (int j = 0; j < S; j++)                                                               \
            o[j] = _mm256_add_epi64(_mm256_set1_epi64x(G + per * j * G), _mm256_set_epi64x(3 * G, 2 * G, G, 0)); \
        for (uint64_t i = 0; i < per; i += 8) {                                                   \
            __m256i x[2 * S];                                                                     \
            for (int j = 0; j < S; j++) {                                                         \
                const unsigned char *q = p + 8 * (per * j + i);                                   \
                if (PREFETCH) _mm_prefetch((const char *)(q + PREFETCH), _MM_HINT_T0);            \
                x[2 * j] = _mm256_loadu_si256((const __m256i *)q);                                \
                x[2 * j + 1] = _mm256_loadu_si256((const __m256i *)(q + 32));                     \
                if (ROUNDS) {                                                                     \
                    x[2 * j] = _mm256_add_epi64(x[2 * j], o[j]);                                  \
                    x[2 * j + 1] = _mm256_add_epi64(x[2 * j + 1], _mm256_add_epi64(o[j], half));  \
                    o[j] = _mm256_add_epi64(o[j], step);                                          \
                }                                                                                 \
            }                                                                                     \
            if (ROUNDS == 5)                                                                      \
                for (int r = 0; r < 5; r++)                                                       \
                    for (int v = 0; v < 2 * S; v++) ROUND(x[v], k[r]);                            \
            if (ROUNDS == 4) {                                                                    \
                for (int v = 0; v < 2 * S; v++) x[v] = _mm256_shuffle_epi32(R16(x[v], k[0]), 0xB1); \
                for (int v = 0; v < 2 * S; v++) x[v] = _mm256_shuffle_epi8(R16(x[v], k[1]), rot8); \
                for (int v = 0; v < 2 * S; v++) x[v] = _mm256_shuffle_epi32(R16(x[v], k[2]), 0xB1); \
                for (int v = 0; v < 2 * S; v++) x[v] = R16(x[v], k[3]);                           \
            }                                                                                     \
            for (int v = 0; v < 2 * S; v++) s = _mm256_add_epi64(s, x[v]);                        \
        }                                                                                         \
        uint64_t t[4]; _mm256_storeu_si256((__m256i *)t, s); return t[0] + t[1] + t[2] + t[3];    \
    }
STREAM_LOOP(load_1s, 1, 0, 0)
STREAM_LOOP(load_2s, 2, 0, 0)
STREAM_LOOP(load_4s, 4, 0, 0)
STREAM_LOOP(mix2_1s_2k, 1, 2048, 5)
STREAM_LOOP(mix2_2s_2k, 2, 2048, 5)
STREAM_LOOP(mix2_4s_1k, 4, 1024, 5)
STREAM_LOOP(mix2_4s_2k, 4, 2048, 5)
STREAM_LOOP(mix2_4s_4k, 4, 4096, 5)
STREAM_LOOP(mix2_8s_2k, 8, 2048, 5)
STREAM_LOOP(rot4_4s_2k, 4, 2048, 4)
