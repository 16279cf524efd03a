/* The packed-weight row products of block_gemv.c, shared with decode_step.c (one library). */
#ifndef ATTNKIT_BLOCK_GEMV_H
#define ATTNKIT_BLOCK_GEMV_H
#include <stdint.h>

#define TILE 4 /* rows of x multiplied per pass over a row of W */

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

int block_gemv_vectorized(int64_t group);
int block_gemv_shifted(const float *offset, float zero, int64_t group);
int block_gemv_group_sums(const float *x, int64_t M, int64_t K, int64_t group, float *xsum);
void block_gemv_row(const float *x, int64_t K, int t, const uint8_t *vals, const float *sc, const float *off, int bits,
                    float zero, int64_t group, const float *xsum, int plain, float *out);

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
                       const float *sc, const float *off, int bits, float zero, int64_t group, float *out);
void block_gemv_q8_rows(const float *x, const int8_t *q, const float *d, const int32_t *qsum, const uint8_t *ok,
                        int64_t M, int64_t K, const uint8_t *vals, const float *sc, const float *off, int bits,
                        float zero, int64_t group, float *y, int64_t stride);
#endif
