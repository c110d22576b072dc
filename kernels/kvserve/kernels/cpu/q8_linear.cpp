// A linear layer on Q8_0 weights (GGUF's 8-bit format: per group of 32 inputs one fp16 scale d,
// here widened to float32 once at load, and 32 int8 codes), float32 out: registered as
// torch.ops.kvserve_cpu.q8_linear.
//
// The activations are rounded to Q8 blocks first (q8_activations.h: a scale dx and codes qx per 32
// inputs), and each output is, in float32,
//
//   acc = 0;  for every group g in order:  acc = fma(d·dx, Σ q·qx, acc)
//
// where Σ q·qx is the group's exact integer sum: llama.cpp's Q8_0 × Q8_0 products.
//
// Why: the lm_head is the largest matrix of a small model (49152 x 576 for SmolLM2), and at batch 1
// a decode step reads it whole: 113 MB a token in float32, 30 MB in Q8_0. Widening every code to a
// float and multiplying eight at a time made the step's cost the widening; an 8-bit multiply-add
// sums 32 products. torch's int8 kernels (_weight_int8pack_mm) round their result to bfloat16, a
// step of 1/8 at a logit of 16, which greedy decoding and sampling would feel; here every logit is
// a float32 chain in group order, whatever the batch (interleaved_linear.h).
//
// The kernel's layout (`kvserve.executor.weights.q8_0.pack`) interleaves eight output rows: codes
// [n / 8, k / 4, 32], one 32-byte unit per four inputs, byte 4·o + j row o's input j; scales
// [n / 8, k / 32, 8].

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

#include "interleaved_linear.h"
#include "vec8.h"

namespace kvserve_cpu {
namespace {

struct Q8Format {
  const int8_t* codes;  // [n / 8, k / 4, 32]
  const float* scales;  // [n / 8, k / 32, 8]
  int64_t k, groups;

#ifdef KVSERVE_VEC8_AVX2
  // An 8-bit multiply-add takes one unsigned operand: |w| against qx carrying w's sign. On AVX2 each of
  // its 16-bit pair sums (at most 2 · 128 · 127) is widened to 32 bits at once (`dot_add`): two would overflow.
  template <int MR>
  void tile(const Activations& x, int64_t b, int64_t row, float* out, int64_t out_stride) const {
    const int8_t* block_codes = codes + b * (k / 4) * kUnitBytes;
    const float* block_scales = scales + b * groups * kLanes;
    __m256 acc[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i sum[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) sum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int unit = 0; unit < 8; ++unit) {
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_codes + (g * 8 + unit) * kUnitBytes));
        const __m256i magnitude = _mm256_abs_epi8(w);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          int32_t four;
          std::memcpy(&four, x.codes + (row + r) * k + g * kActGroup + unit * 4, 4);
          sum[r] = dot_add(sum[r], magnitude, _mm256_sign_epi8(_mm256_set1_epi32(four), w));
        }
      }
      const __m256 d = _mm256_loadu_ps(block_scales + g * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.scales[(row + r) * groups + g]));
        acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum[r]), acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * out_stride, acc[r]);
  }
#else  // the same sums and the same float chain, one output at a time
  template <int MR>
  void tile(const Activations& x, int64_t b, int64_t row, float* out, int64_t out_stride) const {
    const int8_t* block_codes = codes + b * (k / 4) * kUnitBytes;
    const float* block_scales = scales + b * groups * kLanes;
    for (int r = 0; r < MR; ++r) {
      for (int o = 0; o < kLanes; ++o) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t sum = 0;
          for (int unit = 0; unit < 8; ++unit) {
            const int8_t* w = block_codes + (g * 8 + unit) * kUnitBytes + 4 * o;
            const int8_t* q = x.codes + (row + r) * k + g * kActGroup + unit * 4;
            for (int j = 0; j < 4; ++j) sum += w[j] * q[j];
          }
          const float scale = block_scales[g * kLanes + o] * x.scales[(row + r) * groups + g];
          acc = std::fma(scale, static_cast<float>(sum), acc);
        }
        out[r * out_stride + o] = acc;
      }
    }
  }
#endif
};

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "codes must be a contiguous int8 [out / 8, in * 8] matrix (eight rows' Q8_0 codes interleaved)");
  const int64_t blocks = codes.size(0), k = codes.size(1) / kLanes;
  TORCH_CHECK(k % kActGroup == 0 && k > 0, "the input width must be a multiple of 32, got ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(1) == k / kActGroup && scales.size(2) == kLanes,
              "scales must be a contiguous float32 [out / 8, in / 32, 8] tensor (eight rows' Q8_0 scales)");
  const Q8Format format{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), k, k / kActGroup};
  return interleaved_linear("q8_linear", x, format, blocks, k, n);
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("q8_linear", kvserve_cpu::q8_linear); }
