/* The packed-weight row products of block_gemv.c, shared with decode_step.c (one library). */
#ifndef ATTNKIT_BLOCK_GEMV_H
#define ATTNKIT_BLOCK_GEMV_H
#include <math.h>
#include <stdint.h>

#define TILE 4 /* rows of x multiplied per pass over a row of W */

/* ROW(T, H) for t rows (1..TILE) and scale width `half`, each pair a constant: one inlined copy
 * per pair, so a row's accumulators stay in registers. The caller defines ROW. */
#define FOR_CONSTANT_TILE(t, half)                                                                          \
    do {                                                                                                    \
        if (half) switch (t) {                                                                              \
            case 1: ROW(1, 1); break;                                                                       \
            case 2: ROW(2, 1); break;                                                                       \
            case 3: ROW(3, 1); break;                                                                       \
            default: ROW(4, 1); break;                                                                      \
            }                                                                                               \
        else switch (t) {                                                                                   \
            case 1: ROW(1, 0); break;                                                                       \
            case 2: ROW(2, 0); break;                                                                       \
            case 3: ROW(3, 0); break;                                                                       \
            default: ROW(4, 0); break;                                                                      \
            }                                                                                               \
    } while (0)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* the sum of a vector's 8 floats */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* A group's scale or offset: float32, or float16 (half = 1: GGUF's own Q4_0 / Q4_1 / Q8_0 scales,
 * kept as the file stores them) widened exactly to float32; its value is the same either way. */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const int exponent = (h >> 10) & 31, mantissa = h & 1023;
    const float magnitude = exponent == 0 ? ldexpf((float)mantissa, -24)
                            : exponent == 31 ? (mantissa ? NAN : INFINITY)
                            : ldexpf((float)(mantissa | 1024), exponent - 25);
    return (h & 0x8000) ? -magnitude : magnitude;
#endif
}

static inline float group_at(const void *p, int half, int64_t g) {
    return half ? half_to_float(((const uint16_t *)p)[g]) : ((const float *)p)[g];
}

/* p advanced by `groups` scales or offsets */
static inline const void *groups_after(const void *p, int half, int64_t groups) {
    return p ? (const char *)p + groups * (half ? 2 : 4) : 0;
}

#if defined(__AVX2__) && defined(__FMA__)
/* groups g .. g + 7 as floats */
static inline __m256 groups8_at(const void *p, int half, int64_t g) {
    if (!half) return _mm256_loadu_ps((const float *)p + g);
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + g)));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = group_at(p, 1, g + i);
    return _mm256_loadu_ps(f);
#endif
}

/* lane j of v in every lane: one of eight groups' scales, loaded (and widened) together */
#define LANE(v, j) _mm256_permutevar8x32_ps((v), _mm256_set1_epi32(j))
#endif

int block_gemv_vectorized(int64_t group);
int block_gemv_shifted(const void *offset, float zero, int64_t group);
int block_gemv_group_sums(const float *x, int64_t M, int64_t K, int64_t group, float *xsum);
void block_gemv_row(const float *x, int64_t K, int t, const uint8_t *vals, const void *sc, const void *off, int half,
                    int bits, float zero, int64_t group, const float *xsum, int plain, float *out);

/* block_gemv_q8.c: x rounded to 8-bit blocks of 32 (llama.cpp's Q8_0), integer dot products */
struct q8_rows { /* M rows of K inputs rounded: q (M, K), d and qsum (M, K / 32), ok (M) */
    int8_t *q;
    float *d;
    int32_t *qsum;
    uint8_t *ok;
};
int q8_rows_alloc(struct q8_rows *r, int64_t M, int64_t K); /* -1 (nothing held) when memory ran out */
void q8_rows_free(struct q8_rows *r);
int block_gemv_q8_takes(int bits, int64_t group, int64_t K);
void block_gemv_q8_round(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *qsum, uint8_t *ok);
void block_gemv_q8_row(const int8_t *q, const float *d, const int32_t *qsum, int64_t K, int t, const uint8_t *vals,
                       const void *sc, const void *off, int half, int bits, float zero, int64_t group, float *out);
void block_gemv_q8_rows(const float *x, const int8_t *q, const float *d, const int32_t *qsum, const uint8_t *ok,
                        int64_t M, int64_t K, const uint8_t *vals, const void *sc, const void *off, int half, int bits,
                        float zero, int64_t group, float *y, int64_t stride);
#endif
