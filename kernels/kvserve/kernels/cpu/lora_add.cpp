// A fused product's LoRA deltas for every adapter of a step in one call, added in place:
// registered as torch.ops.kvserve_cpu.lora_add.
//
//   for every row t under slot s = row_slots[t] >= 0 (-1: the base model, left as it is):
//     h[j]   = x[t] · a[s, j]                          (the slot's rows j of a, float32)
//     for each projection p of the fused product with rows in the slot (ranks[s, p] > 0):
//       out[t, c] = out[t, c] + scaling[s] · Σ_{j of p} h[j] · B_p[j, c]   for c in p's columns
//
// `a` [slots, widest, in] stacks each slot's A matrices, the product's projections in turn (q, k, v
// of qkv; gate, up of gate_up), ranks[s, p] rows each; rows past them are never read. `b` [slots,
// floats] packs each slot's B matrices transposed, projection by projection: B_p is a row-major
// [ranks[s, p], columns[p + 1] - columns[p]] block right after the earlier projections' blocks. So a
// projection's rows meet only its own columns of `out`, no zero block of a fused block-diagonal
// matrix is stored or read, and each slot's weights are two contiguous runs, read front to back. The
// columns of a projection the slot has no rows for are left as they are, as PEFT leaves them.
//
// Why: the torch path gathered a step's rows, ran two small bmm calls per adapter, scaled and
// scattered them back: about ten ops and ~35 µs of overhead per product, 120 products a step on the
// default model, which cost a decode step 1.3x at batch 1 and 1.6x at 32 (docs/benchmarks.md). Here a
// product is one call, and each slot's weights are read once, in order, for all of its rows: at
// batch 32 over eight rank-16 adapters a step reads ~160 MB of float32 LoRA weights, mostly from
// DRAM (the base model's weights pass through the caches in between), which is what it costs.
//
// Batch invariance: every h[j] is one fixed sum over x's inputs: vector v of them (inputs 8v .. 8v + 7,
// the last zero-padded) is multiplied-and-added into accumulator v % 2, lane by lane in index order;
// the two accumulators are added and their lanes summed in vec8.h's fixed pairing. Every output is one
// chain of fused multiply-adds over its projection's j in order, starting from zero, then times the
// scaling, plus out. Nothing else: which rows share a tile, a chunk or a thread only decides which
// chains run side by side, so a row's bits depend on its own x, its slot's weights and its scaling,
// never on the other rows, adapters or threads (tests/kernels/test_lora_add.py).
//
// Rounding: the delta stays float32 and is added to float32(out), one rounding to out's dtype, as
// PEFT does (`result + lora_B(lora_A(x)) * scaling` promoted to float32, then `.to(result.dtype)`).
// (The torch path before this kernel rounded the delta to bfloat16 first: two roundings.)

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec8.h"
#include "work_pool.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kChunkRows = 64;   // rows of one slot per work item
constexpr int64_t kShrinkBlock = 8;  // columns of h (rows of a) per work item of the first product
constexpr int64_t kOutBlock = 256;   // outputs per work item of the second product: at batch 1 a 576-column
                                     // product is three items for the threads, not one (with 1024, a batch-1
                                     // step with one adapter cost 1.41x, now 1.33x; at 32 over eight 1.28x, 1.20x)
constexpr int64_t kTileRows = 4;     // rows per tile: each weight vector loaded once for all of them
constexpr int kChains = 2;           // accumulators per dot product (h[j]): two FMA chains in flight at one row

inline Vec8 load_row(const float* p) { return Vec8::load(p); }
inline Vec8 load_row(const c10::BFloat16* p) { return Vec8::load(reinterpret_cast<const Bf16*>(p)); }
inline Vec8 load_row(const c10::Half* p) { return Vec8::load(p); }
inline float scalar_of(float v) { return v; }
inline float scalar_of(c10::BFloat16 v) { return static_cast<float>(v); }
inline float scalar_of(c10::Half v) { return static_cast<float>(v); }

// A hint to bring the line at `p` towards the core. The LoRA weights come from DRAM (the base model's
// pass through the caches between two products) in short runs, one per slot and projection, which the
// hardware prefetchers start cold and the arithmetic does not overlap by itself: each work item's tiles
// prefetch the next item's weights, line for line with their own (on the Zen 4 VM, the kernel's time in
// a batch-32 step over eight adapters, the caches flushed between products: 21 -> 15 ms).
inline void prefetch_ahead(const float* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 1);  // towards L2 (prefetcht2): an item's weights fit there, not in L1
#else
  (void)p;
#endif
}

// The weights a work item reads: `rows` runs of `columns` floats, `stride` apart (none: data == nullptr).
struct Region {
  const float* data = nullptr;
  int64_t stride = 0, rows = 0, columns = 0;

  // Prefetch the line at (row, column) if the region has it.
  void prefetch(int64_t row, int64_t column) const {
    if (data != nullptr && row < rows && column < columns) prefetch_ahead(data + row * stride + column);
  }
};

// h[r] = x_r · a for MR rows of float32 x (zero-padded to whole vectors) and one row of `a`: vector v of
// the inputs (i = 8v .. 8v + 7, the last one zero-padded) goes to accumulator v % kChains, each lane
// one chain in index order; the accumulators are then added in order and their lanes summed by
// sum_lanes. One row of `a` at a time: a slot's rows are read as one sequential stream.
template <int MR>
void shrink_tile(const float* x, int64_t x_stride, const float* a, int64_t in, float* h, int64_t h_stride,
                 const Region& ahead, int64_t ahead_row) {
  Vec8 acc[MR][kChains];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int k = 0; k < kChains; ++k) acc[r][k] = Vec8::zero();
  const int64_t whole = in / 8 * 8;
  int64_t i = 0;
  for (; i + 8 * kChains <= whole; i += 8 * kChains) {
    ahead.prefetch(ahead_row, i);
#pragma GCC unroll 8
    for (int k = 0; k < kChains; ++k) {
      const Vec8 av = Vec8::load(a + i + 8 * k);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][k] = fma(Vec8::load(x + r * x_stride + i + 8 * k), av, acc[r][k]);
    }
  }
  for (int k = 0; i < in; i += 8, ++k) {  // the vectors left, the very last zero-padded
    float padded[8] = {};
    std::copy(a + i, a + std::min(in, i + 8), padded);
    const Vec8 av = Vec8::load(padded);
    for (int r = 0; r < MR; ++r) acc[r][k] = fma(Vec8::load(x + r * x_stride + i), av, acc[r][k]);
  }
  for (int r = 0; r < MR; ++r) {
    Vec8 total = acc[r][0];
    for (int k = 1; k < kChains; ++k) total = total + acc[r][k];
    h[r * h_stride] = sum_lanes(total);
  }
}

// sums[r][o] = Σ_j h[r][j] · b[j][o] for MR rows and `n` outputs (`b` at the first of them), over j in
// order from zero: each output one chain of fused multiply-adds. b's rows are read JB at a time, each
// a sequential run, while the sums wait in `sums` (MR rows of `sums_stride`, in L1): an output's chain
// is the same operations as if it stayed in a register.
template <int MR, int JB>
void expand_tile(const float* h, int64_t h_stride, int64_t width, const float* b, int64_t b_stride, int64_t n,
                 float* sums, int64_t sums_stride, const Region& ahead) {
  const int64_t whole = n / 8 * 8;
  for (int r = 0; r < MR; ++r) std::fill_n(sums + r * sums_stride, (n + 7) / 8 * 8, 0.0f);
  auto rows_of_b = [&](int64_t j, auto block) {
    constexpr int kRows = decltype(block)::value;
    Vec8 hv[MR][kRows];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int q = 0; q < kRows; ++q) hv[r][q] = Vec8::broadcast(h[r * h_stride + j + q]);
    for (int64_t o = 0; o < whole; o += 8) {
      Vec8 bv[kRows];
#pragma GCC unroll 8
      for (int q = 0; q < kRows; ++q) {
        if ((o & 15) == 0) ahead.prefetch(j + q, o);
        bv[q] = Vec8::load(b + (j + q) * b_stride + o);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        Vec8 acc = Vec8::load(sums + r * sums_stride + o);
#pragma GCC unroll 8
        for (int q = 0; q < kRows; ++q) acc = fma(hv[r][q], bv[q], acc);
        acc.store(sums + r * sums_stride + o);
      }
    }
    if (whole < n) {  // the last few outputs, zero-padded
      for (int q = 0; q < kRows; ++q) {
        float padded[8] = {};
        std::copy(b + (j + q) * b_stride + whole, b + (j + q) * b_stride + n, padded);
        const Vec8 bv = Vec8::load(padded);
        for (int r = 0; r < MR; ++r)
          fma(hv[r][q], bv, Vec8::load(sums + r * sums_stride + whole)).store(sums + r * sums_stride + whole);
      }
    }
  };
  int64_t j = 0;
  for (; j + JB <= width; j += JB) rows_of_b(j, std::integral_constant<int, JB>{});
  for (; j < width; ++j) rows_of_b(j, std::integral_constant<int, 1>{});
}

// out[r][o] = out + scale · sums[r][o], each rounded once to out's dtype.
template <typename O>
void add_scaled(const float* sums, float scale, int64_t n, O* out) {
  const Vec8 sv = Vec8::broadcast(scale);
  int64_t o = 0;
  for (; o + 8 <= n; o += 8) (load_row(out + o) + Vec8::load(sums + o) * sv).store(out + o);
  if (o < n) {
    float padded[8] = {}, result[8];
    for (int64_t k = 0; o + k < n; ++k) padded[k] = scalar_of(out[o + k]);
    (Vec8::load(padded) + Vec8::load(sums + o) * sv).store(result);
    for (int64_t k = 0; o + k < n; ++k) store_as(result[k], out + o + k);
  }
}

// A step's rows grouped by slot: rows[start[s] .. start[s + 1]) are slot s's, in index order. Rows
// left as they are (slot -1, or a slot with no rows for this product) are in no group.
struct Groups {
  std::vector<int64_t> rows, start;
};

template <typename I>
Groups group_rows(const I* slots, int64_t count, const std::vector<int64_t>& widths) {
  const int64_t num_slots = static_cast<int64_t>(widths.size());
  Groups g;
  g.start.assign(num_slots + 1, 0);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t s = slots[t];
    TORCH_CHECK(s >= -1 && s < num_slots, "lora_add: row ", t, " names slot ", s, ", not -1 or one of the ",
                num_slots, " slots");
    if (s >= 0 && widths[s] > 0) ++g.start[s + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) g.start[s + 1] += g.start[s];
  g.rows.resize(g.start[num_slots]);
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t s = slots[t];
    if (s >= 0 && widths[s] > 0) g.rows[next[s]++] = t;
  }
  return g;
}

// Each slot's projections: projection p of slot s is rows [first[s][p], + count[s][p]) of a and h, the
// block of b at offset[s][p] (floats into the slot's row of b), and out's columns [columns[p], columns[p + 1]).
struct Projections {
  std::vector<int64_t> columns;                            // P + 1 boundaries
  std::vector<std::vector<int64_t>> first, count, offset;  // [S][P]
  std::vector<int64_t> width;                              // [S]: the rows of all its projections
};

// A work item: slot s's grouped rows [first_row, last_row) and columns [first, last) of h or of out;
// for the second product, also the rows [j_first, j_last) of h that sum into them and where their
// projection's block of b starts (`b_offset`), its first column and its width.
struct Item {
  int64_t slot, first_row, last_row, first, last;
  int64_t j_first = 0, j_last = 0, b_offset = 0, column = 0, columns = 0;
};

// The first product's items: each slot's rows in chunks, h's columns in blocks of eight.
std::vector<Item> shrink_items(const Groups& g, const Projections& proj) {
  std::vector<Item> list;
  for (int64_t s = 0; s < static_cast<int64_t>(proj.width.size()); ++s)
    for (int64_t row = g.start[s]; row < g.start[s + 1]; row += kChunkRows)
      for (int64_t c = 0; c < proj.width[s]; c += kShrinkBlock) {
        const int64_t last_row = std::min(row + kChunkRows, g.start[s + 1]);
        list.push_back({s, row, last_row, c, std::min(c + kShrinkBlock, proj.width[s])});
      }
  return list;
}

// The second product's items: each slot's rows in chunks, each projection it has rows for, its columns
// in blocks of kOutBlock. Columns of a projection the slot has no rows for are left as they are.
std::vector<Item> expand_items(const Groups& g, const Projections& proj) {
  std::vector<Item> list;
  const int64_t num_projections = static_cast<int64_t>(proj.columns.size()) - 1;
  for (int64_t s = 0; s < static_cast<int64_t>(proj.width.size()); ++s)
    for (int64_t row = g.start[s]; row < g.start[s + 1]; row += kChunkRows)
      for (int64_t p = 0; p < num_projections; ++p) {
        if (proj.count[s][p] == 0) continue;
        const int64_t column = proj.columns[p], columns = proj.columns[p + 1] - column;
        for (int64_t c = column; c < column + columns; c += kOutBlock) {
          Item it{s, row, std::min(row + kChunkRows, g.start[s + 1]), c, std::min(c + kOutBlock, column + columns)};
          it.j_first = proj.first[s][p];
          it.j_last = it.j_first + proj.count[s][p];
          it.b_offset = proj.offset[s][p];
          it.column = column;
          it.columns = columns;
          list.push_back(it);
        }
      }
  return list;
}

template <typename X, typename O>
void lora_add_rows(const at::Tensor& x, const Groups& g, const at::Tensor& a, const at::Tensor& b,
                   const Projections& proj, const float* scaling, at::Tensor& out) {
  const int64_t in = a.size(2), widest = a.size(1), b_stride = b.size(1);
  const int64_t rows = static_cast<int64_t>(g.rows.size()), x_stride = (in + 7) / 8 * 8;
  const float* a_data = a.data_ptr<float>();
  const float* b_data = b.data_ptr<float>();

  // The grouped rows of x in float32 (exact), zero-padded to whole vectors: read by every tile.
  std::vector<float> xf(rows * x_stride);
  const X* x_data = static_cast<const X*>(x.data_ptr());
  for (int64_t p = 0; p < rows; ++p) {
    const X* src = x_data + g.rows[p] * x.stride(0);
    float* dst = xf.data() + p * x_stride;
    int64_t i = 0;
    for (; i + 8 <= in; i += 8) load_row(src + i).store(dst + i);
    for (; i < in; ++i) dst[i] = scalar_of(src[i]);
    std::fill(dst + in, dst + x_stride, 0.0f);
  }

  // Both products' items, and the weights each reads, in order: an item prefetches the next one's.
  const std::vector<Item> shrink = shrink_items(g, proj), expand = expand_items(g, proj);
  std::vector<Region> regions;
  regions.reserve(shrink.size() + expand.size() + 1);
  for (const Item& it : shrink)
    regions.push_back({a_data + (it.slot * widest + it.first) * in, in, it.last - it.first, in});
  for (const Item& it : expand)
    regions.push_back({b_data + it.slot * b_stride + it.b_offset + (it.first - it.column), it.columns,
                       it.j_last - it.j_first, it.last - it.first});
  regions.emplace_back();  // past the last item: nothing

  // The first product, h = x · aᵀ: items of eight columns of h, a row of a at a time for up to four rows.
  std::vector<float> h(rows * widest);  // grouped row p's h at h[p · widest ..]
  parallel_for(0, static_cast<int64_t>(shrink.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Item& it = shrink[k];
      const float* a_slot = a_data + it.slot * widest * in;
      for (int64_t p = it.first_row; p < it.last_row;) {
        const int64_t n = std::min(kTileRows, it.last_row - p);
        const float* xp = xf.data() + p * x_stride;
        float* hp = h.data() + p * widest;
        const Region ahead = p == it.first_row ? regions[k + 1] : Region{};  // the first tile brings it
        for (int64_t j = it.first; j < it.last; ++j) {
          const float* a_row = a_slot + j * in;
          const int64_t row = j - it.first;
          switch (n) {
            case 4: shrink_tile<4>(xp, x_stride, a_row, in, hp + j, widest, ahead, row); break;
            case 3: shrink_tile<3>(xp, x_stride, a_row, in, hp + j, widest, ahead, row); break;
            case 2: shrink_tile<2>(xp, x_stride, a_row, in, hp + j, widest, ahead, row); break;
            default: shrink_tile<1>(xp, x_stride, a_row, in, hp + j, widest, ahead, row); break;
          }
        }
        p += n;
      }
    }
  });

  // The second product, out += scaling · h · B_p, a projection's rows against its columns: items of up
  // to kOutBlock outputs, tiles of up to four rows.
  O* out_data = static_cast<O*>(out.data_ptr());
  parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> sums(kTileRows * kOutBlock);
    for (int64_t k = first; k < last; ++k) {
      const Item& it = expand[k];
      const float* b_block = b_data + it.slot * b_stride + it.b_offset + (it.first - it.column);
      const int64_t width = it.j_last - it.j_first, n = it.last - it.first;
      for (int64_t p = it.first_row; p < it.last_row;) {
        const int64_t tile = std::min(kTileRows, it.last_row - p);
        const float* hp = h.data() + p * widest + it.j_first;
        const Region ahead = p == it.first_row ? regions[shrink.size() + k + 1] : Region{};
        float* sum = sums.data();
        switch (tile) {
          case 4: expand_tile<4, 2>(hp, widest, width, b_block, it.columns, n, sum, kOutBlock, ahead); break;
          case 3: expand_tile<3, 2>(hp, widest, width, b_block, it.columns, n, sum, kOutBlock, ahead); break;
          case 2: expand_tile<2, 4>(hp, widest, width, b_block, it.columns, n, sum, kOutBlock, ahead); break;
          default: expand_tile<1, 4>(hp, widest, width, b_block, it.columns, n, sum, kOutBlock, ahead); break;
        }
        for (int64_t r = 0; r < tile; ++r)
          add_scaled(sums.data() + r * kOutBlock, scaling[it.slot], n,
                     out_data + g.rows[p + r] * out.stride(0) + it.first);
        p += tile;
      }
    }
  });
}

bool is_activation(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

// Each slot's projections from `ranks` [S, P] (none: one projection of the stacked width) and out's
// column boundaries (`columns`; empty: one block of every column), checked against a and b.
Projections projections(const std::optional<at::Tensor>& ranks, at::IntArrayRef columns, int64_t num_slots,
                        int64_t widest, int64_t out_features, int64_t b_floats) {
  Projections proj;
  const int64_t num_projections = ranks ? ranks->size(1) : 1;
  if (columns.empty()) {
    TORCH_CHECK(num_projections == 1, "lora_add: ", num_projections, " projections need their column boundaries");
    proj.columns = {0, out_features};
  } else {
    proj.columns.assign(columns.begin(), columns.end());
  }
  TORCH_CHECK(static_cast<int64_t>(proj.columns.size()) == num_projections + 1 && proj.columns.front() == 0 &&
                  proj.columns.back() == out_features && std::is_sorted(proj.columns.begin(), proj.columns.end()),
              "lora_add: columns must be ", num_projections + 1, " increasing boundaries from 0 to out's ",
              out_features, " columns, got ", columns);
  std::vector<int64_t> counts(num_slots * num_projections, widest);
  if (ranks) {  // read in place: a copy to int64 would be an op of its own in every call
    const at::Tensor r = ranks->contiguous();
    if (r.scalar_type() == at::kInt)
      std::copy_n(r.data_ptr<int32_t>(), counts.size(), counts.begin());
    else
      std::copy_n(r.data_ptr<int64_t>(), counts.size(), counts.begin());
  }
  proj.first.assign(num_slots, std::vector<int64_t>(num_projections));
  proj.count = proj.offset = proj.first;
  proj.width.assign(num_slots, 0);
  for (int64_t s = 0; s < num_slots; ++s) {
    int64_t floats = 0;
    for (int64_t p = 0; p < num_projections; ++p) {
      const int64_t count = counts[s * num_projections + p];
      TORCH_CHECK(count >= 0, "lora_add: slot ", s, " has ", count, " rows for projection ", p);
      proj.first[s][p] = proj.width[s];
      proj.count[s][p] = count;
      proj.offset[s][p] = floats;
      proj.width[s] += count;
      floats += count * (proj.columns[p + 1] - proj.columns[p]);
    }
    TORCH_CHECK(proj.width[s] <= widest, "lora_add: slot ", s, "'s projections take ", proj.width[s],
                " rows of a, more than the ", widest, " stacked");
    TORCH_CHECK(floats <= b_floats, "lora_add: slot ", s, "'s blocks of b take ", floats, " floats, more than the ",
                b_floats, " of its row of b");
  }
  return proj;
}

void lora_add(const at::Tensor& x, const at::Tensor& row_slots, const at::Tensor& a, const at::Tensor& b,
              const std::optional<at::Tensor>& ranks, at::IntArrayRef columns, const at::Tensor& scaling,
              at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && row_slots.device().is_cpu() && a.device().is_cpu() &&
                  b.device().is_cpu() && scaling.device().is_cpu() && (!ranks || ranks->device().is_cpu()),
              "lora_add runs on the CPU: every tensor must be there");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "lora_add: x [rows, in] and out [rows, out] must have contiguous rows");
  TORCH_CHECK(is_activation(x.scalar_type()) && is_activation(out.scalar_type()),
              "lora_add: x and out must be float32, bfloat16 or float16, got ", x.scalar_type(), " and ",
              out.scalar_type());
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() &&
                  b.is_contiguous() && a.dim() == 3 && b.dim() == 2,
              "lora_add: a [slots, widest, in] and b [slots, floats] must be contiguous float32");
  const int64_t num_slots = a.size(0), widest = a.size(1);
  TORCH_CHECK(b.size(0) == num_slots, "lora_add: a has ", num_slots, " slots but b ", b.size(0));
  TORCH_CHECK(a.size(2) == x.size(1), "lora_add: x has ", x.size(1), " columns but a's rows ", a.size(2), " inputs");
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.is_contiguous() && row_slots.numel() == x.size(0) &&
                  x.size(0) == out.size(0) &&
                  (row_slots.scalar_type() == at::kInt || row_slots.scalar_type() == at::kLong),
              "lora_add: row_slots must be a contiguous int32 or int64 vector, one per row of x and out");
  TORCH_CHECK(scaling.scalar_type() == at::kFloat && scaling.is_contiguous() && scaling.numel() == num_slots,
              "lora_add: scaling must be a contiguous float32 vector, one per slot");
  TORCH_CHECK(!ranks || (ranks->dim() == 2 && ranks->size(0) == num_slots &&
                         (ranks->scalar_type() == at::kInt || ranks->scalar_type() == at::kLong)),
              "lora_add: ranks must be an int32 or int64 [slots, projections] matrix");
  const Projections proj = projections(ranks, columns, num_slots, widest, out.size(1), b.size(1));
  const Groups g = row_slots.scalar_type() == at::kInt
                       ? group_rows(row_slots.data_ptr<int32_t>(), row_slots.numel(), proj.width)
                       : group_rows(row_slots.data_ptr<int64_t>(), row_slots.numel(), proj.width);
  if (g.rows.empty()) return;
  const float* scale = scaling.data_ptr<float>();
  // The activations' dtypes as element types (bfloat16 read through Bf16).
  auto with_out = [&](auto x_type) {
    using X = decltype(x_type);
    switch (out.scalar_type()) {
      case at::kFloat: lora_add_rows<X, float>(x, g, a, b, proj, scale, out); break;
      case at::kBFloat16: lora_add_rows<X, c10::BFloat16>(x, g, a, b, proj, scale, out); break;
      default: lora_add_rows<X, c10::Half>(x, g, a, b, proj, scale, out); break;
    }
  };
  switch (x.scalar_type()) {
    case at::kFloat: with_out(float{}); break;
    case at::kBFloat16: with_out(c10::BFloat16{}); break;
    default: with_out(c10::Half{}); break;
  }
}

}  // namespace
}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def(
      "lora_add(Tensor x, Tensor row_slots, Tensor a, Tensor b, Tensor? ranks, int[] columns, Tensor scaling, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("lora_add", kvserve_cpu::lora_add); }
