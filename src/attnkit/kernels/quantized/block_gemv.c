/* y = x W^T for a few rows of x, W read as packed blocks and dequantized in registers
 * (docs/decisions.md item 136; the Python side is block_gemv.py).
 *
 *   W[n, g*group + i] = scale[n, g] * (q[n, g*group + i] - zero) + offset[n, g]
 *
 * x: float32 (M, K), row-major.  y: float32 (M, N).  values: int8 (N, K) when bits == 8; uint8
 * (N, K / 2) when bits == 4, each group of 32 in 16 bytes, element i in the low nibble of byte i and
 * element i + 16 in its high nibble.  scale, offset: float32 (N, K / group), or float16 when half
 * (GGUF's own scales, widened exactly: the same values); offset may be NULL.
 *
 * bfloat16_gemv: the same for a bfloat16 W (N, K) on a CPU without bfloat16 products: each weight
 * widened exactly to float32 in registers (16 bits shifted up), float32 products and sums.
 *
 * Each weight is dequantized once per tile of up to TILE rows of x and multiplied in float32: no
 * rounding of the activations (llama.cpp rounds them to 8 bits), so y differs from a float64
 * x W^T only by float32 accumulation.  Rows n are shared among the threads (OpenMP: torch's own
 * libgomp, already loaded, so one thread pool).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "block_gemv.h"

#if defined(__AVX2__) && defined(__FMA__)

/* the eight lanes of sum_i w_i x_i over a group of 32 (w in four vectors), in two independent
 * chains: four dependent FMAs a group left the FMA units waiting */
static inline __attribute__((always_inline)) __m256 dot32(const float *x, __m256 w0, __m256 w1, __m256 w2, __m256 w3) {
    __m256 d0 = _mm256_mul_ps(w0, _mm256_loadu_ps(x)), d1 = _mm256_mul_ps(w1, _mm256_loadu_ps(x + 8));
    d0 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), d0);
    d1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), d1);
    return _mm256_add_ps(d0, d1);
}

/* acc[m] += s * sum_i q_i x_i over group g, rows [0, t) */
static inline __attribute__((always_inline)) void group_avx2(
        const float *x, int64_t K, const int t, const uint8_t *vals, int64_t g, __m256 s, int bits, int64_t group,
        __m256 *acc) {
    const float *xg = x + g * group;
    if (bits == 4) { /* group == 32: 16 bytes */
        const __m128i b = _mm_loadu_si128((const __m128i *)(vals + g * 16));
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
        for (int m = 0; m < t; m++) acc[m] = _mm256_fmadd_ps(s, dot32(xg + m * K, q0, q1, q2, q3), acc[m]);
    } else if (group == 32) { /* Q8_0: the group's 32 int8 weights as four vectors */
        const int8_t *q = (const int8_t *)vals + g * 32;
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16))));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 24))));
        for (int m = 0; m < t; m++) acc[m] = _mm256_fmadd_ps(s, dot32(xg + m * K, w0, w1, w2, w3), acc[m]);
    } else { /* int8, group a multiple of 8 */
        const int8_t *q = (const int8_t *)vals + g * group;
        __m256 d[TILE];
        for (int m = 0; m < t; m++) d[m] = _mm256_setzero_ps();
        for (int64_t i = 0; i < group; i += 8) {
            const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))));
            for (int m = 0; m < t; m++) d[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + m * K + i), d[m]);
        }
        for (int m = 0; m < t; m++) acc[m] = _mm256_fmadd_ps(s, d[m], acc[m]);
    }
}

/* rows [0, t) of the sums s_g * sum_i q_i x_i over the groups g of one row n of W (the offsets are
 * added by the caller); inlined for each constant t and scale width, so the accumulators stay in
 * registers. Scales are read eight at a time (float16 ones widened by one instruction). */
static inline __attribute__((always_inline)) void row_avx2(
        const float *x, int64_t K, const int t, const uint8_t *vals, const void *sc, const int half, int bits,
        int64_t group, float *out) {
    __m256 acc[TILE];
    for (int m = 0; m < t; m++) acc[m] = _mm256_setzero_ps();
    const int64_t G = K / group;
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256 s8 = groups8_at(sc, half, g);
        for (int j = 0; j < 8; j++) group_avx2(x, K, t, vals, g + j, LANE(s8, j), bits, group, acc);
    }
    for (; g < G; g++) group_avx2(x, K, t, vals, g, _mm256_set1_ps(group_at(sc, half, g)), bits, group, acc);
    for (int m = 0; m < t; m++) out[m] = hsum(acc[m]);
}

static void row_avx2_tile(const float *x, int64_t K, int t, const uint8_t *vals, const void *sc, int half, int bits,
                          int64_t group, float *out) {
#define ROW(T, H) row_avx2(x, K, T, vals, sc, H, bits, group, out)
    FOR_CONSTANT_TILE(t, half);
#undef ROW
}
#endif

/* the same sums in plain C: CPUs without AVX2 and FMA, and groups that are not a multiple of 8 */
static void row_plain(const float *x, int64_t K, int t, const uint8_t *vals, const void *sc, const void *off, int half,
                      int bits, float zero, int64_t group, float *out) {
    for (int m = 0; m < t; m++) out[m] = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        const int64_t g = k / group;
        float q;
        if (bits == 4) {
            const int64_t i = k % 32;
            const uint8_t b = vals[(k / 32) * 16 + (i % 16)];
            q = (float)(i < 16 ? (b & 15) : (b >> 4));
        } else {
            q = (float)((const int8_t *)vals)[k];
        }
        const float w = group_at(sc, half, g) * (q - zero) + (off ? group_at(off, half, g) : 0.0f);
        for (int m = 0; m < t; m++) out[m] += w * x[m * K + k];
    }
}

int block_gemv_vectorized(int64_t group) {
#if defined(__AVX2__) && defined(__FMA__)
    return group % 8 == 0;
#else
    (void)group;
    return 0;
#endif
}

/* Whether the vector loop of W needs the groups' sums of x (an offset or a zero point). */
int block_gemv_shifted(const void *offset, float zero, int64_t group) {
    return block_gemv_vectorized(group) && (offset || zero != 0.0f);
}

/* xsum (M, G) = each group's sum of x (M, K); 1 where a sum is not finite (0 * inf = NaN in the
 * factored sums: the caller multiplies those rows otherwise), else 0. */
int block_gemv_group_sums(const float *x, int64_t M, int64_t K, int64_t group, float *xsum) {
    const int64_t G = K / group;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float total = 0.0f;
            for (int64_t i = 0; i < group; i++) total += x[m * K + g * group + i];
            if (!isfinite(total)) return 1;
            xsum[m * G + g] = total;
        }
    return 0;
}

/* out[m] = sum_k W[n, k] x[m, k] for t <= TILE rows of x and one row n of W (its values, scales and
 * offsets); xsum: the t rows' group sums where block_gemv_shifted, else unread; plain: the scalar loop,
 * which dequantizes each weight before multiplying (non-finite x). */
void block_gemv_row(const float *x, int64_t K, int t, const uint8_t *vals, const void *sc, const void *off, int half,
                    int bits, float zero, int64_t group, const float *xsum, int plain, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    if (!plain && block_gemv_vectorized(group)) {
        row_avx2_tile(x, K, t, vals, sc, half, bits, group, out);
        if (off || zero != 0.0f) { /* + sum_g (o_g - s_g zero) xsum[m, g], eight groups at a time */
            const int64_t G = K / group;
            const __m256 z = _mm256_set1_ps(zero);
            for (int m = 0; m < t; m++) {
                const float *xs = xsum + m * G;
                __m256 acc = _mm256_setzero_ps();
                int64_t g = 0;
                for (; g + 8 <= G; g += 8) {
                    const __m256 c = _mm256_fnmadd_ps(groups8_at(sc, half, g), z, off ? groups8_at(off, half, g) : _mm256_setzero_ps());
                    acc = _mm256_fmadd_ps(c, _mm256_loadu_ps(xs + g), acc);
                }
                out[m] += hsum(acc);
                for (; g < G; g++) out[m] += ((off ? group_at(off, half, g) : 0.0f) - group_at(sc, half, g) * zero) * xs[g];
            }
        }
        return;
    }
#endif
    (void)xsum;
    (void)plain;
    row_plain(x, K, t, vals, sc, off, half, bits, zero, group, out);
}

int block_gemv(const float *x, int64_t M, int64_t K, const uint8_t *values, const void *scale, const void *offset,
               int half, int bits, float zero, int64_t group, int64_t N, float *y, int threads) {
    const int64_t G = K / group, row_bytes = bits == 4 ? K / 2 : K;
    /* sum_i W[n, i] x[m, i] = sum_g s_g sum_i q_i x_i + (o_g - s_g zero) xsum[m, g]: the vector loop
     * multiplies the integers only; each group's constant part meets the group's sum of x */
    const int shifted = block_gemv_shifted(offset, zero, group);
    float *xsum = shifted ? (float *)malloc(sizeof(float) * (size_t)(M * G)) : 0;
    if (shifted && !xsum) return -1; /* no memory: block_gemv.py raises */
    if (shifted && block_gemv_group_sums(x, M, K, group, xsum)) {
        free(xsum);
        return 1; /* block_gemv.py dequantizes */
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *vals = values + n * row_bytes;
        const void *sc = groups_after(scale, half, n * G), *off = groups_after(offset, half, n * G);
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int t = M - m0 < TILE ? (int)(M - m0) : TILE;
            float out[TILE];
            block_gemv_row(x + m0 * K, K, t, vals, sc, off, half, bits, zero, group, shifted ? xsum + m0 * G : 0, 0, out);
            for (int m = 0; m < t; m++) y[(m0 + m) * N + n] = out[m];
        }
    }
    free(xsum);
    return 0;
}

/* y (M, N) = x (M, K) W^T for W bfloat16 (N, K), as raw 16-bit patterns */
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void bf16_row_avx2(const float *x, int64_t K, const int t, const uint16_t *w,
                                                                float *out) {
    __m256 acc[TILE][2];
    for (int m = 0; m < t; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k))), 16));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k + 8))), 16));
        for (int m = 0; m < t; m++) {
            acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), acc[m][1]);
        }
    }
    for (int m = 0; m < t; m++) out[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
    for (; k < K; k++) { /* the last K % 16 inputs */
        uint32_t bits = (uint32_t)w[k] << 16;
        float wk;
        memcpy(&wk, &bits, 4);
        for (int m = 0; m < t; m++) out[m] += wk * x[m * K + k];
    }
}
#endif

static void bf16_row_plain(const float *x, int64_t K, int t, const uint16_t *w, float *out) {
    for (int m = 0; m < t; m++) out[m] = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        uint32_t bits = (uint32_t)w[k] << 16;
        float wk;
        memcpy(&wk, &bits, 4);
        for (int m = 0; m < t; m++) out[m] += wk * x[m * K + k];
    }
}

void bfloat16_gemv(const float *x, int64_t M, int64_t K, const uint16_t *weight, int64_t N, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *w = weight + n * K;
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int t = M - m0 < TILE ? (int)(M - m0) : TILE;
            float out[TILE];
#if defined(__AVX2__) && defined(__FMA__)
            switch (t) {
            case 1: bf16_row_avx2(x + m0 * K, K, 1, w, out); break;
            case 2: bf16_row_avx2(x + m0 * K, K, 2, w, out); break;
            case 3: bf16_row_avx2(x + m0 * K, K, 3, w, out); break;
            default: bf16_row_avx2(x + m0 * K, K, 4, w, out); break;
            }
#else
            bf16_row_plain(x + m0 * K, K, t, w, out);
#endif
            for (int m = 0; m < t; m++) y[(m0 + m) * N + n] = out[m];
        }
    }
}

/* W (N, K) float32 = scale (q - zero) + offset, each weight as block_matmul.dequantize computes it,
 * bit for bit (a product, then a sum: the library is built with -ffp-contract=off), for a prefill's
 * GEMM; rows shared among the threads. */
void block_dequantize(const uint8_t *values, const void *scale, const void *offset, int half, int bits, float zero,
                      int64_t group, int64_t N, int64_t K, float *w, int threads) {
    const int64_t G = K / group, row_bytes = bits == 4 ? K / 2 : K;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < G; g++) {
            const float s = group_at(scale, half, n * G + g), o = offset ? group_at(offset, half, n * G + g) : 0.0f;
            float *out = w + n * K + g * group;
            if (bits == 4) { /* group 32: element i in the low nibble of byte i, i + 16 in its high one */
                const uint8_t *b = values + n * row_bytes + g * 16;
                for (int i = 0; i < 16; i++) {
                    out[i] = s * ((float)(b[i] & 15) - zero);
                    out[i + 16] = s * ((float)(b[i] >> 4) - zero);
                }
            } else {
                const int8_t *q = (const int8_t *)values + n * row_bytes + g * group;
                for (int64_t i = 0; i < group; i++) out[i] = s * ((float)q[i] - zero);
            }
            if (offset)
                for (int64_t i = 0; i < group; i++) out[i] += o;
        }
    }
}
