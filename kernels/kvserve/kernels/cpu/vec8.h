// Eight fp32 lanes with explicit operations: AVX2 + FMA where the compiler targets it, plain
// scalar code elsewhere. Every operation is one IEEE-rounded step per lane (fused multiply-add
// included), so both versions produce the same bits, and no result depends on how many lanes a
// loop happened to fill. The kernels build every reduction from these operations in a fixed order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVSERVE_VEC8_AVX2 1
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace kvserve_cpu {

struct Bf16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half v) { return static_cast<float>(v); }

// fp32 to an element type, rounding to nearest even.
inline void store_as(float v, float* dst) { *dst = v; }
inline void store_as(float v, c10::BFloat16* dst) { *dst = c10::BFloat16(v); }
inline void store_as(float v, c10::Half* dst) { *dst = c10::Half(v); }

#ifdef KVSERVE_VEC8_AVX2

struct Vec8 {
  __m256 v;
  static Vec8 zero() { return {_mm256_setzero_ps()}; }
  static Vec8 broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static Vec8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec8 load(const Bf16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  static Vec8 load(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // A mask of the lanes whose index, counted from `first`, is below `n`.
  static Vec8 iota_below(int64_t first, int64_t n) {
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), lane))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  // Lanes that hold integers in -128..127, as eight int8s.
  void store_int8(int8_t* p) const {
    const __m256i wide = _mm256_cvtps_epi32(v);
    const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(halves, halves));
  }
  // Rounded to nearest even, NaN to the quiet NaN 0x7fc0: c10::BFloat16's conversion, eight at a time.
  void store(c10::BFloat16* p) const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7fc0), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  void store(c10::Half* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  float first() const { return _mm256_cvtss_f32(v); }
};

inline Vec8 operator+(Vec8 a, Vec8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec8 operator-(Vec8 a, Vec8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec8 operator*(Vec8 a, Vec8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec8 fma(Vec8 a, Vec8 b, Vec8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec8 max(Vec8 a, Vec8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec8 abs(Vec8 a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
inline Vec8 min(Vec8 a, Vec8 b) { return {_mm256_min_ps(a.v, b.v)}; }
inline Vec8 operator/(Vec8 a, Vec8 b) { return {_mm256_div_ps(a.v, b.v)}; }
// mask lanes (all bits set) take `a`, the others `b`.
inline Vec8 select(Vec8 mask, Vec8 a, Vec8 b) { return {_mm256_blendv_ps(b.v, a.v, mask.v)}; }
inline Vec8 round_to_int(Vec8 a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral n in [-126, 127].
inline Vec8 exp2_int(Vec8 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
// Fixed pairing: lanes (i, i + 4), then (i, i + 2), then (0, 1).
inline float sum_lanes(Vec8 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float max_lanes(Vec8 a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

#else  // scalar lanes, the same operations one lane at a time

struct Vec8 {
  float x[8];
  static Vec8 zero() { return broadcast(0.0f); }
  static Vec8 broadcast(float v) {
    Vec8 r;
    for (float& lane : r.x) lane = v;
    return r;
  }
  template <typename T>
  static Vec8 load(const T* p) {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.x[i] = to_float(p[i]);
    return r;
  }
  static Vec8 iota_below(int64_t first, int64_t n) {
    Vec8 r;
    for (int i = 0; i < 8; ++i) {
      const uint32_t bits = first + i < n ? 0xffffffffu : 0u;
      std::memcpy(&r.x[i], &bits, sizeof(float));
    }
    return r;
  }
  void store(float* p) const { std::memcpy(p, x, sizeof x); }
  void store_int8(int8_t* p) const {
    for (int i = 0; i < 8; ++i) p[i] = static_cast<int8_t>(x[i]);
  }
  template <typename T>
  void store(T* p) const {
    for (int i = 0; i < 8; ++i) store_as(x[i], p + i);
  }
  float first() const { return x[0]; }
};

#define KVSERVE_LANEWISE(expr)   \
  Vec8 r;                        \
  for (int i = 0; i < 8; ++i) {  \
    r.x[i] = (expr);             \
  }                              \
  return r

inline Vec8 operator+(Vec8 a, Vec8 b) { KVSERVE_LANEWISE(a.x[i] + b.x[i]); }
inline Vec8 operator-(Vec8 a, Vec8 b) { KVSERVE_LANEWISE(a.x[i] - b.x[i]); }
inline Vec8 operator*(Vec8 a, Vec8 b) { KVSERVE_LANEWISE(a.x[i] * b.x[i]); }
inline Vec8 fma(Vec8 a, Vec8 b, Vec8 c) { KVSERVE_LANEWISE(std::fma(a.x[i], b.x[i], c.x[i])); }
// _mm256_max_ps / _mm256_min_ps semantics: the second operand when either is NaN or both are zeros.
inline Vec8 max(Vec8 a, Vec8 b) { KVSERVE_LANEWISE(a.x[i] > b.x[i] ? a.x[i] : b.x[i]); }
inline Vec8 min(Vec8 a, Vec8 b) { KVSERVE_LANEWISE(a.x[i] < b.x[i] ? a.x[i] : b.x[i]); }
inline Vec8 abs(Vec8 a) { KVSERVE_LANEWISE(std::fabs(a.x[i])); }
inline Vec8 operator/(Vec8 a, Vec8 b) { KVSERVE_LANEWISE(a.x[i] / b.x[i]); }
inline Vec8 select(Vec8 mask, Vec8 a, Vec8 b) {
  Vec8 r;
  for (int i = 0; i < 8; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &mask.x[i], sizeof bits);
    r.x[i] = (bits >> 31) ? a.x[i] : b.x[i];
  }
  return r;
}
inline Vec8 round_to_int(Vec8 a) { KVSERVE_LANEWISE(std::nearbyint(a.x[i])); }
inline Vec8 exp2_int(Vec8 n) {
  Vec8 r;
  for (int i = 0; i < 8; ++i) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.x[i]) + 127) << 23;
    std::memcpy(&r.x[i], &bits, sizeof(float));
  }
  return r;
}
#undef KVSERVE_LANEWISE

inline float sum_lanes(Vec8 a) {
  float x[4];
  for (int i = 0; i < 4; ++i) x[i] = a.x[i] + a.x[i + 4];
  x[0] = x[0] + x[2];
  x[1] = x[1] + x[3];
  return x[0] + x[1];
}
inline float max_lanes(Vec8 a) {
  float x[4];
  for (int i = 0; i < 4; ++i) x[i] = a.x[i] > a.x[i + 4] ? a.x[i] : a.x[i + 4];
  x[0] = x[0] > x[2] ? x[0] : x[2];
  x[1] = x[1] > x[3] ? x[1] : x[3];
  return x[0] > x[1] ? x[0] : x[1];
}

#endif

// exp(x), Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n. About one ulp;
// x is clamped to [-87, 88] (below: under 2^-125, no weight in a softmax; above: near the largest
// float, no overflow). exp(0) is exactly 1.
inline Vec8 exp(Vec8 x) {
  x = min(max(x, Vec8::broadcast(-87.0f)), Vec8::broadcast(88.0f));
  const Vec8 n = round_to_int(x * Vec8::broadcast(1.44269504088896341f));
  Vec8 r = fma(n, Vec8::broadcast(-0.693359375f), x);
  r = fma(n, Vec8::broadcast(2.12194440e-4f), r);
  Vec8 p = Vec8::broadcast(1.9875691500e-4f);
  p = fma(p, r, Vec8::broadcast(1.3981999507e-3f));
  p = fma(p, r, Vec8::broadcast(8.3334519073e-3f));
  p = fma(p, r, Vec8::broadcast(4.1665795894e-2f));
  p = fma(p, r, Vec8::broadcast(1.6666665459e-1f));
  p = fma(p, r, Vec8::broadcast(5.0000001201e-1f));
  p = fma(p * r, r, r) + Vec8::broadcast(1.0f);
  return p * exp2_int(n);
}

}  // namespace kvserve_cpu
