// softmax and log_softmax over the last dim of float32 [rows, n] (torch.ops.kvserve_cpu.softmax,
// torch.ops.kvserve_cpu.log_softmax): the sampler's top_p and min_p probabilities and its reported
// logprobs, and teacher-forced scoring's logprobs, on the CPU path.
//
// Why not torch's: its softmax and log_softmax take their exp and their sums from the vector code of
// the CPU capability torch picked (default, AVX2, AVX512), so the same logits gave other bits on
// another CPU, and a token on a top_p or min_p boundary could be kept on one and dropped on the other
// (issue 49: a step's bits on any x86 CPU; tests/kernels/test_scalar_build.py). Here every row is
// computed in one fixed order, whatever the CPU's vector width, the thread count and the other rows:
//   1. max: the row's maximum, exact in any order (8 lanes, tail lanes -inf, then max_lanes).
//   2. sum: e_i = exp(x_i - max) by vec8.h's exp, 0 where x_i - max < -87 (below exp's clamp: a -inf
//      entry among them); added in 8 lanes, lane j taking entries j, j + 8, j + 16, ... in index order
//      (a short last chunk's missing lanes add an exact 0), then sum_lanes' fixed pairing. The max's own
//      term is exp(0) = 1, so 1 <= sum <= n.
//   3. softmax_i = e_i / sum, one correctly rounded division (not a product with 1 / sum: two roundings).
//      log_softmax_i = (x_i - max) - log(sum), log(sum) once per row by `log_of_sum`: double operations
//      only, rounded to float.
// A row must hold a finite entry; a row of -inf, or holding +inf or NaN, comes out NaN, as torch's does.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec8.h"
#include "work_pool.h"

namespace kvserve_cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Entries i..n-1 (fewer than 8) of a row in the first lanes, -inf in the others.
inline Vec8 load_tail(const float* x, int64_t i, int64_t n) {
  float lanes[8];
  std::fill(lanes, lanes + 8, -kInf);
  std::copy(x + i, x + n, lanes);
  return Vec8::load(lanes);
}

// The row's max; +inf where it holds +inf or NaN (min(v, +inf) takes +inf in a NaN lane, in both vec8.h versions).
float row_max(const float* x, int64_t n) {
  const Vec8 inf = Vec8::broadcast(kInf);
  Vec8 m = Vec8::broadcast(-kInf);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = max(m, min(Vec8::load(x + i), inf));
  if (i < n) m = max(m, min(load_tail(x, i, n), inf));
  return max_lanes(m);
}

// exp(d) for d = x - max <= 0, and exactly 0 where d < -87, where `exp` clamps its argument (-inf included:
// a masked entry or a padded lane). The mask is the sign of d + 87 (negative just there, never -0): select
// reads a mask lane's sign bit, as blendv does and vec8.h's scalar version does too.
inline Vec8 exp_or_zero(Vec8 d) { return select(d + Vec8::broadcast(87.0f), Vec8::zero(), exp(d)); }

// The row's sum of exp(x - max) in the fixed order above; with kStore each exp is written to `e` too.
template <bool kStore>
float exp_sum(const float* x, int64_t n, float row_max_value, float* e) {
  const Vec8 m = Vec8::broadcast(row_max_value);
  Vec8 sum = Vec8::zero();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // four independent exps, added in index order
    const Vec8 e0 = exp_or_zero(Vec8::load(x + i) - m);
    const Vec8 e1 = exp_or_zero(Vec8::load(x + i + 8) - m);
    const Vec8 e2 = exp_or_zero(Vec8::load(x + i + 16) - m);
    const Vec8 e3 = exp_or_zero(Vec8::load(x + i + 24) - m);
    sum = sum + e0, sum = sum + e1, sum = sum + e2, sum = sum + e3;
    if constexpr (kStore) e0.store(e + i), e1.store(e + i + 8), e2.store(e + i + 16), e3.store(e + i + 24);
  }
  for (; i + 8 <= n; i += 8) {
    const Vec8 e0 = exp_or_zero(Vec8::load(x + i) - m);
    sum = sum + e0;
    if constexpr (kStore) e0.store(e + i);
  }
  if (i < n) {  // the padded lanes' -inf give exp 0
    const Vec8 e0 = exp_or_zero(load_tail(x, i, n) - m);
    sum = sum + e0;
    if constexpr (kStore) {
      float lanes[8];
      e0.store(lanes);
      std::copy(lanes, lanes + (n - i), e + i);
    }
  }
  return sum_lanes(sum);
}

// log(sum) rounded to float, for a finite sum >= 1, from IEEE double operations alone: no libm, whose
// log differs between versions and the variants it picks per CPU. sum = m * 2^k with m in
// (sqrt(1/2), sqrt(2)] (exact), log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.1716, by its
// series to s^23 (the rest under 2^-65 of it), plus k ln 2. The double is within a few units of 2^-52
// of log(sum), so the float is the correctly rounded log(sum) unless log(sum) lies that close to a
// midpoint between two floats, and it is the same float on every machine.
float log_of_sum(float sum) {
  uint32_t bits;
  std::memcpy(&bits, &sum, sizeof bits);
  int k = static_cast<int>(bits >> 23) - 127;  // sum >= 1: positive and normal
  const uint32_t mantissa_bits = (bits & 0x007fffffu) | 0x3f800000u;
  float mantissa;
  std::memcpy(&mantissa, &mantissa_bits, sizeof mantissa);
  double m = mantissa;  // [1, 2)
  if (m > 1.41421356237309504880) m *= 0.5, k += 1;
  const double s = (m - 1.0) / (m + 1.0);  // m - 1 is exact
  const double s2 = s * s;
  double series = 1.0 / 23.0;
  for (int j = 21; j >= 1; j -= 2) series = series * s2 + 1.0 / j;
  const double log_m = 2.0 * s * series;
  return static_cast<float>(static_cast<double>(k) * 0.69314718055994530942 + log_m);
}

void fill_nan(float* out, int64_t n) { std::fill(out, out + n, std::numeric_limits<float>::quiet_NaN()); }

void softmax_row(const float* x, float* out, int64_t n) {
  const float m = row_max(x, n);
  if (!std::isfinite(m)) return fill_nan(out, n);
  const Vec8 sum = Vec8::broadcast(exp_sum<true>(x, n, m, out));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) (Vec8::load(out + i) / sum).store(out + i);
  for (; i < n; ++i) out[i] = out[i] / sum.first();  // the same IEEE division as a lane's
}

void log_softmax_row(const float* x, float* out, int64_t n) {
  const float m = row_max(x, n);
  if (!std::isfinite(m)) return fill_nan(out, n);
  const float log_sum = log_of_sum(exp_sum<false>(x, n, m, nullptr));
  const Vec8 max_v = Vec8::broadcast(m), log_sum_v = Vec8::broadcast(log_sum);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) ((Vec8::load(x + i) - max_v) - log_sum_v).store(out + i);
  for (; i < n; ++i) out[i] = (x[i] - m) - log_sum;  // the same two IEEE subtractions as a lane's
}

void check_softmax_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, n], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  TORCH_CHECK(x.size(1) >= 1, op, ": x must have at least one column");
}

template <typename Row>
at::Tensor over_rows(const at::Tensor& x, const char* op, Row row) {
  check_softmax_input(x, op);
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  // A row is one thread's from start to end, so its bits do not depend on the thread count.
  parallel_for(0, x.size(0), std::max<int64_t>(1, 16384 / n), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) row(src + r * n, dst + r * n, n);
  });
  return out;
}

at::Tensor softmax(const at::Tensor& x) { return over_rows(x, "softmax", softmax_row); }

at::Tensor log_softmax(const at::Tensor& x) { return over_rows(x, "log_softmax", log_softmax_row); }

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("softmax(Tensor x) -> Tensor");
  m.def("log_softmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("softmax", kvserve_cpu::softmax);
  m.impl("log_softmax", kvserve_cpu::log_softmax);
}
