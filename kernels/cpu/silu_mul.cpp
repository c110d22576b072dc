// SwiGLU's activation for the CPU: out = silu(gate) * up, from a fused [tokens, 2 * width] gate/up
// product (gate columns first), registered as torch.ops.kvserve_cpu.silu_mul.
//
// Why not torch's silu: its vectorized loop hands a chunk's last few elements to scalar code, whose
// exp is the C library's rather than the vector one, and where a chunk ends depends on the tensor's
// size and the thread count. So the same element could round differently in two batch sizes. Here
// each element is computed by the same fixed operations (vec8.h) wherever it sits: silu in fp32 with
// the kernels' own exp, times up, rounded once to the output dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>

#include "vec8.h"

namespace kvserve_cpu {
namespace {

template <typename R, typename W>
void silu_mul_rows(const R* in, int64_t in_stride, W* out, int64_t width, int64_t first, int64_t last) {
  const Vec8 one = Vec8::broadcast(1.0f);
  float g[8], u[8], y[8];
  for (int64_t t = first; t < last; ++t) {
    const R* gate = in + t * in_stride;
    const R* up = gate + width;
    W* dst = out + t * width;
    for (int64_t i = 0; i < width; i += 8) {
      const int64_t n = std::min<int64_t>(8, width - i);
      for (int64_t k = 0; k < 8; ++k) {  // a short last chunk is zero-padded: the same operations
        g[k] = k < n ? to_float(gate[i + k]) : 0.0f;
        u[k] = k < n ? to_float(up[i + k]) : 0.0f;
      }
      const Vec8 x = Vec8::load(g);
      ((x / (one + exp(Vec8::zero() - x))) * Vec8::load(u)).store(y);
      for (int64_t k = 0; k < n; ++k) store_as(y[k], dst + i + k);
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
    at::parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
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
