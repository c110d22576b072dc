// A linear layer on Q8_0 weights (GGUF's 8-bit format: per group of 32 inputs one fp16 scale d,
// here widened to float32 once at load, and 32 int8 codes), float32 out: registered as
// torch.ops.kvserve_cpu.q8_linear.
//
// Why: the lm_head is the largest matrix of a small model (49152 x 576 for SmolLM2), and at batch 1
// a decode step reads it whole. In float32 that is 113 MB a token; in Q8_0 30 MB. torch's int8
// kernels (_weight_int8pack_mm) round their result to bfloat16, a step of 1/8 at a logit of 16,
// which greedy decoding and sampling would feel. Here each weight is dequantized exactly (an int8
// code times an fp16 scale fits a float32's mantissa) and each logit summed in float32, in one
// fixed order for every row whatever the batch (quant_linear.h).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "quant_linear.h"
#include "vec8.h"

namespace kvserve_cpu {
namespace {

struct Q8Format {
  const int8_t* codes;  // [n, k]
  const float* scales;  // [n, k / 32]
  int64_t k, groups, row_bytes;

  const void* row_start(int64_t row) const { return codes + row * k; }

  void dequantize(int64_t row, int64_t rows, float* w) const {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const Vec8 d = Vec8::broadcast(scales[(row + r) * groups + g]);
        const int8_t* q = codes + (row + r) * k + g * kQuantGroup;
        float* dst = w + r * k + g * kQuantGroup;
        for (int64_t i = 0; i < kQuantGroup; i += 8) (Vec8::load(q + i) * d).store(dst + i);
      }
    }
  }

  template <typename T>
  void dot8(int64_t row, const T* x, float* out) const {
    const int8_t* c = codes + row * k;
    const float* d = scales + row * groups;
    Vec8 acc[kDotRows];
#pragma GCC unroll 8
    for (int r = 0; r < kDotRows; ++r) acc[r] = Vec8::zero();
    for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 4
      for (int64_t i = g * kQuantGroup; i < (g + 1) * kQuantGroup; i += 8) {
        const Vec8 xs = Vec8::load(x + i);
#pragma GCC unroll 8
        for (int r = 0; r < kDotRows; ++r) {
          const Vec8 wr = Vec8::load(c + r * k + i) * Vec8::broadcast(d[r * groups + g]);
          acc[r] = fma(wr, xs, acc[r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kDotRows; ++r) out[r] = sum_lanes(acc[r]);
  }
};

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "codes must be a contiguous int8 [out, in] matrix");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kQuantGroup == 0 && k > 0, "the input width must be a multiple of 32, got ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / kQuantGroup,
              "scales must be a contiguous float32 [out, in / 32] matrix (Q8_0's fp16 scales, widened)");
  const Q8Format format{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), k, k / kQuantGroup, k};
  return quant_linear("q8_linear", x, format, n, k);
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) { m.def("q8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("q8_linear", kvserve_cpu::q8_linear); }
