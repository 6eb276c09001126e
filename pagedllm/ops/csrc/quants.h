// GGUF's quantized blocks as the file stores them, read in registers: each block type's codes for one
// SIMD vector of bytes, and its scales, with nothing repacked (the weight in memory is the file's bytes).
//
// Every type is read as unsigned codes u with a float scale s and offset c for each group of 16 values,
// W = s * u + c (exact in float32: s * u is, and the sum's one rounding is the reference's), except Q8_0,
// whose codes are signed (W = s * q):
//
//   type  block  bytes  u                                  s           c
//   Q4_0  32     18     4 bits                             d           -8 d
//   Q4_1  32     20     4 bits                             d           m
//   Q5_0  32     22     4 bits + a high bit                d           -16 d
//   Q5_1  32     24     4 bits + a high bit                d           m
//   Q8_0  32     34     int8 q (signed)                    d           0
//   Q4_K  256    144    4 bits, 8 sub-blocks of 32         d * sc_j    -dmin * m_j   (6-bit sc_j, m_j)
//   Q5_K  256    176    4 bits + a high bit                d * sc_j    -dmin * m_j
//   Q6_K  256    210    4 bits + 2 high bits, 16 of 16     d * sc_g    -32 d * sc_g  (int8 sc_g)
//
// A row is read in chunks of 256 values (a K super-block, or eight 32-blocks; a row's last chunk of
// 32-blocks may hold fewer), each chunk in units of one vector of byte codes (64 on AVX-512, 32 on AVX2)
// in the values' order (Q4_K and Q6_K also in their own order for the integer sub-scales, below). A unit
// meets activations as int16 values (ActivationBlocks in linear.cpp, at unit_position's places) in
// multiply-adds of 16-bit pairs (VNNI's vpdpwssd, else pmaddwd). AVX-512: the codes widened by byte
// interleaving (unpacklo / unpackhi within each 128-bit lane of 16 values; the activations are stored in
// that order), both halves summed into one vector whose 128-bit lane k holds the unit's group k. AVX2: x
// in order; a 32-value block's codes become words whole (code_words: Q4_0 / Q4_1 nibbles and Q8_0 bytes
// widened from memory by vpmovzxbw / vpmovsxbw, Q5_0 / Q5_1 bytes built in word order and unpacked), and
// dot (Q5_K's units) widens a unit's bytes in order and pairs the halves' products by vphaddd: 32-bit
// lanes 0, 1, 4, 5 hold group 0, lanes 2, 3, 6, 7 group 1 (unit_scales).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace pagedllm {
namespace quants {

constexpr int kChunkValues = 256;
constexpr int kGroupValues = 16;
constexpr int kGroups = kChunkValues / kGroupValues;
constexpr int kGroupVectors = kGroups / VecF::kWidth;  // vectors of one float per group of a chunk

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
inline uint32_t bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return bits;
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 32 codes as int16 words, values 0-15 and 16-31 (both builds: 256-bit vectors).
struct Words {
  __m256i low, high;
};
// acc + the sums of a's and b's 16-bit pairs' products, an int32 lane each (vpdpwssd, else vpmaddwd).
inline __m256i add_pairs(__m256i acc, __m256i a, __m256i b) {
#if defined(PAGEDLLM_VNNI) && defined(PAGEDLLM_AVX512)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(PAGEDLLM_VNNI)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

#if defined(PAGEDLLM_AVX512)

using VecB = __m512i;
constexpr int kUnitValues = 64;
using VecI = __m512i;

inline __m512i mask_bytes(VecB v, int value) { return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(value))); }
// 32 bytes at p -> 64 codes: their low nibbles, then their high nibbles (the bytes broadcast to both
// halves by the load, each half shifted by its own count: no shuffle).
inline VecB split_nibbles(const uint8_t* p) {
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return mask_bytes(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load32(p)), shifts), 15);
}
// Two 32-value blocks of nibbles (16 bytes each: value i in byte i's low nibble, i + 16 in its high) ->
// their 64 codes in order: a, a >> 4, b, b >> 4 in the four 128-bit lanes.
inline VecB two_nibble_blocks(const uint8_t* a, const uint8_t* b) {
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(load16(a))),
                                          _mm256_broadcastsi128_si256(load16(b)), 1);
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0,
                                           0x0004000400040004, 0x0004000400040004);
  return mask_bytes(_mm512_srlv_epi16(both, shifts), 15);
}
// `value` in each byte whose bit is set in `bits` (bit i for byte i), else 0.
inline VecB bit_bytes(uint64_t bits, int value) {
  return _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(static_cast<char>(value)));
}

// Where value i of a unit sits in its activations' int16 codes: each 128-bit lane's first 8 values, then
// each one's last 8 (unpacklo / unpackhi's order).
constexpr int unit_position(int i) { return i % 16 / 8 * (kUnitValues / 2) + i / 16 * 8 + i % 8; }
// Lanes of sum w_i x_i over 4 values each: a unit's codes (signed or not) against its activations
// (int16, at unit_position's places).
template <bool kSigned>
inline VecI dot(VecB codes, const int16_t* x) {
  const __m512i high = kSigned ? _mm512_movm_epi8(_mm512_movepi8_mask(codes)) : _mm512_setzero_si512();
  const __m512i first = _mm512_unpacklo_epi8(codes, high), second = _mm512_unpackhi_epi8(codes, high);
  const __m512i xa = _mm512_loadu_si512(x), xb = _mm512_loadu_si512(x + 32);
#if defined(PAGEDLLM_VNNI)
  return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), first, xa), second, xb);
#else
  return _mm512_add_epi32(_mm512_madd_epi16(first, xa), _mm512_madd_epi16(second, xb));
#endif
}
// 16 bytes (signed or not) as kGroupVectors vectors of floats.
template <bool kSigned>
inline void bytes_as_floats(__m128i b, VecF* out) {
  out[0] = _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}
// The group scales of unit u's lanes (lane l: group 4u + l / 4).
inline VecF unit_scales(const VecF* groups, int u) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(4 * u),
                                         _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2));
  return _mm512_permutexvar_ps(index, groups[0].v);
}
// The 32-bit words at the start of each of a chunk's first `blocks` 32-value blocks (kBytes apart), zero
// past them: one gather, where a scalar loop's stores stalled the vector load that followed them.
template <int kBytes>
inline __m256i block_words(const uint8_t* p, int blocks) {
  const __m256i index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(kBytes));
  return _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), static_cast<__mmask8>((1u << blocks) - 1), index,
                                      p, 1);
}
// Each 32-bit word's low (shift 0) or high (16) float16 half as a float.
inline __m256 half_floats(__m256i words, int shift) {
  return _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(words, shift)));
}
// The words' low (shift 0) or high (16) float16 halves as floats, once per group.
inline void word_halves(__m256i words, int shift, VecF* out) {
  const __m256 values = half_floats(words, shift);
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  out[0] = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(values));
}
// Vector j (of kUnitValues / kWidth) of a unit's codes as floats, in registers (a store of the codes and
// narrower reloads of its parts can stall store-to-load forwarding on every vector).
template <bool kSigned>
inline VecF code_floats(VecB codes, int j) {
  __m128i part;
  switch (j) {  // the lane is an immediate; j is a constant once the caller's loop is unrolled
    case 0: part = _mm512_extracti32x4_epi32(codes, 0); break;
    case 1: part = _mm512_extracti32x4_epi32(codes, 1); break;
    case 2: part = _mm512_extracti32x4_epi32(codes, 2); break;
    default: part = _mm512_extracti32x4_epi32(codes, 3); break;
  }
  return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(part) : _mm512_cvtepu8_epi32(part));
}
// Which group vector j of unit u lies in.
inline int vector_group(int u, int j) { return 4 * u + j; }

// For the integer sub-scales (below): the bytes of `src` that `index` names in each 128-bit lane (0 where
// its byte has bit 7 set), the even bytes' values moved to the odd ones, products of unsigned codes and
// signed scales in 16-bit lanes, and 16-bit multiply-adds into int32 lanes.
inline VecB select_bytes(VecB src, const uint8_t* index) { return _mm512_shuffle_epi8(src, _mm512_load_si512(index)); }
inline VecB to_odd_bytes(VecB even) { return _mm512_slli_epi16(even, 8); }
inline VecI byte_products(VecB codes, VecB scales) { return _mm512_maddubs_epi16(codes, scales); }
inline VecI add_products(VecI acc, VecI a, const int16_t* x) {
#if defined(PAGEDLLM_VNNI)
  return _mm512_dpwssd_epi32(acc, a, _mm512_loadu_si512(x));
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, _mm512_loadu_si512(x)));
#endif
}
// int8 x: the even bytes' scales as 16-bit lanes (select_bytes zeroed the odd bytes: signed scales are
// sign-extended, unsigned ones already are the lanes), and a vector of codes against 64 int8 values of x
// (neighbours' products summed in a 16-bit lane) times those scales, into int32 lanes.
template <bool kSigned>
inline VecI scale_words(VecB even) { return kSigned ? _mm512_srai_epi16(_mm512_slli_epi16(even, 8), 8) : even; }
inline VecI add_byte_products(VecI acc, VecB codes, const int8_t* x, VecI scales) {
  const __m512i pairs = _mm512_maddubs_epi16(codes, _mm512_loadu_si512(x));
#if defined(PAGEDLLM_VNNI)
  return _mm512_dpwssd_epi32(acc, pairs, scales);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scales));
#endif
}
inline VecI add_int(VecI a, VecI b) { return _mm512_add_epi32(a, b); }
inline VecI zero_int() { return _mm512_setzero_si512(); }
inline VecB broadcast_bytes(__m128i bytes) { return _mm512_broadcast_i32x4(bytes); }

#else  // AVX2

using VecB = __m256i;
constexpr int kUnitValues = 32;
using VecI = __m256i;

inline VecB mask_bytes(VecB v, int value) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(value))); }
// A 32-value block of nibbles (value i in byte i's low nibble, i + 16 in its high) -> its codes in order.
inline VecB nibble_block(const uint8_t* q) {
  const __m128i b = load16(q);
  return mask_bytes(_mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1), 15);
}
// Byte j all ones where bit 8 index[j] + j % 8 of bits is set, else zero.
inline VecB select_bit_masks(uint32_t bits, __m256i index) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), index);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
// Byte i all ones where bit i of bits is set, else zero.
inline VecB bit_masks(uint32_t bits) {
  return select_bit_masks(bits, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                                 2, 3, 3, 3, 3, 3, 3, 3, 3));
}
inline VecB bit_bytes(uint32_t bits, int value) { return mask_bytes(bit_masks(bits), value); }
// A unit's activations are in order: value i at place i.
constexpr int unit_position(int i) { return i; }
template <bool kSigned>
inline Words byte_words(VecB codes) {
  const __m128i a = _mm256_castsi256_si128(codes), b = _mm256_extracti128_si256(codes, 1);
  if constexpr (kSigned) return {_mm256_cvtepi8_epi16(a), _mm256_cvtepi8_epi16(b)};
  return {_mm256_cvtepu8_epi16(a), _mm256_cvtepu8_epi16(b)};
}
// Word order: a block's 32 byte codes placed so that unpacklo / unpackhi within each 128-bit lane widen
// them to values 0-15 and 16-31 (lane 0 holds values 0-7 and 16-23, lane 1 values 8-15 and 24-31).
// Widening bytes in the values' order (byte_words) crosses lanes: Q5_0's blocks took 1.15x as long so.
template <bool kSigned>
inline Words word_order_words(VecB codes) {
  const __m256i high = kSigned ? _mm256_cmpgt_epi8(_mm256_setzero_si256(), codes) : _mm256_setzero_si256();
  return {_mm256_unpacklo_epi8(codes, high), _mm256_unpackhi_epi8(codes, high)};
}
// A 32-value block of nibbles in word order: each lane's 8 bytes twice, the second copy shifted to its
// high nibbles.
inline VecB word_order_nibbles(const uint8_t* q) {
  const __m256i halves = _mm256_shuffle_epi8(
      _mm256_broadcastsi128_si256(load16(q)),
      _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12,
                       13, 14, 15));
  return mask_bytes(_mm256_srlv_epi64(halves, _mm256_setr_epi64x(0, 4, 0, 4)), 15);
}
// Byte j of word order all ones where the bit of its value is set in bits, else zero.
inline VecB word_order_bit_masks(uint32_t bits) {
  return select_bit_masks(bits, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1,
                                                 1, 3, 3, 3, 3, 3, 3, 3, 3));
}
inline __m256i pair_products(__m256i w, const int16_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(PAGEDLLM_VNNI)
  return _mm256_dpwssd_avx_epi32(_mm256_setzero_si256(), w, xv);
#else
  return _mm256_madd_epi16(w, xv);
#endif
}
// Lanes of sum w_i x_i: a block's words against its 32 activations (int16, in order).
inline VecI words_dot(const Words& w, const int16_t* x) {
#if defined(PAGEDLLM_VNNI)
  const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  return _mm256_dpwssd_avx_epi32(pair_products(w.low, x), w.high, xb);
#else
  return _mm256_add_epi32(pair_products(w.low, x), pair_products(w.high, x + 16));
#endif
}
// Lanes of sum w_i x_i over 4 values each, a group's lanes apart (unit_scales): a unit's codes (signed or
// not) against its activations.
template <bool kSigned>
inline VecI dot(VecB codes, const int16_t* x) {
  const Words w = byte_words<kSigned>(codes);
  return _mm256_hadd_epi32(pair_products(w.low, x), pair_products(w.high, x + 16));
}
template <bool kSigned>
inline void bytes_as_floats(__m128i b, VecF* out) {
  out[0] = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  const __m128i rest = _mm_srli_si128(b, 8);
  out[1] = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(rest) : _mm256_cvtepu8_epi32(rest));
}
// The group scales of unit u's lanes (dot's: lane l, group 2u + l / 2 % 2).
inline VecF unit_scales(const VecF* groups, int u) {
  const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(2 * (u % 4)), _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1));
  return _mm256_permutevar8x32_ps(groups[u / 4].v, index);
}
template <int kBytes>
inline __m256i block_words(const uint8_t* p, int blocks) {
  const __m256i index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(kBytes));
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(blocks), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(p), index, mask, 1);
}
inline __m256 half_floats(__m256i words, int shift) {
  const __m256i low = _mm256_and_si256(_mm256_srli_epi32(words, shift), _mm256_set1_epi32(0xffff));
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
}
inline void word_halves(__m256i words, int shift, VecF* out) {
  const __m256 values = half_floats(words, shift);
  out[0] = _mm256_permutevar8x32_ps(values, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  out[1] = _mm256_permutevar8x32_ps(values, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}
template <bool kSigned>
inline VecF code_floats(VecB codes, int j) {
  const __m128i half = j < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
  const __m128i part = j % 2 == 0 ? half : _mm_unpackhi_epi64(half, half);
  return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part));
}
inline int vector_group(int u, int j) { return 2 * u + j / 2; }

inline VecB select_bytes(VecB src, const uint8_t* index) {
  return _mm256_shuffle_epi8(src, _mm256_load_si256(reinterpret_cast<const __m256i*>(index)));
}
inline VecB to_odd_bytes(VecB even) { return _mm256_slli_epi16(even, 8); }
inline VecI byte_products(VecB codes, VecB scales) { return _mm256_maddubs_epi16(codes, scales); }
inline VecI add_products(VecI acc, VecI a, const int16_t* x) {
  return add_pairs(acc, a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
template <bool kSigned>
inline VecI scale_words(VecB even) { return kSigned ? _mm256_srai_epi16(_mm256_slli_epi16(even, 8), 8) : even; }
inline VecI add_byte_products(VecI acc, VecB codes, const int8_t* x, VecI scales) {
  return add_pairs(acc, _mm256_maddubs_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), scales);
}
inline VecI add_int(VecI a, VecI b) { return _mm256_add_epi32(a, b); }
inline VecI zero_int() { return _mm256_setzero_si256(); }
inline VecB broadcast_bytes(__m128i bytes) { return _mm256_broadcastsi128_si256(bytes); }

#endif

// K super-blocks with integer sub-scales (Q4_K and Q6_K on few rows of x). x is rounded to int8 (the
// default: llama.cpp's q8_K, max |x| / 127) or int16 (max |x| / 32767) with one scale dx per chunk of 256
// values, so a super-block's sum is an integer dot product and one float multiply-add:
//   x . w = d dx sum_i sc(i) u_i q_i  +  sum_g c_g dx sum_{i in g} q_i
// with sc(i) the integer sub-scale of value i's group (Q4_K's 6-bit scale, Q6_K's int8), d the
// super-block's float16 scale and c_g the group's offset (the c above: Q4_K's -dmin m, Q6_K's -32 d sc).
// A vector of codes meets its sub-scales in vpmaddubsw twice, the scales in the even bytes (zeros in the
// odd) and then in the odd: each 16-bit lane is one product sc u (no pair summed, nothing saturates), and
// those meet x in 16-bit multiply-adds summed in int32 lanes. A chunk is kChunkVectors vectors of codes,
// in an order of values each type reads cheaply (vector_sub_block); a type's kWindow vectors are summed in
// int32 before the float multiply-add: as many as cannot overflow (|q| <= 32767, |sc u| <= kMaxProduct,
// each vector adds 4 products to a lane). int8 x takes half the instructions: a vector of codes meets x
// in one vpmaddubsw (neighbours' u q summed in a 16-bit lane) and its sub-scales, widened to 16 bits, in
// one 16-bit multiply-add, the whole chunk in one int32 chain (run_position: where x's bytes sit).
constexpr int kChunkVectors = kChunkValues / kUnitValues;

constexpr int window_vectors(int max_product) {
  return static_cast<int>(std::min<int64_t>(kChunkVectors, int64_t{INT32_MAX} / (int64_t{max_product} * 32767 * 4)));
}
// The 32-value sub-block that byte b of a chunk's code vector v holds. AVX-512: sub-blocks (0, 2), (1, 3),
// (4, 6), (5, 7), the low and the high nibbles of one 64-byte load of Q4_K's; AVX2: sub-block v.
constexpr int vector_sub_block(int v, int b) {
#if defined(PAGEDLLM_AVX512)
  return 4 * (v / 2) + v % 2 + (b >= 32 ? 2 : 0);
#else
  static_cast<void>(b);
  return v;
#endif
}
// Where value i (0 .. 255) of a chunk sits in x's int16 codes: vector after vector, each vector's values
// of even bytes, then of odd bytes (the order of the two vpmaddubsw products' lanes).
constexpr int chunk_position(int i) {
  const int sub_block = i / 32, l = i % 32;
#if defined(PAGEDLLM_AVX512)
  const int v = 2 * (sub_block / 4) + sub_block % 2, b = 32 * (sub_block % 4 / 2) + l;
#else
  const int v = sub_block, b = l;
#endif
  return v * kUnitValues + b % 2 * (kUnitValues / 2) + b / 2;
}
// Where the 32-value run r (a sub-block) of a chunk sits in x's int8 codes: byte b of code vector v holds
// value b % 32 of sub-block vector_sub_block(v, b), and meets x's byte at the same place (vpmaddubsw).
constexpr int run_position(int r) {
#if defined(PAGEDLLM_AVX512)
  return (2 * (r / 4) + r % 2) * kUnitValues + 32 * (r % 4 / 2);
#else
  return r * kUnitValues;
#endif
}
// With int8 x a chunk's vectors sum in one int32 chain: each adds at most 2 products of 2 x 63 x 127
// (a pair of codes times x, Q6_K's largest) times 128 (|sc|) to a lane.
static_assert(int64_t{kChunkVectors} * 2 * (2 * 63 * 127) * 128 < INT32_MAX, "int8 x's chunk sum may overflow");
// For each code vector, which byte of the broadcast scales each even byte takes (bit 7 set in the odd
// bytes: zero). kPerSubBlock scales a sub-block: 1 (Q4_K's per 32 values) or 2 (Q6_K's per 16).
struct ScaleIndex {
  alignas(64) uint8_t bytes[kChunkVectors][kUnitValues];
};
template <int kPerSubBlock>
constexpr ScaleIndex make_scale_index() {
  ScaleIndex index{};
  for (int v = 0; v < kChunkVectors; ++v)
    for (int b = 0; b < kUnitValues; ++b)
      index.bytes[v][b] = b % 2 ? 0x80 : kPerSubBlock * vector_sub_block(v, b) + (kPerSubBlock == 2 ? b % 32 / 16 : 0);
  return index;
}
inline constexpr ScaleIndex kScalePerSubBlock = make_scale_index<1>(), kScalePerGroup = make_scale_index<2>();

// One chunk's part of the integer sum: its sub-scales broadcast (for select_bytes), d, and c.
struct IntegerChunk {
  VecB scales;
  float d;
  VecF offsets[kGroupVectors];
};

// Words of `value` where bit i of `bits` (16 bits) is set, else 0.
inline __m256i bit_words(uint32_t bits, int value) {
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
  const __m256i set = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi16(set, bit), _mm256_set1_epi16(static_cast<int16_t>(value)));
}

// The types. Each has kType (ggml's number), kBlockValues, kBlockBytes, kSigned, and for a chunk p of a
// row holding `blocks` 32-value blocks:
//   scales(p, blocks, s, c)  the chunk's kGroups scales and offsets as kGroupVectors vectors each (zero
//                            past its blocks)
//   codes(p, u, blocks)      unit u's codes (a unit past the blocks reads bytes of the chunk's first
//                            block: the activations there are zeros)
// and the 32-value types, for block p alone: pair_words(p), its codes as int16 words (less the offset where it
// is implicit; on AVX2 also code_words(p), in the few-row walk's order), and kMinByte, the byte offset of its
// m (-1: none).

// The 32-value types: a chunk is 8 blocks, each starting with d (float16); byte offsets of m (-1: none,
// c = -kImplicitOffset d; else right after d), of the high bits (-1: none) and of the nibbles.
template <int kTypeNumber, int kBytes, int kMinOffset, int kHighOffset, int kCodeOffset, int kImplicitOffset>
struct SmallBlocks {
  static constexpr int kType = kTypeNumber, kBlockValues = 32, kBlockBytes = kBytes;
  static constexpr bool kSigned = false, kIntegerScales = false;

  static_assert(kMinOffset < 0 || kMinOffset == 2, "m follows d");

  static void scales(const uint8_t* p, int blocks, VecF* s, VecF* c) {
    const __m256i words = block_words<kBytes>(p, blocks);
    word_halves(words, 0, s);
    if constexpr (kMinOffset >= 0) {
      word_halves(words, 16, c);
    } else {
      for (int j = 0; j < kGroupVectors; ++j) c[j] = s[j] * VecF::set1(-static_cast<float>(kImplicitOffset));
    }
  }

  static VecB codes(const uint8_t* p, int u, int blocks) {
    constexpr int kPer = kUnitValues / 32;  // blocks a unit
    const uint8_t* a = p + u * kPer * kBytes;
#if defined(PAGEDLLM_AVX512)
    const uint8_t* b = u * kPer + 1 < blocks ? a + kBytes : a;
    VecB q = two_nibble_blocks(a + kCodeOffset, b + kCodeOffset);
    if constexpr (kHighOffset >= 0) {
      q = _mm512_or_si512(q, bit_bytes(bits32(a + kHighOffset) | uint64_t{bits32(b + kHighOffset)} << 32, 16));
    }
#else
    (void)blocks;
    VecB q = nibble_block(a + kCodeOffset);
    if constexpr (kHighOffset >= 0) q = _mm256_or_si256(q, bit_bytes(bits32(a + kHighOffset), 16));
#endif
    return q;
  }

  // The block at p's 32 codes as int16 words: the integers its values are d times, less the offset where it
  // is implicit (Q4_0's 8, Q5_0's 16: kImplicit, which codes() leaves in); m (kMinByte, -1: none) stays apart.
  static constexpr int kMinByte = kMinOffset, kImplicit = kImplicitOffset;
  static Words pair_words(const uint8_t* p) {
    const __m256i bytes = _mm256_cvtepu8_epi16(load16(p + kCodeOffset));
    __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(15)), high = _mm256_srli_epi16(bytes, 4);
#if defined(PAGEDLLM_AVX512)
    if constexpr (kHighOffset >= 0) {
      // Q5_1: + 16 where the fifth bit is set; Q5_0: q - 16 = the nibble where it is set, the nibble + 0xfff0
      // (the nibble - 16 in two's complement) where it is clear
      const uint32_t bits = bits32(p + kHighOffset);
      const auto mask = [&](uint32_t half) { return static_cast<__mmask16>(kMinOffset < 0 ? ~half : half); };
      const __m256i add = _mm256_set1_epi16(kMinOffset < 0 ? static_cast<int16_t>(0xfff0) : 16);
      return {_mm256_mask_add_epi16(low, mask(bits & 0xffff), low, add), _mm256_mask_add_epi16(high, mask(bits >> 16), high, add)};
    }
#else
    if constexpr (kHighOffset >= 0) {
      const uint32_t bits = bits32(p + kHighOffset);
      low = _mm256_or_si256(low, bit_words(bits & 0xffff, 16));
      high = _mm256_or_si256(high, bit_words(bits >> 16, 16));
    }
#endif
    if constexpr (kMinOffset < 0) {
      const __m256i offset = _mm256_set1_epi16(kImplicitOffset);
      low = _mm256_sub_epi16(low, offset);
      high = _mm256_sub_epi16(high, offset);
    }
    return {low, high};
  }

#if !defined(PAGEDLLM_AVX512)
  // The block at p's codes as the integers its values are d times, in words, where the offset is
  // implicit: q - 8 (Q4_0); q - 16 (Q5_0: a clear fifth bit gives the code the high nibble 0xf0, q - 16
  // in two's complement, widened signed). Where m is stored (kMinByte), the codes as they are.
  static_assert(kHighOffset < 0 || kMinOffset >= 0 || kImplicitOffset == 16, "a clear fifth bit is -16");
  static Words code_words(const uint8_t* p) {
    if constexpr (kHighOffset < 0) {
      return pair_words(p);  // values 0-15 and 16-31: the walk's order too
    } else {
      const VecB nibbles = word_order_nibbles(p + kCodeOffset), bits = word_order_bit_masks(bits32(p + kHighOffset));
      if constexpr (kMinOffset < 0) {
        return word_order_words<true>(_mm256_or_si256(nibbles, _mm256_andnot_si256(bits, _mm256_set1_epi8(-16))));
      } else {
        return word_order_words<false>(_mm256_or_si256(nibbles, mask_bytes(bits, 16)));
      }
    }
  }
#endif
};

using Q4_0 = SmallBlocks<2, 18, -1, -1, 2, 8>;
using Q4_1 = SmallBlocks<3, 20, 2, -1, 4, 0>;
using Q5_0 = SmallBlocks<6, 22, -1, 2, 6, 16>;
using Q5_1 = SmallBlocks<7, 24, 2, 4, 8, 0>;

struct Q8_0 {
  static constexpr int kType = 8, kBlockValues = 32, kBlockBytes = 34;
  static constexpr bool kSigned = true, kIntegerScales = false;

  static void scales(const uint8_t* p, int blocks, VecF* s, VecF* c) {
    word_halves(block_words<kBlockBytes>(p, blocks), 0, s);
    for (int j = 0; j < kGroupVectors; ++j) c[j] = VecF::zero();
  }
  static VecB codes(const uint8_t* p, int u, int blocks) {
#if defined(PAGEDLLM_AVX512)
    const uint8_t* a = p + 2 * u * kBlockBytes + 2;
    const uint8_t* b = 2 * u + 1 < blocks ? a + kBlockBytes : a;
    return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
#else
    (void)blocks;
    return load32(p + u * kBlockBytes + 2);
#endif
  }
  static constexpr int kMinByte = -1, kImplicit = 0;
  static Words pair_words(const uint8_t* p) {
    return {_mm256_cvtepi8_epi16(load16(p + 2)), _mm256_cvtepi8_epi16(load16(p + 18))};
  }
#if !defined(PAGEDLLM_AVX512)
  static Words code_words(const uint8_t* p) { return pair_words(p); }
#endif
};

#if defined(PAGEDLLM_AVX512)
// Q4_1 at few rows of x, in "quads" (AVX-512): a chunk's 160 bytes are 40 32-bit words, block b's d and m
// (float16) in word 5b and its codes in words 5b + 1 .. 5b + 4, so that one vpermt2d moves the code words
// of blocks 4q .. 4q + 3 (quad q) into one vector, block 4q + L's word t in lane 4L + t, and another their
// (d, m) words into lanes 2b, 2b + 1 of one vector of floats: no gather (whose 8 loads cost 10-30% of a
// chunk), no shuffle of codes to widen them. The nibbles of each 16-bit word, masked and shifted out, are
// four vectors of words (kQuadVectors: value 4t + 2k of the word k of lane 4L + t, then 4t + 2k + 1,
// 4t + 2k + 16, 4t + 2k + 17; x in that order, quad_position), so each 32-bit lane of their multiply-adds
// sums one block: a quad's int32 sums take one conversion to float and one multiply by its blocks' d dx,
// where the dot order above converts each 64 values.
constexpr int kQuadVectors = 4;
struct QuadChunk {
  VecF dm;           // d_b, m_b of the chunk's blocks in lanes 2b, 2b + 1 (0 past its blocks)
  VecB codes[2];     // each quad's code words
};
// Where value i (0 .. 31) of a chunk's block b (0 .. 7) sits in x's int16 codes of the chunk.
constexpr int quad_position(int b, int i) {
  const int j = i % 16, t = j / 4, k = j % 4 / 2, r = 2 * (i / 16) + j % 2;
  return (4 * (b / 4) + r) * 32 + (4 * (b % 4) + t) * 2 + k;
}
// The chunk at p holding `blocks` blocks: masked loads read nothing past them (a row's last chunk may hold
// 2, and the weight's end may follow) and give zeros there, so d, m and the codes are 0 past the blocks.
__attribute__((always_inline)) inline QuadChunk q4_1_quads(const uint8_t* p, int blocks) {
  const int words = 5 * blocks;
  const auto part = [&](int first) {  // words first .. first + 15
    const int n = std::clamp(words - first, 0, 16);
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << n) - 1), p + 4 * first);
  };
  const __m512i a = part(0), b = part(16), c = part(24), s = part(20);
  const __m512i dm = _mm512_permutex2var_epi32(a, _mm512_setr_epi32(0, 5, 10, 15, 16, 21, 26, 31, 0, 0, 0, 0, 0, 0, 0, 0), s);
  QuadChunk chunk;
  chunk.dm = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
  chunk.codes[0] = _mm512_permutex2var_epi32(a, _mm512_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19), b);
  // blocks 4-7: words 21 .. 31 from b (lanes 5 ..), 32 .. 39 from c (its lanes 8 .., indices 24 ..)
  chunk.codes[1] = _mm512_permutex2var_epi32(b, _mm512_setr_epi32(5, 6, 7, 8, 10, 11, 12, 13, 15, 24, 25, 26, 28, 29, 30, 31), c);
  return chunk;
}
// Vector r of a quad's code words as 16-bit values (the low byte's low nibble, the high byte's, the low
// byte's high nibble, the high byte's).
inline VecB quad_vector(VecB words, int r) {
  const __m512i low = _mm512_set1_epi16(15);
  switch (r) {  // the shift is an immediate; r is a constant once the caller's loop is unrolled
    case 0: return _mm512_and_si512(words, low);
    case 1: return _mm512_and_si512(_mm512_srli_epi16(words, 8), low);
    case 2: return _mm512_and_si512(_mm512_srli_epi16(words, 4), low);
    default: return _mm512_srli_epi16(words, 12);
  }
}
// Each block's scale per lane of quad q (lane 4L + t: block 4q + L's lane 2(4q + L) of dm-ordered values).
inline VecF quad_scales(VecF per_block, int q) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(8 * q), _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6));
  return _mm512_permutexvar_ps(index, per_block.v);
}
#endif

// Whether type T is read in quads at few rows of x (Q4_1 on AVX-512, above).
template <typename T>
constexpr bool kQuads = false;
#if defined(PAGEDLLM_AVX512)
template <>
inline constexpr bool kQuads<Q4_1> = true;
#endif

// Q4_K / Q5_K's eight 6-bit scales and mins (12 bytes at p + 4, packed as llama.cpp's get_scale_min_k4
// reads them) as one vector of bytes: sub-block j's scale in byte j, its min in byte 8 + j. In vector
// registers: the scalar unpacking was a quarter of a Q4_K chunk's time at one row of x (docs/JOURNAL.md).
inline __m128i k_scale_bytes(const uint8_t* p) {
  const __m128i raw = load16(p + 4);  // bytes 0-3 scales 0-3, 4-7 mins 0-3, 8-11 the rest's low nibbles
  // the low 6 bits of scales / mins 0-3; the low (scales 4-7) and high (mins 4-7) nibbles of bytes 8-11
  const __m128i low = _mm_shuffle_epi8(raw, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i bits = _mm_and_si128(_mm_blend_epi32(low, _mm_srli_epi16(low, 4), 0x8),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  // the top 2 bits of bytes 0-7, the high bits of scales / mins 4-7
  const __m128i high = _mm_shuffle_epi8(raw, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  return _mm_or_si128(bits, _mm_srli_epi16(_mm_and_si128(high, _mm_set1_epi8(static_cast<char>(0xc0))), 2));
}
// A K super-block's float16 d and dmin (at p, p + 2) as floats, in one conversion.
struct KScale {
  float d, dmin;
};
inline KScale k_scale(const uint8_t* p) {
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits32(p))));
  return {_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm))};
}

// Q4_K / Q5_K's (scale, min) pairs as each group's s and c (each byte twice: two 16-value groups a sub-block).
inline void k_scales(const uint8_t* p, VecF* s, VecF* c) {
  const __m128i bytes = k_scale_bytes(p);
  bytes_as_floats<false>(_mm_unpacklo_epi8(bytes, bytes), s);
  bytes_as_floats<false>(_mm_unpackhi_epi8(bytes, bytes), c);
  const KScale scale = k_scale(p);
  const VecF d = VecF::set1(scale.d), minus_dmin = VecF::set1(-scale.dmin);
  for (int j = 0; j < kGroupVectors; ++j) {
    s[j] = s[j] * d;
    c[j] = c[j] * minus_dmin;
  }
}

// Q4_K / Q5_K's nibbles: in each 32-byte run, the low nibbles are one sub-block, the high the next.
inline VecB k_nibbles(const uint8_t* qs, int u) {
#if defined(PAGEDLLM_AVX512)
  return split_nibbles(qs + 32 * u);
#else
  const __m256i b = load32(qs + 32 * (u / 2));
  return mask_bytes(u % 2 ? _mm256_srli_epi16(b, 4) : b, 15);
#endif
}

// The walks of int8 x on the K types (linear.cpp, byte_chunk_row and byte_tile; both builds: AVX-512 CPUs
// run the tile in 256-bit vectors, the same instructions' work a cycle on Zen 4): a chunk's sub-scales
// broadcast (for select_bytes, as IntegerChunk's), each 16-value group's integer multiplier of x's sum over
// it (Q4_K: its sub-block's m; Q6_K: its sc) as 16-bit lanes, and the float factors of the two integer sums:
// d and c (Q4_K: -dmin; Q6_K: -32 d), as d, c, d, c.
struct ByteChunk {
  VecB scales;
  __m256i multipliers;
  __m128 factors;
};
// kByteRows weight rows' chunks interleaved, lane r of every vector row r's: codes[t] holds the chunk's code
// bytes 4t .. 4t + 3 in T::integer_codes' order (x's bytes at the same places: run_position), one 32-bit lane
// a row; scales[s] the sub-scale of codes [256 s / kScales ..) of that order (tile_scales' form),
// multipliers[q] the 16-bit pair of multipliers of offset runs 2q and 2q + 1 (runs of T::kOffsetValues values
// in order: Q4_K's sub-blocks of 32, Q6_K's groups of 16), so that one vpmaddwd meets a pair of x's sums over
// them (Q4_K's sub-block as one run, not two groups of one m: half the multiply-adds), d and c the factors.
constexpr int kByteRows = 8;
struct ByteRows {
  __m256i codes[kChunkValues / 4];
  __m256i scales[kGroups];
  __m256i multipliers[kGroups / 2];
  __m256 d, c;
};
// 256-bit halves a code vector has (AVX-512: 2), and half h of one.
constexpr int kCodeHalves = sizeof(VecB) / sizeof(__m256i);
inline __m256i code_half(VecB v, int h) {
#if defined(PAGEDLLM_AVX512)
  return h ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
#else
  static_cast<void>(h);
  return v;
#endif
}
// A vector's int32 lanes added down to 256 bits (exact): AVX-512's two halves summed, AVX2's vector itself.
inline __m256i fold_halves(VecB v) {
  __m256i sum = code_half(v, 0);
  for (int h = 1; h < kCodeHalves; ++h) sum = _mm256_add_epi32(sum, code_half(v, h));
  return sum;
}
// The sub-block that run s (32 codes) of a chunk's code bytes in integer_codes' order holds.
constexpr int run_sub_block(int s) { return vector_sub_block(s / kCodeHalves, 32 * (s % kCodeHalves)); }
// The run s (as run_sub_block numbers them) that holds sub-block b.
constexpr int sub_block_run(int b) {
  int s = 0;
  while (run_sub_block(s) != b) ++s;
  return s;
}
// Codes of kByteRows chunks (T::integer_codes) in ByteRows' order: each 256 bits' 8 lanes of 4 codes,
// transposed with the other rows' (Q6_K; Q4_K transposes its nibbles as packed: half the transposes).
template <typename T>
inline void interleave_codes(const uint8_t* const* p, __m256i* codes) {
  for (int v = 0; v < kChunkVectors; ++v) {
    __m256i rows[kCodeHalves][kByteRows];
    for (int r = 0; r < kByteRows; ++r) {
      const VecB c = T::integer_codes(p[r], v);
      for (int h = 0; h < kCodeHalves; ++h) rows[h][r] = code_half(c, h);
    }
    for (int h = 0; h < kCodeHalves; ++h) {
      transpose8(rows[h]);
      for (int i = 0; i < kByteRows; ++i) codes[kByteRows * (kCodeHalves * v + h) + i] = rows[h][i];
    }
  }
}
// Lanes of int32 values whose low 16 bits are both of the lane's 16-bit halves (a scale for vpmaddwd).
inline __m256i both_halves(__m256i v) {
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
}
// ByteRows' sub-scales as the tile multiplies them: with VNNI an int32 lane (vpmulld of a vpdpbusd sum),
// else in both 16-bit halves (vpmaddwd of 16-bit sums).
inline __m256i tile_scales(__m256i v) {
#if defined(PAGEDLLM_VNNI)
  return v;
#else
  return both_halves(v);
#endif
}
#if defined(PAGEDLLM_VNNI)
// acc + the sums of 4 products of a's unsigned bytes and b's signed ones, an int32 lane each (vpdpbusd).
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
#if defined(PAGEDLLM_AVX512)
  return _mm256_dpbusd_epi32(acc, a, b);
#else
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#endif
}
#endif

// The 32-value types' walk (linear.cpp pair_tile; both builds, in 256-bit vectors). x is int16 with one scale
// dx per chunk of 256 values, so a block's sum is one integer dot product I = sum_i q_i q_x(i) (exact: at most
// 32 x 128 x 32767), whose float work is per block and pair of rows. kByteRows weight rows' blocks are
// interleaved, lane r of every vector row r's: pairs[p] the codes of values pair_value(p) and pair_value(p) + 16
// as two int16 (x's codes at the same places), so that one broadcast pair of x meets 8 rows in one 16-bit
// multiply-add whose lanes are rows; d and m (0 where the type has none) as floats.
struct PairRows {
  __m256i pairs[16];
  __m256 d, m;
};
// The value (0 .. 15) whose pair, with value + 16, pairs[p] holds: the order of an unpack of the two words
// within 128-bit lanes (values 0-3, 8-11 from unpacklo; 4-7, 12-15 from unpackhi) and a transpose.
constexpr int pair_value(int p) { return (p < 8 ? 0 : 4) + (p % 8 < 4 ? p % 8 : p % 8 + 4); }
// The float16 at `offset` of each of the 8 blocks at p[r], as floats.
inline __m256 block_halves(const uint8_t* const* p, int offset) {
  const auto word = [&](int r) {
    uint16_t v;
    std::memcpy(&v, p[r] + offset, 2);
    return static_cast<int>(v);
  };
  __m128i h = _mm_cvtsi32_si128(word(0));
  h = _mm_insert_epi16(h, word(1), 1);
  h = _mm_insert_epi16(h, word(2), 2);
  h = _mm_insert_epi16(h, word(3), 3);
  h = _mm_insert_epi16(h, word(4), 4);
  h = _mm_insert_epi16(h, word(5), 5);
  h = _mm_insert_epi16(h, word(6), 6);
  h = _mm_insert_epi16(h, word(7), 7);
  return _mm256_cvtph_ps(h);
}
// The blocks at p[0 .. kByteRows) (one of each row) as PairRows.
template <typename T>
inline void interleave_pairs(const uint8_t* const* p, PairRows& out) {
  __m256i a[kByteRows], b[kByteRows];
  for (int r = 0; r < kByteRows; ++r) {
    const Words w = T::pair_words(p[r]);
    a[r] = _mm256_unpacklo_epi16(w.low, w.high);
    b[r] = _mm256_unpackhi_epi16(w.low, w.high);
  }
  transpose8(a);
  transpose8(b);
  for (int i = 0; i < kByteRows; ++i) {
    out.pairs[i] = a[i];
    out.pairs[kByteRows + i] = b[i];
  }
  out.d = block_halves(p, 0);
  out.m = T::kMinByte >= 0 ? block_halves(p, T::kMinByte) : _mm256_setzero_ps();
}

struct Q4_K {
  static constexpr int kType = 12, kBlockValues = 256, kBlockBytes = 144;
  static constexpr bool kSigned = false, kIntegerScales = true, kSignedScales = false;
  static constexpr int kWindow = window_vectors(15 * 63);
  static void scales(const uint8_t* p, int, VecF* s, VecF* c) { k_scales(p, s, c); }
  static VecB codes(const uint8_t* p, int u, int) { return k_nibbles(p + 16, u); }

  static IntegerChunk integer_chunk(const uint8_t* p) {
    const __m128i bytes = k_scale_bytes(p);
    const KScale scale = k_scale(p);
    IntegerChunk chunk{broadcast_bytes(bytes), scale.d, {}};
    bytes_as_floats<false>(_mm_unpackhi_epi8(bytes, bytes), chunk.offsets);
    const VecF minus_dmin = VecF::set1(-scale.dmin);
    for (int j = 0; j < kGroupVectors; ++j) chunk.offsets[j] = chunk.offsets[j] * minus_dmin;
    return chunk;
  }
  static const ScaleIndex& scale_index() { return kScalePerSubBlock; }
  // Code vector v (vector_sub_block's order).
  static VecB integer_codes(const uint8_t* p, int v) {
#if defined(PAGEDLLM_AVX512)
    const __m512i b = _mm512_loadu_si512(p + 16 + 64 * (v / 2));
    return mask_bytes(v % 2 ? _mm512_srli_epi16(b, 4) : b, 15);
#else
    return k_nibbles(p + 16, v);
#endif
  }
  // 4-code lanes a 16-bit sum takes (a sub-block's 8: each lane's pair of u q at most 2 x 15 x 127), and
  // the lanes one sub-scale spans
  static constexpr int kSumCodes = 8, kScaleCodes = 8;
  // values an offset's multiplier spans (a sub-block's m), and the runs of them in a chunk
  static constexpr int kOffsetValues = 32, kOffsetRuns = kChunkValues / kOffsetValues;
  static ByteChunk byte_chunk(const uint8_t* p) {
    const __m128i bytes = k_scale_bytes(p);
    const KScale scale = k_scale(p);
    return {broadcast_bytes(bytes), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(bytes, bytes)),
            _mm_setr_ps(scale.d, -scale.dmin, scale.d, -scale.dmin)};
  }
  static void interleave(const uint8_t* const* p, ByteRows& out) {
    // each 32-byte run R of the nibbles (sub-blocks 2R, 2R + 1 in its low and high nibbles) transposed as the
    // file packs it, then split: half the transposes of interleave_codes, which takes unpacked codes
    for (int R = 0; R < 4; ++R) {
      __m256i rows[kByteRows];
      for (int r = 0; r < kByteRows; ++r) rows[r] = load32(p[r] + 16 + 32 * R);
      transpose8(rows);
      __m256i* low = out.codes + kByteRows * sub_block_run(2 * R);
      __m256i* high = out.codes + kByteRows * sub_block_run(2 * R + 1);
      for (int i = 0; i < kByteRows; ++i) {
        low[i] = _mm256_and_si256(rows[i], _mm256_set1_epi8(15));
        high[i] = _mm256_and_si256(_mm256_srli_epi16(rows[i], 4), _mm256_set1_epi8(15));
      }
    }
    __m256i scales[kByteRows], mins[kByteRows];
    alignas(32) float d[kByteRows], c[kByteRows];
    for (int r = 0; r < kByteRows; ++r) {
      const __m128i bytes = k_scale_bytes(p[r]);
      scales[r] = _mm256_cvtepu8_epi32(bytes);
      mins[r] = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
      const KScale scale = k_scale(p[r]);
      d[r] = scale.d;
      c[r] = -scale.dmin;
    }
    transpose8(scales);  // scales[j]: sub-block j's
    transpose8(mins);
    for (int j = 0; j < kByteRows; ++j) out.scales[j] = tile_scales(scales[run_sub_block(j)]);
    for (int q = 0; q < kOffsetRuns / 2; ++q)  // sub-blocks 2q and 2q + 1's m, a 16-bit pair
      out.multipliers[q] = _mm256_or_si256(mins[2 * q], _mm256_slli_epi32(mins[2 * q + 1], 16));
    out.d = _mm256_load_ps(d);
    out.c = _mm256_load_ps(c);
  }
};

struct Q5_K {
  static constexpr int kType = 13, kBlockValues = 256, kBlockBytes = 176;
  static constexpr bool kSigned = false, kIntegerScales = false;
  static void scales(const uint8_t* p, int, VecF* s, VecF* c) { k_scales(p, s, c); }
  // The high bit of sub-block j's value l is bit j of qh[l].
  static VecB codes(const uint8_t* p, int u, int) {
    const __m256i qh = load32(p + 16);
#if defined(PAGEDLLM_AVX512)
    const uint64_t low = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * u))));
    const uint64_t high = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * u + 1))));
    return _mm512_or_si512(k_nibbles(p + 48, u), bit_bytes(low | high << 32, 16));
#else
    const __m256i bit = mask_bytes(_mm256_srli_epi16(qh, u), 1);
    return _mm256_or_si256(k_nibbles(p + 48, u), _mm256_slli_epi16(bit, 4));
#endif
  }
};

// Q6_K: two halves of 128 values, each 64 bytes of nibbles ql and 32 of 2-bit pairs qh: value l (< 32)
// of the half's four runs of 32 is ql[l] low, ql[l + 32] low, ql[l] high, ql[l + 32] high, with
// bits 0-1, 2-3, 4-5, 6-7 of qh[l] on top; scales int8 at byte 192, d at 208.
struct Q6_K {
  static constexpr int kType = 14, kBlockValues = 256, kBlockBytes = 210;
  static constexpr bool kSigned = false, kIntegerScales = true, kSignedScales = true;
  static constexpr int kWindow = window_vectors(63 * 128);
  static void scales(const uint8_t* p, int, VecF* s, VecF* c) {
    bytes_as_floats<true>(load16(p + 192), s);
    const VecF d = VecF::set1(half(p + 208));
    for (int j = 0; j < kGroupVectors; ++j) {
      s[j] = s[j] * d;
      c[j] = s[j] * VecF::set1(-32.f);
    }
  }
  static VecB codes(const uint8_t* p, int u, int) {
#if defined(PAGEDLLM_AVX512)
    const int half = u / 2, high_nibbles = u % 2;
    const __m512i ql = _mm512_loadu_si512(p + 64 * half);
    const __m512i low = mask_bytes(high_nibbles ? _mm512_srli_epi16(ql, 4) : ql, 15);
    const __m512i qh = _mm512_broadcast_i64x4(load32(p + 128 + 32 * half));
    const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(4 * high_nibbles)),
                                              _mm256_set1_epi16(static_cast<short>(4 * high_nibbles + 2)), 1);
    return _mm512_or_si512(low, _mm512_slli_epi16(mask_bytes(_mm512_srlv_epi16(qh, shifts), 3), 4));
#else
    const int half = u / 4, run = u % 4;
    const __m256i ql = load32(p + 64 * half + 32 * (run % 2));
    const __m256i low = mask_bytes(run / 2 ? _mm256_srli_epi16(ql, 4) : ql, 15);
    const __m256i qh = load32(p + 128 + 32 * half);
    return _mm256_or_si256(low, _mm256_slli_epi16(mask_bytes(_mm256_srli_epi16(qh, 2 * run), 3), 4));
#endif
  }
  static IntegerChunk integer_chunk(const uint8_t* p) {
    IntegerChunk chunk{broadcast_bytes(load16(p + 192)), half(p + 208), {}};
    bytes_as_floats<true>(load16(p + 192), chunk.offsets);
    const VecF minus_32d = VecF::set1(-32.f * chunk.d);
    for (int j = 0; j < kGroupVectors; ++j) chunk.offsets[j] = chunk.offsets[j] * minus_32d;
    return chunk;
  }
  static const ScaleIndex& scale_index() { return kScalePerGroup; }
  // Code vector v (vector_sub_block's order). AVX-512: runs 0 and 2 of a half (j = 0: ql's first 32
  // bytes' low and high nibbles, qh's bits 0-1 and 4-5) or runs 1 and 3 (j = 1: ql's next 32, bits 2-3 and
  // 6-7), the high bits rotated to bits 4-5 of their byte.
  static VecB integer_codes(const uint8_t* p, int v) {
#if defined(PAGEDLLM_AVX512)
    const int half = v / 2, j = v % 2;
    const __m512i ql = _mm512_broadcast_i64x4(load32(p + 64 * half + 32 * j));
    const __m512i qh = _mm512_broadcast_i64x4(load32(p + 128 + 32 * half));
    const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i bits_rotate = _mm512_inserti64x4(_mm512_set1_epi32(4 - 2 * j), _mm256_set1_epi32((32 - 2 * j) % 32), 1);
    return _mm512_or_si512(mask_bytes(_mm512_srlv_epi16(ql, nibble_shift), 15),
                           mask_bytes(_mm512_rolv_epi32(qh, bits_rotate), 0x30));
#else
    return codes(p, v, 8);
#endif
  }
  // 4-code lanes a 16-bit sum takes (2: each lane's pair of u q at most 2 x 63 x 127), and the lanes one
  // sub-scale spans (16 values)
  static constexpr int kSumCodes = 2, kScaleCodes = 4;
  // values an offset's multiplier spans (a group's sc), and the runs of them in a chunk
  static constexpr int kOffsetValues = 16, kOffsetRuns = kChunkValues / kOffsetValues;
  static ByteChunk byte_chunk(const uint8_t* p) {
    const __m128i scales = load16(p + 192);
    const float d = half(p + 208);
    return {broadcast_bytes(scales), _mm256_cvtepi8_epi16(scales), _mm_setr_ps(d, -32.f * d, d, -32.f * d)};
  }
  static void interleave(const uint8_t* const* p, ByteRows& out) {
    interleave_codes<Q6_K>(p, out.codes);
    __m256i first[kByteRows], second[kByteRows], pairs[kByteRows];
    alignas(32) float d[kByteRows], c[kByteRows];
    for (int r = 0; r < kByteRows; ++r) {
      const __m128i scales = load16(p[r] + 192);
      first[r] = _mm256_cvtepi8_epi32(scales);
      second[r] = _mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8));
      pairs[r] = _mm256_cvtepi8_epi16(scales);
      d[r] = half(p[r] + 208);
      c[r] = -32.f * d[r];
    }
    transpose8(first);  // first[g], second[g]: group g's, group 8 + g's
    transpose8(second);
    transpose8(pairs);
    for (int s = 0; s < kGroups; ++s) {  // group s of the codes' order: half s % 2 of run s / 2
      const int g = 2 * run_sub_block(s / 2) + s % 2;
      out.scales[s] = tile_scales(g < kByteRows ? first[g] : second[g - kByteRows]);
    }
    for (int j = 0; j < kOffsetRuns / 2; ++j) out.multipliers[j] = pairs[j];  // groups 2j and 2j + 1's sc
    out.d = _mm256_load_ps(d);
    out.c = _mm256_load_ps(c);
  }
};

// Calls fn(T{}) for ggml type number `type`; false if it is not one of these.
template <typename Fn>
bool with_type(int64_t type, const Fn& fn) {
  switch (type) {
    case Q4_0::kType: fn(Q4_0{}); return true;
    case Q4_1::kType: fn(Q4_1{}); return true;
    case Q5_0::kType: fn(Q5_0{}); return true;
    case Q5_1::kType: fn(Q5_1{}); return true;
    case Q8_0::kType: fn(Q8_0{}); return true;
    case Q4_K::kType: fn(Q4_K{}); return true;
    case Q5_K::kType: fn(Q5_K{}); return true;
    case Q6_K::kType: fn(Q6_K{}); return true;
    default: return false;
  }
}

// Bytes of a row of `cols` values of type T (cols a multiple of its block).
template <typename T>
int64_t row_bytes(int64_t cols) {
  return cols / T::kBlockValues * T::kBlockBytes;
}
// Bytes of one chunk of 256 values.
template <typename T>
constexpr int64_t chunk_bytes() {
  return kChunkValues / T::kBlockValues * T::kBlockBytes;
}

// Chunk k (256 values, fewer at the end of a row of 32-value blocks) of a row of `cols` values as float32
// at out: the values the reference dequantizer gives, bit for bit.
template <typename T>
void dequantize_chunk(const uint8_t* row, int64_t k, int64_t cols, float* out) {
  const uint8_t* p = row + k * chunk_bytes<T>();
  const int blocks = static_cast<int>(std::min<int64_t>(8, (cols - k * kChunkValues) / 32));
  VecF s[kGroupVectors], c[kGroupVectors];
  T::scales(p, blocks, s, c);
  // each group's s and c broadcast from memory (a load each: a permute of the group vectors per value
  // competed with code_floats' for the one shuffle port)
  alignas(64) float scale[kGroups], offset[kGroups];
  for (int j = 0; j < kGroupVectors; ++j) {
    s[j].store(scale + j * VecF::kWidth);
    c[j].store(offset + j * VecF::kWidth);
  }
  for (int u = 0; u * kUnitValues < blocks * 32; ++u) {
    const VecB codes = T::codes(p, u, blocks);
    for (int j = 0; j < kUnitValues / VecF::kWidth; ++j) {
      const int v = u * kUnitValues + j * VecF::kWidth;
      if (v >= blocks * 32) break;
      const int g = vector_group(u, j);
      fmadd(code_floats<T::kSigned>(codes, j), VecF::set1(scale[g]), VecF::set1(offset[g])).store(out + v);
    }
  }
}

// A row of `cols` values as float32.
template <typename T>
void dequantize_row(const uint8_t* row, int64_t cols, float* out) {
  for (int64_t k = 0; k * kChunkValues < cols; ++k) dequantize_chunk<T>(row, k, cols, out + k * kChunkValues);
}

}  // namespace quants
}  // namespace pagedllm
