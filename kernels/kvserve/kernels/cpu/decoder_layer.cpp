// One decoder layer of the native (Q4_1) CPU path as one op, and its RMSNorm
// (torch.ops.kvserve_cpu.decoder_layer, torch.ops.kvserve_cpu.rms_norm).
//
// Why one op: at one token a layer's arithmetic is a few hundred microseconds, and the ~100 torch
// ops it took from Python (norms, rotary, views, the residual adds) cost as much again in dispatch:
// about half of a batch-1 decode step. Here the layer's own steps are plain loops, and the four
// matrix products, the KV store, attention and SwiGLU are the registered kernels called through the
// dispatcher, with no Python between them.
//
// Batch invariance: every step is row-local. RMSNorm sums a row's squares in one fixed order (eight
// lanes, then the lanes in index order), rotary and the residual adds are single IEEE operations
// per element, and the kernels called are batch-invariant themselves. So a token's bits do not
// depend on what it was batched with, and the op's result equals its steps run one by one through
// the separate kernels, bit for bit (tests/kernels/test_decoder_layer.py).
//
// float32 activations only: the native path keeps float32 between its layers.
//
// LoRA: a step with rows under adapters passes each product's `lora_add` operands, and the op adds
// the deltas right after the product, as the op-by-op layers do (`LlamaModel._layers`). A step with
// adapter rows so keeps the fused layer, and a base-model row keeps its bits beside them (lora_add
// never touches a row under no adapter).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "vec8.h"
#include "work_pool.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kRowGrain = 16;  // rows per thread chunk of the row-local loops

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight: the squares summed in eight lanes in index order,
// the lanes then summed in a fixed order (sum_lanes), so a row's result is the same in any batch.
void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t width, double eps) {
  parallel_for(0, rows, kRowGrain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* src = x + r * width;
      float* dst = out + r * width;
      Vec8 squares = Vec8::zero();
      for (int64_t i = 0; i < width; i += 8) {
        const Vec8 v = Vec8::load(src + i);
        squares = fma(v, v, squares);
      }
      const float mean = sum_lanes(squares) / static_cast<float>(width);
      const Vec8 inv = Vec8::broadcast(1.0f / std::sqrt(mean + static_cast<float>(eps)));
      for (int64_t i = 0; i < width; i += 8) (Vec8::load(src + i) * inv * Vec8::load(weight + i)).store(dst + i);
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, width] CPU tensor");
  TORCH_CHECK(x.size(1) % 8 == 0, "the width must be a multiple of 8, got ", x.size(1));
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be a contiguous float32 vector of the row width");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  at::Tensor out = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps);
  return out;
}

// x += y, row by row (both contiguous float32 [rows, width]).
void add_rows(at::Tensor& x, const at::Tensor& y) {
  const int64_t width = x.size(1);
  float* dst = x.data_ptr<float>();
  const float* src = y.data_ptr<float>();
  parallel_for(0, x.size(0), kRowGrain, [&](int64_t first, int64_t last) {
    for (int64_t i = first * width; i < last * width; i += 8)
      (Vec8::load(dst + i) + Vec8::load(src + i)).store(dst + i);
  });
}

// Rotate-half RoPE of the q and k heads at the front of each qkv row, into q [T, heads, D] and
// k [T, kv_heads, D]: out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin_signed[i], the sign of
// rotate_half living in the table, two rounded products and one rounded sum, as
// `kvserve.executor.model.llama.apply_rope` computes them.
void rotate_qk(const float* qkv, int64_t qkv_stride, const int64_t* positions, const float* cos, const float* sin,
               int64_t heads, int64_t kv_heads, int64_t head_dim, float* q, float* k, int64_t tokens) {
  const int64_t half = head_dim / 2;
  parallel_for(0, tokens, kRowGrain, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const float* c = cos + positions[t] * head_dim;
      const float* s = sin + positions[t] * head_dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const float* src = qkv + t * qkv_stride + h * head_dim;
        float* dst = h < heads ? q + (t * heads + h) * head_dim : k + (t * kv_heads + h - heads) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) {
          const float a = src[i] * c[i];
          const float b = src[(i + half) % head_dim] * s[i];
          dst[i] = a + b;
        }
      }
    }
  });
}

// The registered kernels, called through the dispatcher (each is its own translation unit).
template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t out_features) {
  static const auto op = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>(
      "kvserve_cpu::q4_1_linear");
  return op.call(x, codes, scales, out_features);
}

// The step's LoRA deltas for the layer's four products, in `lora_add`'s operands: one source per
// stack of adapter slots (or adapter running from its own tensors), with its rows' slots and scalings;
// the matrices of product p (qkv, o_proj, gate_up, down) and source s at p * sources + s, an empty `a`
// where the source has none for p, an empty `ranks` for None, `columns` as int64 boundaries.
struct LayerLora {
  at::TensorList row_slots, scaling, a, b, ranks, columns;

  void check() const {
    const size_t sources = row_slots.size(), entries = 4 * sources;
    TORCH_CHECK(scaling.size() == sources && a.size() == entries && b.size() == entries && ranks.size() == entries &&
                    columns.size() == entries,
                "decoder_layer: the LoRA lists take one row_slots and scaling per source and four a, b, ranks and "
                "columns per source (qkv, o_proj, gate_up, down), got ", sources, " sources and ", a.size(), ", ",
                b.size(), ", ", ranks.size(), ", ", columns.size());
    for (const at::Tensor& c : columns)
      TORCH_CHECK(c.scalar_type() == at::kLong && c.is_contiguous() && c.dim() == 1,
                  "decoder_layer: LoRA columns must be contiguous int64 vectors");
  }

  // out += the deltas of product `product` for the rows of `x` under adapters.
  void add(size_t product, const at::Tensor& x, at::Tensor& out) const {
    static const auto lora_add =
        kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const std::optional<at::Tensor>&, at::IntArrayRef, const at::Tensor&, at::Tensor&)>(
            "kvserve_cpu::lora_add");
    const size_t sources = row_slots.size();
    for (size_t s = 0; s < sources; ++s) {
      const size_t i = product * sources + s;
      if (a[i].numel() == 0) continue;
      const std::optional<at::Tensor> r = ranks[i].numel() > 0 ? std::optional<at::Tensor>(ranks[i]) : std::nullopt;
      const at::IntArrayRef cols(columns[i].data_ptr<int64_t>(), columns[i].numel());
      lora_add.call(x, row_slots[s], a[i], b[i], r, cols, scaling[s], out);
    }
  }
};

void decoder_layer(at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_attention_norm, double eps,
                   at::TensorList codes, at::TensorList scales, at::IntArrayRef out_features,
                   const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin_signed,
                   int64_t num_heads, int64_t num_kv_heads, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                   const at::Tensor& seq_lens, double scale, at::TensorList lora_row_slots,
                   at::TensorList lora_scaling, at::TensorList lora_a, at::TensorList lora_b,
                   at::TensorList lora_ranks, at::TensorList lora_columns) {
  static const auto store_kv = kernel<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                           const at::Tensor&)>("kvserve_cpu::store_kv");
  static const auto attention =
      kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, double)>("kvserve_cpu::paged_attention");
  static const auto silu_mul = kernel<at::Tensor(const at::Tensor&)>("kvserve_cpu::silu_mul");
  check_norm_args(x, input_norm);
  check_norm_args(x, post_attention_norm);
  TORCH_CHECK(codes.size() == 4 && scales.size() == 4 && out_features.size() == 4,
              "codes, scales and out_features: the qkv, o_proj, gate_up and down matrices");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions: int64, one per row of x");
  const int64_t tokens = x.size(0), hidden = x.size(1), head_dim = cos.size(1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin_signed.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin_signed.is_contiguous() && sin_signed.sizes() == cos.sizes() && head_dim % 2 == 0,
              "cos and sin_signed: contiguous float32 [positions, head_dim] tables");
  const int64_t qk_width = (num_heads + num_kv_heads) * head_dim;
  TORCH_CHECK(out_features[0] == qk_width + num_kv_heads * head_dim, "qkv's out_features does not match the heads");
  TORCH_CHECK(out_features[1] == hidden && out_features[3] == hidden, "o_proj and down must produce hidden columns");
  const LayerLora lora{lora_row_slots, lora_scaling, lora_a, lora_b, lora_ranks, lora_columns};
  lora.check();
  if (tokens > 0) {
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t table_rows = cos.size(0);
    TORCH_CHECK(*std::min_element(pos, pos + tokens) >= 0 && *std::max_element(pos, pos + tokens) < table_rows,
                "a position is past the rotary tables");
  }

  at::Tensor h = rms_norm(x, input_norm, eps);
  at::Tensor qkv = linear(h, codes[0], scales[0], out_features[0]);
  lora.add(0, h, qkv);
  at::Tensor q = at::empty({tokens, num_heads, head_dim}, x.options());
  at::Tensor k = at::empty({tokens, num_kv_heads, head_dim}, x.options());
  rotate_qk(qkv.data_ptr<float>(), qkv.stride(0), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
            sin_signed.data_ptr<float>(), num_heads, num_kv_heads, head_dim, q.data_ptr<float>(),
            k.data_ptr<float>(), tokens);
  const at::Tensor v = qkv.narrow(1, qk_width, num_kv_heads * head_dim).view({tokens, num_kv_heads, head_dim});
  store_kv.call(k, v, k_cache, v_cache, slot_mapping);
  const at::Tensor attn =
      attention.call(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale).view({tokens, -1});
  at::Tensor attn_out = linear(attn, codes[1], scales[1], out_features[1]);
  lora.add(1, attn, attn_out);
  add_rows(x, attn_out);
  h = rms_norm(x, post_attention_norm, eps);
  at::Tensor gate_up = linear(h, codes[2], scales[2], out_features[2]);
  lora.add(2, h, gate_up);
  const at::Tensor activated = silu_mul.call(gate_up);
  at::Tensor mlp_out = linear(activated, codes[3], scales[3], out_features[3]);
  lora.add(3, activated, mlp_out);
  add_rows(x, mlp_out);
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "decoder_layer(Tensor(a!) x, Tensor input_norm, Tensor post_attention_norm, float eps, Tensor[] codes, "
      "Tensor[] scales, int[] out_features, Tensor positions, Tensor cos, Tensor sin_signed, int num_heads, "
      "int num_kv_heads, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, Tensor[] lora_row_slots, Tensor[] lora_scaling, "
      "Tensor[] lora_a, Tensor[] lora_b, Tensor[] lora_ranks, Tensor[] lora_columns) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("rms_norm", kvserve_cpu::rms_norm);
  m.impl("decoder_layer", kvserve_cpu::decoder_layer);
}
