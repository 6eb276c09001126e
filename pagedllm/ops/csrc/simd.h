// One SIMD vector of floats, the width chosen at compile time: 16 lanes with -DPAGEDLLM_AVX512, else 8
// (AVX2 + FMA). The same kernel source is built once per instruction set and Python loads the build
// the CPU can run, so every kernel below is written once against this small interface.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedllm {

// fp8 e4m3 codes (one per 16-bit lane, zero-extended) as the bits of half-precision floats 2^-8 times
// their values: s.eeee.mmm becomes s.0eeee.mmm0000000, which with the half's bias of 15 instead of 7 is
// the same number over 2^8, subnormals included, so a conversion to float and a multiply by 2^8 give the
// value exactly (no CPU here converts fp8 itself). The NaN codes 0x7f / 0xff read as +-480, but are never
// written: a row holding a NaN is stored as codes 0 with a NaN scale.
#if defined(PAGEDLLM_AVX512)
inline __m256i e4m3_as_half_bits(__m256i b) {
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
}
#endif
inline __m128i e4m3_as_half_bits(__m128i b) {
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                      _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
}

// Rows r[0 .. 8) of an 8 x 8 tile of 32-bit values become its columns, in registers (both builds: the K
// types' AVX2 tile runs on AVX-512 CPUs too, linear.cpp byte_tile).
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // r[i + j]: lane l holds column 4l + j of rows i .. i + 3
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
    t[4 + j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}
inline void transpose8(__m256i (&v)[8]) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_castsi256_ps(v[i]);
  transpose8(r);
  for (int i = 0; i < 8; ++i) v[i] = _mm256_castps_si256(r[i]);
}

#if defined(PAGEDLLM_AVX512)

struct VecF {
  static constexpr int kWidth = 16;
  __m512 v;
  VecF() = default;
  VecF(__m512 x) : v(x) {}
  static VecF zero() { return _mm512_setzero_ps(); }
  static VecF set1(float x) { return _mm512_set1_ps(x); }
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static VecF load(const float* p) { return _mm512_loadu_ps(p); }
  static VecF load(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static VecF load(const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static VecF load(const c10::BFloat16* p, int n) {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static VecF load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static VecF load(const c10::Half* p, int n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p)); }
  // The 32-bit integer lanes as floats.
  static VecF from_int(__m512i x) { return _mm512_cvtepi32_ps(x); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(float* p, int n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  // Each lane rounded to nearest even as c10::BFloat16 does (NaN stays NaN), the bf16 in its low 16 bits.
  static __m512i bf16_bits(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, lsb), _mm512_set1_epi32(0x7fff)), 16);
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  }
  static __m256i to_bf16(__m512 x) { return _mm512_cvtepi32_epi16(bf16_bits(x)); }
  // The lanes rounded to bf16 and widened back, in registers.
  static VecF round_bf16(VecF x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x.v), 16)); }
  void store(c10::BFloat16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
  void store(c10::BFloat16* p, int n) const { _mm256_mask_storeu_epi16(p, mask(n), to_bf16(v)); }
  // Each lane rounded to nearest even, as c10::Half (and torch's .half()) rounds.
  static __m256i to_f16(__m512 x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  void store(c10::Half* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(v)); }
  void store(c10::Half* p, int n) const { _mm256_mask_storeu_epi16(p, mask(n), to_f16(v)); }
  // kWidth int8 values as floats.
  static VecF load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static VecF load(const int8_t* p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask(n), p)));
  }
  // kWidth fp8 e4m3 values as floats, exactly (see e4m3_as_half_bits).
  static VecF from_e4m3(__m128i bytes) {
    return _mm512_mul_ps(_mm512_cvtph_ps(e4m3_as_half_bits(_mm256_cvtepu8_epi16(bytes))), _mm512_set1_ps(256.f));
  }
  static VecF load(const c10::Float8_e4m3fn* p) {
    return from_e4m3(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static VecF load(const c10::Float8_e4m3fn* p, int n) { return from_e4m3(_mm_maskz_loadu_epi8(mask(n), p)); }
  // kWidth bytes: their low nibbles and their high nibbles, as floats.
  static void load_nibbles(const uint8_t* p, VecF& low, VecF& high) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
};

inline VecF operator+(VecF a, VecF b) { return _mm512_add_ps(a.v, b.v); }
inline VecF operator-(VecF a, VecF b) { return _mm512_sub_ps(a.v, b.v); }
inline VecF operator*(VecF a, VecF b) { return _mm512_mul_ps(a.v, b.v); }
inline VecF operator/(VecF a, VecF b) { return _mm512_div_ps(a.v, b.v); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }  // a * b + c
inline VecF max(VecF a, VecF b) { return _mm512_max_ps(a.v, b.v); }
inline VecF min(VecF a, VecF b) { return _mm512_min_ps(a.v, b.v); }
inline float reduce_add(VecF a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(VecF a) { return _mm512_reduce_max_ps(a.v); }
inline int first_lane_equal(VecF a, float x) {  // -1 if none
  const unsigned m = _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(x), _CMP_EQ_OQ);
  return m ? __builtin_ctz(m) : -1;
}
inline VecF round_nearest(VecF a) { return _mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF scale_by_pow2(VecF a, VecF n) { return _mm512_scalef_ps(a.v, n.v); }  // a * 2^n, n integral
inline VecF reciprocal_estimate(VecF a) { return _mm512_rcp14_ps(a.v); }  // relative error < 2^-14
// x where begin <= t < end, lane by lane; else fill.
inline VecF select_in_range(VecF x, VecF t, VecF begin, VecF end, VecF fill) {
  const __mmask16 in = _mm512_cmp_ps_mask(t.v, begin.v, _CMP_GE_OQ) & _mm512_cmp_ps_mask(t.v, end.v, _CMP_LT_OQ);
  return _mm512_mask_mov_ps(fill.v, in, x.v);
}

// A 4-bit code's 16 possible values, scale * q + min for q = 0..15, one a lane: a table for lookup_nibbles.
inline VecF nibble_table(VecF scale, VecF min) {
  return fmadd(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), scale, min);
}
// 16 bytes: their low nibbles' and their high nibbles' values in `table` (vpermps reads an index's low 4
// bits): two instructions a vector in place of a conversion and a multiply-add.
inline void lookup_nibbles(const uint8_t* p, VecF table, VecF& low, VecF& high) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = _mm512_permutexvar_ps(bytes, table.v);
  high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table.v);
}

// The 16 x 16 32-bit lanes of r transposed in registers: r[k] then holds lane k of each old r[i], in i's
// order. Interleaves within 128-bit lanes, then moves whole lanes.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + j]: lane l holds column 4l + j of rows i .. i + 3
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44), d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(a, c, 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The kWidth x kWidth floats at src (rows ld_src apart) transposed into dst (rows ld_dst apart): dst row
// k holds column k of src.
inline void transpose_tile(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld_src);
  transpose16(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ld_dst, r[i]);
}

#else  // AVX2 + FMA

struct VecF {
  static constexpr int kWidth = 8;
  __m256 v;
  VecF() = default;
  VecF(__m256 x) : v(x) {}
  static VecF zero() { return _mm256_setzero_ps(); }
  static VecF set1(float x) { return _mm256_set1_ps(x); }
  static __m256i mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static VecF load(const float* p) { return _mm256_loadu_ps(p); }
  static VecF load(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static VecF widen(__m128i raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)); }
  static VecF load(const c10::BFloat16* p) { return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static VecF load(const c10::BFloat16* p, int n) {
    alignas(16) uint16_t tmp[8] = {0};
    std::memcpy(tmp, p, n * sizeof(uint16_t));
    return widen(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
  }
  static VecF load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static VecF load(const c10::Half* p, int n) {
    alignas(16) uint16_t tmp[8] = {0};
    std::memcpy(tmp, p, n * sizeof(uint16_t));
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
  }
  // The 32-bit integer lanes as floats.
  static VecF from_int(__m256i x) { return _mm256_cvtepi32_ps(x); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(float* p, int n) const { _mm256_maskstore_ps(p, mask(n), v); }
  // Each lane rounded to nearest even as c10::BFloat16 does (NaN stays NaN), the bf16 in its low 16 bits.
  static __m256i bf16_bits(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, lsb), _mm256_set1_epi32(0x7fff)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  }
  static __m128i to_bf16(__m256 x) {
    const __m256i rounded = bf16_bits(x);
    // Pack the eight 32-bit lanes (each < 2^16) into eight 16-bit values, in order.
    const __m256i packed = _mm256_packus_epi32(rounded, rounded);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xd8));
  }
  // The lanes rounded to bf16 and widened back, in registers.
  static VecF round_bf16(VecF x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x.v), 16)); }
  void store(c10::BFloat16* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
  void store(c10::BFloat16* p, int n) const {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), to_bf16(v));
    std::memcpy(p, tmp, n * sizeof(uint16_t));
  }
  // Each lane rounded to nearest even, as c10::Half (and torch's .half()) rounds.
  static __m128i to_f16(__m256 x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  void store(c10::Half* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(v)); }
  void store(c10::Half* p, int n) const {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), to_f16(v));
    std::memcpy(p, tmp, n * sizeof(uint16_t));
  }
  // kWidth int8 values as floats.
  static VecF load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static VecF load(const int8_t* p, int n) {
    alignas(8) int8_t tmp[8] = {0};
    std::memcpy(tmp, p, n);
    return load(tmp);
  }
  // kWidth fp8 e4m3 values as floats, exactly (see e4m3_as_half_bits).
  static VecF from_e4m3(__m128i bytes) {
    return _mm256_mul_ps(_mm256_cvtph_ps(e4m3_as_half_bits(_mm_cvtepu8_epi16(bytes))), _mm256_set1_ps(256.f));
  }
  static VecF load(const c10::Float8_e4m3fn* p) {
    return from_e4m3(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static VecF load(const c10::Float8_e4m3fn* p, int n) {
    alignas(8) uint8_t tmp[8] = {0};
    std::memcpy(tmp, p, n);
    return from_e4m3(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tmp)));
  }
  // kWidth bytes: their low nibbles and their high nibbles, as floats.
  static void load_nibbles(const uint8_t* p, VecF& low, VecF& high) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
    high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  }
};

inline VecF operator+(VecF a, VecF b) { return _mm256_add_ps(a.v, b.v); }
inline VecF operator-(VecF a, VecF b) { return _mm256_sub_ps(a.v, b.v); }
inline VecF operator*(VecF a, VecF b) { return _mm256_mul_ps(a.v, b.v); }
inline VecF operator/(VecF a, VecF b) { return _mm256_div_ps(a.v, b.v); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }  // a * b + c
inline VecF max(VecF a, VecF b) { return _mm256_max_ps(a.v, b.v); }
inline VecF min(VecF a, VecF b) { return _mm256_min_ps(a.v, b.v); }
inline float reduce_add(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(VecF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline int first_lane_equal(VecF a, float x) {  // -1 if none
  const int m = _mm256_movemask_ps(_mm256_cmp_ps(a.v, _mm256_set1_ps(x), _CMP_EQ_OQ));
  return m ? __builtin_ctz(m) : -1;
}
inline VecF round_nearest(VecF a) { return _mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF reciprocal_estimate(VecF a) { return _mm256_rcp_ps(a.v); }  // relative error < 1.5 * 2^-12
inline VecF select_in_range(VecF x, VecF t, VecF begin, VecF end, VecF fill) {
  const __m256 in = _mm256_and_ps(_mm256_cmp_ps(t.v, begin.v, _CMP_GE_OQ), _mm256_cmp_ps(t.v, end.v, _CMP_LT_OQ));
  return _mm256_blendv_ps(fill.v, x.v, in);
}
inline VecF scale_by_pow2(VecF a, VecF n) {  // a * 2^n, n integral in [-126, 127]
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return _mm256_mul_ps(a.v, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

inline void transpose_tile(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld_src);
  transpose8(r);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * ld_dst, r[i]);
}
#endif

// 16-bit integer dot products over "units" of kBlocks blocks of 32 columns: a weight unit's codes widened
// to 16 bits as two vectors, the first 16 columns of each block, then the last 16 (the order 4-bit codes
// unpack in), and x's unit as 16-bit values in the same order. dot(w, x) has a 32-bit lane per float lane,
// each the sum of four products (multiply-add of 16-bit pairs, twice), lane l belonging to block l / 8.
#if defined(PAGEDLLM_AVX512)
constexpr int kUnitBlocks = 2;
struct WideCodes {
  __m512i first, second;
};
// Blocks' 4-bit codes, 16 bytes a block (column i in byte i's low nibble, column i + 16 in its high).
inline WideCodes widen_nibbles(const uint8_t* p, int blocks) {
  const __m256i raw = blocks == kUnitBlocks ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                            : _mm256_maskz_loadu_epi8(0xffff, p);
  const __m512i words = _mm512_cvtepu8_epi16(raw);
  return {_mm512_and_si512(words, _mm512_set1_epi16(15)), _mm512_srli_epi16(words, 4)};
}
// Blocks' int8 codes, 32 bytes a block.
inline WideCodes widen_int8(const int8_t* p, int blocks) {
  auto half = [&](int offset) {
    const __m256i one = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + offset)));
    return blocks == kUnitBlocks
               ? _mm256_inserti128_si256(one, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + offset)), 1)
               : one;
  };
  return {_mm512_cvtepi8_epi16(half(0)), _mm512_cvtepi8_epi16(half(16))};
}
inline __m512i dot(const WideCodes& w, const int16_t* x) {
  return _mm512_add_epi32(_mm512_madd_epi16(w.first, _mm512_loadu_si512(x)),
                          _mm512_madd_epi16(w.second, _mm512_loadu_si512(x + 32)));
}
// The lanes rounded to the nearest integer (ties to even), saturated to int16, stored as kWidth values.
inline void store_int16(VecF v, int16_t* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v.v)));
}
// Lane l of the result: per_block[unit * kUnitBlocks + l / 8] (a float for each block of a chunk of kWidth).
inline VecF unit_lanes(VecF per_block, int unit) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(unit * 2),
                                         _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  return _mm512_permutexvar_ps(index, per_block.v);
}
#else
constexpr int kUnitBlocks = 1;
struct WideCodes {
  __m256i first, second;
};
inline WideCodes widen_nibbles(const uint8_t* p, int) {
  const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_and_si256(words, _mm256_set1_epi16(15)), _mm256_srli_epi16(words, 4)};
}
inline WideCodes widen_int8(const int8_t* p, int) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline __m256i dot(const WideCodes& w, const int16_t* x) {
  return _mm256_add_epi32(_mm256_madd_epi16(w.first, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                          _mm256_madd_epi16(w.second, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
}
inline void store_int16(VecF v, int16_t* p) {
  const __m256i ints = _mm256_cvtps_epi32(v.v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1)));
}
inline VecF unit_lanes(VecF per_block, int unit) {
  return _mm256_permutevar8x32_ps(per_block.v, _mm256_set1_epi32(unit));
}
#endif

// The horizontal sums of four vectors, in lanes 0..3.
#if defined(PAGEDLLM_AVX512)
inline __m128 reduce_add4(VecF a, VecF b, VecF c, VecF d) {
  auto half = [](__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  };
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(half(a.v), half(b.v)), _mm256_hadd_ps(half(c.v), half(d.v)));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#else
inline __m128 reduce_add4(VecF a, VecF b, VecF c, VecF d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a.v, b.v), _mm256_hadd_ps(c.v, d.v));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

// exp(x) to ~1 ulp for x in [-87, 88] (clamped there): 2^n * exp(r), |r| <= ln2 / 2, Taylor to r^7.
inline VecF exp(VecF x) {
  x = min(max(x, VecF::set1(-87.f)), VecF::set1(88.f));
  const VecF n = round_nearest(x * VecF::set1(1.44269504f));
  VecF r = fmadd(n, VecF::set1(-0.693145752f), x);
  r = fmadd(n, VecF::set1(-1.42860677e-6f), r);
  VecF p = VecF::set1(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fmadd(p, r, VecF::set1(c));
  return scale_by_pow2(p, n);
}

// 1 / a without a division (whose throughput is a fraction of a multiply's): the estimate refined by
// two Newton steps, each r * (2 - a r), to within an ulp or two of the quotient.
inline VecF reciprocal(VecF a) {
  VecF r = reciprocal_estimate(a);
  r = r * (VecF::set1(2.f) - a * r);
  return r * (VecF::set1(2.f) - a * r);
}

// Calls fn(std::integral_constant<int, N>) with N = min(n, Max) for n >= 1: a row count the micro-kernels
// take at compile time.
template <int Max, typename F>
inline void with_count(int64_t n, const F& fn) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, fn);
  }
  fn(std::integral_constant<int, Max>{});
}

// Calls fn(i, n) for each SIMD chunk [i, i + n) of [0, d): full vectors, then one partial tail.
template <typename F>
inline void for_each_chunk(int64_t d, const F& fn) {
  int64_t i = 0;
  for (; i + VecF::kWidth <= d; i += VecF::kWidth) fn(i, static_cast<int>(VecF::kWidth));
  if (i < d) fn(i, static_cast<int>(d - i));
}

template <typename T>
inline VecF load(const T* p, int n) {
  return n == VecF::kWidth ? VecF::load(p) : VecF::load(p, n);
}

template <typename T>
inline void store(VecF v, T* p, int n) {
  if (n == VecF::kWidth) {
    v.store(p);
  } else {
    v.store(p, n);
  }
}

}  // namespace pagedllm
