// Matmuls over a weight stored row after row: out[M, N] = x[M, K] W[N, K]^T (+ bias[N]) (+ residual[M, N]).
//
// The weight formats (each row of W one contiguous run of memory, rows in order):
//   float32 / bf16  W itself
//   int8            q [N, K] int8:  W[n, k] = scale[n, k / g] * q[n, k] (+ min[n, k / g])
//   int4            q [N, K / 2] uint8, two unsigned 4-bit values a byte: in each run of 32 columns byte i
//                   holds column i in its low nibble and column i + 16 in its high nibble (the layout of
//                   GGUF's Q4_0 / Q4_1 blocks);  W[n, k] = scale[n, k / g] * q[n, k] + min[n, k / g]
// g is the group size; scales and mins are [N, K / g], float32 or float16. And one format not row after
// row: float32 packed in panels of 48 columns, [ceil(N / 48), K, 48] (see panel_matmul), with N passed as
// group_size: the default float32 storage on AVX-512 CPUs, multiplied by register tiles at any row count.
//
// One storage serves both regimes:
//   few rows of x (decode): each weight is read once from memory, converted to float in registers and
//   multiplied with every row of x; output rows are split between threads. Bound by memory bandwidth.
//   many rows (prefill, batched decode): each thread converts (or copies) a panel of weight rows once
//   into a float32 buffer that stays in cache, then runs register tiles of dot products (4 rows of x by
//   4 rows of W) over it. Bound by arithmetic: on par with oneDNN's prepacked fp32 GEMM here
//   (docs/BENCHMARKS.md, `pagedllm bench linear`), without a second, prepacked copy of the weight.
// Sums are float32 whatever the storage; x may be float32 or bf16 (converted to float32 first), out has
// x's dtype. A bf16 x on a bf16 weight at more rows than are streamed goes to torch's matmul instead
// (oneDNN's AVX512-BF16 GEMM on the same plain weight), which float32 arithmetic cannot match.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/add.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <algorithm>
#include <new>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "quants.h"
#include "simd.h"

namespace pagedllm {
namespace {

constexpr int kTileRows = 4;             // rows of x in one register tile
constexpr int kTileCols = 4;             // rows of W in one register tile
constexpr int64_t kPanelRows = 32;       // rows of W in one work item
constexpr int64_t kChunkRows = 256;      // rows of x in one work item (many-row regime)
constexpr int64_t kStreamRows = 4;       // up to this many rows of x, weights are streamed (codes: integer path)
constexpr int64_t kBlockStreamRows = 16; // the same for GGUF blocks, in register tiles of kRowGroup rows
constexpr int kRowGroup = 4;
constexpr int64_t kSpanChunks = 8;       // chunks of 256 columns of x those rows take in turn
constexpr int64_t kRowsAhead = 4;        // weight rows ahead whose span's bytes are prefetched
constexpr int64_t kWholeRows = 2;        // up to this many rows of x, the 32-value types walk whole weight rows
constexpr int64_t kIntegerChunkRows = 128;  // rows of int16 x (int8: twice) a work item of the integer path takes
constexpr int64_t kNarrowIntegerRows = 64;  // from this many rows of int16 x, K types on AVX2 take the float panels
constexpr int64_t kTaskWork = 1 << 17;   // multiply-adds a parallel task should have (a spinning thread starts in ~1 us)

// A std::vector whose data starts on a 64-byte cache line. The quantized rows of x below are read a
// vector at a time: from std::vector's 16-byte alignment each 64-byte load of them spanned two lines,
// which doubled the K types' time per chunk at 8-16 rows of x (docs/JOURNAL.md).
template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kLine{64};
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kLine)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kLine); }
  bool operator==(const LineAllocator&) const { return true; }
  bool operator!=(const LineAllocator&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// Lanes of vector j of a unit with `valid` columns.
inline int lanes(int valid, int j) { return std::clamp(valid - j * VecF::kWidth, 0, VecF::kWidth); }

inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return _cvtsh_ss(v.x); }

// A source of weight rows as floats. for_each_unit<R>(n, fn) calls fn(k, w, valid) for the runs
// ("units") of columns of rows n .. n + R - 1 in order: w[r * kVectors + j] holds row n + r's columns
// k + j * kWidth onwards; `valid` < kVectors * kWidth only for the last unit of a float row whose length
// is not a multiple of it (the lanes beyond it are zero). Each of a unit's vectors is summed in its own
// chain of multiply-adds: one chain's latency (4 cycles a vector) left a streamed row at a third of
// what the arithmetic units can do.
template <typename W, int V>
struct DenseRows {
  static constexpr int kVectors = V;
  const W* data;
  int64_t ld, cols;

  template <int R, typename Fn>
  void for_each_unit(int64_t n, const Fn& fn) const {
    constexpr int64_t kUnit = V * VecF::kWidth;
    VecF w[R * V];
    int64_t k = 0;
    for (; k + kUnit <= cols; k += kUnit) {
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) w[r * V + j] = VecF::load(data + (n + r) * ld + k + j * VecF::kWidth);
      fn(k, w, static_cast<int>(kUnit));
    }
    if (k < cols) {
      const int valid = static_cast<int>(cols - k);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) w[r * V + j] = load(data + (n + r) * ld + k + j * VecF::kWidth, lanes(valid, j));
      fn(k, w, valid);
    }
  }
};

// Per-group scales (and mins) of a quantized weight, broadcast for R rows at group g.
template <typename S>
struct Groups {
  const S* scales;
  const S* mins;  // null: no offset
  int64_t size, per_row;

  template <int R>
  void load(int64_t n, int64_t g, VecF* scale, VecF* min) const {
    for (int r = 0; r < R; ++r) {
      scale[r] = VecF::set1(to_float(scales[(n + r) * per_row + g]));
      if (mins != nullptr) min[r] = VecF::set1(to_float(mins[(n + r) * per_row + g]));
    }
  }
};

// int8 values, kUnit (16 or 32, dividing the group size) columns a unit.
template <typename S, int kUnit>
struct Int8Rows {
  static constexpr int kVectors = kUnit / VecF::kWidth;
  const int8_t* data;
  int64_t ld, cols;  // ld in bytes
  Groups<S> groups;

  template <int R, typename Fn>
  void for_each_unit(int64_t n, const Fn& fn) const {
    if (groups.mins != nullptr) {
      run<R, true>(n, fn);
    } else {
      run<R, false>(n, fn);
    }
  }

  template <int R, bool kMin, typename Fn>
  void run(int64_t n, const Fn& fn) const {
    VecF scale[R], min[R], w[R * kVectors];
    for (int64_t g = 0; g < groups.per_row; ++g) {
      groups.template load<R>(n, g, scale, min);
      for (int64_t k = g * groups.size; k < (g + 1) * groups.size; k += kUnit) {
        for (int r = 0; r < R; ++r) {
          const int8_t* q = data + (n + r) * ld + k;
          for (int j = 0; j < kVectors; ++j) {
            const VecF v = VecF::load(q + j * VecF::kWidth);
            w[r * kVectors + j] = kMin ? fmadd(v, scale[r], min[r]) : v * scale[r];
          }
        }
        fn(k, w, kUnit);
      }
    }
  }
};

// Pairs of 4-bit values, 32 columns (16 bytes) a unit; always with mins.
template <typename S>
struct Int4Rows {
  static constexpr int kUnit = 32;
  static constexpr int kVectors = kUnit / VecF::kWidth;
  const uint8_t* data;
  int64_t ld, cols;  // ld in bytes
  Groups<S> groups;

  template <int R, typename Fn>
  void for_each_unit(int64_t n, const Fn& fn) const {
    constexpr int kHalf = kVectors / 2;  // vectors of low nibbles (columns 0-15) = of high ones (16-31)
    VecF scale[R], min[R], w[R * kVectors];
    for (int64_t g = 0; g < groups.per_row; ++g) {
      groups.template load<R>(n, g, scale, min);
#if defined(PAGEDLLM_AVX512)
      VecF table[R];  // the group's 16 values: one lookup a vector (the same values scale * q + min give)
      for (int r = 0; r < R; ++r) table[r] = nibble_table(scale[r], min[r]);
#endif
      for (int64_t k = g * groups.size; k < (g + 1) * groups.size; k += kUnit) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* q = data + (n + r) * ld + k / 2;
#if defined(PAGEDLLM_AVX512)
          lookup_nibbles(q, table[r], w[r * kVectors], w[r * kVectors + 1]);
#else
          for (int j = 0; j < kHalf; ++j) {
            VecF low, high;
            VecF::load_nibbles(q + j * VecF::kWidth, low, high);
            w[r * kVectors + j] = fmadd(low, scale[r], min[r]);
            w[r * kVectors + kHalf + j] = fmadd(high, scale[r], min[r]);
          }
#endif
        }
        fn(k, w, kUnit);
      }
    }
  }
};

// Writes out[m, n] = sum (+ bias[n]) (+ residual[m, n]) in out's dtype (float32 or bf16).
struct Epilogue {
  void* out;
  const void* bias;
  const void* residual;
  int64_t ld_out, ld_residual;
  bool bf16;

  // Into out [m, n] (row-major, float32 or bf16), with bias and residual of out's dtype where given.
  static Epilogue into(const at::Tensor& out, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual) {
    return {out.data_ptr(), bias.has_value() ? bias->data_ptr() : nullptr,
            residual.has_value() ? residual->data_ptr() : nullptr, out.size(1),
            residual.has_value() ? residual->stride(0) : 0, out.scalar_type() == at::kBFloat16};
  }

  float read(const void* p, int64_t i) const {
    return bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  void store(int64_t m, int64_t n, float sum) const {
    if (bias != nullptr) sum += read(bias, n);
    if (residual != nullptr) sum += read(residual, m * ld_residual + n);
    if (bf16) {
      static_cast<c10::BFloat16*>(out)[m * ld_out + n] = c10::BFloat16(sum);
    } else {
      static_cast<float*>(out)[m * ld_out + n] = sum;
    }
  }
  VecF read_vector(const void* p, int64_t i, int valid) const {
    return bf16 ? load(static_cast<const c10::BFloat16*>(p) + i, valid) : load(static_cast<const float*>(p) + i, valid);
  }
  // store(m, n + i, sums[i]) for i < count, a vector at a time (the same values).
  void store_row(int64_t m, int64_t n, const float* sums, int64_t count) const {
    for_each_chunk(count, [&](int64_t i, int valid) {
      VecF sum = load(sums + i, valid);
      if (bias != nullptr) sum = sum + read_vector(bias, n + i, valid);
      if (residual != nullptr) sum = sum + read_vector(residual, m * ld_residual + n + i, valid);
      if (bf16) {
        pagedllm::store(sum, static_cast<c10::BFloat16*>(out) + m * ld_out + n + i, valid);
      } else {
        pagedllm::store(sum, static_cast<float*>(out) + m * ld_out + n + i, valid);
      }
    });
  }
};

// The MR x R dot products of x rows [m, m + MR) with weight rows [n, n + R), stored through the epilogue
// (at output column n + col_offset).
template <int MR, int R, typename Source>
void tile(const Source& src, int64_t n, const float* x, int64_t ld_x, int64_t m, const Epilogue& out,
          int64_t col_offset) {
  constexpr int V = Source::kVectors;
  VecF acc[MR][R][V];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < V; ++j) acc[i][r][j] = VecF::zero();
  const float* xm = x + m * ld_x;
  src.template for_each_unit<R>(n, [&](int64_t k, const VecF* w, int valid) {
    for (int j = 0; j < V; ++j) {
      for (int i = 0; i < MR; ++i) {
        const float* xk = xm + i * ld_x + k + j * VecF::kWidth;
        const VecF xv = valid == V * VecF::kWidth ? VecF::load(xk) : load(xk, lanes(valid, j));
        for (int r = 0; r < R; ++r) acc[i][r][j] = fmadd(xv, w[r * V + j], acc[i][r][j]);
      }
    }
  });
  for (int i = 0; i < MR; ++i) {
    VecF sum[R];
    for (int r = 0; r < R; ++r) {
      sum[r] = acc[i][r][0];
      for (int j = 1; j < V; ++j) sum[r] = sum[r] + acc[i][r][j];
    }
    if constexpr (R == 4) {
      alignas(16) float sums[4];
      _mm_store_ps(sums, reduce_add4(sum[0], sum[1], sum[2], sum[3]));
      for (int r = 0; r < 4; ++r) out.store(m + i, n + col_offset + r, sums[r]);
    } else {
      for (int r = 0; r < R; ++r) out.store(m + i, n + col_offset + r, reduce_add(sum[r]));
    }
  }
}

template <int R, typename Source>
void tile_rows(int mr, const Source& src, int64_t n, const float* x, int64_t ld_x, int64_t m, const Epilogue& out,
               int64_t col_offset) {
  switch (mr) {
    case 1: return tile<1, R>(src, n, x, ld_x, m, out, col_offset);
    case 2: return tile<2, R>(src, n, x, ld_x, m, out, col_offset);
    case 3: return tile<3, R>(src, n, x, ld_x, m, out, col_offset);
    default: return tile<4, R>(src, n, x, ld_x, m, out, col_offset);
  }
}

// out[m0:m1, n0 + col_offset : n1 + col_offset] from source rows [n0, n1). Streaming from memory, one
// row of W at a time (a single sequential stream: four rows read side by side left the hardware
// prefetcher at half the bandwidth); from cache, register tiles of four rows.
template <typename Source>
void block(const Source& src, int64_t n0, int64_t n1, const float* x, int64_t ld_x, int64_t m0, int64_t m1,
           const Epilogue& out, int64_t col_offset, bool stream) {
  for (int64_t m = m0; m < m1; m += kTileRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kTileRows, m1 - m));
    int64_t n = n0;
    if (!stream) {
      for (; n + kTileCols <= n1; n += kTileCols) tile_rows<kTileCols>(mr, src, n, x, ld_x, m, out, col_offset);
    }
    for (; n < n1; ++n) tile_rows<1>(mr, src, n, x, ld_x, m, out, col_offset);
  }
}

// Rows [n0, n1) of the source as float32 into buf (row-major, ld = cols).
template <typename Source>
void convert_rows(const Source& src, int64_t n0, int64_t n1, int64_t cols, float* buf) {
  for (int64_t n = n0; n < n1; ++n) {
    float* row = buf + (n - n0) * cols;
    src.template for_each_unit<1>(n, [&](int64_t k, const VecF* w, int valid) {
      for (int j = 0; j < Source::kVectors; ++j) store(w[j], row + k + j * VecF::kWidth, lanes(valid, j));
    });
  }
}

template <typename Source>
void matmul(const Source& src, int64_t n_rows, int64_t cols, const float* x, int64_t m_rows, const Epilogue& out) {
  const bool stream = m_rows <= kStreamRows;
  const int64_t chunk_rows = stream ? m_rows : kChunkRows;
  const int64_t chunks = (m_rows + chunk_rows - 1) / chunk_rows;
  const int64_t panels = (n_rows + kPanelRows - 1) / kPanelRows;
  const int64_t item_work = kPanelRows * cols * std::min(chunk_rows, m_rows);
  at::parallel_for(0, panels * chunks, std::max<int64_t>(1, kTaskWork / item_work), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = (item / chunks) * kPanelRows, n1 = std::min(n0 + kPanelRows, n_rows);
      const int64_t m0 = (item % chunks) * chunk_rows, m1 = std::min(m0 + chunk_rows, m_rows);
      if (stream) {
        block(src, n0, n1, x, cols, m0, m1, out, 0, stream);
      } else {
        static thread_local std::vector<float> buffer;
        buffer.resize(kPanelRows * cols);
        convert_rows(src, n0, n1, cols, buffer.data());
        const DenseRows<float, 1> panel{buffer.data(), cols, cols};  // 4 x 4 tiles: chains enough
        block(panel, 0, n1 - n0, x, cols, m0, m1, out, n0, false);
      }
    }
  });
}

// A few rows of x (a decode step: up to kStreamRows) against int8 / int4 codes, in integer arithmetic:
// each 32-column block of an x row is rounded to int16 values with one float scale (max |x| / 32767: a
// relative error of 1.5e-5, where llama.cpp's int8 blocks cost SmolLM2 2.5% perplexity), and a weight
// row's codes, widened to 16 bits, meet them in multiply-adds of 16-bit pairs (32 products an
// instruction, where the float path converts every code to float and does one multiply-add for it). The
// float work is per block:
//   x . w_n = sum_b scale_w(n, b) scale_x(b) sum_i q_w q_x  +  min_w(n, b) sum_i x_i
// with each block's exact float sum of x in the min term. Used for groups of whole blocks (32 | g). At
// more rows the float path's register tiles over a converted panel do more work per instruction (a
// batch of 64 requests ran 1.6x faster with it), so a row's result there differs in the fifth digit.
constexpr int64_t kBlock = 32;

// Rows of x as int16 blocks, each unit of kUnitBlocks blocks in WideCodes' order; `padded` rounds the
// blocks up to a chunk (kWidth blocks), zeros beyond.
struct QuantizedRows {
  int64_t blocks, padded;
  LineVector<int16_t> q;         // [rows, padded * kBlock]
  LineVector<float> scale, sum;  // [rows, padded]

  QuantizedRows(const float* x, int64_t rows, int64_t cols)
      : blocks(cols / kBlock),
        padded((cols / kBlock + VecF::kWidth - 1) / VecF::kWidth * VecF::kWidth),
        q(rows * padded * kBlock, 0),
        scale(rows * padded, 0.f),
        sum(rows * padded, 0.f) {
    constexpr int kVectors = kBlock / VecF::kWidth;
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* src = x + m * cols + b * kBlock;
        VecF v[kVectors], amax = VecF::zero(), total = VecF::zero();
        for (int j = 0; j < kVectors; ++j) {
          v[j] = VecF::load(src + j * VecF::kWidth);
          amax = max(amax, max(v[j], VecF::zero() - v[j]));
          total = total + v[j];
        }
        const float d = reduce_max(amax) / 32767.f;
        const VecF inverse = VecF::set1(d > 0.f ? 1.f / d : 0.f);
        // the unit's first halves of its blocks, then their second halves
        int16_t* unit = q.data() + (m * padded + b / kUnitBlocks * kUnitBlocks) * kBlock;
        for (int j = 0; j < kVectors; ++j) {
          const int64_t column = j * VecF::kWidth, half = column / 16;
          store_int16(v[j] * inverse, unit + (half * kUnitBlocks + b % kUnitBlocks) * 16 + column % 16);
        }
        scale[m * padded + b] = d;
        sum[m * padded + b] = reduce_add(total);
      }
    }
  }
  const int16_t* codes(int64_t m, int64_t b) const { return q.data() + (m * padded + b) * kBlock; }
  VecF scales(int64_t m, int64_t b) const { return VecF::load(scale.data() + m * padded + b); }
  VecF sums(int64_t m, int64_t b) const { return VecF::load(sum.data() + m * padded + b); }
};

// A weight's codes (int8, or int4 as packed pairs) with their group scales and mins.
template <typename S, bool kInt4>
struct CodeRows {
  const uint8_t* data;
  int64_t ld;  // bytes a row
  Groups<S> groups;

  // Blocks [b, b + blocks) of row n, widened.
  WideCodes unit(int64_t n, int64_t b, int blocks) const {
    if constexpr (kInt4) {
      return widen_nibbles(data + n * ld + b * kBlock / 2, blocks);
    } else {
      return widen_int8(reinterpret_cast<const int8_t*>(data + n * ld + b * kBlock), blocks);
    }
  }

  // Row n's scales (or mins) of blocks [b, b + valid), one a lane, zero beyond.
  VecF per_block(const S* values, int64_t n, int64_t b, int valid) const {
    const int64_t per_group = groups.size / kBlock;
    const S* row = values + n * groups.per_row;
    if (per_group == 1) return load(row + b, valid);
    if (groups.per_row == 1) return VecF::set1(to_float(row[0]));
    alignas(64) float lanes[VecF::kWidth] = {};
    for (int l = 0; l < valid; ++l) lanes[l] = to_float(row[(b + l) / per_group]);
    return VecF::load(lanes);
  }
};

// out[0 .. MR, n] for one weight row n.
template <int MR, typename Rows>
void integer_row(const Rows& w, int64_t n, const QuantizedRows& x, const Epilogue& out) {
  constexpr int kUnits = VecF::kWidth / kUnitBlocks;  // units a chunk of kWidth blocks
  VecF acc[MR], acc_min[MR];
  for (int i = 0; i < MR; ++i) acc[i] = acc_min[i] = VecF::zero();
  // Units [0, units) of the chunk of blocks from c, the last one holding `last` blocks.
  const auto chunk = [&](int64_t c, int valid, int units, int last) {
    const VecF w_scales = w.per_block(w.groups.scales, n, c, valid);
    VecF scales[MR];
    for (int i = 0; i < MR; ++i) scales[i] = w_scales * x.scales(i, c);
    if (w.groups.mins != nullptr) {
      const VecF w_mins = w.per_block(w.groups.mins, n, c, valid);
      for (int i = 0; i < MR; ++i) acc_min[i] = fmadd(w_mins, x.sums(i, c), acc_min[i]);
    }
    for (int u = 0; u < units; ++u) {
      const int64_t b = c + u * kUnitBlocks;
      const WideCodes codes = w.unit(n, b, u + 1 == units ? last : kUnitBlocks);
      for (int i = 0; i < MR; ++i) {
        const VecF sums = VecF::from_int(dot(codes, x.codes(i, b)));
        acc[i] = fmadd(sums, unit_lanes(scales[i], u), acc[i]);
      }
    }
  };
  int64_t c = 0;
  for (; c + VecF::kWidth <= x.blocks; c += VecF::kWidth) chunk(c, VecF::kWidth, kUnits, kUnitBlocks);
  if (c < x.blocks) {
    const int valid = static_cast<int>(x.blocks - c);
    const int units = (valid + kUnitBlocks - 1) / kUnitBlocks;
    chunk(c, valid, units, valid - (units - 1) * kUnitBlocks);
  }
  for (int i = 0; i < MR; ++i) out.store(i, n, reduce_add(acc[i] + acc_min[i]));
}

// The few rows of x (up to kStreamRows) against every weight row, panels of rows split between threads.
template <typename Rows>
void integer_matmul(const Rows& w, int64_t n_rows, int64_t cols, const float* x, int64_t m_rows,
                    const Epilogue& out) {
  const QuantizedRows qx(x, m_rows, cols);
  const int64_t panels = (n_rows + kPanelRows - 1) / kPanelRows;
  const int64_t item_work = kPanelRows * cols * m_rows;
  at::parallel_for(0, panels, std::max<int64_t>(1, kTaskWork / item_work), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * kPanelRows; n < std::min(end * kPanelRows, n_rows); ++n) {
      switch (m_rows) {
        case 1: integer_row<1>(w, n, qx, out); break;
        case 2: integer_row<2>(w, n, qx, out); break;
        case 3: integer_row<3>(w, n, qx, out); break;
        default: integer_row<4>(w, n, qx, out); break;
      }
    }
  });
}

// A float32 weight packed in panels (Python's pack_panels): W [N, K] as [ceil(N / 48), K, 48], panel p
// holding columns 48p .. 48p + 47 of out (zeros past N) one k after another. A register tile of MR rows of
// x by a panel's 48 columns broadcasts x[m, k] and multiplies it into the panel's row k: every weight
// loaded feeds MR multiply-adds, and the panel (110-300 KB at these sizes) stays in L2 for the next MR
// rows. One storage serves one row (the panel streamed once from memory) up to a prefill's thousands.
constexpr int64_t kPanelCols = 48;
constexpr int kPanelVectors = kPanelCols / VecF::kWidth;
// A register tile's rows of x and vectors of the panel: 8 rows by the whole panel in AVX-512's 32
// registers; in AVX2's 16, 4 rows by half the panel, each half in turn (2 rows by the whole panel loaded
// 6 weight vectors for 12 multiply-adds, and ran at 85 GFLOP/s, 39% of the arithmetic's rate).
constexpr int kPanelTileRows = VecF::kWidth == 16 ? 8 : 4;
constexpr int kTileVectors = VecF::kWidth == 16 ? kPanelVectors : kPanelVectors / 2;

// out[m0 .. m0 + MR, panel p's vectors j0 .. j0 + kTileVectors] = x rows . panel (+ bias) (+ residual). A
// tile of few rows keeps KU sets of sums over alternate k so that enough multiply-adds are in flight (4
// cycles of latency each).
template <int MR, int KU>
void panel_tile(const float* panel, const float* x, int64_t ld_x, int64_t cols, float* out, int64_t ld_out,
                const float* bias, const float* residual, int64_t ld_residual, int valid, int j0) {
  constexpr int V = kTileVectors;
  VecF acc[KU][MR][V];
  for (int u = 0; u < KU; ++u)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) acc[u][r][j] = VecF::zero();
  const float* slice = panel + j0 * VecF::kWidth;
  const auto step = [&](int u, int64_t k) {
    VecF w[V];
    for (int j = 0; j < V; ++j) w[j] = VecF::load(slice + k * kPanelCols + j * VecF::kWidth);
    for (int r = 0; r < MR; ++r) {
      const VecF b = VecF::set1(x[r * ld_x + k]);
      for (int j = 0; j < V; ++j) acc[u][r][j] = fmadd(b, w[j], acc[u][r][j]);
    }
  };
  int64_t k = 0;
  for (; k + KU <= cols; k += KU)
    for (int u = 0; u < KU; ++u) step(u, k + u);
  for (; k < cols; ++k) step(0, k);
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < V; ++j) {
      const int n = lanes(valid, j0 + j);
      if (n == 0) break;
      const int64_t c = (j0 + j) * VecF::kWidth;
      VecF sum = acc[0][r][j];
      for (int u = 1; u < KU; ++u) sum = sum + acc[u][r][j];
      if (bias != nullptr) sum = sum + load(bias + c, n);
      if (residual != nullptr) sum = sum + load(residual + r * ld_residual + c, n);
      store(sum, out + r * ld_out + c, n);
    }
  }
}

// Rows of x a panel multiplies before the next panel takes them: at most this many bytes of them, so
// that they stay in L2 while every panel of W passes over them (a prefill's x, megabytes, was read from
// L3 or memory again for each of the panels).
constexpr int64_t kPanelChunkBytes = 256 << 10;

// out[m_begin .. m_end, n .. n + valid] = x rows . the panel at output column n (+ bias) (+ residual).
void panel_rows(const float* panel, int64_t n, int valid, int64_t n_rows, int64_t cols, const float* x,
                int64_t m_begin, int64_t m_end, float* out, const float* bias, const float* residual,
                int64_t ld_residual) {
  const float* b = bias != nullptr ? bias + n : nullptr;
  for (int64_t m = m_begin; m < m_end; m += kPanelTileRows) {
    const float* xm = x + m * cols;
    float* om = out + m * n_rows + n;
    const float* rm = residual != nullptr ? residual + m * ld_residual + n : nullptr;
    with_count<kPanelTileRows>(m_end - m, [&](auto rows) {
      constexpr int MR = decltype(rows)::value;
      // ~12 sums in flight, within the registers; of kPanelVectors, not kTileVectors, so that each row keeps
      // the order of sums it had when an AVX2 tile took the whole panel
      constexpr int KU = std::max(1, 12 / (MR * kPanelVectors));
      for (int j0 = 0; j0 < kPanelVectors && lanes(valid, j0) > 0; j0 += kTileVectors)
        panel_tile<MR, KU>(panel, xm, cols, cols, om, n_rows, b, rm, ld_residual, valid, j0);
    });
  }
}

// out[M, N] = x[M, K] W^T (+ bias) (+ residual) on a panel-packed float32 W. Work items are (chunk of
// x's rows, panel), chunk after chunk: a thread's run of items takes every panel over one chunk in turn.
void panel_matmul(const float* packed, int64_t n_rows, int64_t cols, const float* x, int64_t m_rows, float* out,
                  const float* bias, const float* residual, int64_t ld_residual) {
  const int64_t panels = (n_rows + kPanelCols - 1) / kPanelCols;
  const int64_t fit = kPanelChunkBytes / (cols * static_cast<int64_t>(sizeof(float)));
  const int64_t chunk_rows = std::min(m_rows, std::max<int64_t>(kPanelTileRows, fit / kPanelTileRows * kPanelTileRows));
  const int64_t chunks = (m_rows + chunk_rows - 1) / chunk_rows;
  const int64_t item_work = kPanelCols * cols * chunk_rows;
  at::parallel_for(0, chunks * panels, std::max<int64_t>(1, kTaskWork / item_work), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i % panels, n = p * kPanelCols;
      const int64_t m_begin = i / panels * chunk_rows, m_end = std::min(m_rows, m_begin + chunk_rows);
      const int valid = static_cast<int>(std::min(kPanelCols, n_rows - n));
      panel_rows(packed + p * cols * kPanelCols, n, valid, n_rows, cols, x, m_begin, m_end, out, bias, residual,
                 ld_residual);
    }
  });
}

// GGUF's blocks as the file stores them (quants.h): weight uint8 [bytes], the rows of one or more
// shards one after another (q, k and v of a fused projection may differ in type), with `scales` an
// int64 [shards, 2] tensor of each shard's (rows, ggml type). x is rounded once a call, shared by every
// shard, and meets the codes, unpacked in registers, in integer multiply-adds:
//   Q4_K and Q6_K, at any number of rows (with AVX2 and int16 x, below kNarrowIntegerRows; from there as
//     the other types at more rows, below): x in int8 (blocks_int8, the default) or int16 blocks of 256
//     (ChunkActivations), each super-block one integer dot product with its integer sub-scales (quants.h,
//     "integer sub-scales");
//   the 32-value types where the invariant gate asks, at any number of rows: x in int16 with one scale per 256
//     values, each block one integer dot product and one float product, in one order at any row count
//     (pair_rows, below);
//   the other types (and the 32-value types below that), up to kBlockStreamRows rows: x in int16 blocks of 32
//     (ActivationBlocks), as for int8 / int4 codes above; per 16-value group g,
//       x . w = sum_g d_x(g) (s_w(g) sum_i u_i q_i + c_w(g) sum_i q_i)
//     (quants.h's s, c); on AVX2 the 32-value types a block at a time, the offset inside the codes where
//     it is implicit (block_units_row). More rows: each thread dequantizes a panel of weight rows once into a float32
//     buffer in cache (exactly the file's values) and runs the float path's register tiles over it.
// With group_size > 0 (set where the CPU multiplies bf16), from group_size rows of x on: the weight
// dequantized to bf16 and multiplied by oneDNN (bf16_blocks_linear, below), or on AMX panel by panel in
// cache (vnni_blocks_linear).
struct BlockShard {
  int64_t type, rows, first_row, row_bytes;
  const uint8_t* data;
};

std::vector<BlockShard> block_shards(const at::Tensor& weight, const c10::optional<at::Tensor>& layout, int64_t cols) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "GGUF blocks must be a contiguous uint8 tensor");
  TORCH_CHECK(layout.has_value() && layout->scalar_type() == at::kLong && layout->dim() == 2 && layout->size(1) == 2 &&
                  layout->is_contiguous(),
              "GGUF blocks need `scales` as a contiguous int64 [shards, 2] tensor of (rows, ggml type)");
  TORCH_CHECK(cols % 32 == 0, "GGUF blocks need x's columns (", cols, ") to be a multiple of 32");
  const int64_t* entry = layout->data_ptr<int64_t>();
  std::vector<BlockShard> shards;
  int64_t row = 0, offset = 0;
  for (int64_t i = 0; i < layout->size(0); ++i) {
    const int64_t rows = entry[2 * i], type = entry[2 * i + 1];
    int64_t bytes = -1;
    quants::with_type(type, [&](auto t) {
      using T = decltype(t);
      TORCH_CHECK(cols % T::kBlockValues == 0, "ggml type ", type, " needs columns in multiples of ",
                  T::kBlockValues, ", x has ", cols);
      bytes = quants::row_bytes<T>(cols);
    });
    TORCH_CHECK(bytes >= 0, "ggml type ", type, " (shard ", i, ") is not one the kernel reads");
    TORCH_CHECK(rows >= 0, "shard ", i, " has ", rows, " rows");
    shards.push_back({type, rows, row, bytes, weight.data_ptr<uint8_t>() + offset});
    row += rows;
    offset += rows * bytes;
  }
  TORCH_CHECK(offset == weight.numel(), "the shards' rows take ", offset, " bytes, the weight has ", weight.numel());
  return shards;
}

int64_t total_rows(const std::vector<BlockShard>& shards) {
  int64_t rows = 0;
  for (const BlockShard& s : shards) rows += s.rows;
  return rows;
}

// Rows of x as int16 blocks of 32 (scale max |x| / 32767), zero-padded to whole chunks of 256, each unit
// at quants::unit_position's places, with each 16-value group's scale and scale * (sum of its codes); for
// the types read in quads (quants::kQuads), where `quads` asks for them, also the codes in
// quants::quad_position's order with each block's scale and scale * (sum of its codes) in lanes 2b, 2b + 1
// of a chunk's 16 floats.
struct ActivationBlocks {
  int64_t cols, chunks, padded;
  LineVector<int16_t> q, quad_q;             // [rows, padded] each
  LineVector<float> scale, code_sum, pairs;  // [rows, padded / 16] each
  LineVector<float> block_sum;               // [rows, padded / 32]: each block's scale * (sum of its codes), AVX2

  ActivationBlocks(const float* x, int64_t rows, int64_t cols_, bool dots, bool quads)
      : cols(cols_),
        chunks((cols_ + quants::kChunkValues - 1) / quants::kChunkValues),
        padded(chunks * quants::kChunkValues),
        q(dots ? rows * padded : 0, 0),
        quad_q(quads ? rows * padded : 0, 0),
        scale(dots ? rows * padded / quants::kGroupValues : 0, 0.f),
        code_sum(dots ? rows * padded / quants::kGroupValues : 0, 0.f),
        pairs(quads ? rows * padded / quants::kGroupValues : 0, 0.f),
        block_sum(dots && VecF::kWidth == 8 ? rows * padded / 32 : 0, 0.f) {
    constexpr int kVectors = 32 / VecF::kWidth, kPerGroup = quants::kGroupValues / VecF::kWidth;
    constexpr int kUnit = quants::kUnitValues;
    alignas(64) int16_t codes[32];
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t b = 0; b < cols / 32; ++b) {
        const float* src = x + m * cols + b * 32;
        VecF v[kVectors], amax = VecF::zero();
        for (int j = 0; j < kVectors; ++j) {
          v[j] = VecF::load(src + j * VecF::kWidth);
          amax = max(amax, max(v[j], VecF::zero() - v[j]));
        }
        const float d = reduce_max(amax) / 32767.f;
        const VecF inverse = VecF::set1(d > 0.f ? 1.f / d : 0.f);
        float sums[2] = {0.f, 0.f};
        for (int j = 0; j < kVectors; ++j) {
          const VecF r = round_nearest(v[j] * inverse);
          store_int16(r, codes + j * VecF::kWidth);
          sums[j / kPerGroup] += reduce_add(r);
        }
        if (dots) {
          int16_t* row = q.data() + m * padded;
          for (int i = 0; i < 32; ++i) {
            const int64_t v_index = b * 32 + i, in_unit = v_index % kUnit;
            row[v_index - in_unit + quants::unit_position(static_cast<int>(in_unit))] = codes[i];
          }
          for (int g = 0; g < 2; ++g) {
            scale[(m * padded + b * 32) / quants::kGroupValues + g] = d;
            code_sum[(m * padded + b * 32) / quants::kGroupValues + g] = d * sums[g];
          }
#if !defined(PAGEDLLM_AVX512)
          block_sum[(m * padded + b * 32) / 32] = d * (sums[0] + sums[1]);  // exact: integers below 2^24
#endif
        }
#if defined(PAGEDLLM_AVX512)
        if (quads) {
          int16_t* chunk = quad_q.data() + m * padded + b / 8 * quants::kChunkValues;
          for (int i = 0; i < 32; ++i) chunk[quants::quad_position(static_cast<int>(b % 8), i)] = codes[i];
          float* pair = pairs.data() + (m * padded + b * 32) / quants::kGroupValues;
          pair[0] = d;
          pair[1] = d * (sums[0] + sums[1]);  // exact: integers below 2^24
        }
#endif
      }
    }
  }
  int blocks_in(int64_t k) const { return static_cast<int>(std::min<int64_t>(8, (cols - k * quants::kChunkValues) / 32)); }
  const int16_t* unit(int64_t m, int64_t k, int u) const {
    return q.data() + m * padded + k * quants::kChunkValues + u * quants::kUnitValues;
  }
  VecF scales(int64_t m, int64_t k, int j) const {
    return VecF::load(scale.data() + (m * padded + k * quants::kChunkValues) / quants::kGroupValues + j * VecF::kWidth);
  }
  VecF sums(int64_t m, int64_t k, int j) const {
    return VecF::load(code_sum.data() + (m * padded + k * quants::kChunkValues) / quants::kGroupValues + j * VecF::kWidth);
  }
  // Block b of chunk k: its scale, and its scale * (sum of its codes).
  float block_scale(int64_t m, int64_t k, int b) const {
    return scale[(m * padded + k * quants::kChunkValues) / quants::kGroupValues + 2 * b];
  }
  float block_code_sum(int64_t m, int64_t k, int b) const {
    return block_sum[(m * padded + k * quants::kChunkValues) / 32 + b];
  }
  const int16_t* quad_vector(int64_t m, int64_t k, int v) const {
    return quad_q.data() + m * padded + k * quants::kChunkValues + v * (quants::kChunkValues / 8);
  }
  VecF block_pairs(int64_t m, int64_t k) const {
    return VecF::load(pairs.data() + (m * padded + k * quants::kChunkValues) / quants::kGroupValues);
  }
};

// Asks for the lines of `bytes` bytes from p (into L1; a prefetch never faults, wherever p points).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(p) + line, _MM_HINT_T0);
}
// Asks for the lines of the chunk of type T at p.
template <typename T>
inline void prefetch_chunk(const uint8_t* p) {
  prefetch_bytes(p, quants::chunk_bytes<T>());
}

// A row's float sums over chunks [k0, k1) are reduced into its total at the end of each span of kSpanChunks
// chunks and at k1, and its chains are as many whatever MR: a row's bits are the same in any register tile
// and in a whole-row or a span walk (spans start at multiples of kSpanChunks), so in a call of any rows.
inline bool span_ends(int64_t k, int64_t k1) { return (k + 1) % kSpanChunks == 0 || k + 1 == k1; }

// sums[0 .. MR] += x rows m0 .. m0 + MR . chunks [k0, k1) of one weight row of type T, prefetching each
// chunk's bytes `ahead` on. Each x row sums its units in kBlockChains chains of multiply-adds (a unit's work
// is shorter than one multiply-add's latency), the same number at any MR (span_ends).
constexpr int kBlockChains = 4;
template <typename T, int MR>
void blocks_row(const uint8_t* row, const ActivationBlocks& x, int64_t m0, int64_t k0, int64_t k1, float* sums,
                int64_t ahead) {
  using namespace quants;
  constexpr int kUnits = kChunkValues / kUnitValues, kChains = kBlockChains;
  VecF acc[MR][kChains], offsets[MR];
  for (int i = 0; i < MR; ++i) {
    offsets[i] = VecF::zero();
    for (int j = 0; j < kChains; ++j) acc[i][j] = VecF::zero();
  }
  for (int64_t k = k0; k < k1; ++k) {
    const uint8_t* p = row + k * chunk_bytes<T>();
    prefetch_chunk<T>(p + ahead);
    const int blocks = x.blocks_in(k);
    VecF s[kGroupVectors], c[kGroupVectors], scale[MR][kGroupVectors];
    T::scales(p, blocks, s, c);
    for (int j = 0; j < kGroupVectors; ++j) {
      for (int i = 0; i < MR; ++i) {
        scale[i][j] = s[j] * x.scales(m0 + i, k, j);
        offsets[i] = fmadd(c[j], x.sums(m0 + i, k, j), offsets[i]);
      }
    }
    // unrolled (u a constant: unit_scales' indices fold, the chains stay in registers); a K super-block
    // has all kUnits
    const int units = T::kBlockValues == kChunkValues ? kUnits : (blocks * 32 + kUnitValues - 1) / kUnitValues;
    for (int u = 0; u < kUnits; ++u) {
      if (u >= units) break;
      const VecB codes = T::codes(p, u, blocks);
      for (int i = 0; i < MR; ++i) {
        const VecI dots = dot<T::kSigned>(codes, x.unit(m0 + i, k, u));
        acc[i][u % kChains] = fmadd(VecF::from_int(dots), unit_scales(scale[i], u), acc[i][u % kChains]);
      }
    }
    if (span_ends(k, k1)) {
      for (int i = 0; i < MR; ++i) {
        VecF sum = offsets[i];
        for (int j = 0; j < kChains; ++j) sum = sum + acc[i][j];
        sums[i] += reduce_add(sum);
        offsets[i] = VecF::zero();
        for (int j = 0; j < kChains; ++j) acc[i][j] = VecF::zero();
      }
    }
  }
}

#if !defined(PAGEDLLM_AVX512)
// blocks_row for the 32-value types on AVX2, where a unit is one block: each block's codes meet x in integer
// multiply-adds, their int32 sums one float multiply-add by d dx, in one chain a row of x (a block's work is
// longer than the multiply-add's latency). A block's codes are int16 words, less the type's offset where
// it is implicit (quants.h code_words), which leaves no offset term; Q4_1 / Q5_1 add m (dx sum q) a block,
// in a scalar chain. The per-chunk vectors of scales and offsets that blocks_row builds (8 loads of d, a
// conversion, permutes) took a fifth of a one-row call's time on Zen 3 (docs/JOURNAL.md, session 23).
template <typename T, int MR>
void block_units_row(const uint8_t* row, const ActivationBlocks& x, int64_t m0, int64_t k0, int64_t k1, float* sums,
                     int64_t ahead) {
  using namespace quants;
  VecF acc[MR];
  float offsets[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = VecF::zero();
    offsets[i] = 0.f;
  }
  for (int64_t k = k0; k < k1; ++k) {
    const uint8_t* p = row + k * chunk_bytes<T>();
    prefetch_chunk<T>(p + ahead);
    const int blocks = x.blocks_in(k);
    for (int b = 0; b < kChunkValues / 32; ++b) {
      if (b >= blocks) break;
      const uint8_t* block = p + b * T::kBlockBytes;
      const float d = half(block), m = T::kMinByte >= 0 ? half(block + T::kMinByte) : 0.f;
      const Words words = T::code_words(block);
      for (int i = 0; i < MR; ++i) {
        const VecI dots = words_dot(words, x.unit(m0 + i, k, b));
        acc[i] = fmadd(VecF::from_int(dots), VecF::set1(d * x.block_scale(m0 + i, k, b)), acc[i]);
        if constexpr (T::kMinByte >= 0) offsets[i] = std::fma(m, x.block_code_sum(m0 + i, k, b), offsets[i]);
      }
    }
    if (span_ends(k, k1)) {
      for (int i = 0; i < MR; ++i) {
        sums[i] += reduce_add(acc[i]) + offsets[i];
        acc[i] = VecF::zero();
        offsets[i] = 0.f;
      }
    }
  }
}
#endif

#if defined(PAGEDLLM_AVX512)
// blocks_row compiled as a function of its own, for Q8_0: inlined into blocks_matmul's work loop, its row
// took 2.0-2.2 ns a block against 1.55-1.65 alone (measured with GCC; why, not found); the other types'
// rows are 5-10% faster inlined (docs/JOURNAL.md, session 11).
template <typename T, int MR>
__attribute__((noinline)) void blocks_row_apart(const uint8_t* row, const ActivationBlocks& x, int64_t m0, int64_t k0,
                                                int64_t k1, float* sums, int64_t ahead) {
  blocks_row<T, MR>(row, x, m0, k0, k1, sums, ahead);
}

// blocks_row for the types read in quads (quants.h): per chunk and row of x, each quad's int32 sums of its
// four vectors' multiply-adds, converted once and multiplied by its blocks' d dx; the m dx (sum q) terms
// from the odd lanes of dm times the chunk's (dx, dx sum q) pairs.
template <typename T, int MR>
void quad_row(const uint8_t* row, const ActivationBlocks& x, int64_t m0, int64_t k0, int64_t k1, float* sums,
              int64_t ahead) {
  using namespace quants;
  VecF acc[MR][2], offsets[MR];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = offsets[i] = VecF::zero();
  for (int64_t k = k0; k < k1; ++k) {
    const uint8_t* p = row + k * chunk_bytes<T>();
    prefetch_chunk<T>(p + ahead);
    const int blocks = x.blocks_in(k);
    const QuadChunk chunk = q4_1_quads(p, blocks);
    VecB words[2][kQuadVectors];
    for (int q = 0; q < 2; ++q)
      for (int r = 0; r < kQuadVectors; ++r) words[q][r] = quad_vector(chunk.codes[q], r);
    for (int i = 0; i < MR; ++i) {
      const VecF scaled = chunk.dm * x.block_pairs(m0 + i, k);  // d dx, m dx sum q
      offsets[i] = _mm512_mask_add_ps(offsets[i].v, 0xaaaa, offsets[i].v, scaled.v);
      for (int q = 0; q < 2; ++q) {
        if (q * 4 >= blocks) break;
        VecI dots = _mm512_madd_epi16(words[q][0], _mm512_load_si512(x.quad_vector(m0 + i, k, 4 * q)));
        for (int r = 1; r < kQuadVectors; ++r) dots = add_products(dots, words[q][r], x.quad_vector(m0 + i, k, 4 * q + r));
        acc[i][q] = fmadd(VecF::from_int(dots), quad_scales(scaled, q), acc[i][q]);
      }
    }
    if (span_ends(k, k1)) {
      for (int i = 0; i < MR; ++i) {
        sums[i] += reduce_add(acc[i][0] + acc[i][1] + offsets[i]);
        acc[i][0] = acc[i][1] = offsets[i] = VecF::zero();
      }
    }
  }
}
#endif

// Rows of x with one scale per chunk of 256 values, for the K types' integer sub-scales (quants.h): as int8
// (`bytes`: max |x| / 127, llama.cpp's q8_K) at quants::run_position's places, or as int16 (max |x| / 32767)
// in quants::chunk_position's order; each chunk's scale dx, and each 16-value group's sum of its codes (int8
// x: the integer, for the offsets' N of byte_chunk_row and byte_tile, with each 32-value run's too; int16 x:
// times dx).
struct ChunkActivations {
  int64_t chunks;
  bool bytes;
  LineVector<int16_t> q;              // [rows, chunks * 256], int16 x
  LineVector<int8_t> q8;              // [rows, chunks * 256], int8 x
  LineVector<float> scale, code_sum;  // [rows, chunks], [rows, chunks * 16] (int16 x)
  LineVector<int16_t> group_sum;      // [rows, chunks * 16], int8 x: |sum| <= 16 * 127
  LineVector<int16_t> run_sum;        // [rows, chunks * 8], int8 x: |sum| <= 32 * 127

  ChunkActivations(const float* x, int64_t rows, int64_t cols, bool bytes_)
      : chunks(cols / quants::kChunkValues),
        bytes(bytes_),
        q(bytes_ ? 0 : rows * cols),
        q8(bytes_ ? rows * cols : 0),
        scale(rows * chunks),
        code_sum(bytes_ ? 0 : rows * chunks * quants::kGroups),
        group_sum(bytes_ ? rows * chunks * quants::kGroups : 0),
        run_sum(bytes_ ? rows * chunks * kRuns : 0) {
    constexpr int kValues = quants::kChunkValues, kVectors = kValues / VecF::kWidth;
    constexpr int kPerGroup = quants::kGroupValues / VecF::kWidth;
    static const std::vector<int> position = [] {
      std::vector<int> p(kValues);
      for (int i = 0; i < kValues; ++i) p[i] = quants::chunk_position(i);
      return p;
    }();
    const float largest = bytes ? 127.f : 32767.f;
    at::parallel_for(0, rows * chunks, 64, [&](int64_t begin, int64_t end) {
    alignas(64) int16_t codes[kValues];
    for (int64_t c = begin; c < end; ++c) {
      const float* src = x + c * kValues;
      VecF amax = VecF::zero();
      for (int j = 0; j < kVectors; ++j) {
        const VecF v = VecF::load(src + j * VecF::kWidth);
        amax = max(amax, max(v, VecF::zero() - v));
      }
      const float d = reduce_max(amax) / largest;
      const VecF inverse = VecF::set1(d > 0.f ? 1.f / d : 0.f);
      float sums[quants::kGroups] = {};
      for (int j = 0; j < kVectors; ++j) {
        const VecF r = round_nearest(VecF::load(src + j * VecF::kWidth) * inverse);
        store_int16(r, codes + j * VecF::kWidth);
        sums[j / kPerGroup] += reduce_add(r);  // exact: integers below 2^24
      }
      if (bytes) {
        for (int g = 0; g < quants::kGroups; ++g) group_sum[c * quants::kGroups + g] = static_cast<int16_t>(sums[g]);
        for (int r = 0; r < kRuns; ++r) run_sum[c * kRuns + r] = static_cast<int16_t>(sums[2 * r] + sums[2 * r + 1]);
        int8_t* out = q8.data() + c * kValues;
        for (int r = 0; r < kValues / 32; ++r)
          for (int l = 0; l < 32; ++l) out[quants::run_position(r) + l] = static_cast<int8_t>(codes[32 * r + l]);
      } else {
        for (int g = 0; g < quants::kGroups; ++g) code_sum[c * quants::kGroups + g] = sums[g] * d;
        int16_t* out = q.data() + c * kValues;
        for (int i = 0; i < kValues; ++i) out[position[i]] = codes[i];
      }
      scale[c] = d;
    }
    });
  }
  const int16_t* vector(int64_t m, int64_t k, int v) const {
    return q.data() + (m * chunks + k) * quants::kChunkValues + v * quants::kUnitValues;
  }
  const int8_t* byte_vector(int64_t m, int64_t k, int v) const {
    return q8.data() + (m * chunks + k) * quants::kChunkValues + v * quants::kUnitValues;
  }
  float scale_of(int64_t m, int64_t k) const { return scale[m * chunks + k]; }
  VecF sums(int64_t m, int64_t k, int j) const {
    return VecF::load(code_sum.data() + (m * chunks + k) * quants::kGroups + j * VecF::kWidth);
  }
  const int16_t* group_sums(int64_t m, int64_t k) const { return group_sum.data() + (m * chunks + k) * quants::kGroups; }
  const int16_t* run_sums(int64_t m, int64_t k) const { return run_sum.data() + (m * chunks + k) * kRuns; }
  // x's sums over the runs of kValues values of chunk k of row m (16: its groups, 32: its runs)
  template <int kValues>
  const int16_t* sums_over(int64_t m, int64_t k) const {
    static_assert(kValues == quants::kGroupValues || kValues == 32, "x has sums over 16 or 32 values");
    return kValues == 32 ? run_sums(m, k) : group_sums(m, k);
  }
  static constexpr int kRuns = quants::kChunkValues / 32;
};

// sums[0 .. MR] += x rows m0 .. m0 + MR . chunks [k0, k1) of one weight row of a K type with integer
// sub-scales (quants.h) and int16 x, prefetching as blocks_row does: a code vector's scaled products are made
// once and meet every row of x, each row summing in two int32 chains (the even bytes' products and the odd
// ones'); each row's d dx made where it is used. (int8 x: byte_chunk_row and byte_tile, below.)
template <typename T, int MR>
void integer_chunk_row(const uint8_t* row, const ChunkActivations& x, int64_t m0, int64_t k0, int64_t k1,
                       float* sums, int64_t ahead) {
  using namespace quants;
  constexpr int kWindow = T::kWindow;
  VecF acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = VecF::zero();
  const ScaleIndex& index = T::scale_index();
  for (int64_t k = k0; k < k1; ++k) {
    const uint8_t* p = row + k * T::kBlockBytes;
    prefetch_chunk<T>(p + ahead);
    const IntegerChunk chunk = T::integer_chunk(p);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kGroupVectors; ++j) acc[i] = fmadd(chunk.offsets[j], x.sums(m0 + i, k, j), acc[i]);
    for (int w = 0; w < kChunkVectors; w += kWindow) {
      VecI dots[MR][2];
      for (int i = 0; i < MR; ++i) dots[i][0] = dots[i][1] = zero_int();
      for (int v = w; v < w + kWindow; ++v) {
        const VecB codes = T::integer_codes(p, v);
        const VecB even = select_bytes(chunk.scales, index.bytes[v]);
        const VecI e = byte_products(codes, even), o = byte_products(codes, to_odd_bytes(even));
        for (int i = 0; i < MR; ++i) {
          const int16_t* xv = x.vector(m0 + i, k, v);
          dots[i][0] = add_products(dots[i][0], e, xv);
          dots[i][1] = add_products(dots[i][1], o, xv + kUnitValues / 2);
        }
      }
      for (int i = 0; i < MR; ++i)
        acc[i] = fmadd(VecF::from_int(add_int(dots[i][0], dots[i][1])), VecF::set1(chunk.d * x.scale_of(m0 + i, k)), acc[i]);
    }
    if (span_ends(k, k1)) {
      for (int i = 0; i < MR; ++i) {
        sums[i] += reduce_add(acc[i]);
        acc[i] = VecF::zero();
      }
    }
  }
}

// Work items of at most `size` rows, none crossing a shard: (shard, first row, end row) in it.
struct ShardPanel {
  int64_t shard, n0, n1;
};

// int8 x on the K types (the default), on both builds: chunk k of a (weight row, row of x) pair gives two exact
// integers, the codes' sum M = sum_i sc(i) u_i q_i and the offsets' N = sum_g mult_g (sum_{i in g} q_i)
// (quants::ByteChunk: Q4_K's mult is m, Q6_K's sc), which two float sums take in the order of k:
//   acc_M = fma(M, d dx, acc_M),  acc_N = fma(N, c dx, acc_N),  x . w = acc_M + acc_N.
// Integers are exact in any order, so both walks below give a row the same bits whatever rows are beside it,
// and AVX-512 CPUs the bits AVX2 ones give (their wider code vectors only change which lanes hold a part of M).
// Few rows of x (byte_chunk_row): a weight row's code vectors meet x in the values' order, as
// integer_chunk_row's, and each chunk's lanes are added up (two hadds). Many rows (byte_tile): kByteRows weight
// rows' codes are interleaved once a chunk into L1 (quants::ByteRows), 4 codes of each row a 32-bit lane, so
// that 4 values of x broadcast meet 8 rows in one vpmaddubsw whose lanes are rows: no lanes to add up, and
// kSumCodes products summed in 16 bits before one vpmaddwd by their scale (Q4_K: a sub-block's 8, each pair
// of u q at most 2 x 15 x 127). The tile it replaced (integer_chunk_row's order, lanes of values) spent a
// fifth of a chunk on each pair's float epilogue (3 multiply-adds a lane) and could not sum in 16 bits: this
// one ran the 1.5B's 200-row gate and down projections 1.5x and 1.24x as fast (docs/JOURNAL.md, session 26).
// Four pairs' M lanes and N lanes summed pairwise within each 128-bit half (hadd) -> M0 N0 .. M3 N3: each
// half's M0 N0 M1 N1 (a) and M2 N2 M3 N3 (b), the halves added.
inline __m256i four_pairs(const __m256i* pairs) {
  const __m256i a = _mm256_hadd_epi32(pairs[0], pairs[1]), b = _mm256_hadd_epi32(pairs[2], pairs[3]);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

template <typename T, int MR>
void byte_chunk_row(const uint8_t* row, const ChunkActivations& x, int64_t m0, int64_t chunks, float* sums,
                    int64_t ahead) {
  using namespace quants;
  static_assert(MR >= 2 && MR <= 4, "2 to 4 rows of x share one reduction (one row: byte_chunk_weights)");
  // int32 chains a row: two where the sum is a VNNI multiply-add (its latency), else one
#if defined(PAGEDLLM_VNNI)
  constexpr int kChains = 2;
#else
  constexpr int kChains = 1;
#endif
  const ScaleIndex& index = T::scale_index();
  // lanes 2i and 2i + 1: row i's acc_M and acc_N
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < chunks; ++k) {
    const uint8_t* p = row + k * T::kBlockBytes;
    prefetch_chunk<T>(p + ahead);
    const ByteChunk chunk = T::byte_chunk(p);
    VecI dots[MR][kChains];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < kChains; ++c) dots[i][c] = zero_int();
    for (int v = 0; v < kChunkVectors; ++v) {
      const VecB codes = T::integer_codes(p, v);
      const VecI scales = scale_words<T::kSignedScales>(select_bytes(chunk.scales, index.bytes[v]));
      for (int i = 0; i < MR; ++i)
        dots[i][v % kChains] = add_byte_products(dots[i][v % kChains], codes, x.byte_vector(m0 + i, k, v), scales);
    }
    // pairs[i]: row i's M lanes and N lanes summed pairwise (hadd), within each 128-bit half
    __m256i pairs[4];
    for (int i = 0; i < 4; ++i) {
      if (i >= MR) {
        pairs[i] = _mm256_setzero_si256();
        continue;
      }
      VecI lanes_sum = dots[i][0];
      for (int c = 1; c < kChains; ++c) lanes_sum = add_int(lanes_sum, dots[i][c]);
      const __m256i codes_sum = fold_halves(lanes_sum);
      const __m256i group_sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.group_sums(m0 + i, k)));
      pairs[i] = _mm256_hadd_epi32(codes_sum, _mm256_madd_epi16(chunk.multipliers, group_sums));
    }
    // d, c times each row's dx, lane for lane (in registers: 8 stores read back as a vector stall)
    const auto scale = [&](int i) { return x.scale_of(m0 + std::min(i, MR - 1), k); };
    const __m128 four = _mm_setr_ps(scale(0), scale(1), scale(2), scale(3));
    const __m256 dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(four), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(four_pairs(pairs)), _mm256_mul_ps(_mm256_broadcast_ps(&chunk.factors), dx), acc);
  }
  alignas(32) float parts[8];
  _mm256_store_ps(parts, acc);
  for (int i = 0; i < MR; ++i) sums[i] = parts[2 * i] + parts[2 * i + 1];
}

// sums[0 .. NW] += x row m . weight rows rows[0 .. NW): byte_chunk_row's walk for one row of x, NW weight rows
// side by side, each weight row's (M, N) where byte_chunk_row puts a row of x's, so that a chunk's lane sums and
// float multiply-add serve NW pairs (one user's Q4_K walk ran 1.13-1.15x as fast so: docs/JOURNAL.md, session
// 32). Each pair's operations are lane for lane those of one pair alone: the same bits.
template <typename T, int NW>
void byte_chunk_weights(const uint8_t* const* rows, const ChunkActivations& x, int64_t m, int64_t chunks,
                        float* sums, int64_t ahead) {
  using namespace quants;
  static_assert(NW >= 1 && NW <= 4, "a chunk's (M, N) of up to 4 pairs share one reduction");
  const ScaleIndex& index = T::scale_index();
  __m256 acc = _mm256_setzero_ps();  // lanes 2w and 2w + 1: weight row w's acc_M and acc_N
  for (int64_t k = 0; k < chunks; ++k) {
    const __m256i group_sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.group_sums(m, k)));
    __m256i pairs[4];
    __m128 factors[4];
    for (int w = 0; w < 4; ++w) {
      if (w >= NW) {
        pairs[w] = _mm256_setzero_si256();
        factors[w] = _mm_setzero_ps();
        continue;
      }
      const uint8_t* p = rows[w] + k * T::kBlockBytes;
      prefetch_chunk<T>(p + ahead);
      const ByteChunk chunk = T::byte_chunk(p);
      VecI dots[2] = {zero_int(), zero_int()};  // two int32 chains, as byte_chunk_row's one row
      for (int v = 0; v < kChunkVectors; ++v) {
        const VecI scales = scale_words<T::kSignedScales>(select_bytes(chunk.scales, index.bytes[v]));
        dots[v % 2] = add_byte_products(dots[v % 2], T::integer_codes(p, v), x.byte_vector(m, k, v), scales);
      }
      const __m256i codes_sum = fold_halves(add_int(dots[0], dots[1]));
      pairs[w] = _mm256_hadd_epi32(codes_sum, _mm256_madd_epi16(chunk.multipliers, group_sums));
      factors[w] = chunk.factors;
    }
    // d, c of each weight row (its factors' first two lanes) times dx
    const __m256 dc = _mm256_set_m128(_mm_movelh_ps(factors[2], factors[3]), _mm_movelh_ps(factors[0], factors[1]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(four_pairs(pairs)), _mm256_mul_ps(dc, _mm256_set1_ps(x.scale_of(m, k))), acc);
  }
  alignas(32) float parts[8];
  _mm256_store_ps(parts, acc);
  for (int w = 0; w < NW; ++w) sums[w] += parts[2 * w] + parts[2 * w + 1];
}

// sums[(m - m_begin) * ld_sums + n - panel.n0] += x row m . weight row n for the panel's rows and x rows
// [m_begin, m_end), kRowGroup rows of x at a time walking whole weight rows (a lone row of x: kWeightRows weight
// rows side by side, byte_chunk_weights).
template <typename T>
void byte_rows(const BlockShard& shard, const ShardPanel& panel, const ChunkActivations& x, int64_t m_begin,
               int64_t m_end, int64_t chunks, float* sums, int64_t ld_sums) {
  const int64_t ahead = kRowsAhead * kSpanChunks * quants::chunk_bytes<T>();
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kRowGroup) {
    with_count<kRowGroup>(std::min<int64_t>(kRowGroup, m_end - m0), [&](auto count) {
      constexpr int R = decltype(count)::value;
      if constexpr (R == 1) {
        constexpr int kWeightRows = 4;
        for (int64_t n = panel.n0; n < panel.n1; n += kWeightRows) {
          const int rows_here = static_cast<int>(std::min<int64_t>(kWeightRows, panel.n1 - n));
          const uint8_t* rows[kWeightRows];
          for (int w = 0; w < rows_here; ++w) rows[w] = shard.data + (n + w) * shard.row_bytes;
          with_count<kWeightRows>(rows_here, [&](auto weights) {
            float* out = sums + (m0 - m_begin) * ld_sums + (n - panel.n0);
            byte_chunk_weights<T, decltype(weights)::value>(rows, x, m0, chunks, out, ahead);
          });
        }
      } else {
        for (int64_t n = panel.n0; n < panel.n1; ++n) {
          float row_sums[R];
          byte_chunk_row<T, R>(shard.data + n * shard.row_bytes, x, m0, chunks, row_sums, ahead);
          for (int i = 0; i < R; ++i) sums[(m0 - m_begin + i) * ld_sums + (n - panel.n0)] += row_sums[i];
        }
      }
    });
  }
}

// The tile's registers: kByteTileRows rows of x by kByteTileVectors interleaved chunks (8 weight rows each).
// AVX-512 VNNI (32 registers): 6 x 2, twelve int32 sums in flight, enough for vpdpbusd's latency with one chain
// each, and each broadcast of x meets two code vectors (this Zen 4 ran 2.0 vpdpbusd a cycle so, 0.97 at 4 x 1:
// docs/JOURNAL.md, session 28); otherwise (16 registers) 2 x 1, two chains a row.
#if defined(PAGEDLLM_VNNI) && defined(PAGEDLLM_AVX512)
constexpr int kByteTileRows = 6, kByteTileVectors = 2;
#else
constexpr int kByteTileRows = 2, kByteTileVectors = 1;
#endif
constexpr int kByteTileWeightRows = quants::kByteRows * kByteTileVectors;
// From how many rows of x in a work item the tile runs (below, byte_rows): where interleaving a chunk, once
// for all the item's rows, costs less than the lanes' sums and epilogues it saves (session 26, 1.5B shapes).
constexpr int64_t tile_min_rows(int64_t type) { return type == quants::Q6_K::kType ? 8 : 16; }

// 4 int8 values of x row m at chunk k's code bytes 4t .. 4t + 3, in every lane.
inline __m256i x_four(const ChunkActivations& x, int64_t m, int64_t k, int t) {
  int32_t four;
  std::memcpy(&four, x.byte_vector(m, k, 0) + 4 * t, sizeof(four));
  return _mm256_set1_epi32(four);
}

// acc[2 (NV i + j)], acc[2 (NV i + j) + 1] (lane r: weight row r of w[j], its acc_M, acc_N) += chunk k of x
// row mb + i against the interleaved rows w[j], for MR rows of x from mb and NV interleaved chunks. Without VNNI
// a scale's kSumCodes code lanes sum their vpmaddubsw pairs in 16 bits before one vpmaddwd by the scale; with
// VNNI (vpdpbusd: 4 u q products into an int32 lane) a scale's lanes sum in int32 (in two chains where the tile
// has fewer than 8 sums) before one vpmulld. The same integers either way.
template <typename T, int MR, int NV>
inline void byte_tile_step(const quants::ByteRows* w, const ChunkActivations& x, int64_t mb, int64_t k,
                           __m256* acc) {
  using namespace quants;
  __m256i codes_sum[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) codes_sum[i][j] = _mm256_setzero_si256();
#if defined(PAGEDLLM_VNNI)
  constexpr int kChains = MR * NV >= 8 ? 1 : 2;
  // a loop over the sub-scales: unrolled, GCC spilled the sums (a fifth of the step's instructions went to the
  // stack; Q6_K's 16 sub-scales ran 0.7x as fast: session 28)
#pragma GCC unroll 1
  for (int s = 0; s < kChunkValues / 4 / T::kScaleCodes; ++s) {
    __m256i dots[MR][NV][kChains];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j)
        for (int c = 0; c < kChains; ++c) dots[i][j][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = s * T::kScaleCodes; t < (s + 1) * T::kScaleCodes; ++t) {
      for (int i = 0; i < MR; ++i) {
        const __m256i four = x_four(x, mb + i, k, t);
        for (int j = 0; j < NV; ++j) dots[i][j][t % kChains] = dpbusd(dots[i][j][t % kChains], w[j].codes[t], four);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) {
        __m256i dot = dots[i][j][0];
        for (int c = 1; c < kChains; ++c) dot = _mm256_add_epi32(dot, dots[i][j][c]);
        codes_sum[i][j] = _mm256_add_epi32(codes_sum[i][j], _mm256_mullo_epi32(dot, w[j].scales[s]));
      }
  }
#else
#pragma GCC unroll 32
  for (int s = 0; s < kChunkValues / 4 / T::kSumCodes; ++s) {
    __m256i products[MR][NV];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) products[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = s * T::kSumCodes; t < (s + 1) * T::kSumCodes; ++t) {
      for (int i = 0; i < MR; ++i) {
        const __m256i four = x_four(x, mb + i, k, t);
        for (int j = 0; j < NV; ++j)
          products[i][j] = _mm256_add_epi16(products[i][j], _mm256_maddubs_epi16(w[j].codes[t], four));
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) {
        const __m256i scales = w[j].scales[s * T::kSumCodes / T::kScaleCodes];
        codes_sum[i][j] = _mm256_add_epi32(codes_sum[i][j], _mm256_madd_epi16(products[i][j], scales));
      }
  }
#endif
  constexpr int kPairs = T::kOffsetRuns / 2;
  for (int i = 0; i < MR; ++i) {
    const int16_t* offset_sums = x.template sums_over<T::kOffsetValues>(mb + i, k);
    __m256i pairs[kPairs];
    for (int q = 0; q < kPairs; ++q) {
      int32_t pair;
      std::memcpy(&pair, offset_sums + 2 * q, sizeof(pair));
      pairs[q] = _mm256_set1_epi32(pair);
    }
    const __m256 dx = _mm256_set1_ps(x.scale_of(mb + i, k));
    for (int j = 0; j < NV; ++j) {
      __m256i offsets = _mm256_setzero_si256();
      for (int q = 0; q < kPairs; ++q) offsets = _mm256_add_epi32(offsets, _mm256_madd_epi16(w[j].multipliers[q], pairs[q]));
      __m256* a = acc + 2 * (NV * i + j);
      a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes_sum[i][j]), _mm256_mul_ps(w[j].d, dx), a[0]);
      a[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offsets), _mm256_mul_ps(w[j].c, dx), a[1]);
    }
  }
}

// byte_tile_step over `rows` rows of x from mb, kByteTileRows at a time, the rest in one step. GCC's
// reassociation of the 16-bit sums into trees spilled them to the stack (1.3x the time in session 26's
// harness): off here.
template <typename T>
__attribute__((noinline, optimize("no-tree-reassoc"))) void byte_tile_rows(const quants::ByteRows* w,
                                                                            const ChunkActivations& x, int64_t mb,
                                                                            int64_t rows, int64_t k, __m256* acc) {
  constexpr int NV = kByteTileVectors;
  int64_t m = 0;
  for (; m + kByteTileRows <= rows; m += kByteTileRows) {
    // the next step's rows of x (L2: the item's rows of a chunk are more than L1 holds)
    for (int64_t i = m + kByteTileRows; i < std::min(rows, m + 2 * kByteTileRows); ++i)
      prefetch_bytes(x.byte_vector(mb + i, k, 0), quants::kChunkValues);
    byte_tile_step<T, kByteTileRows, NV>(w, x, mb + m, k, acc + 2 * NV * m);
  }
  if (m < rows) {
    with_count<kByteTileRows - 1>(rows - m, [&](auto count) {
      byte_tile_step<T, decltype(count)::value, NV>(w, x, mb + m, k, acc + 2 * NV * m);
    });
  }
}

// sums[(m - m_begin) * ld_sums + n - panel.n0] += x row m . weight row n, as byte_rows sums them:
// kByteTileWeightRows weight rows at a time, each chunk of them interleaved once for all the item's rows of x
// (blocks of 32 rows, each interleaving its own, ran 200-row calls 0.85-0.95x as fast: the interleaving of
// Q6_K's codes costs more than their products at 32 rows).
template <typename T>
void byte_tile(const BlockShard& shard, const ShardPanel& panel, const ChunkActivations& x, int64_t m_begin,
               int64_t m_end, int64_t chunks, float* sums, int64_t ld_sums) {
  using namespace quants;
  alignas(64) static const uint8_t kZeros[chunk_bytes<T>()] = {};  // rows past the panel's: zero codes and scales
  const int64_t rows = m_end - m_begin;
  static thread_local LineVector<float> acc_buffer;
  acc_buffer.resize(2 * kByteTileVectors * rows * 8);
  __m256* acc = reinterpret_cast<__m256*>(acc_buffer.data());
  alignas(64) ByteRows w[kByteTileVectors];
  for (int64_t g0 = panel.n0; g0 < panel.n1; g0 += kByteTileWeightRows) {
    const int64_t count = std::min<int64_t>(kByteTileWeightRows, panel.n1 - g0);
    for (int64_t a = 0; a < 2 * kByteTileVectors * rows; ++a) acc[a] = _mm256_setzero_ps();
    for (int64_t k = 0; k < chunks; ++k) {
      const uint8_t* p[kByteTileWeightRows];
      for (int r = 0; r < kByteTileWeightRows; ++r)
        p[r] = r < count ? shard.data + (g0 + r) * shard.row_bytes + k * T::kBlockBytes : kZeros;
      // the chunks visited next: these rows' next, or after their last the next rows' first
      for (int r = 0; r < count; ++r) {
        const int64_t next = k + 1 < chunks ? (g0 + r) * shard.row_bytes + (k + 1) * T::kBlockBytes
                                            : (g0 + kByteTileWeightRows + r) * shard.row_bytes;
        prefetch_chunk<T>(shard.data + next);
      }
      for (int j = 0; j < kByteTileVectors; ++j) T::interleave(p + kByteRows * j, w[j]);
      byte_tile_rows<T>(w, x, m_begin, rows, k, acc);
    }
    for (int64_t m = 0; m < rows; ++m)
      for (int j = 0; j < kByteTileVectors; ++j) {
        alignas(32) float codes_part[kByteRows], offsets_part[kByteRows];
        _mm256_store_ps(codes_part, acc[2 * (kByteTileVectors * m + j)]);
        _mm256_store_ps(offsets_part, acc[2 * (kByteTileVectors * m + j) + 1]);
        for (int r = 0; r < std::min<int64_t>(kByteRows, count - kByteRows * j); ++r)
          sums[m * ld_sums + (g0 + kByteRows * j + r - panel.n0)] += codes_part[r] + offsets_part[r];
      }
  }
}

// From this many rows of x a call of the 32-value types takes pair_tile (every item, a last one of fewer rows
// too), below it pair_row.
constexpr int64_t kPairTileMinRows = 4;

// Rows of x for the 32-value types (pair_rows): int16 codes with one scale per chunk of 256 values (max |x| /
// 32767 over its values), zeros past the row's blocks to a whole chunk, and each block's sum of its codes
// (the offset of Q4_0 / Q5_0, the m of Q4_1 / Q5_1). For the tile each block's 32 codes as 16 pairs in
// quants::PairRows' order (pair p: values pair_value(p) and pair_value(p) + 16); for the walk (`walk`: a call
// of fewer than kPairTileMinRows rows) each unit at quants::unit_position's places (AVX2: the values' order),
// and on AVX-512 where `quads` asks (a Q4_1 shard) also in quants::quad_position's order.
struct PairActivations {
  static constexpr int kBlocks = quants::kChunkValues / 32;
  int64_t cols, chunks;
  bool walk;
  LineVector<int32_t> q;             // [rows, chunks, kBlocks, 16]: two int16 each
  LineVector<int16_t> quad_q;        // [rows, chunks, 256]
  LineVector<float> scale, code_sum;  // [rows, chunks], [rows, chunks, kBlocks]

  PairActivations(const float* x, int64_t rows, int64_t cols_, bool quads)
      : cols(cols_),
        chunks((cols_ + quants::kChunkValues - 1) / quants::kChunkValues),
        walk(rows < kPairTileMinRows),
        q(rows * chunks * kBlocks * 16, 0),
        quad_q(walk && quads && VecF::kWidth == 16 ? rows * chunks * quants::kChunkValues : 0, 0),
        scale(rows * chunks, 0.f),
        code_sum(rows * chunks * kBlocks, 0.f) {
    at::parallel_for(0, rows * chunks, 64, [&](int64_t begin, int64_t end) {
      alignas(64) int16_t codes[quants::kChunkValues];
      for (int64_t c = begin; c < end; ++c) {
        const int64_t m = c / chunks, k = c % chunks;
        const int blocks = blocks_in(k);
        const float* src = x + m * cols + k * quants::kChunkValues;
        VecF amax = VecF::zero();
        for (int v = 0; v < blocks * 32; v += VecF::kWidth) {
          const VecF value = VecF::load(src + v);
          amax = max(amax, max(value, VecF::zero() - value));
        }
        const float d = reduce_max(amax) / 32767.f;
        const VecF inverse = VecF::set1(d > 0.f ? 1.f / d : 0.f);
        for (int v = 0; v < blocks * 32; v += VecF::kWidth)
          store_int16(round_nearest(VecF::load(src + v) * inverse), codes + v);
        int16_t* out = reinterpret_cast<int16_t*>(q.data() + c * kBlocks * 16);
        for (int b = 0; b < blocks; ++b) {
          int32_t sum = 0;
          for (int i = 32 * b; i < 32 * b + 32; ++i) sum += codes[i];
          code_sum[c * kBlocks + b] = static_cast<float>(sum);  // exact: |sum| <= 32 x 32767
          if (walk) {  // unit order (AVX2's: the values' own)
            for (int i = 32 * b; i < 32 * b + 32; ++i)
              out[i - i % quants::kUnitValues + quants::unit_position(i % quants::kUnitValues)] = codes[i];
#if defined(PAGEDLLM_AVX512)
            if (!quad_q.empty())
              for (int i = 0; i < 32; ++i)
                quad_q[c * quants::kChunkValues + quants::quad_position(b, i)] = codes[32 * b + i];
#endif
            continue;
          }
          for (int p = 0; p < 16; ++p) {
            const int i = 32 * b + quants::pair_value(p);
            out[32 * b + 2 * p] = codes[i];
            out[32 * b + 2 * p + 1] = codes[i + 16];
          }
        }
        scale[c] = d;
      }
    });
  }
  int blocks_in(int64_t k) const { return static_cast<int>(std::min<int64_t>(kBlocks, (cols - k * quants::kChunkValues) / 32)); }
  const int32_t* pairs(int64_t m, int64_t k, int b) const { return q.data() + ((m * chunks + k) * kBlocks + b) * 16; }
  const int16_t* unit(int64_t m, int64_t k, int u) const {
    return reinterpret_cast<const int16_t*>(pairs(m, k, 0)) + u * quants::kUnitValues;
  }
  const int16_t* quad_vector(int64_t m, int64_t k, int v) const {
    return quad_q.data() + (m * chunks + k) * quants::kChunkValues + v * (quants::kChunkValues / 8);
  }
  float scale_of(int64_t m, int64_t k) const { return scale[m * chunks + k]; }
  float sum_of(int64_t m, int64_t k, int b) const { return code_sum[(m * chunks + k) * kBlocks + b]; }
  const float* sums_of(int64_t m, int64_t k) const { return code_sum.data() + (m * chunks + k) * kBlocks; }
};

// The 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) at any number of rows of x, in one numeric contract: for a
// (weight row, row of x) pair, chunk k's blocks b give exact integers I_b (quants.h PairRows), each one float
// product p_b = I_b d_b (Q4_1 / Q5_1: fma(m_b, sum of x's codes over b, I_b d_b)), summed in a fixed tree
//   S_k = ((p_0 + p_1) + (p_2 + p_3)) + ((p_4 + p_5) + (p_6 + p_7))   (0 past the row's blocks)
// and the row's sum acc = fma(S_k, dx_k, acc) chunk after chunk. Each pair's float operations are its lane's
// alone, so a row's bits are the same whatever rows of x or W are beside it and on every build. The tile:
// kPairTileVectors interleaved groups of 8 weight rows by kPairTileRows rows of x, one broadcast pair of x
// meeting each group in one 16-bit multiply-add (AVX-512 VNNI: 6 x 2, twelve vpdpwssd chains; else 4 x 2).
#if defined(PAGEDLLM_AVX512)
constexpr int kPairTileRows = 6;
#else
constexpr int kPairTileRows = 4;
#endif
constexpr int kPairTileVectors = 2;
constexpr int kPairTileWeightRows = quants::kByteRows * kPairTileVectors;
constexpr int kChunkBlocks = PairActivations::kBlocks;

// acc[NV i + j] (lane r: weight row r of group j) += chunk k of x row mb + i against the groups' blocks w[b][j].
template <typename T, int MR, int NV>
inline void pair_tile_step(const quants::PairRows (*w)[NV], int blocks, const PairActivations& x, int64_t mb,
                           int64_t k, __m256* acc) {
  __m256 p[MR][NV][kChunkBlocks];
#pragma GCC unroll 1
  for (int b = 0; b < blocks; ++b) {
    __m256i dots[MR][NV];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) dots[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      for (int i = 0; i < MR; ++i) {
        const __m256i pair = _mm256_set1_epi32(x.pairs(mb + i, k, b)[t]);
        for (int j = 0; j < NV; ++j) dots[i][j] = quants::add_pairs(dots[i][j], w[b][j].pairs[t], pair);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) {
        __m256 product = _mm256_mul_ps(_mm256_cvtepi32_ps(dots[i][j]), w[b][j].d);
        if constexpr (T::kMinByte >= 0)
          product = _mm256_fmadd_ps(w[b][j].m, _mm256_set1_ps(x.sum_of(mb + i, k, b)), product);
        p[i][j][b] = product;
      }
  }
  for (int b = blocks; b < kChunkBlocks; ++b)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) p[i][j][b] = _mm256_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    const __m256 dx = _mm256_set1_ps(x.scale_of(mb + i, k));
    for (int j = 0; j < NV; ++j) {
      const __m256* q = p[i][j];
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(q[0], q[1]), _mm256_add_ps(q[2], q[3])),
                                       _mm256_add_ps(_mm256_add_ps(q[4], q[5]), _mm256_add_ps(q[6], q[7])));
      acc[NV * i + j] = _mm256_fmadd_ps(sum, dx, acc[NV * i + j]);
    }
  }
}

// pair_tile_step over `rows` rows of x from mb, kPairTileRows at a time, the rest in one step.
template <typename T>
__attribute__((noinline)) void pair_tile_rows(const quants::PairRows (*w)[kPairTileVectors], int blocks,
                                              const PairActivations& x, int64_t mb, int64_t rows, int64_t k,
                                              __m256* acc) {
  constexpr int NV = kPairTileVectors;
  int64_t m = 0;
  for (; m + kPairTileRows <= rows; m += kPairTileRows) {
    for (int64_t i = m + kPairTileRows; i < std::min(rows, m + 2 * kPairTileRows); ++i)
      prefetch_bytes(x.pairs(mb + i, k, 0), blocks * 64);
    pair_tile_step<T, kPairTileRows, NV>(w, blocks, x, mb + m, k, acc + NV * m);
  }
  if (m < rows) {
    with_count<kPairTileRows - 1>(rows - m, [&](auto count) {
      pair_tile_step<T, decltype(count)::value, NV>(w, blocks, x, mb + m, k, acc + NV * m);
    });
  }
}

// sums[(m - m_begin) * ld_sums + n - panel.n0] += x row m . weight row n for the panel's rows and x rows
// [m_begin, m_end): kPairTileWeightRows weight rows at a time, each chunk of them interleaved once for all
// the item's rows of x.
template <typename T>
void pair_tile(const BlockShard& shard, const ShardPanel& panel, const PairActivations& x, int64_t m_begin,
               int64_t m_end, float* sums, int64_t ld_sums) {
  constexpr int NV = kPairTileVectors;
  alignas(64) static const uint8_t kZeros[T::kBlockBytes] = {};  // rows past the panel's: d = m = 0
  const int64_t rows = m_end - m_begin;
  static thread_local LineVector<float> acc_buffer;
  acc_buffer.resize(NV * rows * 8);
  __m256* acc = reinterpret_cast<__m256*>(acc_buffer.data());
  alignas(64) quants::PairRows w[kChunkBlocks][NV];
  for (int64_t g0 = panel.n0; g0 < panel.n1; g0 += kPairTileWeightRows) {
    const int64_t count = std::min<int64_t>(kPairTileWeightRows, panel.n1 - g0);
    for (int64_t a = 0; a < NV * rows; ++a) acc[a] = _mm256_setzero_ps();
    for (int64_t k = 0; k < x.chunks; ++k) {
      const int blocks = x.blocks_in(k);
      for (int r = 0; r < count; ++r) {  // the chunks visited next: these rows' next, or the next rows' first
        const int64_t next = k + 1 < x.chunks ? (g0 + r) * shard.row_bytes + (k + 1) * quants::chunk_bytes<T>()
                                              : (g0 + kPairTileWeightRows + r) * shard.row_bytes;
        prefetch_chunk<T>(shard.data + next);
      }
      for (int j = 0; j < NV; ++j)
        for (int b = 0; b < blocks; ++b) {
          const uint8_t* p[quants::kByteRows];
          for (int r = 0; r < quants::kByteRows; ++r) {
            const int64_t n = quants::kByteRows * j + r;
            p[r] = n < count ? shard.data + (g0 + n) * shard.row_bytes + k * quants::chunk_bytes<T>() + b * T::kBlockBytes
                             : kZeros;
          }
          quants::interleave_pairs<T>(p, w[b][j]);
        }
      pair_tile_rows<T>(w, blocks, x, m_begin, rows, k, acc);
    }
    for (int64_t m = 0; m < rows; ++m)
      for (int j = 0; j < NV; ++j) {
        alignas(32) float part[quants::kByteRows];
        _mm256_store_ps(part, acc[NV * m + j]);
        for (int r = 0; r < std::min<int64_t>(quants::kByteRows, count - quants::kByteRows * j); ++r)
          sums[m * ld_sums + (g0 + quants::kByteRows * j + r - panel.n0)] += part[r];
      }
  }
}

// The tile's float work for one (weight row, row of x) pair and chunk, with a block a lane: p = I d (+ m sum),
// the tree by swaps of neighbouring lanes, of pairs of lanes and of halves (a + b is b + a), and the row's fma
// by dx.
template <typename T>
__attribute__((always_inline)) inline float pair_chunk_sum(__m256i integers, __m256 d, __m256 m,
                                                          const float* code_sums, float dx, float acc) {
  __m256 product = _mm256_mul_ps(_mm256_cvtepi32_ps(integers), d);
  if constexpr (T::kMinByte >= 0) product = _mm256_fmadd_ps(m, _mm256_loadu_ps(code_sums), product);
  const __m256 s1 = _mm256_add_ps(product, _mm256_permute_ps(product, 0xb1));  // (p0 + p1), (p2 + p3), ...
  const __m256 s2 = _mm256_add_ps(s1, _mm256_permute_ps(s1, 0x4e));            // (p0 + p1) + (p2 + p3), ...
  const __m256 s3 = _mm256_add_ps(s2, _mm256_permute2f128_ps(s2, s2, 0x01)); // the halves' sums added
  return std::fma(_mm256_cvtss_f32(s3), dx, acc);
}

#if defined(PAGEDLLM_AVX512)
// acc[0 .. MR] (rows m0 .. m0 + MR of x) += chunk k of one weight row of a 32-value type, of kBlocks blocks, in
// pair_tile's contract: the blocks' codes as the few-row walk reads them (quants.h codes: a unit of two blocks,
// the implicit offset left in) meet x's units in 16 int32 lanes, 8 a block; the four units' lanes added down
// to one a block by two rounds of pairing neighbours across two vectors (exact in any order), less the offset
// times x's code sum (exact), then the tile's float work. Inlined: as a call its row sum went through memory
// and the chunks' float work no longer overlapped (SmolLM2's Q4_1 ffn_down 0.045-0.048 ms, inlined 0.041-0.042).
template <typename T, int MR, int kBlocks>
__attribute__((always_inline)) inline void pair_chunk(const uint8_t* chunk, const PairActivations& x, int64_t m0,
                                                     int64_t k, float* acc) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const auto pair_up = [&](__m512i a, __m512i b) {  // lane j: lanes 2j and 2j + 1 of a then b, added
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
  };
  const auto block_integers = [](__m512i twos) {  // lanes 2b, 2b + 1: block b's -> 8 lanes, a block each
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(twos, _mm512_shuffle_epi32(twos, _MM_PERM_CDAB)));
  };
  if constexpr (quants::kQuads<T>) {  // Q4_1: its quads (quants.h), a block's 4 lanes in each multiply-add
    const quants::QuadChunk quads = quants::q4_1_quads(chunk, kBlocks);  // zero past the blocks
    const __m512i dm = _mm512_castps_si512(quads.dm.v);
    const __m256 d = _mm256_castsi256_ps(_mm512_cvtepi64_epi32(dm));
    const __m256 m = _mm256_castsi256_ps(_mm512_cvtepi64_epi32(_mm512_srli_epi64(dm, 32)));
    quants::VecB words[2][quants::kQuadVectors];
    for (int q = 0; q < 2; ++q)
      for (int r = 0; r < quants::kQuadVectors; ++r) words[q][r] = quants::quad_vector(quads.codes[q], r);
    for (int i = 0; i < MR; ++i) {
      __m512i dots[2];
      for (int q = 0; q < 2; ++q) {
        dots[q] = _mm512_setzero_si512();
        if (4 * q >= kBlocks) continue;
        for (int r = 0; r < quants::kQuadVectors; ++r)
          dots[q] = quants::add_products(dots[q], words[q][r], x.quad_vector(m0 + i, k, 4 * q + r));
      }
      acc[i] = pair_chunk_sum<T>(block_integers(pair_up(dots[0], dots[1])), d, m, x.sums_of(m0 + i, k),
                                 x.scale_of(m0 + i, k), acc[i]);
    }
    return;
  }
  constexpr int kUnits = quants::kChunkValues / quants::kUnitValues;
  __m512i dots[MR][kUnits];
  for (int u = 0; u < kUnits; ++u) {
    if (2 * u >= kBlocks) {
      for (int i = 0; i < MR; ++i) dots[i][u] = _mm512_setzero_si512();
      continue;
    }
    const quants::VecB codes = T::codes(chunk, u, kBlocks);
    for (int i = 0; i < MR; ++i) dots[i][u] = quants::dot<T::kSigned>(codes, x.unit(m0 + i, k, u));
  }
  const __m256i words = quants::block_words<T::kBlockBytes>(chunk, kBlocks);  // zero past the blocks
  const __m256 d = quants::half_floats(words, 0);
  const __m256 m = T::kMinByte >= 0 ? quants::half_floats(words, 16) : _mm256_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    __m256i integers = block_integers(pair_up(pair_up(dots[i][0], dots[i][1]), pair_up(dots[i][2], dots[i][3])));
    const float* code_sums = x.sums_of(m0 + i, k);
    if constexpr (T::kImplicit != 0) {
      integers = _mm256_sub_epi32(integers, _mm256_mullo_epi32(_mm256_cvtps_epi32(_mm256_loadu_ps(code_sums)),
                                                               _mm256_set1_epi32(T::kImplicit)));
    }
    acc[i] = pair_chunk_sum<T>(integers, d, m, code_sums, x.scale_of(m0 + i, k), acc[i]);
  }
}
#else
// acc[0 .. MR] (rows m0 .. m0 + MR of x) += chunk k of one weight row of a 32-value type, of kBlocks blocks, in
// pair_tile's contract: each block's codes as the per-32 walk reads them (quants.h code_words, the implicit
// offset taken off) meet x in value order in 8 int32 lanes, a chunk's lanes added down to one a block (exact in
// any order; hadd, as the blocks arrive), then the tile's float work.
template <typename T, int MR, int kBlocks>
__attribute__((always_inline)) inline void pair_chunk(const uint8_t* chunk, const PairActivations& x, int64_t m0,
                                                     int64_t k, float* acc) {
  const auto dots = [&](int b, __m256i* out) {  // out[i]: block b's lanes of values against x row m0 + i
    if (b >= kBlocks) {
      for (int i = 0; i < MR; ++i) out[i] = _mm256_setzero_si256();
      return;
    }
    const quants::Words w = T::code_words(chunk + b * T::kBlockBytes);
    for (int i = 0; i < MR; ++i) out[i] = quants::words_dot(w, x.unit(m0 + i, k, 0) + 32 * b);
  };
  // quads[h][i]: blocks 4h .. 4h + 3's sums over each 128-bit half of their lanes, for x row i
  __m256i quads[2][MR];
  for (int h = 0; h < 2; ++h) {
    if (4 * h >= kBlocks) {
      for (int i = 0; i < MR; ++i) quads[h][i] = _mm256_setzero_si256();
      continue;
    }
    __m256i a[MR], b[MR], pair01[MR];
    dots(4 * h, a);
    dots(4 * h + 1, b);
    for (int i = 0; i < MR; ++i) pair01[i] = _mm256_hadd_epi32(a[i], b[i]);
    dots(4 * h + 2, a);
    dots(4 * h + 3, b);
    for (int i = 0; i < MR; ++i) quads[h][i] = _mm256_hadd_epi32(pair01[i], _mm256_hadd_epi32(a[i], b[i]));
  }
  const __m256i words = quants::block_words<T::kBlockBytes>(chunk, kBlocks);  // zero past the blocks
  const __m256 d = quants::half_floats(words, 0);
  const __m256 m = T::kMinByte >= 0 ? quants::half_floats(words, 16) : _mm256_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    const __m256i integers = _mm256_add_epi32(_mm256_permute2x128_si256(quads[0][i], quads[1][i], 0x20),
                                              _mm256_permute2x128_si256(quads[0][i], quads[1][i], 0x31));
    acc[i] = pair_chunk_sum<T>(integers, d, m, x.sums_of(m0 + i, k), x.scale_of(m0 + i, k), acc[i]);
  }
}
#endif

// sums[0 .. MR] += x rows m0 .. m0 + MR . one weight row of a 32-value type (pair_chunk), prefetching `ahead`
// bytes on.
template <typename T, int MR>
void pair_row(const uint8_t* row, const PairActivations& x, int64_t m0, float* sums, int64_t ahead) {
  float acc[MR] = {};
  for (int64_t k = 0; k < x.chunks; ++k) {
    const uint8_t* chunk = row + k * quants::chunk_bytes<T>();
    prefetch_chunk<T>(chunk + ahead);
    const int blocks = x.blocks_in(k);
    if (blocks == kChunkBlocks) {
      pair_chunk<T, MR, kChunkBlocks>(chunk, x, m0, k, acc);
    } else {
      with_count<kChunkBlocks - 1>(blocks, [&](auto count) { pair_chunk<T, MR, decltype(count)::value>(chunk, x, m0, k, acc); });
    }
  }
  for (int i = 0; i < MR; ++i) sums[i] += acc[i];
}

// x rows [m_begin, m_end) against the panel's rows of a 32-value type: the tile, or where x is laid out for
// the walk whole weight rows (pair_row), kRowGroup rows of x at a time, each row prefetching kRowsAhead rows
// on (past the panel's end too: a thread's next item is the next panel).
template <typename T>
void pair_rows(const BlockShard& shard, const ShardPanel& panel, const PairActivations& x, int64_t m_begin,
               int64_t m_end, float* sums, int64_t ld_sums) {
  if (!x.walk) return pair_tile<T>(shard, panel, x, m_begin, m_end, sums, ld_sums);
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kRowGroup) {
    with_count<kRowGroup>(std::min<int64_t>(kRowGroup, m_end - m0), [&](auto count) {
      constexpr int R = decltype(count)::value;
      for (int64_t n = panel.n0; n < panel.n1; ++n) {
        float row_sums[R] = {};
        pair_row<T, R>(shard.data + n * shard.row_bytes, x, m0, row_sums, kRowsAhead * shard.row_bytes);
        for (int i = 0; i < R; ++i) sums[(m0 - m_begin + i) * ld_sums + (n - panel.n0)] += row_sums[i];
      }
    });
  }
}

std::vector<ShardPanel> shard_panels(const std::vector<BlockShard>& shards, int64_t size) {
  std::vector<ShardPanel> panels;
  for (int64_t s = 0; s < static_cast<int64_t>(shards.size()); ++s)
    for (int64_t n = 0; n < shards[s].rows; n += size) panels.push_back({s, n, std::min(n + size, shards[s].rows)});
  return panels;
}

// A panel's rows of a shard dequantized into pack_panels' layout ([cols, kPanelCols], zeros past its
// rows), kWidth rows at a time through `rows` (kWidth rows of cols floats), moved into the panel by
// register transposes (one scalar store a value, scattered 48 floats apart, cost more than the
// dequantization itself).
template <typename T>
void dequantize_panel(const BlockShard& shard, const ShardPanel& p, int64_t cols, float* panel, float* rows) {
  constexpr int W = VecF::kWidth;
  for (int r0 = 0; r0 < kPanelCols; r0 += W) {
    for (int r = 0; r < W; ++r) {
      float* row = rows + r * cols;
      if (p.n0 + r0 + r < p.n1) {
        quants::dequantize_row<T>(shard.data + (p.n0 + r0 + r) * shard.row_bytes, cols, row);
      } else {
        std::fill(row, row + cols, 0.f);
      }
    }
    for (int64_t k = 0; k < cols; k += W) transpose_tile(rows + k, cols, panel + k * kPanelCols + r0, kPanelCols);
  }
}

// Whether this thread's GGUF calls may take the many-row paths whose sums for a row change with the rows
// beside it: bf16 (bf16_blocks_linear, vnni_blocks_linear, below) and, with AVX2 and int16 x, the K types'
// float panels. The calling thread may switch it off (set_blocks_bf16: the model runner does, for a step that
// computes no prompt tokens), so that decode rows keep the blocks' integer path however many there are.
thread_local bool blocks_bf16 = true;
// Whether this thread's GGUF calls take the blocks' integer path at every row count, whatever group_size
// and blocks_bf16 say (set_blocks_invariant: the model runner's default, models/quantization.py): x rounded
// per row, integer dot products, each row's float sums in an order no other row changes (span_ends), so that
// a row's output bits do not depend on the rows beside it.
thread_local bool blocks_invariant = false;
// Whether this thread's GGUF calls round x as the default does (set_blocks_int8, models/quantization.py
// gguf_activations): the K types to int8 per 256 values (llama.cpp's class of arithmetic), the 32-value types
// to int16 per 256 in pair_rows' contract; else the exact path: the K types int16 per 256, the 32-value types
// int16 per 32 (blocks_row) at few rows and the many-row paths above that.
thread_local bool blocks_int8 = true;

void blocks_matmul(const std::vector<BlockShard>& shards, int64_t cols, const float* x, int64_t m_rows,
                   const Epilogue& out) {
  // The 32-value types take pair_rows (its numeric contract: the same bits in a call of any rows) by default
  // and where the invariant gate asks; with the exact path's x (blocks_int8 off) the few-row walk of
  // blocks_row, int16 x per 32 values, closer to transformers' sums (the equality tests hold it to them:
  // session 29). Read here, on the calling thread: the gates are thread_local, and the work items below run on
  // at::parallel_for's threads, whose own copies are the defaults.
  const bool pair_contract = blocks_invariant || blocks_int8;
  // the forms of x the shards read: the K types' chunks (integer sub-scales), the 32-value types' pairs, the
  // other types' blocks in dot's order or in quads
  bool integer_scales = false, pairs = false, pair_quads = false, dots = false, quads = false;
  for (const BlockShard& shard : shards) {
    quants::with_type(shard.type, [&](auto t) {
      using T = decltype(t);
      if constexpr (T::kIntegerScales) {
        integer_scales = true;
      } else if (T::kBlockValues == 32 && pair_contract) {
        pairs = true;
        pair_quads = pair_quads || quants::kQuads<T>;
      } else {
        (quants::kQuads<T> ? quads : dots) = true;
      }
    });
  }
  const bool float_scales = dots || quads;
  // K types with integer sub-scales take it at any number of rows with AVX-512 (faster than the float
  // panels below at every batch measured: docs/JOURNAL.md) and with int8 x on AVX2 too (1.0-1.2x the float
  // panels' speed at 64-256 rows: session 19); with int16 x on AVX2's 8 lanes below kNarrowIntegerRows, or
  // where blocks_bf16 is off (there the float panels' 4 x 24 tiles ran the 1.5B's 200-row prefill
  // projections in 3.6-3.9 s against 5.7-6.3, and 64 rows about even: session 12); the other types up to
  // kBlockStreamRows
  const bool k_panels = VecF::kWidth == 8 && !blocks_int8 && blocks_bf16 && !out.bf16 && m_rows >= kNarrowIntegerRows;
  if (blocks_invariant || m_rows <= kBlockStreamRows || (!float_scales && !k_panels)) {
    // items: kIntegerChunkRows rows of x (all of them, if few; twice as many of the K types' int8 x, the same
    // bytes a span: 128 rows ran a 200-row call in two runs at 0.8x the float panels' speed, one run of 200
    // at 1.2x) by a panel of weight rows, panel after panel over one run of x
    const std::vector<ShardPanel> panels = shard_panels(shards, kPanelRows);
    const auto items = static_cast<int64_t>(panels.size());
    const int64_t run_rows = float_scales || !blocks_int8 ? kIntegerChunkRows : 2 * kIntegerChunkRows;
    const int64_t x_rows = std::min(m_rows, m_rows <= kBlockStreamRows ? kBlockStreamRows : run_rows);
    const int64_t runs = (m_rows + x_rows - 1) / x_rows;
    // each form of x only where a shard reads it
    const ActivationBlocks qx(x, float_scales ? m_rows : 0, cols, dots, quads);
    const PairActivations px(x, pairs ? m_rows : 0, cols, pair_quads);
    const ChunkActivations cx(x, integer_scales ? m_rows : 0, cols, blocks_int8);
    const int64_t chunks = (cols + quants::kChunkValues - 1) / quants::kChunkValues;
    // spans of x, kRowGroup rows at a time, so that the span stays in L1 while the panel's rows pass (a
    // whole row of x, 18 KB at 8,960 columns, was read from L2 from two rows of x on); the panel's rows
    // are then read a span at a time, too many runs for the hardware's prefetcher: each row prefetches
    // its span's bytes of the row kRowsAhead on (the panel's last rows: of its first rows' next span).
    // The 32-value types keep whole rows up to kWholeRows rows of x (every type reduces its sums per
    // kSpanChunks, whatever the walk: span_ends).
    // The K types walk whole rows at one row of x, whose codes fit in L1 at any width here: the panel is
    // then one sequential stream, which a span walk over its 32 rows read at two thirds of the rate on the
    // 8,960-column down projection; that stream prefetches a fixed kRowsAhead spans' bytes ahead (4 whole
    // rows, 29 KB there, was too far). Whole rows of the 32-value types prefetch kRowsAhead rows on past the
    // panel's end too: a thread's next item is the next panel, and the rows there (the old rule's: the
    // panel's first rows again) cost the 0.5B's one-row step 4% (docs/JOURNAL.md, session 12)
    const int64_t grain = std::max<int64_t>(1, kTaskWork / (kPanelRows * cols * x_rows));
    at::parallel_for(0, items * runs, grain, [&](int64_t begin, int64_t end) {
      static thread_local std::vector<float> sums;
      sums.resize(kPanelRows * x_rows);
      for (int64_t item = begin; item < end; ++item) {
        const ShardPanel& panel = panels[item % items];
        const BlockShard& shard = shards[panel.shard];
        const int64_t m_begin = item / items * x_rows, m_end = std::min(m_begin + x_rows, m_rows);
        std::fill(sums.begin(), sums.end(), 0.f);
        quants::with_type(shard.type, [&](auto t) {
          using T = decltype(t);
          if constexpr (T::kBlockValues == 32) {
            if (pair_contract) return pair_rows<T>(shard, panel, px, m_begin, m_end, sums.data(), kPanelRows);
          }
          if constexpr (T::kIntegerScales) {
            if (cx.bytes) {
              if (m_end - m_begin >= tile_min_rows(T::kType)) {
                byte_tile<T>(shard, panel, cx, m_begin, m_end, chunks, sums.data(), kPanelRows);
              } else {
                byte_rows<T>(shard, panel, cx, m_begin, m_end, chunks, sums.data(), kPanelRows);
              }
              return;
            }
          }
          const bool whole_rows = x_rows <= (T::kIntegerScales ? 1 : kWholeRows);
          const int64_t span = whole_rows ? chunks : kSpanChunks;
          const int64_t stream_ahead = kRowsAhead * kSpanChunks * quants::chunk_bytes<T>();
          for (int64_t k0 = 0; k0 < chunks; k0 += span) {
            const int64_t k1 = std::min(k0 + span, chunks);
            for (int64_t m0 = m_begin; m0 < m_end; m0 += kRowGroup) {
              with_count<kRowGroup>(std::min<int64_t>(kRowGroup, m_end - m0), [&](auto rows) {
                constexpr int R = decltype(rows)::value;
                for (int64_t n = panel.n0; n < panel.n1; ++n) {
                  const uint8_t* row = shard.data + n * shard.row_bytes;
                  float* row_sums = sums.data() + (m0 - m_begin) * kPanelRows + (n - panel.n0);
                  const int64_t ahead = whole_rows && T::kIntegerScales ? stream_ahead
                                        : whole_rows || n + kRowsAhead < panel.n1
                                            ? kRowsAhead * shard.row_bytes
                                            : (kRowsAhead - (panel.n1 - panel.n0)) * shard.row_bytes +
                                                  (k1 - k0) * quants::chunk_bytes<T>();
                  // the row's sums kept apart from `sums` until it ends: summed there through the pointer,
                  // Q8_0's rows took 1.5x as long (docs/JOURNAL.md, session 11)
                  float row_sum[R] = {};
                  if constexpr (T::kIntegerScales) {
                    integer_chunk_row<T, R>(row, cx, m0, k0, k1, row_sum, ahead);
                  } else {
#if defined(PAGEDLLM_AVX512)
                    if constexpr (T::kSigned) {
                      blocks_row_apart<T, R>(row, qx, m0, k0, k1, row_sum, ahead);
                    } else if constexpr (quants::kQuads<T>) {
                      quad_row<T, R>(row, qx, m0, k0, k1, row_sum, ahead);
                    } else {
                      blocks_row<T, R>(row, qx, m0, k0, k1, row_sum, ahead);
                    }
#else
                    if constexpr (T::kBlockValues == 32) {
                      block_units_row<T, R>(row, qx, m0, k0, k1, row_sum, ahead);
                    } else {
                      blocks_row<T, R>(row, qx, m0, k0, k1, row_sum, ahead);
                    }
#endif
                  }
                  for (int i = 0; i < R; ++i) row_sums[i * kPanelRows] += row_sum[i];
                }
              });
            }
          }
        });
        // a row of out at a time, from a row of sums (column after column, each load and store of a 200-row
        // item on a line of its own, 1 KB apart in sums, took an eighth of the 1.5B's 200-row calls: session 28)
        for (int64_t m = m_begin; m < m_end; ++m)
          out.store_row(m, shard.first_row + panel.n0, sums.data() + (m - m_begin) * kPanelRows, panel.n1 - panel.n0);
      }
    });
    return;
  }
  if (!out.bf16) {
    // float32 out: panels of 48 dequantized once for each run of kChunkRows rows of x, under panel_matmul's
    // register tiles; items panel after panel over one run of x
    const std::vector<ShardPanel> panels = shard_panels(shards, kPanelCols);
    const auto items = static_cast<int64_t>(panels.size());
    const int64_t chunks = (m_rows + kChunkRows - 1) / kChunkRows;
    const int64_t grain = std::max<int64_t>(1, kTaskWork / (kPanelCols * cols * std::min(kChunkRows, m_rows)));
    const int64_t n_rows = total_rows(shards);
    at::parallel_for(0, items * chunks, grain, [&](int64_t begin, int64_t end) {
      static thread_local std::vector<float> panel, rows;
      panel.resize(kPanelCols * cols);
      rows.resize(VecF::kWidth * cols);
      for (int64_t item = begin; item < end; ++item) {
        const ShardPanel& p = panels[item % items];
        const BlockShard& shard = shards[p.shard];
        const int64_t m0 = item / items * kChunkRows, m1 = std::min(m0 + kChunkRows, m_rows);
        quants::with_type(shard.type, [&](auto t) { dequantize_panel<decltype(t)>(shard, p, cols, panel.data(), rows.data()); });
        panel_rows(panel.data(), shard.first_row + p.n0, static_cast<int>(p.n1 - p.n0), n_rows, cols, x, m0, m1,
                   static_cast<float*>(out.out), static_cast<const float*>(out.bias),
                   static_cast<const float*>(out.residual), out.ld_residual);
      }
    });
    return;
  }
  const std::vector<ShardPanel> panels = shard_panels(shards, kPanelRows);
  const auto items = static_cast<int64_t>(panels.size());
  const int64_t chunks = (m_rows + kChunkRows - 1) / kChunkRows;
  const int64_t grain = std::max<int64_t>(1, kTaskWork / (kPanelRows * cols * std::min(kChunkRows, m_rows)));
  at::parallel_for(0, items * chunks, grain, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> buffer;
    buffer.resize(kPanelRows * cols);
    for (int64_t item = begin; item < end; ++item) {
      const ShardPanel& panel = panels[item / chunks];
      const BlockShard& shard = shards[panel.shard];
      const int64_t m0 = (item % chunks) * kChunkRows, m1 = std::min(m0 + kChunkRows, m_rows);
      // consecutive items of a thread share a panel: converted once for all its chunks of x
      if (item == begin || item % chunks == 0) {
        quants::with_type(shard.type, [&](auto t) {
          for (int64_t n = panel.n0; n < panel.n1; ++n)
            quants::dequantize_row<decltype(t)>(shard.data + n * shard.row_bytes, cols, buffer.data() + (n - panel.n0) * cols);
        });
      }
      const DenseRows<float, 1> rows{buffer.data(), cols, cols};
      block(rows, 0, panel.n1 - panel.n0, x, cols, m0, m1, out, shard.first_row + panel.n0, false);
    }
  });
}

// Many rows of x on GGUF blocks where the CPU multiplies bf16 (AVX512_BF16): the weight's rows are
// dequantized, tile by tile of at most kScratchValues values, into one bf16 scratch of the calling
// thread (shared by every layer, reused by every call) and multiplied by torch's bf16 matmul (oneDNN),
// x rounded to bf16. The values multiplied are the file's rounded to bf16 (8 significant bits), and the
// matmul's output is bf16 before it is widened to out's dtype: a bf16 model's error, not float32's.
// Python's GGUFLinear enables it (group_size = the rows from which it runs) only where it is faster, and
// blocks_bf16 (above blocks_matmul) gates it.
constexpr int64_t kScratchValues = int64_t{32} << 20;  // 64 MiB of bf16: every projection of the built-in models but an LM head in one tile

// Rows row_of(0), ..., row_of(count - 1) of the shards dequantized into dst (count rows of cols, row-major):
// the file's values, rounded to bf16 where T is; rows split between threads.
template <typename T, typename RowOf>
void dequantize_shard_rows(const std::vector<BlockShard>& shards, int64_t count, int64_t cols, const RowOf& row_of, T* dst) {
  at::parallel_for(0, count, std::max<int64_t>(1, kTaskWork / (4 * cols)), [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> row;
    row.resize(cols);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = row_of(i);
      const auto shard = std::find_if(shards.begin(), shards.end(), [&](const BlockShard& s) { return n < s.first_row + s.rows; });
      float* values = row.data();
      if constexpr (std::is_same_v<T, float>) values = dst + i * cols;
      quants::with_type(shard->type, [&](auto t) {
        quants::dequantize_row<decltype(t)>(shard->data + (n - shard->first_row) * shard->row_bytes, cols, values);
      });
      if constexpr (!std::is_same_v<T, float>) {
        for_each_chunk(cols, [&](int64_t k, int valid) { store(load(row.data() + k, valid), dst + i * cols + k, valid); });
      }
    }
  });
}

at::Tensor bf16_blocks_linear(const at::Tensor& x, const std::vector<BlockShard>& shards, int64_t n_rows, int64_t cols,
                              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  static thread_local at::Tensor scratch;  // per calling thread: tensor-parallel ranks may be threads
  const int64_t tile_rows = std::min(n_rows, std::max<int64_t>(1, kScratchValues / cols));
  if (!scratch.defined() || scratch.numel() < tile_rows * cols) {
    scratch = at::empty({tile_rows * cols}, x.options().dtype(at::kBFloat16));
  }
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  at::Tensor out;
  for (int64_t n0 = 0; n0 < n_rows; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, n_rows - n0);
    const at::Tensor w = scratch.narrow(0, 0, rows * cols).view({rows, cols});
    dequantize_shard_rows(shards, rows, cols, [n0](int64_t i) { return n0 + i; }, w.data_ptr<c10::BFloat16>());
    const at::Tensor y = at::linear(xb, w);
    if (rows == n_rows) {
      out = y.to(x.scalar_type());
    } else {
      if (!out.defined()) out = at::empty({x.size(0), n_rows}, x.options());
      out.narrow(1, n0, rows).copy_(y);
    }
  }
  if (bias.has_value()) out.add_(*bias);
  if (residual.has_value()) out.add_(*residual);
  return out;
}

// Many rows of x on GGUF blocks where the CPU has AMX (could_pack(bf16): oneDNN's brgemm ukernel runs bf16
// tiles): without the scratch above, which a whole weight's dequantization sends through memory. Each
// thread dequantizes a panel of weight rows once into bf16, which stays in L2, and multiplies every row of
// x (rounded to bf16 once a call) by it into float32 sums, kVnniXRows rows of x a brgemm call; the epilogue
// adds bias and residual. Up to kVnniRowPanelRows rows of x (decode steps, where filling the panels is most
// of the time) the panel is brgemm's A, row-major as the file stores the rows, and x is B in VNNI layout
// ([K / 2][rows of x][2], built once a call), the sums [panel rows][rows of x] transposed in the epilogue;
// above it x is A and the panel B in VNNI layout ([K / 2][panel rows][2]), a register transpose of every
// 512 values that the brgemm of many rows repays. The values multiplied are the file's rounded to bf16, the
// sums float32 (no bf16 output rounding). Panels of 64 rows, 32 where 64 would pass kVnniPanelBytes (a
// wide down projection's panel beside its rows of x overflowed L2). Crossovers and panel sizes:
// docs/JOURNAL.md, "GGUF blocks on AMX" and "Session 10: the panel as brgemm's A".
constexpr int64_t kVnniPanelBytes = 512 << 10;
constexpr int64_t kVnniXRows = 32;  // rows of x a brgemm call
constexpr int64_t kVnniRowPanelRows = 64;

int64_t vnni_panel_rows(int64_t cols) { return cols * 64 * 2 <= kVnniPanelBytes ? 64 : 32; }

#if defined(PAGEDLLM_AVX512)
// Panel p of a shard as brgemm's B: VNNI pairs, 16 rows at a time, a chunk of 256 columns at a time: the
// rows' floats (in L1), each row's 32 columns converted to 16 bf16 pairs (a 32-bit lane each) and
// transposed so that a pair's 16 rows are contiguous. Rows past the shard's are zeros.
template <typename T>
__attribute__((target("avx512bf16"))) void vnni_pair_panel(const BlockShard& shard, const ShardPanel& p,
                                                           int64_t cols, int64_t panel_rows, c10::BFloat16* panel) {
  constexpr int W = 16, kValues = quants::kChunkValues;
  alignas(64) float rows[W][kValues];
  for (int64_t r0 = 0; r0 < panel_rows; r0 += W) {
    const int64_t valid = std::clamp<int64_t>(p.n1 - p.n0 - r0, 0, W);
    for (int64_t k = 0; k * kValues < cols; ++k) {
      const int values = static_cast<int>(std::min<int64_t>(kValues, cols - k * kValues));
      for (int r = 0; r < W; ++r) {
        if (r < valid) {
          quants::dequantize_chunk<T>(shard.data + (p.n0 + r0 + r) * shard.row_bytes, k, cols, rows[r]);
        } else {
          std::fill(rows[r], rows[r] + values, 0.f);
        }
      }
      for (int j = 0; j < values; j += 2 * W) {
        __m512 pairs[W];
        for (int r = 0; r < W; ++r) {
          pairs[r] = reinterpret_cast<__m512>(_mm512_cvtne2ps_pbh(_mm512_load_ps(rows[r] + j + W), _mm512_load_ps(rows[r] + j)));
        }
        transpose16(pairs);
        float* dst = reinterpret_cast<float*>(panel) + (k * kValues + j) / 2 * panel_rows + r0;
        for (int i = 0; i < W; ++i) _mm512_storeu_ps(dst + i * panel_rows, pairs[i]);
      }
    }
  }
}

// Panel p of a shard as brgemm's A: its rows as bf16, row-major, a chunk of 256 columns at a time through
// a row of floats in L1.
template <typename T>
__attribute__((target("avx512bf16"))) void vnni_row_panel(const BlockShard& shard, const ShardPanel& p, int64_t cols,
                                                          c10::BFloat16* panel) {
  constexpr int W = 16, kValues = quants::kChunkValues;
  alignas(64) float chunk[kValues];
  for (int64_t r = 0; r < p.n1 - p.n0; ++r) {
    const uint8_t* row = shard.data + (p.n0 + r) * shard.row_bytes;
    for (int64_t k = 0; k * kValues < cols; ++k) {
      const int values = static_cast<int>(std::min<int64_t>(kValues, cols - k * kValues));
      quants::dequantize_chunk<T>(row, k, cols, chunk);
      for (int j = 0; j < values; j += 2 * W) {  // values: whole 32-value blocks
        const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_load_ps(chunk + j + W), _mm512_load_ps(chunk + j));
        _mm512_storeu_si512(panel + r * cols + k * kValues + j, reinterpret_cast<__m512i>(pairs));
      }
    }
  }
}

// The 32-bit elements src [rows][cols] (rows ld_src apart) transposed into dst [cols][ld_dst]: 16 x 16 at
// a time in registers where whole.
void transpose_words(const uint32_t* src, int64_t rows, int64_t cols, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
  int64_t r = 0;
  for (; r + 16 <= rows; r += 16) {
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      transpose_tile(reinterpret_cast<const float*>(src + r * ld_src + c), ld_src,
                     reinterpret_cast<float*>(dst + c * ld_dst + r), ld_dst);
    }
    for (; c < cols; ++c)
      for (int64_t i = r; i < r + 16; ++i) dst[c * ld_dst + i] = src[i * ld_src + c];
  }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

at::Tensor vnni_blocks_linear(const at::Tensor& x, const std::vector<BlockShard>& shards, int64_t n_rows, int64_t cols,
                              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  const int64_t m_rows = x.size(0);
  const bool panel_is_a = m_rows <= kVnniRowPanelRows;
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const c10::BFloat16* xs = xb.data_ptr<c10::BFloat16>();
  // panel_is_a: x as B, the VNNI pairs of each kVnniXRows rows at m * cols, as the brgemm calls read them
  const at::Tensor xv = panel_is_a ? at::empty(xb.sizes(), xb.options()) : xb;
  c10::BFloat16* xvs = xv.data_ptr<c10::BFloat16>();
  if (panel_is_a) {
    for (int64_t m = 0; m < m_rows; m += kVnniXRows) {
      const int64_t mr = std::min(kVnniXRows, m_rows - m);
      transpose_words(reinterpret_cast<const uint32_t*>(xs + m * cols), mr, cols / 2, cols / 2,
                      reinterpret_cast<uint32_t*>(xvs + m * cols), mr);
    }
  }
  at::Tensor out = at::empty({m_rows, n_rows}, x.options());
  const Epilogue epilogue = Epilogue::into(out, bias, residual);
  const int64_t np = vnni_panel_rows(cols);
  const std::vector<ShardPanel> panels = shard_panels(shards, np);
  at::parallel_for(0, static_cast<int64_t>(panels.size()), 1, [&](int64_t begin, int64_t end) {
    static thread_local LineVector<c10::BFloat16> panel;
    static thread_local LineVector<float> sums, by_row;
    panel.resize(cols * np);
    sums.resize(kVnniXRows * np);
    by_row.resize(kVnniXRows * np);
    for (int64_t item = begin; item < end; ++item) {
      const ShardPanel& p = panels[item];
      const BlockShard& shard = shards[p.shard];
      const int64_t pr = p.n1 - p.n0;
      quants::with_type(shard.type, [&](auto t) {
        if (panel_is_a) return vnni_row_panel<decltype(t)>(shard, p, cols, panel.data());
        vnni_pair_panel<decltype(t)>(shard, p, cols, np, panel.data());
      });
      for (int64_t m = 0; m < m_rows; m += kVnniXRows) {
        const int64_t mr = std::min(kVnniXRows, m_rows - m);
        if (panel_is_a) {  // sums [pr][mr], by_row [mr][np]
          at::native::cpublas::brgemm(pr, mr, cols, cols, mr, mr, false, panel.data(), xvs + m * cols, sums.data(), true);
          transpose_words(reinterpret_cast<const uint32_t*>(sums.data()), pr, mr, mr,
                          reinterpret_cast<uint32_t*>(by_row.data()), np);
        } else {  // by_row [mr][np]
          at::native::cpublas::brgemm(mr, np, cols, cols, np, np, false, xs + m * cols, panel.data(), by_row.data(), true);
        }
        for (int64_t i = 0; i < mr; ++i) epilogue.store_row(m + i, shard.first_row + p.n0, by_row.data() + i * np, pr);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
}
#endif

// Calls fn(source) with the row source for this weight format: for int8 / int4 codes in groups of whole
// blocks, their CodeRows (integer dot products) if kInteger.
template <bool kInteger, typename Fn>
void with_source(const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                 const c10::optional<at::Tensor>& mins, int64_t group, int64_t cols, const Fn& fn) {
  const int64_t n_rows = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous 2-D tensor");
  const auto type = weight.scalar_type();
  if (type == at::kFloat || type == at::kBFloat16) {
    TORCH_CHECK(weight.size(1) == cols, "weight has ", weight.size(1), " columns, x has ", cols);
    if (type == at::kFloat) return fn(DenseRows<float, 2>{weight.data_ptr<float>(), cols, cols});
    return fn(DenseRows<c10::BFloat16, 2>{weight.data_ptr<c10::BFloat16>(), cols, cols});
  }
  const bool int4 = type == at::kByte;
  TORCH_CHECK(int4 || type == at::kChar, "unsupported weight dtype ", type, " (float32, bfloat16, int8 or uint8 = int4)");
  TORCH_CHECK(weight.size(1) * (int4 ? 2 : 1) == cols, "weight has ", weight.size(1), " bytes a row, x has ",
              cols, " columns");
  TORCH_CHECK(group > 0 && group % (int4 ? 32 : 16) == 0 && cols % group == 0, "group size ", group,
              " must divide the columns (", cols, ") and be a multiple of ", int4 ? 32 : 16);
  TORCH_CHECK(scales.has_value(), "a quantized weight needs scales");
  const at::Tensor& s = *scales;
  TORCH_CHECK(s.is_contiguous() && s.dim() == 2 && s.size(0) == n_rows && s.size(1) == cols / group,
              "scales must be a contiguous [", n_rows, ", ", cols / group, "] tensor, got ", s.sizes());
  TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == at::kHalf, "scales must be float32 or float16");
  if (mins.has_value()) {
    TORCH_CHECK(mins->sizes() == s.sizes() && mins->is_contiguous() && mins->scalar_type() == s.scalar_type(),
                "mins must be shaped and typed like scales");
  }
  TORCH_CHECK(!int4 || mins.has_value(), "an int4 weight needs mins");
  auto run = [&](auto scale_tag) {
    using S = decltype(scale_tag);
    const Groups<S> groups{s.data_ptr<S>(), mins.has_value() ? mins->data_ptr<S>() : nullptr, group, cols / group};
    if constexpr (kInteger) {
      if (group % kBlock == 0) {
        const auto* codes = static_cast<const uint8_t*>(weight.data_ptr());
        if (int4) return fn(CodeRows<S, true>{codes, weight.size(1), groups});
        return fn(CodeRows<S, false>{codes, weight.size(1), groups});
      }
    }
    if (int4) return fn(Int4Rows<S>{weight.data_ptr<uint8_t>(), weight.size(1), cols, groups});
    if (group % 32 == 0) return fn(Int8Rows<S, 32>{weight.data_ptr<int8_t>(), weight.size(1), cols, groups});
    return fn(Int8Rows<S, 16>{weight.data_ptr<int8_t>(), weight.size(1), cols, groups});
  };
  if (s.scalar_type() == at::kFloat) return run(float{});
  return run(c10::Half{});
}

template <typename Source>
void multiply(const Source& src, int64_t n_rows, int64_t cols, const float* x, int64_t m_rows, const Epilogue& out) {
  matmul(src, n_rows, cols, x, m_rows, out);
}
template <typename S, bool kInt4>
void multiply(const CodeRows<S, kInt4>& src, int64_t n_rows, int64_t cols, const float* x, int64_t m_rows,
              const Epilogue& out) {
  integer_matmul(src, n_rows, cols, x, m_rows, out);
}

bool is_float_or_bf16(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

// x W^T (+ bias) (+ residual) by torch, as models/linear.py's dense_linear computes it.
at::Tensor torch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual) {
  if (!residual.has_value()) return at::linear(x, weight, bias);
  if (!bias.has_value()) return at::addmm(*residual, x, weight.t());
  return at::add(at::linear(x, weight, bias), *residual);
}

}  // namespace

// Whether GGUF blocks' bf16 path is vnni_blocks_linear: an AVX-512 build on a CPU with AMX bf16 tiles.
bool blocks_amx() {
#if defined(PAGEDLLM_AVX512)
  static const bool available = at::native::cpublas::could_pack(at::kBFloat16);
  return available;
#else
  return false;
#endif
}

bool set_blocks_bf16(bool enabled) {
  const bool previous = blocks_bf16;
  blocks_bf16 = enabled;
  return previous;
}

bool set_blocks_invariant(bool enabled) {
  const bool previous = blocks_invariant;
  blocks_invariant = enabled;
  return previous;
}

bool set_blocks_int8(bool enabled) {
  const bool previous = blocks_int8;
  blocks_int8 = enabled;
  return previous;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                  const c10::optional<at::Tensor>& mins, int64_t group_size, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && is_float_or_bf16(x), "x must be a 2-D float32 or bfloat16 tensor, got ", x.sizes(),
              " ", x.scalar_type());
  const bool packed = weight.dim() == 3, blocks = weight.dim() == 1;
  const int64_t m_rows = x.size(0), cols = x.size(1);
  const std::vector<BlockShard> shards = blocks ? block_shards(weight, scales, cols) : std::vector<BlockShard>{};
  const int64_t n_rows = packed ? group_size : blocks ? total_rows(shards) : weight.size(0);
  if (packed) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && weight.is_contiguous() &&
                    weight.size(2) == kPanelCols && weight.size(1) == cols &&
                    weight.size(0) == (n_rows + kPanelCols - 1) / kPanelCols,
                "a panel-packed weight must be a contiguous float32 [ceil(N / ", kPanelCols, "), K, ", kPanelCols,
                "] tensor with N = group_size (", n_rows, ") and K = x's columns (", cols, ") and x float32, got ",
                weight.sizes(), " ", weight.scalar_type(), " and x ", x.scalar_type());
  }
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && m_rows > kStreamRows) {
    return torch_linear(x, weight, bias, residual);
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_rows && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous [", n_rows, "] tensor of x's dtype");
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == m_rows && residual->size(1) == n_rows &&
                    residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "residual must be a [", m_rows, ", ", n_rows, "] tensor of x's dtype with contiguous rows");
  }
  // GGUF blocks: group_size, where set, is the number of rows from which they are multiplied in bf16
  if (blocks && blocks_bf16 && !blocks_invariant && group_size > 0 && m_rows >= group_size && n_rows > 0) {
#if defined(PAGEDLLM_AVX512)
    if (blocks_amx()) return vnni_blocks_linear(x, shards, n_rows, cols, bias, residual);
#endif
    return bf16_blocks_linear(x, shards, n_rows, cols, bias, residual);
  }
  at::Tensor out = at::empty({m_rows, n_rows}, x.options());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const Epilogue epilogue = Epilogue::into(out, bias, residual);
  if (m_rows == 0 || n_rows == 0) return out;
  if (blocks) {
    blocks_matmul(shards, cols, xf.data_ptr<float>(), m_rows, epilogue);
    return out;
  }
  if (packed) {
    panel_matmul(weight.data_ptr<float>(), n_rows, cols, xf.data_ptr<float>(), m_rows, out.data_ptr<float>(),
                 bias.has_value() ? bias->data_ptr<float>() : nullptr,
                 residual.has_value() ? residual->data_ptr<float>() : nullptr, epilogue.ld_residual);
    return out;
  }
  const auto run = [&](const auto& src) { multiply(src, n_rows, cols, xf.data_ptr<float>(), m_rows, epilogue); };
  if (m_rows <= kStreamRows) {
    with_source<true>(weight, scales, mins, group_size, cols, run);
  } else {
    with_source<false>(weight, scales, mins, group_size, cols, run);
  }
  return out;
}

void dequantize_rows(at::Tensor out, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                     const c10::optional<at::Tensor>& mins, int64_t group_size, const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "ids must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == ids.size(0) && out.is_contiguous() && is_float_or_bf16(out),
              "out must be a contiguous float32 or bfloat16 [len(ids), K] tensor");
  const int64_t cols = out.size(1), count = ids.size(0);
  const std::vector<BlockShard> shards = weight.dim() == 1 ? block_shards(weight, scales, cols) : std::vector<BlockShard>{};
  const int64_t n_rows = weight.dim() == 1 ? total_rows(shards) : weight.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n_rows, "row id ", id[i], " is out of range [0, ", n_rows, ")");
  }
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  if (!shards.empty()) {
    const auto row_of = [id](int64_t i) { return id[i]; };
    if (bf16) {
      dequantize_shard_rows(shards, count, cols, row_of, out.data_ptr<c10::BFloat16>());
    } else {
      dequantize_shard_rows(shards, count, cols, row_of, out.data_ptr<float>());
    }
    return;
  }
  with_source<false>(weight, scales, mins, group_size, cols, [&](const auto& src) {
    using Source = std::decay_t<decltype(src)>;
    at::parallel_for(0, count, std::max<int64_t>(1, kTaskWork / (4 * cols)), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        src.template for_each_unit<1>(id[i], [&](int64_t k, const VecF* w, int valid) {
          for (int j = 0; j < Source::kVectors; ++j) {
            const int64_t offset = i * cols + k + j * VecF::kWidth;
            if (bf16) {
              store(w[j], out.data_ptr<c10::BFloat16>() + offset, lanes(valid, j));
            } else {
              store(w[j], out.data_ptr<float>() + offset, lanes(valid, j));
            }
          }
        });
      }
    });
  });
}

}  // namespace pagedllm
