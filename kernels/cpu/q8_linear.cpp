// A linear layer on Q8_0 weights (GGUF's 8-bit format: per group of 32 inputs one fp16 scale d,
// here widened to float32 once at load, and 32 int8 codes), float32 out: registered as
// torch.ops.kvserve_cpu.q8_linear.
//
// Why: the lm_head is the largest matrix of a small model (49152 x 576 for SmolLM2), and at batch 1
// a decode step reads it whole. In float32 that is 113 MB a token; in Q8_0 30 MB. torch's int8
// kernels (_weight_int8pack_mm) round their result to bfloat16, a step of 1/8 at a logit of 16,
// which greedy decoding and sampling would feel. Here each weight is dequantized exactly (an int8
// code times an fp16 scale fits a float32's mantissa) and each logit summed in float32, in one
// fixed order for every row whatever the batch (see `tile`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vec8.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRows = 8;  // output rows dequantized at a time (18 KB at 576 inputs: in L1)

// Dequantize `rows` output rows of codes [N, K] and scales [N, K / 32] into w [rows][K].
void dequantize(const int8_t* codes, const float* scales, int64_t k, int64_t rows, float* w) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const Vec8 d = Vec8::broadcast(scales[r * groups + g]);
      const int8_t* q = codes + r * k + g * kGroup;
      float* dst = w + r * k + g * kGroup;
      for (int64_t i = 0; i < kGroup; i += 8) (Vec8::load(q + i) * d).store(dst + i);
    }
  }
}

// A tile of NR output rows by MR activation rows. Every logit is one chain: a vector accumulator
// over the input in chunks of eight, in order, then its lanes reduced (i, i + 4), (i, i + 2),
// (0, 1). The tile shape only decides which chains run side by side (enough of them to hide the
// fused multiply-add's latency, sharing each load), so every shape gives every logit the same bits.
template <int NR, int MR, typename T>
inline void tile(const float* w, int64_t k, const T* x, int64_t x_stride, float* out, int64_t out_stride) {
  Vec8 acc[NR][MR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < MR; ++t) acc[r][t] = Vec8::zero();
  for (int64_t i = 0; i < k; i += 8) {
    Vec8 xs[MR];
#pragma GCC unroll 4
    for (int t = 0; t < MR; ++t) xs[t] = Vec8::load(x + t * x_stride + i);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const Vec8 wr = Vec8::load(w + r * k + i);
#pragma GCC unroll 4
      for (int t = 0; t < MR; ++t) acc[r][t] = fma(wr, xs[t], acc[r][t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < MR; ++t) out[t * out_stride + r] = sum_lanes(acc[r][t]);
}

// `tile<8, 1>` with each chunk of weights dequantized in registers rather than read from a buffer
// (the same exact products, so the same bits): for one or two activation rows, where dequantizing
// a block to memory first costs more than the multiply-adds it feeds.
template <typename T>
inline void tile_codes(const int8_t* codes, const float* d, int64_t k, const T* x, float* out) {
  constexpr int NR = 8;
  const int64_t groups = k / kGroup;
  Vec8 acc[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) acc[r] = Vec8::zero();
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 4
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; i += 8) {
      const Vec8 xs = Vec8::load(x + i);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const Vec8 wr = Vec8::load(codes + r * k + i) * Vec8::broadcast(d[r * groups + g]);
        acc[r] = fma(wr, xs, acc[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) out[r] = sum_lanes(acc[r]);
}

template <typename T>
void q8_rows(const T* x, int64_t m, const int8_t* codes, const float* scales, int64_t n, int64_t k,
             float* out, int64_t first_block, int64_t last_block) {
  std::vector<float> w(kRows * k);
  const int64_t groups = k / kGroup;
  for (int64_t block = first_block; block < last_block; ++block) {
    const int64_t row = block * kRows, rows = std::min(kRows, n - row);
    // The block after next: the hardware prefetcher alone left a cold call at float32's speed.
    for (int64_t ahead = 0; ahead < kRows * k && row + 3 * kRows <= n; ahead += 64)
      __builtin_prefetch(codes + (row + 2 * kRows) * k + ahead);
    if (rows == kRows && m <= 2) {
      for (int64_t t = 0; t < m; ++t) tile_codes(codes + row * k, scales + row * groups, k, x + t * k, out + t * n + row);
      continue;
    }
    dequantize(codes + row * k, scales + row * groups, k, rows, w.data());
    float* dst = out + row;
    if (rows < kRows) {  // the matrix's last few rows
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t t = 0; t < m; ++t) tile<1, 1>(w.data() + r * k, k, x + t * k, k, dst + t * n + r, n);
      continue;
    }
    int64_t t = 0;
    for (; t + 3 <= m; t += 3) {  // 4 x 3 tiles: twelve chains, seven loads per twelve multiply-adds
      tile<4, 3>(w.data(), k, x + t * k, k, dst + t * n, n);
      tile<4, 3>(w.data() + 4 * k, k, x + t * k, k, dst + t * n + 4, n);
    }
    for (; t < m; ++t) tile<8, 1>(w.data(), k, x + t * k, k, dst + t * n, n);
  }
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu(), "q8_linear runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in] matrix");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "codes must be a contiguous int8 [out, in] matrix");
  const int64_t m = x.size(0), n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the codes ", k);
  TORCH_CHECK(k % kGroup == 0 && k > 0, "the input width must be a multiple of 32, got ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / kGroup,
              "scales must be a contiguous float32 [out, in / 32] matrix (Q8_0's fp16 scales, widened)");
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const int64_t blocks = (n + kRows - 1) / kRows;
  auto run = [&](auto element) {
    using T = decltype(element);
    const auto* xp = static_cast<const T*>(x.data_ptr());
    at::parallel_for(0, blocks, 64, [&](int64_t first, int64_t last) {
      q8_rows(xp, m, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), n, k, out.data_ptr<float>(), first,
              last);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(Bf16{}); break;
    default: TORCH_CHECK(false, "q8_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) { m.def("q8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("q8_linear", kvserve_cpu::q8_linear); }
