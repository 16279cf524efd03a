/* The packed-weight row products of block_gemv.c, shared with decode_step.c (one library). */
#ifndef ATTNKIT_BLOCK_GEMV_H
#define ATTNKIT_BLOCK_GEMV_H
#include <stdint.h>

#define TILE 4 /* rows of x multiplied per pass over a row of W */

int block_gemv_vectorized(int64_t group);
int block_gemv_shifted(const float *offset, float zero, int64_t group);
int block_gemv_group_sums(const float *x, int64_t M, int64_t K, int64_t group, float *xsum);
void block_gemv_row(const float *x, int64_t K, int t, const uint8_t *vals, const float *sc, const float *off, int bits,
                    float zero, int64_t group, const float *xsum, int plain, float *out);

/* block_gemv_q8.c: x rounded to 8-bit blocks of 32 (llama.cpp's Q8_0), integer dot products */
int block_gemv_q8_takes(int bits, int64_t group, int64_t K);
void block_gemv_q8_round(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *qsum, uint8_t *ok);
void block_gemv_q8_row(const int8_t *q, const float *d, const int32_t *qsum, int64_t K, int t, const uint8_t *vals,
                       const float *sc, const float *off, int bits, float zero, int64_t group, float *out);
void block_gemv_q8_rows(const float *x, const int8_t *q, const float *d, const int32_t *qsum, const uint8_t *ok,
                        int64_t M, int64_t K, const uint8_t *vals, const float *sc, const float *off, int bits,
                        float zero, int64_t group, float *y, int64_t stride);
#endif
