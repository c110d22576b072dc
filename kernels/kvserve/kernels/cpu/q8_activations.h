// Activations rounded to 8-bit codes, a scale per run of 32 inputs along a row (llama.cpp's Q8_1
// rule): d = max|x| / 127, q = round(x / d) to nearest even, and s = d·Σq for the weights' minimums.
//
// Why: a product of 4-bit weight codes and 8-bit activation codes is an integer, summed exactly by
// the CPU's 8-bit multiply-adds (32 products in two instructions), where float32 needs a decode and
// a multiply-add for every eight. Each row is rounded on its own, so a token's codes do not depend
// on the rows beside it; every step below is one IEEE-rounded operation in both Vec8 versions.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "vec8.h"
#include "work_pool.h"

namespace kvserve_cpu {

constexpr int64_t kActGroup = 32;  // inputs per activation scale

// One matrix of activations in Q8 blocks.
struct Q8Rows {
  at::Tensor codes;   // [m, k] int8 in -127..127
  at::Tensor scales;  // [m, k / 32] float32: d
  at::Tensor sums;    // [m, k / 32] float32: d·Σq, the group's value against a constant weight
};

template <typename T>
inline void quantize_group(const T* x, int8_t* q, float* d, float* s) {
  Vec8 v[kActGroup / 8];
  Vec8 amax = Vec8::zero();
#pragma GCC unroll 4
  for (int i = 0; i < kActGroup / 8; ++i) {
    v[i] = Vec8::load(x + 8 * i);
    amax = max(amax, abs(v[i]));
  }
  const float dg = max_lanes(amax) / 127.0f;
  const float inverse = dg != 0.0f ? 1.0f / dg : 0.0f;
  const Vec8 lo = Vec8::broadcast(-127.0f), hi = Vec8::broadcast(127.0f), scale = Vec8::broadcast(inverse);
  Vec8 total = Vec8::zero();  // integers below 2^12: exact in any order
#pragma GCC unroll 4
  for (int i = 0; i < kActGroup / 8; ++i) {
    const Vec8 rounded = min(max(round_to_int(v[i] * scale), lo), hi);
    total = total + rounded;
    rounded.store_int8(q + 8 * i);
  }
  *d = dg;
  *s = dg * sum_lanes(total);
}

// `x` [m, k] (float32 or bfloat16, k a multiple of 32) in Q8 blocks.
inline Q8Rows quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kActGroup;
  Q8Rows rows{at::empty({m, k}, x.options().dtype(at::kChar)), at::empty({m, groups}, x.options().dtype(at::kFloat)),
              at::empty({m, groups}, x.options().dtype(at::kFloat))};
  auto* q = rows.codes.data_ptr<int8_t>();
  auto* d = rows.scales.data_ptr<float>();
  auto* s = rows.sums.data_ptr<float>();
  auto run = [&](auto element) {
    using T = decltype(element);
    const auto* xp = static_cast<const T*>(x.data_ptr());
    parallel_for(0, m * groups, 2048, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) quantize_group(xp + g * kActGroup, q + g * kActGroup, d + g, s + g);
    });
  };
  if (x.scalar_type() == at::kBFloat16)
    run(Bf16{});
  else
    run(float{});
  return rows;
}

}  // namespace kvserve_cpu
