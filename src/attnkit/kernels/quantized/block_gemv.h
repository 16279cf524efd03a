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
#endif
