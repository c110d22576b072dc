// The part of kvserve's quantized linear layers (q4_1_linear.cpp, q8_linear.cpp) that does not depend
// on the weight format: activations rounded to Q8 blocks once per call, the loops over blocks of
// eight output rows and chunks of activation rows, the op's threading, and a ragged last block.
//
// Both formats interleave eight output rows, so one 32-byte vector of codes holds eight rows' codes
// for a few inputs and meets one broadcast of the same activation codes: the lanes of a product are
// eight outputs, and no sum runs across lanes. A format is a struct with
//
//   template <int MR>
//   void tile(const Activations& x, int64_t block, int64_t row, float* out, int64_t out_stride) const
//
// which writes activation rows [row, row + MR) against the block's eight outputs, each output one
// float chain over the groups of its inputs in order (each group's integer sum exact). Tile sizes,
// chunks and threads only decide which chains run side by side, so a token's outputs do not depend
// on what it was batched with.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

#include "q8_activations.h"
#include "work_pool.h"

namespace kvserve_cpu {

constexpr int64_t kLanes = 8;          // output rows per interleaved block: one float32 vector of results
constexpr int64_t kUnitBytes = 32;     // a vector of codes
constexpr int64_t kChunkRows = 64;     // activation rows per pass over a thread's blocks (96 KB of codes at 1536 inputs)
constexpr int64_t kThreadBlocks = 16;  // blocks below which a thread of its own does not pay
constexpr int kTileRows = 4;           // activation rows per tile: each tile splits a block's codes once for all of them

// The integer core of both formats' vector tiles: acc + four u8 × s8 products per 32-bit lane.
// AVX2 takes vpmaddubsw (pairs into 16 bits), vpmaddwd (pairs of those into 32) and vpaddd; VNNI's
// vpdpbusd does it in one instruction, exactly and without saturation. A group's integer sum is exact
// either way (far below 2^31), so a VNNI build hands the float chain the integers the AVX2 and scalar
// builds do, and gives their bits. Chosen at compile time, as vec8.h picks AVX2: AVX-512 VNNI's 256-bit
// form (EVEX), or AVX-VNNI's (VEX) on CPUs without AVX-512. The 512-bit form (two partial sums per
// output, added at a group's end) measured slower on a Zen 4 EPYC, which splits 512-bit ops in two.
#ifdef KVSERVE_VEC8_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSERVE_VNNI 1
inline __m256i dot_add(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif defined(__AVXVNNI__)
#define KVSERVE_VNNI 1
inline __m256i dot_add(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#else
inline __m256i dot_add(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
#endif
#endif

// The activations' Q8 blocks, as the tiles read them.
struct Activations {
  const int8_t* codes;  // [m, k]
  const float* scales;  // [m, k / 32]
  const float* sums;    // [m, k / 32]
  int64_t k, groups;
};

// Activation rows [row, row + rows) against block b.
template <typename Format>
inline void block_rows(const Format& f, const Activations& x, int64_t b, int64_t row, int64_t rows, float* out,
                       int64_t out_stride) {
  for (; rows >= kTileRows; rows -= kTileRows, row += kTileRows, out += kTileRows * out_stride)
    f.template tile<kTileRows>(x, b, row, out, out_stride);
  switch (rows) {
    case 3: f.template tile<3>(x, b, row, out, out_stride); break;
    case 2: f.template tile<2>(x, b, row, out, out_stride); break;
    case 1: f.template tile<1>(x, b, row, out, out_stride); break;
    default: break;
  }
}

// `x` [m, k] (float32 or bfloat16) times the format's `blocks` blocks of eight rows: float32 [m, n],
// n real outputs (the last block's others are padding, computed and dropped).
template <typename Format>
at::Tensor interleaved_linear(const char* op, const at::Tensor& x, const Format& f, int64_t blocks, int64_t k,
                              int64_t n) {
  TORCH_CHECK(x.device().is_cpu(), op, " runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [rows, in] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " columns, the codes ", k);
  TORCH_CHECK(n > (blocks - 1) * kLanes && n <= blocks * kLanes, op, ": ", n, " outputs do not fill ", blocks,
              " blocks of eight rows");
  const int64_t m = x.size(0);
  const Q8Rows q8 = quantize_rows(x);
  const Activations a{q8.codes.data_ptr<int8_t>(), q8.scales.data_ptr<float>(), q8.sums.data_ptr<float>(), k,
                      k / kActGroup};
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* op_out = out.data_ptr<float>();
  const int64_t whole = n / kLanes;  // blocks whose eight outputs are all real
  parallel_for(0, blocks, kThreadBlocks, [&](int64_t first, int64_t last) {
    for (int64_t chunk = 0; chunk < m; chunk += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, m - chunk);
      for (int64_t b = first; b < std::min(last, whole); ++b)
        block_rows(f, a, b, chunk, rows, op_out + chunk * n + b * kLanes, n);
      if (last > whole) {  // the padded last block: through a buffer, its real lanes copied out
        float tail[kChunkRows * kLanes];
        block_rows(f, a, whole, chunk, rows, tail, kLanes);
        for (int64_t r = 0; r < rows; ++r)
          std::copy_n(tail + r * kLanes, n - whole * kLanes, op_out + (chunk + r) * n + whole * kLanes);
      }
    }
  });
  return out;
}

}  // namespace kvserve_cpu
