// Decode scores over an int8 K cache in integer arithmetic: a query head quantized to int8 codes (one
// float scale a head, per decode step) against the cache's int8 key codes, kRowsAtOnce keys at a time.
//
// A key row's bytes are read kBytes at a time (one vector: 64 on AVX-512, 32 on AVX2) and met by the
// byte dot product of 4-byte groups (VNNI's vpdpbusd, unsigned x signed into 32-bit lanes; emulated in
// 16-bit multiply-adds without VNNI). The unsigned operand is the key codes with their sign bit flipped
// (k + 128), the signed one the query codes, so the sum is q . k + 128 sum(q), corrected once per score.
// One vector a key would leave each score spread over its lanes; instead kRowsAtOnce key vectors are
// half transposed (32- then 64-bit interleaves, within 128-bit lanes) into vectors whose 128-bit lane L
// holds 4 keys' 4-byte group 4L + c (c = 0..3), and each meets a query vector holding group 4L + c of
// that lane (QueryPatterns). The accumulators then hold, lane by lane, 4 keys' partial sums, and
// sum_lanes adds their 128-bit lanes into one vector of kRowsAtOnce scores in key order. Exact: every
// product and sum is an integer (|sum| < 2^31 for head_dim up to 2^16).
#pragma once

#include <cstdint>

#include "simd.h"

namespace pagedllm {
namespace int8_scores {

constexpr int kRowsAtOnce = VecF::kWidth;  // keys scored together: one float lane each
constexpr int kBytes = 4 * VecF::kWidth;   // bytes of a key row per step
constexpr int kGroups = kRowsAtOnce / 4;   // accumulators per query head: 4 keys each

#if defined(PAGEDLLM_AVX512)

using VecI = __m512i;
inline VecI zero() { return _mm512_setzero_si512(); }
// The first n bytes of p (n <= kBytes), zeros after.
inline VecI load_bytes(const int8_t* p, int n) {
  return n == kBytes ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << n) - 1, p);
}
inline VecI flip_sign_bits(VecI x) { return _mm512_xor_si512(x, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline VecI unpacklo32(VecI a, VecI b) { return _mm512_unpacklo_epi32(a, b); }
inline VecI unpackhi32(VecI a, VecI b) { return _mm512_unpackhi_epi32(a, b); }
inline VecI unpacklo64(VecI a, VecI b) { return _mm512_unpacklo_epi64(a, b); }
inline VecI unpackhi64(VecI a, VecI b) { return _mm512_unpackhi_epi64(a, b); }
// Dword c of each 128-bit lane, in all four of its dwords.
template <int C>
inline VecI spread_dword(VecI x) {
  return _mm512_shuffle_epi32(x, static_cast<_MM_PERM_ENUM>(C * 0x55));
}
inline VecI add(VecI a, VecI b) { return _mm512_add_epi32(a, b); }
inline VecI madd16(VecI a, VecI b) { return _mm512_madd_epi16(a, b); }
inline VecI even_bytes_unsigned(VecI u) { return _mm512_and_si512(u, _mm512_set1_epi16(0xff)); }
inline VecI odd_bytes_unsigned(VecI u) { return _mm512_srli_epi16(u, 8); }
inline VecI even_bytes_signed(VecI s) { return _mm512_srai_epi16(_mm512_slli_epi16(s, 8), 8); }
inline VecI odd_bytes_signed(VecI s) { return _mm512_srai_epi16(s, 8); }
#if defined(PAGEDLLM_VNNI)
inline VecI dot_vnni(VecI acc, VecI u, VecI s) { return _mm512_dpbusd_epi32(acc, u, s); }
#endif
// kGroups accumulators (lane L of accumulator g: keys 4g .. 4g + 3) -> one vector, lane 4g + i = key 4g + i.
inline VecI sum_lanes(const VecI* acc) {
  const VecI s01 = add(_mm512_shuffle_i32x4(acc[0], acc[1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_i32x4(acc[0], acc[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const VecI s23 = add(_mm512_shuffle_i32x4(acc[2], acc[3], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_i32x4(acc[2], acc[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return add(_mm512_shuffle_i32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_i32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline VecF to_float(VecI x) { return _mm512_cvtepi32_ps(x); }
inline VecI set1(int32_t x) { return _mm512_set1_epi32(x); }
inline VecI sub(VecI a, VecI b) { return _mm512_sub_epi32(a, b); }

#else  // AVX2

using VecI = __m256i;
inline VecI zero() { return _mm256_setzero_si256(); }
// The first n bytes of p (n <= kBytes and a multiple of 8: head_dim is), zeros after.
inline VecI load_bytes(const int8_t* p, int n) {
  if (n == kBytes) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i words = _mm256_cmpgt_epi64(_mm256_set1_epi64x(n / 8), _mm256_setr_epi64x(0, 1, 2, 3));
  return _mm256_maskload_epi64(reinterpret_cast<const long long*>(p), words);
}
inline VecI flip_sign_bits(VecI x) { return _mm256_xor_si256(x, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline VecI unpacklo32(VecI a, VecI b) { return _mm256_unpacklo_epi32(a, b); }
inline VecI unpackhi32(VecI a, VecI b) { return _mm256_unpackhi_epi32(a, b); }
inline VecI unpacklo64(VecI a, VecI b) { return _mm256_unpacklo_epi64(a, b); }
inline VecI unpackhi64(VecI a, VecI b) { return _mm256_unpackhi_epi64(a, b); }
template <int C>
inline VecI spread_dword(VecI x) {
  return _mm256_shuffle_epi32(x, C * 0x55);
}
inline VecI add(VecI a, VecI b) { return _mm256_add_epi32(a, b); }
inline VecI madd16(VecI a, VecI b) { return _mm256_madd_epi16(a, b); }
inline VecI even_bytes_unsigned(VecI u) { return _mm256_and_si256(u, _mm256_set1_epi16(0xff)); }
inline VecI odd_bytes_unsigned(VecI u) { return _mm256_srli_epi16(u, 8); }
inline VecI even_bytes_signed(VecI s) { return _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8); }
inline VecI odd_bytes_signed(VecI s) { return _mm256_srai_epi16(s, 8); }
#if defined(PAGEDLLM_VNNI)
inline VecI dot_vnni(VecI acc, VecI u, VecI s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
inline VecI sum_lanes(const VecI* acc) {
  return add(_mm256_permute2x128_si256(acc[0], acc[1], 0x20), _mm256_permute2x128_si256(acc[0], acc[1], 0x31));
}
inline VecF to_float(VecI x) { return _mm256_cvtepi32_ps(x); }
inline VecI set1(int32_t x) { return _mm256_set1_epi32(x); }
inline VecI sub(VecI a, VecI b) { return _mm256_sub_epi32(a, b); }

#endif

// acc + in each 32-bit lane the sum of its 4 byte products u_i s_i, u unsigned and s signed, exactly
// (without VNNI: even and odd bytes widened to 16 bits, so no pair sum saturates as pmaddubsw's would).
inline VecI dot(VecI acc, VecI u, VecI s) {
#if defined(PAGEDLLM_VNNI)
  return dot_vnni(acc, u, s);
#else
  return add(add(acc, madd16(even_bytes_unsigned(u), even_bytes_signed(s))),
             madd16(odd_bytes_unsigned(u), odd_bytes_signed(s)));
#endif
}

// One query head as int8 codes for dot(): per kBytes chunk of its head_dim, the 4 vectors of spread
// dwords (pattern c: lane L holds the chunk's 4-byte group 4L + c in each dword), codes past head_dim 0.
struct QueryPatterns {
  static constexpr int kPerChunk = 4;
  // The patterns of codes[0 .. chunks * kBytes) into out[chunk * kPerChunk + c].
  static void build(const int8_t* codes, int64_t chunks, VecI* out) {
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const VecI x = load_bytes(codes + ch * kBytes, kBytes);
      out[ch * kPerChunk + 0] = spread_dword<0>(x);
      out[ch * kPerChunk + 1] = spread_dword<1>(x);
      out[ch * kPerChunk + 2] = spread_dword<2>(x);
      out[ch * kPerChunk + 3] = spread_dword<3>(x);
    }
  }
};

// Integer dot products of H query heads' codes (patterns[h]: QueryPatterns of `chunks` chunks) with up
// to kRowsAtOnce key rows of d codes (k, rows k_stride apart; rows past `count` read as zeros): dots[h]
// lane t = (sum_i k_t[i] q_h[i]) + 128 sum_i q_h[i] (the caller subtracts the second term).
template <int H>
inline void dot_rows(VecI* dots, const VecI* const* patterns, const int8_t* k, int64_t k_stride, int count,
                     int64_t d) {
  VecI acc[H][kGroups];
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < kGroups; ++g) acc[h][g] = zero();
  const int64_t chunks = (d + kBytes - 1) / kBytes;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int n = static_cast<int>(std::min<int64_t>(kBytes, d - ch * kBytes));
    for (int g = 0; g < kGroups; ++g) {
      VecI u[4];
      for (int i = 0; i < 4; ++i) {
        const int r = 4 * g + i;
        u[i] = flip_sign_bits(r < count ? load_bytes(k + r * k_stride + ch * kBytes, n) : zero());
      }
      const VecI t0 = unpacklo32(u[0], u[1]), t1 = unpackhi32(u[0], u[1]);
      const VecI t2 = unpacklo32(u[2], u[3]), t3 = unpackhi32(u[2], u[3]);
      const VecI v[4] = {unpacklo64(t0, t2), unpackhi64(t0, t2), unpacklo64(t1, t3), unpackhi64(t1, t3)};
      for (int h = 0; h < H; ++h) {
        const VecI* p = patterns[h] + ch * QueryPatterns::kPerChunk;
        for (int c = 0; c < 4; ++c) acc[h][g] = dot(acc[h][g], v[c], p[c]);
      }
    }
  }
  for (int h = 0; h < H; ++h) dots[h] = sum_lanes(acc[h]);
}

}  // namespace int8_scores
}  // namespace pagedllm
