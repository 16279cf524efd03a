/* block_gemv as an XLA custom call (jax's FFI): a jitted decoding step's packed products read the
 * packed bytes once, as torch's do (docs/decisions.md item 162). Compiled on first use with the C
 * sources into one library (jax_block_gemv.py). */
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" {
int block_gemv(const float *x, int64_t M, int64_t K, const uint8_t *values, const void *scale, const void *offset,
               int half, int bits, float zero, int64_t group, int64_t N, float *y, int threads);
int block_gemv_q8(const float *x, int64_t M, int64_t K, const uint8_t *values, const void *scale, const void *offset,
                  int half, int bits, float zero, int64_t group, int64_t N, float *y, int threads);
}

/* x (M, K) float32, values (N, K / 2) uint8 or (N, K) int8, scale and offset (N, G) float32 or
 * float16 (offset unread without has_offset) -> y (M, N) float32 and status: 0, or 1 where a group
 * of x sums to an infinity or NaN and W has offsets (the caller then takes the dequantized product). */
static ffi::Error BlockGemvImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::AnyBuffer scale,
                                ffi::AnyBuffer offset, int32_t bits, float zero, int64_t group, int64_t n,
                                bool has_offset, bool q8, int32_t threads, ffi::ResultBuffer<ffi::F32> y,
                                ffi::ResultBuffer<ffi::S32> status) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("block_gemv: x must be (M, K)");
  const int64_t m = dims[0], k = dims[1];
  const int half = scale.element_type() == ffi::DataType::F16;
  const void *off = has_offset ? offset.untyped_data() : nullptr;
  auto product = q8 ? block_gemv_q8 : block_gemv;
  const int code = m == 0 ? 0
                          : product(x.typed_data(), m, k, static_cast<const uint8_t *>(values.untyped_data()),
                                    scale.untyped_data(), off, half, bits, zero, group, n, y->typed_data(), threads);
  if (code == -1) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "block_gemv: no memory for x's group sums");
  *status->typed_data() = code;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnkitBlockGemv, BlockGemvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int32_t>("bits")
                                  .Attr<float>("zero")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("n")
                                  .Attr<bool>("has_offset")
                                  .Attr<bool>("q8")
                                  .Attr<int32_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
