// The part of kvserve's quantized linear layers (q8_linear.cpp, q4_1_linear.cpp) that does not
// depend on the weight format: tiles of float32 multiply-adds, the loop over blocks of output rows,
// and the op's threading. A format supplies how its codes become float32 weights.
//
// Every output is one chain, whatever the batch: a vector accumulator over the input in chunks of
// eight, in order, then its lanes reduced (i, i + 4), (i, i + 2), (0, 1). Tile shapes, the row
// count and the threads only decide which chains run side by side, so a token's logits do not
// depend on what it was batched with.
//
// A format is a struct with
//   void dequantize(int64_t row, int64_t rows, float* w) const   // rows [row, row + rows) into w [rows][k]
//   template <typename T>
//   void dot8(int64_t row, const T* x, float* out) const          // rows [row, row + 8) for one activation
//                                                                  // row, decoded in registers: the tiles' bits
//   const void* row_start(int64_t row) const;  int64_t row_bytes;  // for prefetching
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "vec8.h"

namespace kvserve_cpu {

constexpr int64_t kQuantGroup = 32;  // both formats scale runs of 32 inputs along a row
constexpr int64_t kDotRows = 8;      // output rows a format's dot8 decodes in registers
constexpr int64_t kBlockRows = 24;   // output rows decoded at a time (55 KB at 576 inputs: in L2)
constexpr int64_t kThreadRows = 512;  // output rows below which a thread of its own does not pay
constexpr int64_t kChunkRows = 96;   // activation rows per pass over a thread's blocks
// A tile's six activation rows are reread by every pair of the block, from L1 while they fit in
// 32 KB: whole up to 768 inputs (576: 14 KB), past that in equal slices of at most 512 (the down
// projection's 1536 inputs took 37 KB, and every tile read them from L2 at three-quarters speed).
constexpr int64_t kWholeInputs = 768;
constexpr int64_t kSliceInputs = 512;

// Inputs per slice of a tile: a multiple of eight, so each lane keeps its inputs.
inline int64_t slice_inputs(int64_t k) {
  if (k <= kWholeInputs) return k;
  const int64_t slices = (k + kSliceInputs - 1) / kSliceInputs;
  return ((k + slices - 1) / slices + 7) / 8 * 8;
}

// The decoded block's buffer, on a cache line: `new` gives 16 bytes' alignment, and with rows at
// multiples of 64 bytes from it half of the tiles' 32-byte weight loads split across two lines.
struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
inline float* aligned_floats(int64_t count) {
  return static_cast<float*>(std::aligned_alloc(64, (count * sizeof(float) + 63) / 64 * 64));
}

// A tile of NR output rows by MR activation rows from decoded weights w [NR][k], over inputs
// [begin, end): two weight vectors held, the activations streaming through one register, eight
// loads per twelve multiply-adds. Without `pin` GCC folded each activation load into both of its
// multiply-adds, fourteen loads, and the tile ran ~15% slower; at 4 x 3 it reloaded them for every
// multiply-add, sixteen. Every loop over NR or MR is unrolled whole: one left partly rolled keeps
// the accumulators in memory.
//
// A tile over a slice of the inputs starts from the accumulators `carry` holds unless it begins at
// input 0, and leaves them there unless it ends at k, where it writes the sums to `out`: each
// accumulator sees the same multiply-adds in the same order whatever the slicing.
template <int NR, int MR, typename T>
inline void tile(const float* w, int64_t k, const T* x, int64_t x_stride, float* out, int64_t out_stride,
                 int64_t begin, int64_t end, Vec8* carry) {
  Vec8 acc[NR][MR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) acc[r][t] = begin == 0 ? Vec8::zero() : carry[r * MR + t];
  for (int64_t i = begin; i < end; i += 8) {
    Vec8 ws[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) ws[r] = Vec8::load(w + r * k + i);
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      Vec8 xt = Vec8::load(x + t * x_stride + i);
      xt.pin();
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][t] = fma(ws[r], xt, acc[r][t]);
    }
  }
  if (end < k) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
      for (int t = 0; t < MR; ++t) carry[r * MR + t] = acc[r][t];
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) out[t * out_stride + r] = sum_lanes(acc[r][t]);
}

// Tiles of two output rows by up to six activation rows: the six activation vectors streamed
// against a pair are read again by the block's next pair, from L1 while they fit (see kSliceInputs).
template <typename T>
inline void tile_pair(int64_t rows, const float* w, int64_t k, const T* x, float* out, int64_t n, int64_t begin,
                      int64_t end, Vec8* carry) {
  switch (rows) {
    case 6: tile<2, 6>(w, k, x, k, out, n, begin, end, carry); break;
    case 5: tile<2, 5>(w, k, x, k, out, n, begin, end, carry); break;
    case 4: tile<2, 4>(w, k, x, k, out, n, begin, end, carry); break;
    case 3: tile<2, 3>(w, k, x, k, out, n, begin, end, carry); break;
    case 2: tile<2, 2>(w, k, x, k, out, n, begin, end, carry); break;
    default: tile<2, 1>(w, k, x, k, out, n, begin, end, carry); break;
  }
}

// Rows [row, row + rows) of the codes, towards L1, if the matrix has them: the hardware
// prefetcher alone left a cold call at float32's speed.
template <typename Format>
inline void prefetch(const Format& f, int64_t row, int64_t rows, int64_t n) {
  if (row + rows > n) return;
  const char* ahead = static_cast<const char*>(f.row_start(row));
  for (int64_t b = 0; b < rows * f.row_bytes; b += 64) __builtin_prefetch(ahead + b);
}

// Output blocks [first_block, last_block) for activation rows [0, m).
template <typename Format, typename T>
void linear_blocks(const Format& f, const T* x, int64_t m, int64_t n, int64_t k, float* out, int64_t first_block,
                   int64_t last_block) {
  // Only passes of three rows or more, and a matrix's last rows, decode into memory: at one or two
  // rows the buffer is neither allocated nor zeroed (147 KB at 1536 inputs, on every call).
  std::unique_ptr<float[], AlignedFree> w;
  for (int64_t chunk = 0; chunk < m; chunk += kChunkRows) {
    const int64_t rows_here = std::min(kChunkRows, m - chunk);
    const T* xc = x + chunk * k;
    float* oc = out + chunk * n;
    for (int64_t block = first_block; block < last_block; ++block) {
      int64_t row = block * kBlockRows;
      const int64_t block_end = std::min(row + kBlockRows, n);
      if (rows_here <= 2) {  // decoding in registers beats a pass through memory
        for (; row + kDotRows <= block_end; row += kDotRows) {
          prefetch(f, row + 2 * kDotRows, kDotRows, n);
          for (int64_t t = 0; t < rows_here; ++t) f.dot8(row, xc + t * k, oc + t * n + row);
        }
        if (row == block_end) continue;
      } else {
        prefetch(f, block_end, kBlockRows, n);
      }
      const int64_t rows = block_end - row;
      if (!w) w.reset(aligned_floats(kBlockRows * k));
      f.dequantize(row, rows, w.get());
      float* dst = oc + row;
      const int64_t pairs = rows / 2 * 2;
      const int64_t slice = slice_inputs(k);
      Vec8 carry[kBlockRows / 2][12];  // a pair's accumulators between slices
      for (int64_t t = 0; t < rows_here; t += 6) {  // six activation rows, against every pair, a slice at a time
        const int64_t tile_rows = std::min<int64_t>(6, rows_here - t);
        for (int64_t begin = 0; begin < k; begin += slice)
          for (int64_t r = 0; r < pairs; r += 2)
            tile_pair(tile_rows, w.get() + r * k, k, xc + t * k, dst + t * n + r, n, begin,
                      std::min(begin + slice, k), carry[r / 2]);
      }
      if (pairs < rows)  // the matrix's last odd row
        for (int64_t t = 0; t < rows_here; ++t)
          tile<1, 1>(w.get() + pairs * k, k, xc + t * k, k, dst + t * n + pairs, n, 0, k, nullptr);
    }
  }
}

// `x` [m, k] (float32 or bfloat16) times the format's [n, k] weights: float32 [m, n].
template <typename Format>
at::Tensor quant_linear(const char* op, const at::Tensor& x, const Format& f, int64_t n, int64_t k) {
  TORCH_CHECK(x.device().is_cpu(), op, " runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [rows, in] matrix");
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " columns, the codes ", k);
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  auto run = [&](auto element) {
    using T = decltype(element);
    const auto* xp = static_cast<const T*>(x.data_ptr());
    at::parallel_for(0, blocks, kThreadRows / kBlockRows, [&](int64_t first, int64_t last) {
      linear_blocks(f, xp, m, n, k, out.data_ptr<float>(), first, last);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(Bf16{}); break;
    default: TORCH_CHECK(false, op, ": x must be float32 or bfloat16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace kvserve_cpu
