/* y = x W^T for a few rows of x, x rounded to 8-bit blocks first: llama.cpp's arithmetic
 * (docs/decisions.md item 144; the Python side is block_gemv.py, activations="q8").
 *
 * Each block of 32 inputs of a row of x is rounded as llama.cpp's Q8_0 rounds it:
 *
 *   d = half(max|x_b| / 127),  q_i = round_to_nearest_even(x_i * 127 / max|x_b|),  x^_i = d q_i
 *
 * (half(): rounded to float16, as the block's scale is stored), and y = x^ W^T is computed with
 * integer dot products of the weights' integers and the q_i (u8 x s8 pairs, AVX2's maddubs), each
 * group's scale applied to its integer sum:
 *
 *   sum_i W_i x^_i = s_g d (sum_i q4_i q_i - zero sum_i q_i) + o_g d sum_i q_i      (one group)
 *
 * so it equals a float product of W with x^ up to float32 summation order. A row with a block that
 * cannot be rounded (an infinity or NaN, or a scale beyond float16's range) is multiplied unrounded,
 * each weight dequantized (block_gemv.c's scalar loop): the result is float arithmetic's.
 *
 * Weights: 4-bit groups of 32, or 8-bit groups of 16 (Q6_K) or of a multiple of 32 (Q8_0's 32, a
 * whole row). K a multiple of 32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "block_gemv.h"

#define Q8 32 /* inputs a block of x */

/* f rounded to the nearest float16 (ties to even), as a float; inf beyond float16's range */
static float half_rounded(float f) {
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    if (f == 0.0f || !isfinite(f)) return f;
    int e;
    frexpf(f, &e); /* f = m 2^e, m in [0.5, 1): 11 significant bits, or float16's subnormal step */
    const float step = ldexpf(1.0f, e - 11 < -24 ? -24 : e - 11);
    const float r = nearbyintf(f / step) * step;
    return fabsf(r) > 65504.0f ? copysignf(INFINITY, f) : r;
#endif
}


int q8_rows_alloc(struct q8_rows *r, int64_t M, int64_t K) {
    const size_t blocks = (size_t)(M * (K / Q8)) + 1;
    r->q = (int8_t *)malloc((size_t)(M * K) + 1);
    r->d = (float *)malloc(sizeof(float) * blocks);
    r->qsum = (int32_t *)malloc(sizeof(int32_t) * blocks);
    r->ok = (uint8_t *)malloc((size_t)M + 1);
    if (r->q && r->d && r->qsum && r->ok) return 0;
    q8_rows_free(r);
    return -1;
}

void q8_rows_free(struct q8_rows *r) {
    free(r->q), free(r->d), free(r->qsum), free(r->ok);
    r->q = 0, r->d = 0, r->qsum = 0, r->ok = 0;
}

int block_gemv_q8_takes(int bits, int64_t group, int64_t K) {
    return K % Q8 == 0 && ((bits == 4 && group == 32) || (bits == 8 && (group == 16 || group % Q8 == 0)));
}

/* Rounds the M rows of x (M, K): q (M, K), d and qsum (M, K / 32); ok[m] = 0 where row m has a
 * block that cannot be rounded (its q, d unused). */
void block_gemv_q8_round(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *qsum, uint8_t *ok) {
    const int64_t B = K / Q8;
    for (int64_t m = 0; m < M; m++) {
        ok[m] = 1;
        for (int64_t b = 0; b < B; b++) {
            const float *xb = x + m * K + b * Q8;
            float top = 0.0f;
            int finite = 1;
            for (int i = 0; i < Q8; i++) {
                finite &= isfinite(xb[i]);
                top = fabsf(xb[i]) > top ? fabsf(xb[i]) : top;
            }
            const float scale = half_rounded(top / 127.0f);
            if (!finite || !isfinite(scale)) {
                ok[m] = 0;
                break;
            }
            const float inverse = top != 0.0f ? 127.0f / top : 0.0f;
            int32_t total = 0;
            for (int i = 0; i < Q8; i++) {
                const int8_t v = (int8_t)nearbyintf(xb[i] * inverse);
                q[m * K + b * Q8 + i] = v;
                total += v;
            }
            d[m * B + b] = scale;
            qsum[m * B + b] = total;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* acc[m] += lane j of sd[m] * sum_i q4_i q_i over 4-bit block b, rows [0, t) */
static inline __attribute__((always_inline)) void q4_block(
        const int8_t *q, int64_t K, const int t, const uint8_t *vals, int64_t b, const __m256 *sd, const int j,
        __m256i nibble, __m256i ones, __m256 *acc) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(vals + b * 16));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), nibble); /* 32 u8 */
    for (int m = 0; m < t; m++) {
        const __m256i y = _mm256_loadu_si256((const __m256i *)(q + m * K + b * Q8));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, y), ones)); /* 8 sums */
        acc[m] = _mm256_fmadd_ps(LANE(sd[m], j), dot, acc[m]);
    }
}

/* acc[m] += (lane j of sd[m], or sd[m] itself when j < 0) * sum_i w_i q_i over 8-bit block b, rows [0, t) */
static inline __attribute__((always_inline)) void q8_block(
        const int8_t *q, int64_t K, const int t, const uint8_t *vals, int64_t b, const __m256 *sd, const int j,
        __m256i ones, __m256 *acc) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)((const int8_t *)vals + b * Q8));
    const __m256i magnitude = _mm256_sign_epi8(w, w);
    for (int m = 0; m < t; m++) {
        const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q + m * K + b * Q8)), w);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, y), ones); /* 8 int32 */
        acc[m] = _mm256_fmadd_ps(j < 0 ? sd[m] : LANE(sd[m], j), _mm256_cvtepi32_ps(dot), acc[m]);
    }
}
#endif

/* out[m] = sum_k W[n, k] x^[m, k] for t <= TILE rounded rows (their q, d, qsum) and one row n of W */
static inline __attribute__((always_inline)) void q8_row(
        const int8_t *q, const float *d, const int32_t *qsum, int64_t K, const int t, const uint8_t *vals, const void *sc,
        const void *off, const int half, int bits, float zero, int64_t group, float *out) {
    const int64_t B = K / Q8;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    if (bits == 4) { /* group = block = 32: 16 bytes, element i low and i + 16 high */
        __m256 acc[TILE];
        for (int m = 0; m < t; m++) acc[m] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= B; b += 8) { /* eight blocks: their scales s_b d_b multiplied together */
            const __m256 s8 = groups8_at(sc, half, b);
            __m256 sd[TILE];
            for (int m = 0; m < t; m++) sd[m] = _mm256_mul_ps(s8, _mm256_loadu_ps(d + m * B + b));
            for (int j = 0; j < 8; j++) q4_block(q, K, t, vals, b + j, sd, j, nibble, ones, acc);
        }
        for (; b < B; b++) {
            __m256 sd[TILE];
            for (int m = 0; m < t; m++) sd[m] = _mm256_set1_ps(group_at(sc, half, b) * d[m * B + b]);
            q4_block(q, K, t, vals, b, sd, 0, nibble, ones, acc);
        }
        for (int m = 0; m < t; m++) {
            out[m] = hsum(acc[m]);
            if (off || zero != 0.0f) { /* + sum_b (o_b - s_b zero) d_b qsum_b: the zero point and offset */
                __m256 shift = _mm256_setzero_ps();
                const __m256 z = _mm256_set1_ps(zero);
                int64_t b = 0;
                for (; b + 8 <= B; b += 8) {
                    const __m256 c = _mm256_fnmadd_ps(groups8_at(sc, half, b), z, off ? groups8_at(off, half, b) : _mm256_setzero_ps());
                    const __m256 xs = _mm256_mul_ps(_mm256_loadu_ps(d + m * B + b), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(qsum + m * B + b))));
                    shift = _mm256_fmadd_ps(c, xs, shift);
                }
                out[m] += hsum(shift);
                for (; b < B; b++)
                    out[m] += ((off ? group_at(off, half, b) : 0.0f) - group_at(sc, half, b) * zero) * (d[m * B + b] * (float)qsum[m * B + b]);
            }
        }
        return;
    }
    if (bits == 8) { /* signed weights: |w| (unsigned) times y with w's sign */
        __m256 acc[TILE];
        for (int m = 0; m < t; m++) acc[m] = _mm256_setzero_ps();
        int64_t b = 0;
        if (group == Q8) /* Q8_0: eight blocks' scales s_b d_b multiplied together */
            for (; b + 8 <= B; b += 8) {
                const __m256 s8 = groups8_at(sc, half, b);
                __m256 sd[TILE];
                for (int m = 0; m < t; m++) sd[m] = _mm256_mul_ps(s8, _mm256_loadu_ps(d + m * B + b));
                for (int j = 0; j < 8; j++) q8_block(q, K, t, vals, b + j, sd, j, ones, acc);
            }
        for (; b < B; b++) {
            /* lanes 0-3 of the dot hold inputs 0-15, lanes 4-7 inputs 16-31: each its group's scale */
            const float s0 = group_at(sc, half, group == 16 ? 2 * b : b * Q8 / group);
            const float s1 = group == 16 ? group_at(sc, half, 2 * b + 1) : s0;
            __m256 sd[TILE];
            for (int m = 0; m < t; m++) sd[m] = _mm256_set_m128(_mm_set1_ps(s1 * d[m * B + b]), _mm_set1_ps(s0 * d[m * B + b]));
            q8_block(q, K, t, vals, b, sd, -1, ones, acc);
        }
        for (int m = 0; m < t; m++) out[m] = hsum(acc[m]);
        return;
    }
#endif
    /* plain C: the same integer sums */
    for (int m = 0; m < t; m++) out[m] = 0.0f;
    for (int64_t b = 0; b < B; b++)
        for (int m = 0; m < t; m++) {
            const int8_t *y = q + m * K + b * Q8;
            const float dm = d[m * B + b];
            if (bits == 4) {
                int32_t dot = 0;
                for (int i = 0; i < Q8; i++) {
                    const uint8_t byte = vals[b * 16 + (i % 16)];
                    dot += (i < 16 ? (byte & 15) : (byte >> 4)) * y[i];
                }
                const float s = group_at(sc, half, b), o = off ? group_at(off, half, b) : 0.0f;
                out[m] += s * dm * (float)dot + (o - s * zero) * dm * (float)qsum[m * B + b];
            } else {
                for (int64_t g0 = 0; g0 < Q8; g0 += group < Q8 ? group : Q8) { /* group 16: two a block */
                    const int64_t width = group < Q8 ? group : Q8;
                    int32_t dot = 0;
                    for (int64_t i = g0; i < g0 + width; i++) dot += ((const int8_t *)vals)[b * Q8 + i] * y[i];
                    out[m] += group_at(sc, half, (b * Q8 + g0) / group) * dm * (float)dot;
                }
            }
        }
}

/* out[m] = sum_k W[n, k] x^[m, k] for t <= TILE rounded rows (their q, d, qsum) and one row n of W */
void block_gemv_q8_row(const int8_t *q, const float *d, const int32_t *qsum, int64_t K, int t, const uint8_t *vals,
                       const void *sc, const void *off, int half, int bits, float zero, int64_t group, float *out) {
#define ROW(T, H) q8_row(q, d, qsum, K, T, vals, sc, off, H, bits, zero, group, out)
    FOR_CONSTANT_TILE(t, half);
#undef ROW
}

/* y (M, N) = x^ W^T: block_gemv with x rounded; -1 when memory ran out */
int block_gemv_q8(const float *x, int64_t M, int64_t K, const uint8_t *values, const void *scale, const void *offset,
                  int half, int bits, float zero, int64_t group, int64_t N, float *y, int threads) {
    const int64_t G = K / group, row_bytes = bits == 4 ? K / 2 : K;
    struct q8_rows r;
    if (q8_rows_alloc(&r, M, K)) return -1;
    block_gemv_q8_round(x, M, K, r.q, r.d, r.qsum, r.ok);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        block_gemv_q8_rows(x, r.q, r.d, r.qsum, r.ok, M, K, values + n * row_bytes, groups_after(scale, half, n * G),
                           groups_after(offset, half, n * G), half, bits, zero, group, y + n, N);
    q8_rows_free(&r);
    return 0;
}

/* y[m * stride] for every row m of x against one row of W: rounded rows by tiles, the others
 * unrounded (the scalar loop) */
void block_gemv_q8_rows(const float *x, const int8_t *q, const float *d, const int32_t *qsum, const uint8_t *ok,
                        int64_t M, int64_t K, const uint8_t *vals, const void *sc, const void *off, int half, int bits,
                        float zero, int64_t group, float *y, int64_t stride) {
    const int64_t B = K / Q8;
    for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int t = M - m0 < TILE ? (int)(M - m0) : TILE;
        float out[TILE];
        int all = 1;
        for (int m = 0; m < t; m++) all &= ok[m0 + m];
        if (all) {
            block_gemv_q8_row(q + m0 * K, d + m0 * B, qsum + m0 * B, K, t, vals, sc, off, half, bits, zero, group, out);
        } else {
            for (int m = 0; m < t; m++) {
                if (ok[m0 + m])
                    block_gemv_q8_row(q + (m0 + m) * K, d + (m0 + m) * B, qsum + (m0 + m) * B, K, 1, vals, sc, off, half,
                                      bits, zero, group, out + m);
                else
                    block_gemv_row(x + (m0 + m) * K, K, 1, vals, sc, off, half, bits, zero, group, 0, 1, out + m);
            }
        }
        for (int m = 0; m < t; m++) y[(m0 + m) * stride] = out[m];
    }
}

/* x^ (M, K) float32: x rounded (block_gemv_q8_round) and multiplied back, d q; rows that cannot be
 * rounded copied unrounded. The input of a prefill's GEMM under q8 activations. */
int block_gemv_q8_rounded(const float *x, int64_t M, int64_t K, float *out, int threads) {
    const int64_t B = K / Q8;
    struct q8_rows r;
    if (q8_rows_alloc(&r, M, K)) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        block_gemv_q8_round(x + m * K, 1, K, r.q + m * K, r.d + m * B, r.qsum + m * B, r.ok + m);
        for (int64_t k = 0; k < K; k++) out[m * K + k] = r.ok[m] ? r.d[m * B + k / Q8] * (float)r.q[m * K + k] : x[m * K + k];
    }
    q8_rows_free(&r);
    return 0;
}
