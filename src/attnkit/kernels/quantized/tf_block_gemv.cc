/* block_gemv as a tensorflow op: a decoding step's packed products (a tf.function) read the packed
 * bytes once, as torch's and jax's do (docs/decisions.md item 162). Compiled on first use with the C
 * sources into one library (tf_block_gemv.py). */
#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

extern "C" {
int block_gemv(const float *x, int64_t M, int64_t K, const uint8_t *values, const void *scale, const void *offset,
               int half, int bits, float zero, int64_t group, int64_t N, float *y, int threads);
int block_gemv_q8(const float *x, int64_t M, int64_t K, const uint8_t *values, const void *scale, const void *offset,
                  int half, int bits, float zero, int64_t group, int64_t N, float *y, int threads);
}

using namespace tensorflow;

/* x (M, K) float32, values (N, K / 2) uint8 or (N, K) int8, scale and offset (N, G) float32 or
 * float16 (offset unread without has_offset) -> y (M, N) float32 and declined: 0, or 1 where a group
 * of x sums to an infinity or NaN and W has offsets (the caller then takes the dequantized product). */
REGISTER_OP("AttnkitBlockGemv")
    .Input("x: float")
    .Input("values: V")
    .Input("scale: S")
    .Input("offset: S")
    .Attr("V: {uint8, int8}")
    .Attr("S: {float, half}")
    .Attr("bits: int")
    .Attr("zero: float")
    .Attr("group: int")
    .Attr("n: int")
    .Attr("has_offset: bool")
    .Attr("q8: bool")
    .Attr("threads: int")
    .Output("y: float")
    .Output("declined: int32")
    .SetShapeFn([](shape_inference::InferenceContext *c) {
      int64_t n;
      TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
      shape_inference::ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      c->set_output(0, c->Matrix(c->Dim(x, 0), n));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    });

class AttnkitBlockGemvOp : public OpKernel {
 public:
  explicit AttnkitBlockGemvOp(OpKernelConstruction *context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(context, context->GetAttr("zero", &zero_));
    OP_REQUIRES_OK(context, context->GetAttr("group", &group_));
    OP_REQUIRES_OK(context, context->GetAttr("n", &n_));
    OP_REQUIRES_OK(context, context->GetAttr("has_offset", &has_offset_));
    OP_REQUIRES_OK(context, context->GetAttr("q8", &q8_));
    OP_REQUIRES_OK(context, context->GetAttr("threads", &threads_));
  }

  void Compute(OpKernelContext *context) override {
    const Tensor &x = context->input(0), &values = context->input(1), &scale = context->input(2),
                 &offset = context->input(3);
    OP_REQUIRES(context, x.dims() == 2, absl::InvalidArgumentError("AttnkitBlockGemv: x must be (M, K)"));
    const int64_t m = x.dim_size(0), k = x.dim_size(1);
    Tensor *y = nullptr, *declined = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({m, n_}), &y));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({}), &declined));
    const int half = scale.dtype() == DT_HALF;
    const void *off = has_offset_ ? offset.data() : nullptr;
    auto product = q8_ ? block_gemv_q8 : block_gemv;
    const int code = m == 0 ? 0
                            : product(x.flat<float>().data(), m, k, static_cast<const uint8_t *>(values.data()),
                                      scale.data(), off, half, bits_, zero_, group_, n_, y->flat<float>().data(),
                                      threads_);
    OP_REQUIRES(context, code != -1, absl::ResourceExhaustedError("AttnkitBlockGemv: no memory for x's group sums"));
    declined->scalar<int32_t>()() = code;
  }

 private:
  int bits_, threads_;
  float zero_;
  int64_t group_, n_;
  bool has_offset_, q8_;
};

REGISTER_KERNEL_BUILDER(Name("AttnkitBlockGemv").Device(DEVICE_CPU), AttnkitBlockGemvOp);
