/* Body sums of the samebits tensor digest, on the CPU (see docs/digest.md for the spec).
 *
 * For each buffer of L bytes, zero-padded to W = ceil(L/8) little-endian uint64 words:
 *     S = sum_{j<W} fmix64(w_j + (j+1)*G)  mod 2^64
 * Headers and the final mix are done in Python: they need only metadata.
 *
 * Loaded with ctypes, so this file uses no Python API: ctypes releases the GIL for the call.
 * Built by setup.py as a setuptools Extension (a plain shared library with a Python-style name).
 *
 * Speed: the loop is written so that GCC vectorizes it; target_clones compiles it three times
 * (x86-64-v4 = AVX-512 with vpmullq, x86-64-v3 = AVX2, baseline) and picks one at load time,
 * so a shipped build never depends on the build machine's CPU.  Inputs above
 * PARALLEL_MIN_BYTES are split into chunks summed by OpenMP threads; wrapping addition is
 * associative and commutative, so the result does not depend on the thread count or order.
 */

#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(_WIN32)
#define SAMEBITS_EXPORT __declspec(dllexport)
#else
#define SAMEBITS_EXPORT __attribute__((visibility("default")))
#endif

/* Function multi-versioning needs GCC >= 12 for the arch=x86-64-vN names (and ifunc support). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    defined(__linux__)
#define SAMEBITS_CLONES \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SAMEBITS_CLONES
#endif

#define SAMEBITS_ABI_VERSION 1

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL; /* G: the per-position offset step */

static inline uint64_t fmix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Sum over num_words full words starting at p, whose first word has index first_word. */
SAMEBITS_CLONES
static uint64_t sum_full_words(const unsigned char *p, uint64_t num_words, uint64_t first_word)
{
    uint64_t s = 0;
    /* The position offset (first_word + i + 1) * G advances by one addition per word (wrapping,
     * so the same bits): written as a product, GCC keeps a third 64-bit multiply per word in
     * the vector loop, a third of its multiplies (vpmullq is 3 uops on Intel; AVX2 emulates
     * each with 3 vpmuludq).  See docs/digest.md, "Speed". */
    uint64_t offset = (first_word + 1) * GOLDEN;
    for (uint64_t i = 0; i < num_words; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8); /* unaligned-safe load; compiles to a plain (vector) load */
        s += fmix64(w + offset);
        offset += GOLDEN;
    }
    return s;
}

SAMEBITS_EXPORT int samebits_digest_abi_version(void) { return SAMEBITS_ABI_VERSION; }

/* Which compiled variant the loader picked, for benchmarks and bug reports. */
SAMEBITS_EXPORT const char *samebits_digest_isa(void)
{
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    defined(__linux__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
        return "x86-64-v4";
    if (__builtin_cpu_supports("x86-64-v3"))
        return "x86-64-v3";
#endif
    return "baseline";
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
        s += fmix64(w + (first_word + num_full + 1) * GOLDEN);
    }
    return s;
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
