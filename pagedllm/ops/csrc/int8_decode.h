// Decode attention over an int8 KV cache in integer arithmetic, as primitives for attention.cpp's
// decode_row_int8: scores of int16 query codes against the key codes, and sums of the value codes weighted
// by int16 weight codes, kRowsAtOnce keys (a tile) at a time.
//
// Scores. A query head's int16 codes c are split as c = 256 h + l, h and l int8 (QueryCodes), and each
// half meets the keys by the byte dot product of 4-byte groups (VNNI's vpdpbusd, unsigned x signed into
// 32-bit lanes; emulated in 16-bit multiply-adds without VNNI): the unsigned operand is the key codes with
// their sign bit flipped (k + 128), the signed one the query half, so each sum is q . k + 128 sum(q),
// corrected once a score. One vector a key would leave each score spread over its lanes; instead a tile's
// key rows are half transposed once (transpose_keys: 32- then 64-bit interleaves, within 128-bit lanes)
// into vectors whose 128-bit lane L holds 4 keys' 4-byte group 4L + c (c = 0..3), each met by a query
// vector holding group 4L + c of that lane (QueryPatterns). The accumulators then hold, lane by lane, 4
// keys' partial sums, and sum_lanes adds their 128-bit lanes into one vector of kRowsAtOnce scores in key
// order.
//
// Values. Two keys' value rows are widened to 16 bits and interleaved 16 bits at a time, so that each
// 32-bit lane holds one channel of both, and meet the two keys' int16 weights (one 32-bit word, broadcast)
// in 16-bit multiply-adds (vpdpwssd; vpmaddwd and an add without VNNI) into 32-bit lanes, one channel a
// lane. The interleave permutes a chunk's channels (value_lane); attention.cpp keeps its float sums in
// that order and puts them back at the end. Every product and sum is an exact integer (|sum| < 2^31 for
// head_dim up to 2^14 and a tile's keys).
#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace pagedllm {
namespace int8_decode {

constexpr int kRowsAtOnce = VecF::kWidth;    // keys of a tile: one float lane each
constexpr int kBytes = 4 * VecF::kWidth;     // bytes of a key row per step of the scores
constexpr int kGroups = kRowsAtOnce / 4;     // score accumulators per query half: 4 keys each
constexpr int kChannels = 2 * VecF::kWidth;  // value channels per step of the sums (16-bit lanes of a vector)

#if defined(PAGEDLLM_AVX512)

using VecI = __m512i;
inline VecI zero() { return _mm512_setzero_si512(); }
// The first n bytes of p (n <= kBytes), zeros after.
inline VecI load_bytes(const int8_t* p, int n) {
  return n == kBytes ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << n) - 1, p);
}
// The first n codes of p (n <= kChannels) widened to 16 bits, zeros after.
inline VecI load_widened(const int8_t* p, int n) {
  const __m256i raw = n == kChannels ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                     : _mm256_maskz_loadu_epi8((1u << n) - 1, p);
  return _mm512_cvtepi8_epi16(raw);
}
inline VecI flip_sign_bits(VecI x) { return _mm512_xor_si512(x, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline VecI unpacklo16(VecI a, VecI b) { return _mm512_unpacklo_epi16(a, b); }
inline VecI unpackhi16(VecI a, VecI b) { return _mm512_unpackhi_epi16(a, b); }
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
inline VecI dot_bytes_vnni(VecI acc, VecI u, VecI s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline VecI dot_words_vnni(VecI acc, VecI a, VecI b) { return _mm512_dpwssd_epi32(acc, a, b); }
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
// The first n codes of p (n <= kChannels and a multiple of 8) widened to 16 bits, zeros after.
inline VecI load_widened(const int8_t* p, int n) {
  const __m128i raw = n == kChannels ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                     : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi8_epi16(raw);
}
inline VecI flip_sign_bits(VecI x) { return _mm256_xor_si256(x, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline VecI unpacklo16(VecI a, VecI b) { return _mm256_unpacklo_epi16(a, b); }
inline VecI unpackhi16(VecI a, VecI b) { return _mm256_unpackhi_epi16(a, b); }
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
inline VecI dot_bytes_vnni(VecI acc, VecI u, VecI s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline VecI dot_words_vnni(VecI acc, VecI a, VecI b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
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
inline VecI dot_bytes(VecI acc, VecI u, VecI s) {
#if defined(PAGEDLLM_VNNI)
  return dot_bytes_vnni(acc, u, s);
#else
  return add(add(acc, madd16(even_bytes_unsigned(u), even_bytes_signed(s))),
             madd16(odd_bytes_unsigned(u), odd_bytes_signed(s)));
#endif
}

// acc + in each 32-bit lane the sum of its 2 products of signed 16-bit values, exactly.
inline VecI dot_words(VecI acc, VecI a, VecI b) {
#if defined(PAGEDLLM_VNNI)
  return dot_words_vnni(acc, a, b);
#else
  return add(acc, madd16(a, b));
#endif
}

// One int8 query half for dot_bytes: per kBytes chunk of its head_dim, the 4 vectors of spread dwords
// (pattern c: lane L holds the chunk's 4-byte group 4L + c in each dword), codes past head_dim 0.
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

// Up to kRowsAtOnce key rows of d codes (k, rows k_stride apart; rows past `count` read as zeros), sign
// bits flipped and half transposed: kt[(chunk * kGroups + g) * 4 + c] holds, in 128-bit lane L, keys
// 4g .. 4g + 3's 4-byte group 4L + c of the chunk.
inline void transpose_keys(VecI* kt, const int8_t* k, int64_t k_stride, int count, int64_t d) {
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
      VecI* out = kt + (ch * kGroups + g) * 4;
      out[0] = unpacklo64(t0, t2);
      out[1] = unpackhi64(t0, t2);
      out[2] = unpacklo64(t1, t3);
      out[3] = unpackhi64(t1, t3);
    }
  }
}

// The transposed keys kt (transpose_keys, `chunks` chunks) against one query head's two halves (their
// QueryPatterns): lane t of high / low = k_t . half + 128 sum(half) (the caller subtracts the second term).
inline void dot_halves(const VecI* kt, const VecI* high_patterns, const VecI* low_patterns, int64_t chunks,
                       VecI& high, VecI& low) {
  VecI acc_high[kGroups], acc_low[kGroups];
  for (int g = 0; g < kGroups; ++g) acc_high[g] = acc_low[g] = zero();
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const VecI* ph = high_patterns + ch * QueryPatterns::kPerChunk;
    const VecI* pl = low_patterns + ch * QueryPatterns::kPerChunk;
    for (int g = 0; g < kGroups; ++g)
      for (int c = 0; c < 4; ++c) {
        const VecI keys = kt[(ch * kGroups + g) * 4 + c];
        acc_high[g] = dot_bytes(acc_high[g], keys, ph[c]);
        acc_low[g] = dot_bytes(acc_low[g], keys, pl[c]);
      }
  }
  high = sum_lanes(acc_high);
  low = sum_lanes(acc_low);
}

// Where channel i of a kChannels chunk ends up among the 2 vectors (2 x VecF::kWidth lanes) of
// accumulate_values' sums: the 16-bit interleave takes 4 channels of each 128-bit lane (8 channels) into
// the first vector's lane and the other 4 into the second's.
inline int value_lane(int i) { return (i % 8) / 4 * VecF::kWidth + i / 8 * 4 + i % 4; }

// sums[h][0..1] = sum_t w_h[t] v_t[c0 .. c0 + n) for H query heads, the count value rows v_t of a tile (v,
// v_stride apart) and n <= kChannels channels from c0, in value_lane order; weights[h] holds head h's
// int16 weights of the tile's keys, two a 32-bit word (keys 2j and 2j + 1 in word j).
template <int H>
inline void accumulate_values(VecI (*sums)[2], const int16_t* const* weights, const int8_t* v, int64_t v_stride,
                              int count, int64_t c0, int n) {
  VecI acc[H][2];
  for (int h = 0; h < H; ++h) acc[h][0] = acc[h][1] = zero();
  for (int t = 0; t < count; t += 2) {
    const VecI a = load_widened(v + t * v_stride + c0, n);
    const VecI b = t + 1 < count ? load_widened(v + (t + 1) * v_stride + c0, n) : zero();
    const VecI first = unpacklo16(a, b), second = unpackhi16(a, b);
    for (int h = 0; h < H; ++h) {
      int32_t pair;
      std::memcpy(&pair, weights[h] + t, sizeof(pair));
      const VecI w = set1(pair);
      acc[h][0] = dot_words(acc[h][0], first, w);
      acc[h][1] = dot_words(acc[h][1], second, w);
    }
  }
  for (int h = 0; h < H; ++h) {
    sums[h][0] = acc[h][0];
    sums[h][1] = acc[h][1];
  }
}

}  // namespace int8_decode
}  // namespace pagedllm
