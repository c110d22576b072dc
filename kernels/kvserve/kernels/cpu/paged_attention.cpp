// Batch-invariant paged attention and KV store for the CPU (torch.ops.kvserve_cpu.*).
//
// Every query row (one token, one head) is reduced over its own context in one fixed order: KV
// block by KV block from position 0, an online softmax per block, keys in slot order, head
// dimensions in index order, each sum one chain of fused multiply-adds. Nothing in that order
// depends on which other rows share the call, how many new tokens the row's sequence brought, or
// how its context was computed (whole, chunked, from the prefix cache, recomputed): those only
// change how rows are grouped into work items, and a work item runs the same arithmetic for each
// of its rows. So a token's attention output is bit-identical however it was batched, which a
// GEMM-based kernel (micro-kernels chosen by shape, split-K, flash blocks sized by the query
// length) does not give.
//
// Arithmetic goes through `Vec8` (vec8.h): explicit fused multiply-adds and single IEEE steps, the
// same bits on the AVX2 and the scalar build. The file is compiled with -ffp-contract=off, so the
// compiler fuses nothing on its own.
//
// Layout (head-major): keys [blocks, kv_heads, head_dim, block_size], values [blocks, kv_heads,
// block_size, head_dim]. One head's block is one contiguous run, and keys come transposed, so the
// scores of a block's keys are plain vector multiply-adds with no gather or transpose.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "vec8.h"
#include "work_pool.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kTileTokens = 16;  // query tokens of one sequence per work item
constexpr int64_t kMaxHeadDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
void widen(const T* src, int64_t n, float* dst) {  // n is a multiple of 8
  for (int64_t i = 0; i < n; i += 8) Vec8::load(src + i).store(dst + i);
}

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t first_token;  // index into the packed query rows
  int32_t num_tokens;
};

struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group;
  int64_t q_stride_t, q_stride_h;  // query strides (elements); head_dim is contiguous
  int64_t max_blocks;              // block table row width
  float scale;
};

// One thread's buffers, grown to the largest work item it runs.
struct Scratch {
  std::vector<float> q, acc, m, l, kt, vb;
  std::vector<int64_t> last;
  void fit(int64_t rows, int64_t head_dim, int64_t block_size) {
    if (q.size() < static_cast<size_t>(rows * head_dim)) q.resize(rows * head_dim), acc.resize(rows * head_dim);
    if (m.size() < static_cast<size_t>(rows)) m.resize(rows), l.resize(rows), last.resize(rows);
    if (kt.size() < static_cast<size_t>(block_size * head_dim)) kt.resize(block_size * head_dim), vb.resize(block_size * head_dim);
  }
};

// acc[r][d0, d0 + 8 NV) = acc * alpha[r] + sum over slots j < valid, in order, of p[r][j] v_j (one fma
// chain per lane). The NR rows share each load of v.
template <int NR, int NV>
inline void add_values(float* const acc[], const Vec8 alpha[], const float* p, int64_t p_stride, const float* vb,
                       int64_t head_dim, int64_t valid, int64_t d0) {
  Vec8 a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = Vec8::load(acc[r] + d0 + 8 * c) * alpha[r];
  for (int64_t j = 0; j < valid; ++j) {
    Vec8 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = Vec8::load(vb + j * head_dim + d0 + 8 * c);
    for (int r = 0; r < NR; ++r) {
      const Vec8 pj = Vec8::broadcast(p[r * p_stride + j]);
      for (int c = 0; c < NV; ++c) a[r][c] = fma(pj, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) a[r][c].store(acc[r] + d0 + 8 * c);
}

// One pass of NR (1 to 4) rows over one KV block (kt: this head's keys [head_dim, BS], vb: its values
// [BS, head_dim], both fp32; `valid` slots hold real data). Row r sees the block's first seen[r] keys.
// The arithmetic of a row, whatever the other rows are and however many:
//   - score s[j] = scale * (q . k_j), the dot product one fma chain over d in index order;
//   - online softmax: m' = max(m, max_j s[j]), alpha = exp(m - m'), p[j] = exp(s[j] - m') (0 for
//     unseen keys), l = l * alpha + (the p[j] summed as a fixed pairwise tree over the BS lanes);
//   - acc[d] = acc[d] * alpha, then one fma chain over the slots j < valid in order, acc += p[j] v_j[d]
//     (an unseen slot adds an exact zero, so `valid` does not change the value).
// The rows share each load of kt and vb and overlap their chains.
template <int BS, int NR>
inline void attend_rows(const float* const q[], float* const acc[], float* const m[], float* const l[],
                        const int64_t seen[], const float* kt, const float* vb, int64_t head_dim, int64_t valid,
                        float scale) {
  constexpr int kVecs = BS / 8;
  constexpr int kStep = kVecs >= 2 ? 2 : 1;  // key vectors scored together: up to 4 rows x 2 = 8 chains
  float s[NR][BS];
  const Vec8 vscale = Vec8::broadcast(scale);
  for (int kv = 0; kv < kVecs; kv += kStep) {
    Vec8 a[NR][kStep];
    for (auto& row : a)
      for (auto& x : row) x = Vec8::zero();
    for (int64_t d = 0; d < head_dim; ++d) {
      Vec8 k[kStep];
      for (int c = 0; c < kStep; ++c) k[c] = Vec8::load(kt + d * BS + 8 * (kv + c));
      for (int r = 0; r < NR; ++r) {
        const Vec8 qd = Vec8::broadcast(q[r][d]);
        for (int c = 0; c < kStep; ++c) a[r][c] = fma(qd, k[c], a[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kStep; ++c) (a[r][c] * vscale).store(s[r] + 8 * (kv + c));
  }
  float p[NR][BS];
  Vec8 alpha[NR];
  for (int r = 0; r < NR; ++r) {
    Vec8 masked[kVecs];
    Vec8 block_max = Vec8::broadcast(kNegInf);
    for (int i = 0; i < kVecs; ++i) {
      masked[i] = select(Vec8::iota_below(8 * i, seen[r]), Vec8::load(s[r] + 8 * i), Vec8::broadcast(kNegInf));
      block_max = max(masked[i], block_max);
    }
    const float m_old = *m[r];
    const float m_new = std::max(m_old, max_lanes(block_max));
    alpha[r] = m_old == kNegInf ? Vec8::zero() : exp(Vec8::broadcast(m_old - m_new));  // the row's first block
    Vec8 sums[kVecs];
    const Vec8 vm = Vec8::broadcast(m_new);
    for (int i = 0; i < kVecs; ++i) {
      // exp(-inf - m) is clamped, not zero: the select zeroes unseen lanes.
      sums[i] = select(Vec8::iota_below(8 * i, seen[r]), exp(masked[i] - vm), Vec8::zero());
      sums[i].store(p[r] + 8 * i);
    }
    for (int n = kVecs; n > 1; n /= 2)
      for (int i = 0; i < n / 2; ++i) sums[i] = sums[i] + sums[i + n / 2];
    *l[r] = *l[r] * alpha[r].first() + sum_lanes(sums[0]);
    *m[r] = m_new;
  }
  int64_t d0 = 0;
  for (; d0 + 32 <= head_dim; d0 += 32) add_values<NR, 4>(acc, alpha, p[0], BS, vb, head_dim, valid, d0);
  for (; d0 < head_dim; d0 += 8) add_values<NR, 1>(acc, alpha, p[0], BS, vb, head_dim, valid, d0);
}

template <int BS, typename KV, typename QR, typename QW>
void run_item(const WorkItem& item, const Geometry& g, const QR* query, const KV* k_cache, const KV* v_cache,
              const int32_t* block_table, int64_t context_before, QW* out, Scratch& w) {
  const int64_t D = g.head_dim, G = g.group;
  const int64_t rows = item.num_tokens * G;
  w.fit(rows, D, BS);
  float* qf = w.q.data();
  for (int64_t t = 0; t < item.num_tokens; ++t) {
    const int64_t token = item.first_token + t;
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = t * G + h, head = item.kv_head * G + h;
      widen(query + token * g.q_stride_t + head * g.q_stride_h, D, qf + r * D);
      w.last[r] = context_before + t;  // the row's own position: it sees keys [0, last]
    }
  }
  std::fill(w.acc.begin(), w.acc.begin() + rows * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);

  const int64_t last_pos = context_before + item.num_tokens - 1;
  const int64_t block_elems = BS * D;  // one head's keys (or values) in one block
  float* kt = w.kt.data();
  float* vb = w.vb.data();
  for (int64_t b = 0; b * BS <= last_pos; ++b) {
    const int64_t start = b * BS;
    const int64_t chunk = (static_cast<int64_t>(block_table[b]) * g.num_kv_heads + item.kv_head) * block_elems;
    // Slots past the item's last position may hold anything (NaN included): their keys are zeroed
    // and their values never read.
    const int64_t valid = std::min<int64_t>(BS, last_pos + 1 - start);
    if ((b + 1) * BS <= last_pos) {
      // One head's block is a short run of its own, which the hardware prefetchers do not follow to
      // the next block: fetch the next one's keys and values while this one computes.
      const int64_t next = (static_cast<int64_t>(block_table[b + 1]) * g.num_kv_heads + item.kv_head) * block_elems;
      const auto* nk = reinterpret_cast<const char*>(k_cache + next);
      const auto* nv = reinterpret_cast<const char*>(v_cache + next);
      for (int64_t off = 0; off < block_elems * static_cast<int64_t>(sizeof(KV)); off += 64) {
        __builtin_prefetch(nk + off);
        __builtin_prefetch(nv + off);
      }
    }
    widen(k_cache + chunk, block_elems, kt);
    widen(v_cache + chunk, valid * D, vb);
    if (valid < BS)
      for (int64_t d = 0; d < D; ++d) std::fill(kt + d * BS + valid, kt + (d + 1) * BS, 0.0f);
    // Rows that see this block, four at a time (an item's rows are in position order).
    int64_t first = 0;
    while (first < rows && w.last[first] < start) ++first;
    for (int64_t r0 = first; r0 < rows; r0 += 4) {
      const int nr = static_cast<int>(std::min<int64_t>(4, rows - r0));
      const float* q4[4];
      float *acc4[4], *m4[4], *l4[4];
      int64_t seen[4];
      for (int i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        q4[i] = qf + r * D;
        acc4[i] = w.acc.data() + r * D;
        m4[i] = w.m.data() + r;
        l4[i] = w.l.data() + r;
        seen[i] = std::min<int64_t>(BS, w.last[r] + 1 - start);
      }
      switch (nr) {  // the same arithmetic per row at every width (a decode's GQA group: 1 to 4 heads)
        case 4: attend_rows<BS, 4>(q4, acc4, m4, l4, seen, kt, vb, D, valid, g.scale); break;
        case 3: attend_rows<BS, 3>(q4, acc4, m4, l4, seen, kt, vb, D, valid, g.scale); break;
        case 2: attend_rows<BS, 2>(q4, acc4, m4, l4, seen, kt, vb, D, valid, g.scale); break;
        default: attend_rows<BS, 1>(q4, acc4, m4, l4, seen, kt, vb, D, valid, g.scale); break;
      }
    }
  }
  for (int64_t t = 0; t < item.num_tokens; ++t) {
    const int64_t token = item.first_token + t;
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = t * G + h, head = item.kv_head * G + h;
      const float* a = w.acc.data() + r * D;
      QW* dst = out + (token * g.num_heads + head) * D;
      const Vec8 l = Vec8::broadcast(w.l[r]);
      for (int64_t d = 0; d < D; d += 8) (Vec8::load(a + d) / l).store(dst + d);
    }
  }
}

// The element types a tensor may hold, as the types the kernels read and write.
template <typename F>
void with_type(at::ScalarType dtype, const char* what, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{}, float{});
    case at::kBFloat16: return f(Bf16{}, c10::BFloat16{});
    case at::kHalf: return f(c10::Half{}, c10::Half{});
    default: TORCH_CHECK(false, what, ": unsupported dtype ", dtype);
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention runs on the CPU");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must have one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32, contiguous");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "query_start_loc and seq_lens: int32");
  Geometry g;
  g.num_heads = query.size(1);
  g.head_dim = query.size(2);
  g.num_kv_heads = k_cache.size(1);
  g.block_size = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == g.head_dim && v_cache.size(3) == g.head_dim, "head_dim differs between query and cache");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == g.num_kv_heads && v_cache.size(2) == g.block_size,
              "v_cache must be [blocks, kv_heads, block_size, head_dim] beside k_cache [blocks, kv_heads, head_dim, block_size]");
  TORCH_CHECK(g.head_dim % 8 == 0 && g.head_dim <= kMaxHeadDim, "head_dim must be a multiple of 8, at most 256");
  TORCH_CHECK(g.num_heads % g.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  g.group = g.num_heads / g.num_kv_heads;
  g.q_stride_t = query.stride(0);
  g.q_stride_h = query.stride(1);
  g.max_blocks = block_tables.size(1);
  g.scale = static_cast<float>(scale);

  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "one row per sequence");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t begin = qsl[s], end = qsl[s + 1];
    TORCH_CHECK(begin <= end && end - begin <= lens[s], "a sequence has more new tokens than its length");
    TORCH_CHECK((lens[s] + g.block_size - 1) / g.block_size <= g.max_blocks, "block table too narrow");
    for (int64_t b = 0; b * g.block_size < lens[s]; ++b)
      TORCH_CHECK(tables[s * g.max_blocks + b] >= 0 && tables[s * g.max_blocks + b] < k_cache.size(0),
                  "block table entry past the cache");
    for (int32_t first = begin; first < end; first += kTileTokens) {
      const int32_t n = std::min<int32_t>(kTileTokens, end - first);
      for (int32_t h = 0; h < g.num_kv_heads; ++h) items.push_back({static_cast<int32_t>(s), h, first, n});
    }
  }
  TORCH_CHECK(qsl[num_seqs] == query.size(0), "query_start_loc does not cover the query rows");
  at::Tensor out = at::empty({query.size(0), g.num_heads, g.head_dim}, query.options());
  with_type(query.scalar_type(), "paged_attention", [&](auto q_read, auto q_write) {
    with_type(k_cache.scalar_type(), "paged_attention", [&](auto kv_read, auto) {
      using QR = decltype(q_read);
      using QW = decltype(q_write);
      using KV = decltype(kv_read);
      // QR and QW are the same bits (float, bfloat16 or half), read and written through their own types.
      const auto* q = static_cast<const QR*>(query.data_ptr());
      auto* o = static_cast<QW*>(out.data_ptr());
      const auto* kc = static_cast<const KV*>(k_cache.data_ptr());
      const auto* vc = static_cast<const KV*>(v_cache.data_ptr());
      parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
        Scratch scratch;
        for (int64_t i = first; i < last; ++i) {
          const WorkItem& item = items[i];
          const int32_t q_len = qsl[item.seq + 1] - qsl[item.seq];
          const int64_t before = lens[item.seq] - q_len + (item.first_token - qsl[item.seq]);
          const int32_t* table = tables + item.seq * g.max_blocks;
          auto run = [&](auto bs) {
            run_item<decltype(bs)::value>(item, g, q, kc, vc, table, before, o, scratch);
          };
          switch (g.block_size) {
            case 8: run(std::integral_constant<int, 8>{}); break;
            case 16: run(std::integral_constant<int, 16>{}); break;
            case 32: run(std::integral_constant<int, 32>{}); break;
            case 64: run(std::integral_constant<int, 64>{}); break;
            default: TORCH_CHECK(false, "paged_attention: block_size must be 8, 16, 32 or 64");
          }
        }
      });
    });
  });
  return out;
}

// Write token t's K/V ([tokens, kv_heads, head_dim]) into slot `slot_mapping[t]` of the head-major
// caches, converted to the caches' dtype (round to nearest even); slots < 0 are skipped.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1 && key.sizes() == value.sizes() &&
                  key.scalar_type() == value.scalar_type(),
              "key and value must be [tokens, kv_heads, head_dim] of one dtype, head_dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "the caches must be contiguous, of one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t tokens = key.size(0), kv_heads = key.size(1), head_dim = key.size(2);
  TORCH_CHECK(slot_mapping.size(0) == tokens, "one slot per token");
  TORCH_CHECK(k_cache.size(1) == kv_heads && k_cache.size(2) == head_dim, "key does not match the k_cache layout");
  TORCH_CHECK(v_cache.size(1) == kv_heads && v_cache.size(3) == head_dim, "value does not match the v_cache layout");
  const int64_t block_size = k_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] < capacity, "slot ", slots[t], " is past the cache");
  with_type(key.scalar_type(), "store_kv", [&](auto src_read, auto) {
    with_type(k_cache.scalar_type(), "store_kv", [&](auto, auto dst_write) {
      using S = decltype(src_read);
      using C = decltype(dst_write);
      const auto* k = static_cast<const S*>(key.data_ptr());
      const auto* v = static_cast<const S*>(value.data_ptr());
      auto* kc = static_cast<C*>(k_cache.data_ptr());
      auto* vc = static_cast<C*>(v_cache.data_ptr());
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t chunk = (block * kv_heads + h) * block_size * head_dim;
          const S* kr = k + t * key.stride(0) + h * key.stride(1);
          const S* vr = v + t * value.stride(0) + h * value.stride(1);
          for (int64_t d = 0; d < head_dim; ++d) {
            store_as(to_float(kr[d]), kc + chunk + d * block_size + offset);  // keys: [head_dim, block_size]
            store_as(to_float(vr[d]), vc + chunk + offset * head_dim + d);    // values: [block_size, head_dim]
          }
        }
      }
    });
  });
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("paged_attention", kvserve_cpu::paged_attention);
  m.impl("store_kv", kvserve_cpu::store_kv);
}
