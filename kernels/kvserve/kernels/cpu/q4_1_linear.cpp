// A linear layer on GGUF Q4_1 weights, float32 out: registered as torch.ops.kvserve_cpu.q4_1_linear.
//
// Q4_1 stores each run of 32 inputs along a row as an fp16 scale d, an fp16 minimum m and 32
// 4-bit codes q: w = d·q + m. The activations are rounded to Q8 blocks first (q8_activations.h:
// a scale dx and codes qx per 32 inputs, sx = dx·Σqx), and each output is, in float32,
//
//   acc = 0;  for every group g in order:  acc = fma(d·dx, Σ q·qx, acc);  acc = fma(m, sx, acc)
//
// where Σ q·qx is the group's exact integer sum. llama.cpp computes the same products (Q4_1 ×
// Q8_1). Why: an 8-bit multiply-add instruction sums 32 of those products where float32 needs a
// nibble decode and four multiply-adds, and at one row a decode step is that decode's cost
// (measured on a 2-core AVX2 EPYC, 30 layers of SmolLM2: half the time of the float32 kernel at
// one row, docs/benchmarks.md). The integer sums are exact and every output's float chain runs in
// group order, whatever the batch or the thread count, so a token's result does not depend on
// what it was batched with.
//
// The kernel's layout (`kvserve.executor.weights.q4_1_linear.pack`) interleaves eight output rows:
// codes [n / 8, k / 8, 32] bytes, one 32-byte unit per eight inputs, where byte 4·o + j holds row
// o's input j in its low nibble and input j + 4 in its high one; scales [n / 8, k / 32, 2, 8] float32,
// the eight rows' d then their m. One vector of codes then meets one broadcast of four activation
// codes, and the eight lanes of a result are eight outputs: no sum across lanes anywhere.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

#include "interleaved_linear.h"
#include "vec8.h"

namespace kvserve_cpu {
namespace {

struct Q4_1Format {
  const uint8_t* codes;  // [n / 8, k / 8, 32]
  const float* scales;   // [n / 8, k / 32, 2, 8]
  int64_t k, groups;

#ifdef KVSERVE_VEC8_AVX2
#ifdef KVSERVE_VNNI
  static __m256i add_products(__m256i partial, __m256i u8, __m256i s8) { return dot_add(partial, u8, s8); }
  static __m256i group_sums(__m256i partial) { return partial; }
#else
  // AVX2 keeps 16-bit partial sums over a group's eight multiply-adds (at most 8 · 2 · 15 · 127 < 2^15)
  // and widens them once, at the group's end.
  static __m256i add_products(__m256i partial, __m256i u8, __m256i s8) {
    return _mm256_add_epi16(partial, _mm256_maddubs_epi16(u8, s8));
  }
  static __m256i group_sums(__m256i partial) { return _mm256_madd_epi16(partial, _mm256_set1_epi16(1)); }
#endif
  template <int MR>
  void tile(const Activations& x, int64_t b, int64_t row, float* out, int64_t out_stride) const {
    const uint8_t* block_codes = codes + b * (k / 8) * kUnitBytes;
    const float* block_scales = scales + b * groups * 2 * kLanes;
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256 acc[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i partial[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) partial[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int unit = 0; unit < 4; ++unit) {
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_codes + (g * 4 + unit) * kUnitBytes));
        const __m256i low = _mm256_and_si256(w, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int8_t* q = x.codes + (row + r) * k + g * kActGroup + unit * 8;
          int32_t first, second;
          std::memcpy(&first, q, 4);
          std::memcpy(&second, q + 4, 4);
          partial[r] = add_products(partial[r], low, _mm256_set1_epi32(first));
          partial[r] = add_products(partial[r], high, _mm256_set1_epi32(second));
        }
      }
      const __m256 d = _mm256_loadu_ps(block_scales + g * 2 * kLanes);
      const __m256 m = _mm256_loadu_ps(block_scales + g * 2 * kLanes + kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const int64_t xg = (row + r) * groups + g;
        const __m256 sum = _mm256_cvtepi32_ps(group_sums(partial[r]));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.scales[xg])), sum, acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sums[xg]), acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * out_stride, acc[r]);
  }
#else  // the same sums and the same float chain, one output at a time
  template <int MR>
  void tile(const Activations& x, int64_t b, int64_t row, float* out, int64_t out_stride) const {
    const uint8_t* block_codes = codes + b * (k / 8) * kUnitBytes;
    const float* block_scales = scales + b * groups * 2 * kLanes;
    for (int r = 0; r < MR; ++r) {
      for (int o = 0; o < kLanes; ++o) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t sum = 0;
          for (int unit = 0; unit < 4; ++unit) {
            const uint8_t* w = block_codes + (g * 4 + unit) * kUnitBytes + 4 * o;
            const int8_t* q = x.codes + (row + r) * k + g * kActGroup + unit * 8;
            for (int j = 0; j < 4; ++j) sum += (w[j] & 0x0f) * q[j] + (w[j] >> 4) * q[j + 4];
          }
          const int64_t xg = (row + r) * groups + g;
          const float d = block_scales[g * 2 * kLanes + o], m = block_scales[g * 2 * kLanes + kLanes + o];
          acc = std::fma(d * x.scales[xg], static_cast<float>(sum), acc);
          acc = std::fma(m, x.sums[xg], acc);
        }
        out[r * out_stride + o] = acc;
      }
    }
  }
#endif
};

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "codes must be a contiguous uint8 [out / 8, in * 4] matrix (eight rows' Q4_1 nibbles interleaved)");
  const int64_t blocks = codes.size(0), k = codes.size(1) / 4;
  TORCH_CHECK(k % kActGroup == 0 && k > 0, "the input width must be a multiple of 32, got ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == blocks && scales.size(1) == k / kActGroup && scales.size(2) == 2 &&
                  scales.size(3) == kLanes,
              "scales must be a contiguous float32 [out / 8, in / 32, 2, 8] tensor (eight rows' d, then m)");
  const Q4_1Format format{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), k, k / kActGroup};
  return interleaved_linear("q4_1_linear", x, format, blocks, k, n);
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("q4_1_linear", kvserve_cpu::q4_1_linear); }
