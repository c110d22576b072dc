// SwiGLU's activation for the CPU: out = silu(gate) * up, from a fused [tokens, 2 * width] gate/up
// product (gate columns first), registered as torch.ops.kvserve_cpu.silu_mul.
//
// Why not torch's silu: its vectorized loop hands a chunk's last few elements to scalar code, whose
// exp is the C library's rather than the vector one, and where a chunk ends depends on the tensor's
// size and the thread count. So the same element could round differently in two batch sizes. Here
// each element is computed by the same fixed operations (vec8.h) wherever it sits: silu in fp32 with
// the kernels' own exp, times up, rounded once to the output dtype.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>

#include "vec8.h"
#include "work_pool.h"

namespace kvserve_cpu {
namespace {

inline Vec8 silu_times(Vec8 x, Vec8 up) { return (x / (Vec8::broadcast(1.0f) + exp(Vec8::zero() - x))) * up; }

template <typename R, typename W>
void silu_mul_rows(const R* in, int64_t in_stride, W* out, int64_t width, int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    const R* gate = in + t * in_stride;
    const R* up = gate + width;
    W* dst = out + t * width;
    int64_t i = 0;
    for (; i + 32 <= width; i += 32) {  // four independent chains through exp's polynomial
      const Vec8 y0 = silu_times(Vec8::load(gate + i), Vec8::load(up + i));
      const Vec8 y1 = silu_times(Vec8::load(gate + i + 8), Vec8::load(up + i + 8));
      const Vec8 y2 = silu_times(Vec8::load(gate + i + 16), Vec8::load(up + i + 16));
      const Vec8 y3 = silu_times(Vec8::load(gate + i + 24), Vec8::load(up + i + 24));
      y0.store(dst + i), y1.store(dst + i + 8), y2.store(dst + i + 16), y3.store(dst + i + 24);
    }
    for (; i + 8 <= width; i += 8) silu_times(Vec8::load(gate + i), Vec8::load(up + i)).store(dst + i);
    if (i < width) {  // a short last chunk, zero-padded: the same operations on its lanes
      float g[8] = {}, u[8] = {}, y[8];
      for (int64_t k = 0; i + k < width; ++k) g[k] = to_float(gate[i + k]), u[k] = to_float(up[i + k]);
      silu_times(Vec8::load(g), Vec8::load(u)).store(y);
      for (int64_t k = 0; i + k < width; ++k) store_as(y[k], dst + i + k);
    }
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_mul runs on the CPU");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [tokens, 2 * width], rows contiguous");
  const int64_t tokens = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({tokens, width}, gate_up.options());
  auto run = [&](auto read, auto write) {
    using R = decltype(read);
    using W = decltype(write);
    const auto* in = static_cast<const R*>(gate_up.data_ptr());
    auto* o = static_cast<W*>(out.data_ptr());
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width));
    parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
      silu_mul_rows(in, gate_up.stride(0), o, width, first, last);
    });
  };
  switch (gate_up.scalar_type()) {
    case at::kFloat: run(float{}, float{}); break;
    case at::kBFloat16: run(Bf16{}, c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}, c10::Half{}); break;
    default: TORCH_CHECK(false, "silu_mul: unsupported dtype ", gate_up.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) { m.def("silu_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("silu_mul", kvserve_cpu::silu_mul); }
