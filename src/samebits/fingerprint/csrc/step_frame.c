/* A Recorder's STEP frame in one call (docs/stream.md, "Frames"), for stream/_encoder.py.
 *
 *     u8 kind=3 | varint payload length | payload | u32 crc32(kind, length, payload)
 *     payload = varint step | varint record count | u64 root | the step's records
 *     root    = the first 8 bytes, little endian, of SHA-256(names key || records)
 *
 * The same bytes as the Python encoder (stream/_format.py: frame, step_root); tests compare
 * the two on random input.  Why native: a recorded step runs between the training step's own
 * work, and each library a few lines of Python touch there (hashlib, zlib, numpy, the file
 * buffer) costs a cold start of tens of microseconds (benchmarks/RESULTS.md); here it is one
 * call of a few kilobytes of code.
 *
 * Compiled into the same library as digest.c (setup.py), loaded with ctypes: no Python API.
 * SHA-256 uses the x86 SHA extensions when the CPU has them (picked once, at load), otherwise
 * the portable code; CRC-32 is zlib's (reflected polynomial 0xEDB88320), eight bytes per step.
 */

#include <stdint.h>
#include <string.h>

#include "native.h"

#if SAMEBITS_X86
#include <cpuid.h>
#endif

#define FRAME_STEP 3

/* -- CRC-32 (zlib's) ------------------------------------------------------------------------ */

static uint32_t crc_tables[8][256];

static void init_crc_tables(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_tables[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc_tables[t][n] = crc_tables[0][crc_tables[t - 1][n] & 0xff] ^ (crc_tables[t - 1][n] >> 8);
}

/* zlib.crc32(data, crc): chains like zlib (crc of a || b == crc32(b, crc32(a))). */
static uint32_t crc32_update(uint32_t crc, const unsigned char *p, uint64_t n)
{
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = crc_tables[7][lo & 0xff] ^ crc_tables[6][(lo >> 8) & 0xff] ^ crc_tables[5][(lo >> 16) & 0xff] ^
              crc_tables[4][lo >> 24] ^ crc_tables[3][hi & 0xff] ^ crc_tables[2][(hi >> 8) & 0xff] ^
              crc_tables[1][(hi >> 16) & 0xff] ^ crc_tables[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc_tables[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* -- SHA-256 (FIPS 180-4) ------------------------------------------------------------------- */

static const uint32_t SHA256_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define ROTR32(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_blocks_portable(uint32_t state[8], const unsigned char *p, uint64_t num_blocks)
{
    for (; num_blocks; num_blocks--, p += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 | (uint32_t)p[4 * t + 2] << 8 |
                   (uint32_t)p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROTR32(w[t - 15], 7) ^ ROTR32(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROTR32(w[t - 2], 17) ^ ROTR32(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROTR32(e, 6) ^ ROTR32(e, 11) ^ ROTR32(e, 25)) + ((e & f) ^ (~e & g)) + SHA256_K[t] + w[t];
            uint32_t t2 = (ROTR32(a, 2) ^ ROTR32(a, 13) ^ ROTR32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}

#if SAMEBITS_X86
/* The SHA extensions (sha256rnds2, sha256msg1/2): four rounds per pair of rnds2, the message
 * schedule four words at a time.  State kept as ABEF / CDGH, as the instructions want it. */
__attribute__((target("sha,sse4.1,ssse3"))) static void sha256_blocks_shani(uint32_t state[8],
                                                                             const unsigned char *p,
                                                                             uint64_t num_blocks)
{
    const __m128i byte_swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[0]), 0xB1); /* CDAB */
    __m128i state1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[4]), 0x1B); /* EFGH */
    __m128i state0 = _mm_alignr_epi8(tmp, state1, 8); /* ABEF */
    state1 = _mm_blend_epi16(state1, tmp, 0xF0);     /* CDGH */
    for (; num_blocks; num_blocks--, p += 64) {
        __m128i abef = state0, cdgh = state1, w[4];
        for (int i = 0; i < 16; i++) {
            __m128i x;
            if (i < 4) {
                x = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), byte_swap);
            } else { /* w[t] = w[t-16] + s0(w[t-15]) + w[t-7] + s1(w[t-2]), four t at once */
                x = _mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
                x = _mm_sha256msg2_epu32(x, w[(i + 3) & 3]);
            }
            w[i & 3] = x;
            __m128i msg = _mm_add_epi32(x, _mm_loadu_si128((const __m128i *)&SHA256_K[4 * i]));
            state1 = _mm_sha256rnds2_epu32(state1, state0, msg);
            state0 = _mm_sha256rnds2_epu32(state0, state1, _mm_shuffle_epi32(msg, 0x0E));
        }
        state0 = _mm_add_epi32(state0, abef);
        state1 = _mm_add_epi32(state1, cdgh);
    }
    tmp = _mm_shuffle_epi32(state0, 0x1B);       /* FEBA */
    state1 = _mm_shuffle_epi32(state1, 0xB1);    /* DCHG */
    state0 = _mm_blend_epi16(tmp, state1, 0xF0); /* DCBA */
    state1 = _mm_alignr_epi8(state1, tmp, 8);    /* HGFE */
    _mm_storeu_si128((__m128i *)&state[0], state0);
    _mm_storeu_si128((__m128i *)&state[4], state1);
}
#endif

typedef void (*sha256_blocks_fn)(uint32_t *, const unsigned char *, uint64_t);
static sha256_blocks_fn sha256_blocks = sha256_blocks_portable;

__attribute__((constructor)) static void init_step_frame(void)
{
    init_crc_tables();
#if SAMEBITS_X86
    unsigned a, b, c, d;
    int sse41 = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 19)) && (c & (1u << 9)); /* SSE4.1, SSSE3 */
    int sha = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29));
    if (sse41 && sha)
        sha256_blocks = sha256_blocks_shani;
#endif
}

/* SHA-256 of a || b, its blocks compressed by `compress`. */
static void sha256_two_with(sha256_blocks_fn compress, const unsigned char *a, uint64_t na,
                            const unsigned char *b, uint64_t nb, unsigned char digest[32])
{
    uint32_t state[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    unsigned char block[128];
    uint64_t total = na + nb, fill = 0;
    const unsigned char *parts[2] = {a, b};
    uint64_t sizes[2] = {na, nb};
    for (int k = 0; k < 2; k++) {
        const unsigned char *p = parts[k];
        uint64_t n = sizes[k];
        if (fill) { /* top up the partial block first */
            uint64_t take = 64 - fill < n ? 64 - fill : n;
            memcpy(block + fill, p, take);
            fill += take;
            p += take;
            n -= take;
            if (fill < 64)
                continue;
            compress(state, block, 1);
            fill = 0;
        }
        if (n >= 64) {
            compress(state, p, n / 64);
            p += n / 64 * 64;
            n %= 64;
        }
        memcpy(block, p, n);
        fill = n;
    }
    /* Padding: 0x80, zeros, the bit length big endian, to a multiple of 64 bytes. */
    block[fill++] = 0x80;
    uint64_t padded = fill <= 56 ? 64 : 128;
    memset(block + fill, 0, padded - fill);
    uint64_t bits = total * 8;
    for (int i = 0; i < 8; i++)
        block[padded - 1 - i] = (unsigned char)(bits >> (8 * i));
    compress(state, block, padded / 64);
    for (int i = 0; i < 8; i++) {
        digest[4 * i] = (unsigned char)(state[i] >> 24);
        digest[4 * i + 1] = (unsigned char)(state[i] >> 16);
        digest[4 * i + 2] = (unsigned char)(state[i] >> 8);
        digest[4 * i + 3] = (unsigned char)state[i];
    }
}

static void sha256_two(const unsigned char *a, uint64_t na, const unsigned char *b, uint64_t nb,
                       unsigned char digest[32])
{
    sha256_two_with(sha256_blocks, a, na, b, nb, digest);
}

/* -- the frame ------------------------------------------------------------------------------ */

static uint64_t put_varint(unsigned char *out, uint64_t value)
{
    uint64_t n = 0;
    while (value > 0x7F) {
        out[n++] = (unsigned char)((value & 0x7F) | 0x80);
        value >>= 7;
    }
    out[n++] = (unsigned char)value;
    return n;
}

static uint64_t varint_size(uint64_t value)
{
    uint64_t n = 1;
    while (value > 0x7F) {
        value >>= 7;
        n++;
    }
    return n;
}

/* The STEP frame of a step whose records (as stored) are body[0 .. body_len), into out (of
 * out_capacity bytes).  names_key: the 32-byte names key.  Returns the frame's length and puts
 * the step root in *root; returns 0 (writes nothing) when out is too small: a frame is at most
 * body_len + 43 bytes. */
SAMEBITS_EXPORT uint64_t samebits_step_frame(const unsigned char *names_key, uint64_t step, uint64_t num_records,
                                             const unsigned char *body, uint64_t body_len, unsigned char *out,
                                             uint64_t out_capacity, uint64_t *root)
{
    unsigned char digest[32];
    sha256_two(names_key, 32, body, body_len, digest);
    uint64_t root_value = 0;
    for (int i = 0; i < 8; i++)
        root_value |= (uint64_t)digest[i] << (8 * i);
    uint64_t payload_len = varint_size(step) + varint_size(num_records) + 8 + body_len;
    uint64_t frame_len = 1 + varint_size(payload_len) + payload_len + 4;
    if (frame_len > out_capacity)
        return 0;
    unsigned char *at = out;
    *at++ = FRAME_STEP;
    at += put_varint(at, payload_len);
    at += put_varint(at, step);
    at += put_varint(at, num_records);
    for (int i = 0; i < 8; i++)
        *at++ = (unsigned char)(root_value >> (8 * i));
    memcpy(at, body, body_len);
    at += body_len;
    uint32_t crc = crc32_update(0, out, (uint64_t)(at - out));
    for (int i = 0; i < 4; i++)
        *at++ = (unsigned char)(crc >> (8 * i));
    *root = root_value;
    return frame_len;
}

/* For tests: SHA-256 of a || b (portable != 0: by the portable code whatever the CPU), zlib's
 * crc32 of data, and which SHA-256 code the frames use. */
SAMEBITS_EXPORT void samebits_sha256_two(int portable, const unsigned char *a, uint64_t na, const unsigned char *b,
                                         uint64_t nb, unsigned char *digest)
{
    sha256_two_with(portable ? sha256_blocks_portable : sha256_blocks, a, na, b, nb, digest);
}

SAMEBITS_EXPORT uint32_t samebits_crc32(uint32_t crc, const unsigned char *data, uint64_t n)
{
    return crc32_update(crc, data, n);
}

SAMEBITS_EXPORT const char *samebits_sha256_variant(void)
{
#if SAMEBITS_X86
    return sha256_blocks == sha256_blocks_shani ? "sha-ni" : "portable";
#else
    return "portable";
#endif
}
