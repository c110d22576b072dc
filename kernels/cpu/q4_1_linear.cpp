// A linear layer on GGUF Q4_1 weights, float32 out: registered as torch.ops.kvserve_cpu.q4_1_linear.
//
// Q4_1 stores each run of 32 inputs along a row as an fp16 scale d, an fp16 minimum m (both widened
// to float32 once at load, kept side by side) and 16 bytes of 4-bit codes: byte j holds weight j in
// its low nibble and weight j + 16 in its high one; w = d·q + m.
//
// Why: at batch 1 a decode step reads every weight once, and 4-bit codes are an eighth of float32's
// bytes. torch's int4 GEMM (_weight_int4pack_mm_for_cpu) is fast only with bfloat16 activations,
// returns bfloat16, and changes its kernel with the row count. Here every weight is decoded to the
// float32 value the dequantized model holds (d·q is exact in a float32, so one rounding, fused or
// not, gives d·q + m), and every output summed in float32 in one fixed order whatever the batch
// (quant_linear.h): `--weights native` computes with the dequantized path's weights, in another order.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "quant_linear.h"
#include "vec8.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kGroupBytes = kQuantGroup / 2;

struct Q4_1Format {
  const uint8_t* codes;  // [n, k / 2]
  const float* scales;   // [n, k / 32, 2]: (d, m)
  int64_t k, groups, row_bytes;

  const void* row_start(int64_t row) const { return codes + row * row_bytes; }

  // The group's four runs of eight weights, in input order.
  static void decode_group(const uint8_t* q, const float* dm, Vec8 w[4]) {
    const Vec8 d = Vec8::broadcast(dm[0]), m = Vec8::broadcast(dm[1]);
    w[0] = fma(Vec8::load_low_nibbles(q), d, m);
    w[1] = fma(Vec8::load_low_nibbles(q + 8), d, m);
    w[2] = fma(Vec8::load_high_nibbles(q), d, m);
    w[3] = fma(Vec8::load_high_nibbles(q + 8), d, m);
  }

  void dequantize(int64_t row, int64_t rows, float* w) const {
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* q = codes + (row + r) * row_bytes;
      const float* dm = scales + (row + r) * groups * 2;
      for (int64_t g = 0; g < groups; ++g) {
        Vec8 runs[4];
        decode_group(q + g * kGroupBytes, dm + 2 * g, runs);
        float* dst = w + r * k + g * kQuantGroup;
        for (int i = 0; i < 4; ++i) runs[i].store(dst + 8 * i);
      }
    }
  }

  template <typename T>
  void dot8(int64_t row, const T* x, float* out) const {
    const uint8_t* q = codes + row * row_bytes;
    const float* dm = scales + row * groups * 2;
    Vec8 acc[kDotRows];
#pragma GCC unroll 8
    for (int r = 0; r < kDotRows; ++r) acc[r] = Vec8::zero();
    for (int64_t g = 0; g < groups; ++g) {
      const T* xg = x + g * kQuantGroup;
      const Vec8 x0 = Vec8::load(xg), x1 = Vec8::load(xg + 8), x2 = Vec8::load(xg + 16), x3 = Vec8::load(xg + 24);
#pragma GCC unroll 8
      for (int r = 0; r < kDotRows; ++r) {
        Vec8 w[4];
        decode_group(q + r * row_bytes + g * kGroupBytes, dm + r * groups * 2 + 2 * g, w);
        acc[r] = fma(w[0], x0, acc[r]);
        acc[r] = fma(w[1], x1, acc[r]);
        acc[r] = fma(w[2], x2, acc[r]);
        acc[r] = fma(w[3], x3, acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kDotRows; ++r) out[r] = sum_lanes(acc[r]);
  }
};

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "codes must be a contiguous uint8 [out, in / 2] matrix (Q4_1's packed nibbles)");
  const int64_t n = codes.size(0), k = codes.size(1) * 2;
  TORCH_CHECK(k % kQuantGroup == 0 && k > 0, "the input width must be a multiple of 32, got ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == n && scales.size(1) == k / kQuantGroup && scales.size(2) == 2,
              "scales must be a contiguous float32 [out, in / 32, 2] tensor (Q4_1's fp16 d and m, widened)");
  const Q4_1Format format{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), k, k / kQuantGroup, k / 2};
  return quant_linear("q4_1_linear", x, format, n, k);
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) { m.def("q4_1_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("q4_1_linear", kvserve_cpu::q4_1_linear); }
