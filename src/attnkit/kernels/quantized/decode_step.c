/* One decoder-only block for a decoding step of M sequences (one new token each), its seven
 * projections read as packed blocks (docs/decisions.md item 143; the Python side is decode_step.py).
 *
 *   x = x + W_o Attention(RoPE(Norm(x) W_q), RoPE(Norm(x) W_k), Norm(x) W_v)   keys, values: the cache
 *   x = x + W_down(SiLU(Norm(x) W_gate) * (Norm(x) W_up))
 *
 * the block `decoder_block` defines (layers/decoder_block.py), for the options this kernel takes:
 * RMSNorm without offset, no q/k norms, SiLU gate, the default scale 1/sqrt(d_k); biases optional;
 * each projection's input as it is or rounded to 8-bit blocks (q8, block_gemv_q8.c).
 * Each step of it is the arithmetic the torch path runs, in float32 (the norm's mean of squares summed
 * in double), so the two differ by float32 rounding only (tests/kernels/test_decode_step.py).
 *
 * One OpenMP region for the whole block: the products share out their output rows, the attention its
 * (row, head) pairs, and the small steps (norms, sums) run on one thread; the torch path's ~50 small
 * operations a block (each a dispatch, a temporary, a thread fork) become one call.
 *
 * x: (M, D) float32, updated in place.  cos, sin: (M, d_k).  keys, values: the layer's cache buffers
 * (M, h_kv, S_max, d_k), written at slot `start`; attention reads slots [0, S).  keep: (M, S) bytes
 * (1 = the key is seen) or NULL (all seen).  Legend: D d_model, F d_ff, H / Hkv heads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "block_gemv.h"

struct projection { /* y = x W^T + bias, W as block_gemv reads it */
    const uint8_t *values;
    const void *scale, *offset; /* float32, or float16 when half; offset NULL when absent */
    const float *bias;          /* NULL when absent */
    int64_t n, k, group;
    int32_t bits;
    float zero;
    int32_t q8;   /* 1: x rounded to 8-bit blocks of 32 first (block_gemv_q8.c) */
    int32_t half; /* 1: scale and offset float16 (GGUF's own) */
};


/* y (M, N) = x (M, K) W^T + bias; called by every thread of the region (orphaned directives). */
static void product(const struct projection *p, const float *x, int64_t M, float *y, float *xsum, int *plain,
                    const struct q8_rows *r) {
    const int64_t K = p->k, N = p->n, G = K / p->group, row_bytes = p->bits == 4 ? K / 2 : K;
    if (p->q8) {
#pragma omp single
        block_gemv_q8_round(x, M, K, r->q, r->d, r->qsum, r->ok);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            block_gemv_q8_rows(x, r->q, r->d, r->qsum, r->ok, M, K, p->values + n * row_bytes, groups_after(p->scale, p->half, n * G),
                               groups_after(p->offset, p->half, n * G), p->half, p->bits, p->zero, p->group, y + n, N);
            if (p->bias)
                for (int64_t m = 0; m < M; m++) y[m * N + n] += p->bias[n];
        }
        return;
    }
    const int shifted = block_gemv_shifted(p->offset, p->zero, p->group);
#pragma omp single
    *plain = shifted && block_gemv_group_sums(x, M, K, p->group, xsum); /* non-finite x: dequantize each weight */
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *vals = p->values + n * row_bytes;
        const void *sc = groups_after(p->scale, p->half, n * G), *off = groups_after(p->offset, p->half, n * G);
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int t = M - m0 < TILE ? (int)(M - m0) : TILE;
            float out[TILE];
            block_gemv_row(x + m0 * K, K, t, vals, sc, off, p->half, p->bits, p->zero, p->group, xsum + m0 * G, *plain, out);
            for (int m = 0; m < t; m++) y[(m0 + m) * N + n] = out[m] + (p->bias ? p->bias[n] : 0.0f);
        }
    }
}

/* out (M, D) = x / sqrt(mean(x^2) + eps) * gamma */
static void rms_norm(const float *x, int64_t M, int64_t D, const float *gamma, float eps, float *out) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        double squares = 0.0;
        for (int64_t i = 0; i < D; i++) squares += (double)x[m * D + i] * x[m * D + i];
        const float r = 1.0f / sqrtf((float)(squares / (double)D) + eps);
        for (int64_t i = 0; i < D; i++) out[m * D + i] = x[m * D + i] * r * gamma[i];
    }
}

/* x (d) <- x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] */
static void rotate(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] + (-x2) * sin[i];
        x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
    }
}

/* sum_i a_i b_i */
static inline float dot(const float *a, const float *b, int64_t d) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total = hsum(acc);
#endif
    for (; i < d; i++) total += a[i] * b[i];
    return total;
}

/* out (d) = softmax(scale q K^T over the kept keys) V; masked keys weigh 0 (as the explicit path's
 * weights times the mask), and a row with no kept key gives sum_j 0 * v_j. scores: S floats. */
static void attend(const float *q, const float *keys, const float *values, int64_t S, int64_t d, const uint8_t *keep,
                   float scale, float *scores, float *out) {
    float top = -INFINITY;
    int any = 0;
    for (int64_t j = 0; j < S; j++) {
        if (keep && !keep[j]) continue;
        scores[j] = dot(q, keys + j * d, d) * scale;
        if (scores[j] > top) top = scores[j];
        any = 1;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < S; j++) {
        if (keep && !keep[j]) {
            scores[j] = 0.0f;
            continue;
        }
        scores[j] = expf(scores[j] - top); /* a NaN score, or top = inf, gives NaN: the row is NaN */
        total += scores[j];
    }
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < S; j++) {
        const float w = any ? scores[j] / total : 0.0f;
        for (int64_t i = 0; i < d; i++) out[i] += w * values[j * d + i];
    }
}

/* 0 on success, -1 when the scratch memory could not be allocated (nothing written then). */
int decode_layer(float *x, int64_t M, int64_t D, const float *norm1, const float *norm2, float eps,
                 const struct projection *w, int64_t H, int64_t Hkv, int64_t dk, const float *cos, const float *sin,
                 float *keys, float *values, int64_t smax, int64_t start, int64_t S, const uint8_t *keep, float scale,
                 int threads) {
    const struct projection *wq = w, *wk = w + 1, *wv = w + 2, *wo = w + 3, *wg = w + 4, *wu = w + 5, *wd = w + 6;
    const int64_t dq = H * dk, dkv = Hkv * dk, F = wg->n, groups = H / Hkv;
    const int64_t widest = D > F ? (D > dq ? D : dq) : (F > dq ? F : dq);
    const size_t floats = (size_t)(M * (D + dq + 2 * dkv + dq + D + 2 * F + widest) + M * H * S);
    float *scratch = (float *)malloc(sizeof(float) * floats);
    struct q8_rows r; /* the q8 products' rounded inputs, the widest of them */
    if (!scratch || q8_rows_alloc(&r, M, widest)) {
        free(scratch);
        return -1;
    }
    float *normed = scratch, *q = normed + M * D, *k = q + M * dq, *v = k + M * dkv, *heads = v + M * dkv;
    float *out = heads + M * dq, *gate = out + M * D, *up = gate + M * F, *xsum = up + M * F, *scores = xsum + M * widest;
    int plain = 0;
#pragma omp parallel num_threads(threads)
    {
        rms_norm(x, M, D, norm1, eps, normed);
        product(wq, normed, M, q, xsum, &plain, &r);
        product(wk, normed, M, k, xsum, &plain, &r);
        product(wv, normed, M, v, xsum, &plain, &r);
#pragma omp for schedule(static)
        for (int64_t mh = 0; mh < M * H; mh++) { /* RoPE on each query head */
            const int64_t m = mh / H;
            rotate(q + mh * dk, cos + m * dk, sin + m * dk, dk);
        }
#pragma omp for schedule(static)
        for (int64_t mg = 0; mg < M * Hkv; mg++) { /* RoPE on each key head; both written at slot `start` */
            const int64_t m = mg / Hkv;
            rotate(k + mg * dk, cos + m * dk, sin + m * dk, dk);
            memcpy(keys + (mg * smax + start) * dk, k + mg * dk, sizeof(float) * dk);
            memcpy(values + (mg * smax + start) * dk, v + mg * dk, sizeof(float) * dk);
        }
#pragma omp for schedule(static)
        for (int64_t mh = 0; mh < M * H; mh++) { /* query head h reads key/value head h / (H / Hkv) */
            const int64_t m = mh / H, cached = (m * Hkv + (mh % H) / groups) * smax * dk;
            attend(q + mh * dk, keys + cached, values + cached, S, dk, keep ? keep + m * S : 0, scale, scores + mh * S,
                   heads + mh * dk);
        }
        product(wo, heads, M, out, xsum, &plain, &r);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * D; i++) x[i] += out[i];
        rms_norm(x, M, D, norm2, eps, normed);
        product(wg, normed, M, gate, xsum, &plain, &r);
        product(wu, normed, M, up, xsum, &plain, &r);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * F; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i]; /* SiLU(gate) * up */
        product(wd, gate, M, out, xsum, &plain, &r);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * D; i++) x[i] += out[i];
    }
    free(scratch);
    q8_rows_free(&r);
    return 0;
}
