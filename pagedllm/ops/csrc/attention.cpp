// Paged attention on the CPU: K/V are read in place through the block table (no gather copy).
//
// One kernel serves decode and prefill: sequence s owns query rows query_start_loc[s]..[s+1], the last
// rows of its context_lens[s] tokens, causal (and inside the sliding window, if any). A call runs in steps:
//   plan     work items of (sequence, kv heads, query rows), each holding the whole GQA group, so that a
//            block of K/V is read from memory once for every head and query row that uses it; the input is
//            checked here, before any work.
//   decode   a decode step's query row is one item (decode_row) of every kv head of its sequence, which
//            walks the block table once for all of them: in the engine's head-major cache a block's heads
//            lie side by side, so it reads one run of block_size x Hkv x D values a block instead of Hkv
//            runs far apart. Memory-bound: two passes over a per-thread score buffer (scores; exp, then the
//            sum of V).
//   prefill  an item of many query rows (prefill_tile) keeps its scores transposed and does both products
//            register-tiled like a GEMM: at prompt lengths the work is arithmetic, which a row at a time wastes.
//   combine  a decode row with far more than its share of the batch's keys would keep one thread busy while
//            the others wait, so its keys are split into parts on several threads, merged after.
// Arithmetic is fp32; a bf16 or fp16 cache is widened in registers. A quantized cache (int8 or fp8 e4m3 codes, a
// float32 scale per token and kv head after each block's codes: ops/kv_cache.py) is read in place too: the
// codes are widened in registers, and the scale multiplies a key's score (decode) or its codes (prefill
// keys, values), or a value's weight (decode). Its keys are stored smoothed, (k - mean) / factor per channel
// (the layer's key smoothing, after its last block): the query is multiplied by the factor as it is loaded,
// and the mean, which shifts every score of a query alike, is left out. The query may be a strided view
// (e.g. the q part of a fused qkv projection): only its last dimension must be contiguous.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "int8_decode.h"
#include "simd.h"
#include "threads.h"

namespace pagedllm {
namespace {

constexpr int64_t kRowsPerTile = 16;  // query rows of one sequence handled by one work item
constexpr int kRows = 4;              // query rows of a micro-kernel: they share every K/V load
constexpr int64_t kBlocksAhead = 1;  // how far ahead blocks are prefetched

// ---- Shared: the items and the rows they read ----

// Whether a cache of T holds codes with a float32 scale per row (value = code * scale) rather than values.
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn>;

// Where a quantized cache's scales are (ops/kv_cache.py): after each block's codes, one float32 per row of
// head_dim codes, in the codes' row order; so in floats, a slot's scales are slot_stride / head_dim apart
// and a head's head_stride / head_dim.
struct ScaleLayout {
  int64_t codes = 0;                         // elements (bytes) of a block's codes, before its scales
  int64_t slot_stride = 0, head_stride = 0;  // in floats
  int64_t bytes = 0;                         // of a block's scales
};

// The ScaleLayout of a quantized cache view, checked to be one that ops/kv_cache.py allocates: dense rows of
// codes in either memory order, room for the scales after each block's, all inside the tensor's memory.
ScaleLayout scale_layout(const at::Tensor& cache) {
  const int64_t block_size = cache.size(1), heads = cache.size(2), d = cache.size(3);
  const int64_t codes = block_size * heads * d, bytes = block_size * heads * static_cast<int64_t>(sizeof(float));
  const bool slot_major = cache.stride(1) == heads * d && cache.stride(2) == d;
  const bool head_major = cache.stride(1) == d && cache.stride(2) == block_size * d;
  const int64_t end = cache.storage_offset() + (cache.size(0) - 1) * cache.stride(0) + codes + bytes;
  const auto first_scale = reinterpret_cast<uintptr_t>(cache.data_ptr()) + codes;
  TORCH_CHECK((slot_major || head_major) && cache.stride(0) >= codes + bytes && cache.stride(0) % 4 == 0 &&
                  first_scale % alignof(float) == 0 && end <= static_cast<int64_t>(cache.storage().nbytes()),
              "a ", cache.scalar_type(), " KV cache must be a view allocate_kv_caches made (each block's scales "
              "after its codes), got sizes ", cache.sizes(), " and strides ", cache.strides());
  return {codes, cache.stride(1) / d, cache.stride(2) / d, bytes};
}

// A quantized K cache's key smoothing (ops/kv_cache.py key_smoothing): its mean, then its factor, [Hkv, D]
// floats each, right after the view's last block; checked to lie inside the tensor's memory.
const float* key_smoothing(const at::Tensor& cache) {
  const int64_t blocks_end = cache.size(0) * cache.stride(0);  // bytes: one a code
  const int64_t bytes = 2 * cache.size(2) * cache.size(3) * static_cast<int64_t>(sizeof(float));
  TORCH_CHECK(cache.storage_offset() + blocks_end + bytes <= static_cast<int64_t>(cache.storage().nbytes()),
              "a ", cache.scalar_type(), " KV cache must be a view allocate_kv_caches made (its key smoothing after "
              "its last block), got sizes ", cache.sizes(), " and strides ", cache.strides());
  return reinterpret_cast<const float*>(static_cast<const char*>(cache.data_ptr()) + blocks_end);
}

// Codes and a scale for one row of d values (ops/reference.py quantize, to the bit): symmetric, scale =
// max |x| / the largest code, each code x / scale rounded to nearest even (int8) or to e4m3 (c10's
// conversion, torch's own); a zero row has scale 0 and codes 0, a row with a NaN or an infinity a NaN scale.
template <typename S, typename D>
void quantize_row(const S* x, D* codes, float* scale, int64_t d) {
  constexpr float kLargest = std::is_same_v<D, int8_t> ? 127.f : 448.f;
  float largest = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < d; ++i) {
    const float v = static_cast<float>(x[i]);
    largest = std::max(largest, std::fabs(v));
    finite = finite && std::isfinite(v);
  }
  const float s = finite ? largest / kLargest : std::numeric_limits<float>::quiet_NaN();
  *scale = s;
  for (int64_t i = 0; i < d; ++i) {
    const float v = s > 0.f ? static_cast<float>(x[i]) / s : 0.f;
    if constexpr (std::is_same_v<D, int8_t>) {
      codes[i] = static_cast<int8_t>(std::nearbyint(v));
    } else {
      codes[i] = D(v);
    }
  }
}

// Key/value rows of one sequence and `heads` kv heads from the first, addressed through its block table.
template <typename T>
struct PagedRows {
  const int32_t* table;
  int64_t block_size, block_stride, slot_stride, head_stride, first_head, heads, head_dim;
  ScaleLayout scales;  // a quantized cache's

  const T* block_start(const T* cache, int64_t b) const {
    return cache + static_cast<int64_t>(table[b]) * block_stride + first_head * head_stride;
  }
  // The scale of block b's first row of the first head (a quantized cache's; nullptr otherwise).
  const float* block_scales(const T* cache, int64_t b) const {
    if constexpr (kScaled<T>) {
      const T* codes_end = cache + static_cast<int64_t>(table[b]) * block_stride + scales.codes;
      return reinterpret_cast<const float*>(codes_end) + first_head * scales.head_stride;
    } else {
      return nullptr;
    }
  }

  // Asks for block b's rows of [lo, hi) (every head's, and a quantized cache's scales) to be brought into
  // the cache ahead of use.
  void prefetch(const T* cache, int64_t b, int64_t hi) const {
    const int64_t first = b * block_size;
    if (first >= hi) return;
    const char* start = reinterpret_cast<const char*>(block_start(cache, b));
    const int64_t rows = std::min(block_size, hi - first), bytes = head_dim * sizeof(T);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t off = 0; off < bytes; off += 64)
          _mm_prefetch(start + (h * head_stride + j * slot_stride) * sizeof(T) + off, _MM_HINT_T1);
    if constexpr (kScaled<T>) {  // all the block's scales (every head's): a few lines
      const char* all = reinterpret_cast<const char*>(cache + table[b] * block_stride + scales.codes);
      for (int64_t off = 0; off < scales.bytes; off += 64) _mm_prefetch(all + off, _MM_HINT_T1);
    }
  }

  // fn(t0, t1, row_t0, scale_t0) for each block's share [t0, t1) of [lo, hi); token rows are slot_stride
  // apart and row_t0 is the first head's (head h's rows start h * head_stride further); for a quantized
  // cache, scale_t0 is row_t0's scale (token j's of head h at j * scales.slot_stride + h * scales.head_stride
  // from it), else nullptr.
  // Blocks are scattered in memory, so the hardware cannot guess the next one: with Prefetch, each is
  // prefetched kBlocksAhead blocks before its turn. For decode, which memory's rate for random runs limits,
  // how far ahead (or whether) made little difference; a prefill tile, which does much more arithmetic a
  // block, runs faster without.
  template <bool Prefetch = true, typename F>
  void for_each_block(const T* cache, int64_t lo, int64_t hi, const F& fn) const {
    const int64_t first_block = lo / block_size;
    if constexpr (Prefetch)
      for (int64_t b = first_block; b < first_block + kBlocksAhead; ++b) prefetch(cache, b, hi);
    for (int64_t b = first_block; b * block_size < hi; ++b) {
      if constexpr (Prefetch) prefetch(cache, b + kBlocksAhead, hi);
      const int64_t first = b * block_size, next = first + block_size;
      const int64_t t0 = std::max(lo, first);
      const float* scale_t0 = kScaled<T> ? block_scales(cache, b) + (t0 - first) * scales.slot_stride : nullptr;
      fn(t0, std::min(hi, next), block_start(cache, b) + (t0 - first) * slot_stride, scale_t0);
    }
  }
  // for_each_block over K and V caches of the same layout at once, without prefetching: fn(t0, t1, b,
  // k_row_t0, k_scale_t0, v_row_t0, v_scale_t0) for block b's share [t0, t1).
  template <typename F>
  void for_each_block_kv(const T* k_cache, const T* v_cache, int64_t lo, int64_t hi, const F& fn) const {
    for_each_block<false>(k_cache, lo, hi, [&](int64_t t0, int64_t t1, const T* k_row, const float* k_scale) {
      const int64_t b = t0 / block_size, skip = t0 - b * block_size;
      const float* v_scale = kScaled<T> ? block_scales(v_cache, b) + skip * scales.slot_stride : nullptr;
      fn(t0, t1, b, k_row, k_scale, block_start(v_cache, b) + skip * slot_stride, v_scale);
    });
  }
};

// The first key a query row sees, given the end of its keys (its position + 1) and the sliding window
// (0: none).
inline int64_t window_begin(int64_t key_end, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, key_end - window) : 0;
}

// One call's tensors as pointers and strides. The caches are [num_blocks, block_size, Hkv, D] views; their
// memory may be slot-major or head-major.
template <typename TQ, typename TKV>
struct Batch {
  const TQ* q;
  TQ* out;
  const TKV* k_cache;
  const TKV* v_cache;
  const int32_t* tables;  // block_tables, max_blocks a row
  const int32_t* starts;  // query_start_loc
  const int32_t* lens;    // context_lens
  int64_t num_seqs, num_heads, group, head_dim, q_row_stride, q_head_stride;
  int64_t num_blocks, max_blocks, block_size, block_stride, slot_stride, head_stride;
  ScaleLayout scales;  // a quantized cache's (K and V share it)
  const float* key_mean;    // a quantized K cache's smoothing mean, [Hkv, D] (nullptr otherwise)
  const float* key_factor;  // and its factor
  double scale;
  int64_t window;  // 0: none
  float softcap;   // scores capped at +-softcap (Gemma 2); 0: not capped

  int64_t q_len(int64_t s) const { return starts[s + 1] - starts[s]; }
  // What element i of query head `head` is multiplied by over a quantized cache, whose keys are stored
  // divided by their kv head's key smoothing factor.
  float key_factor_of(int64_t head, int64_t i) const { return key_factor[head / group * head_dim + i]; }
  // What the kernels leave out of query head `head`'s scores in batch row `row` over such a cache: every
  // key's mean's share, scale * q . mean (the same for every key, so the softmax ignores it; a soft cap
  // does not).
  float mean_score(int64_t row, int64_t head) const {
    const TQ* src = q + row * q_row_stride + head * q_head_stride;
    const float* mean = key_mean + head / group * head_dim;
    float sum = 0.f;
    for (int64_t i = 0; i < head_dim; ++i) sum += static_cast<float>(src[i]) * mean[i];
    return sum * static_cast<float>(scale);
  }
  // Query row r of sequence s sits at position first_pos(s) + r and sees keys (pos - window, pos].
  int64_t first_pos(int64_t s) const { return lens[s] - q_len(s); }
  // Keys a query row of sequence s reads at most: its context, or its window of it.
  int64_t keys_of(int64_t s) const { return window > 0 ? std::min<int64_t>(window, lens[s]) : lens[s]; }
  int64_t blocks_of(int64_t s) const { return (lens[s] + block_size - 1) / block_size; }
  PagedRows<TKV> paged(int64_t s, int64_t first_head, int64_t heads) const {
    return {tables + s * max_blocks, block_size, block_stride, slot_stride, head_stride, first_head, heads, head_dim,
            scales};
  }
};

// The Batch of paged_attention's tensors (checked there first).
template <typename TQ, typename TKV>
Batch<TQ, TKV> batch_of(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                        const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  return {
      .q = q.data_ptr<TQ>(),
      .out = out.data_ptr<TQ>(),
      .k_cache = k_cache.data_ptr<TKV>(),
      .v_cache = v_cache.data_ptr<TKV>(),
      .tables = block_tables.data_ptr<int32_t>(),
      .starts = query_start_loc.data_ptr<int32_t>(),
      .lens = context_lens.data_ptr<int32_t>(),
      .num_seqs = context_lens.size(0),
      .num_heads = q.size(1),
      .group = q.size(1) / k_cache.size(2),
      .head_dim = q.size(2),
      .q_row_stride = q.stride(0),
      .q_head_stride = q.stride(1),
      .num_blocks = k_cache.size(0),
      .max_blocks = block_tables.size(1),
      .block_size = k_cache.size(1),
      .block_stride = k_cache.stride(0),
      .slot_stride = k_cache.stride(1),
      .head_stride = k_cache.stride(2),
      .scales = kScaled<TKV> ? scale_layout(k_cache) : ScaleLayout{},
      .key_mean = kScaled<TKV> ? key_smoothing(k_cache) : nullptr,
      .key_factor = kScaled<TKV> ? key_smoothing(k_cache) + k_cache.size(2) * k_cache.size(3) : nullptr,
      .scale = scale,
      .window = window,
      .softcap = static_cast<float>(softcap),
  };
}

struct WorkItem {
  int64_t seq, kv_head, kv_heads, row_begin, row_end;  // rows relative to the sequence's first query row
  int64_t part = 0, parts = 1;                         // this item's share of a single row's keys

  int64_t rows() const { return row_end - row_begin; }
};

struct KeyRange {
  int64_t lo, hi;
};

// The keys [lo, hi) an item reads: those its rows see, and for a part of a split row, that part's share.
template <typename TQ, typename TKV>
KeyRange key_range(const Batch<TQ, TKV>& b, const WorkItem& it) {
  const int64_t first_pos = b.first_pos(it.seq);
  int64_t lo = window_begin(first_pos + it.row_begin + 1, b.window), hi = first_pos + it.row_end;
  if (it.parts > 1) {
    const int64_t share = (hi - lo + it.parts - 1) / it.parts;
    lo = std::min(hi, lo + it.part * share);
    hi = std::min(hi, lo + share);
  }
  return {lo, hi};
}

// What each part of a split row leaves for the combine step, per query head m of its item: the max score
// (at m), the sum of exp(score - max) (at num_heads + m) and the unnormalised sum of V rows weighted by
// exp(score - max) (at 2 num_heads + m D).
template <typename TQ, typename TKV>
int64_t partial_size(const Batch<TQ, TKV>& b) {
  return b.num_heads * (b.head_dim + 2);
}

// ---- Plan: the work items ----

// Below this many multiply-adds in all, a call runs on the calling thread. Threads that sleep at once
// take tens of microseconds to wake, more than one sequence's decode attention over a few hundred tokens
// takes; threads still spinning from the matmul before (pagedllm's default) start in ~1 us, and one
// user's 200-token context split between two of them took 21 us a layer against 33 inline (SmolLM2, its
// keys out of L2: docs/JOURNAL.md, session 12).
inline int64_t inline_work() { return threads_sleep_at_once() ? int64_t{1} << 19 : int64_t{1} << 15; }

// Runs fn(i) for i in [0, n) on the intra-op thread pool (inline when `work` is small), handing out items
// one at a time so that sequences of very different lengths still balance across threads.
template <typename F>
void parallel_dynamic(int64_t n, int64_t work, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t tasks = work < inline_work() ? 1 : std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

// A decode row's keys are split into parts of at least this many (key, kv head) pairs when its item alone
// would keep a thread busy for long (one request: a 4,000-token context on 2 threads).
constexpr int64_t kMinPartKeys = 256;

struct Plan {
  std::vector<WorkItem> items;
  int64_t work = 0;    // multiply-adds (an upper bound for prefill rows, which see fewer keys)
  bool split = false;  // whether some row's keys are split into parts (combine_parts merges them)
};

// Refuses the first block id the batch reads that is not a block of the cache; called once a call's
// lowest and highest ids say there is one, so that a valid call does no more than that min/max.
template <typename TQ, typename TKV>
void refuse_bad_block_id(const Batch<TQ, TKV>& b) {
  for (int64_t s = 0; s < b.num_seqs; ++s)
    for (int64_t i = 0; i < b.blocks_of(s); ++i) {
      const int32_t id = b.tables[s * b.max_blocks + i];
      TORCH_CHECK(id >= 0 && id < b.num_blocks, "block id ", id, " of sequence ", s, " is out of range (the cache has ",
                  b.num_blocks, " blocks)");
    }
}

// A decode item holding much more than its share of the keys (1 / (2 x threads) of them all) would keep
// one thread busy while the others wait: its keys are split into parts, combined after.
template <typename TQ, typename TKV>
void split_long_rows(const Batch<TQ, TKV>& b, Plan& plan) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || plan.work < inline_work()) return;
  int64_t all_pairs = 0;  // (key, kv head) pairs read for each query row, over all items
  for (const WorkItem& it : plan.items) all_pairs += b.keys_of(it.seq) * it.kv_heads * it.rows();
  const int64_t share = std::max<int64_t>(1, all_pairs / (2 * threads));
  std::vector<WorkItem> split;
  for (const WorkItem& it : plan.items) {
    const int64_t keys = b.keys_of(it.seq), pairs = keys * it.kv_heads;
    // At least kMinPartKeys pairs and 16 keys a part: never an empty part.
    const int64_t most = std::min({(pairs + share - 1) / share, pairs / kMinPartKeys, keys / 16});
    const int64_t parts = it.rows() == 1 ? std::clamp<int64_t>(most, 1, 2 * threads) : 1;
    for (int64_t part = 0; part < parts; ++part)
      split.push_back({it.seq, it.kv_head, it.kv_heads, it.row_begin, it.row_end, part, parts});
    plan.split = plan.split || parts > 1;
  }
  plan.items.swap(split);
}

// The work items: a sequence's single query row (a decode step) is one item of all its kv heads; a
// prompt's rows are tiles of kRowsPerTile rows, one item per kv head. Checks each sequence's lengths
// against its query rows and its block table.
template <typename TQ, typename TKV>
Plan plan_items(const Batch<TQ, TKV>& b) {
  Plan plan;
  const int64_t num_kv_heads = b.num_heads / b.group;
  int32_t lowest_id = 0, highest_id = -1;  // over every block the call reads
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const int64_t q_len = b.q_len(s);
    TORCH_CHECK(q_len <= b.lens[s], "sequence ", s, " has ", q_len, " query rows but context length ", b.lens[s]);
    TORCH_CHECK(b.blocks_of(s) <= b.max_blocks, "context length ", b.lens[s], " of sequence ", s,
                " needs more blocks than block_tables has columns (", b.max_blocks, ")");
    const int32_t* table = b.tables + s * b.max_blocks;
    for (int64_t i = 0; i < b.blocks_of(s); ++i) {
      lowest_id = std::min(lowest_id, table[i]);
      highest_id = std::max(highest_id, table[i]);
    }
    if (q_len == 1) {
      plan.items.push_back({s, 0, num_kv_heads, 0, 1});
    } else {
      for (int64_t r = 0; r < q_len; r += kRowsPerTile) {
        const int64_t end = std::min(q_len, r + kRowsPerTile);
        for (int64_t h = 0; h < num_kv_heads; ++h) plan.items.push_back({s, h, 1, r, end});
      }
    }
    plan.work += 2 * q_len * b.num_heads * b.head_dim * b.keys_of(s);
  }
  if (lowest_id < 0 || highest_id >= b.num_blocks) refuse_bad_block_id(b);
  split_long_rows(b, plan);
  return plan;
}

// ---- Decode: one query row ----

// Dot products of N fp32 query rows (d apart) with one key row; lane r of the result holds row r's.
template <int N, typename T>
inline __m128 dot_rows(const float* q, const T* k, int64_t d) {
  VecF acc[kRows] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
  for_each_chunk(d, [&](int64_t i, int n) {
    const VecF kv = load(k + i, n);
    for (int r = 0; r < N; ++r) acc[r] = fmadd(load(q + r * d + i, n), kv, acc[r]);
  });
  return reduce_add4(acc[0], acc[1], acc[2], acc[3]);
}

// s_r[t0 .. t0 + 3] = q_r . k_t for N fp32 query rows (query(r, c): row r's vector c of C) and four key rows
// k_t (k_stride apart), score rows s_stride apart: each row's four dot products out of one reduction, as one
// store. R rows at a time, so that R x 4 sums, four keys and a query fit the register file (AVX2's 16: two
// rows, the keys loaded again for the next two); row r0 is the first of this call's.
template <int N, int C, typename Q, typename T>
inline void score_four_keys(float* s, int64_t s_stride, const Q& query, int r0, const T* k, int64_t k_stride) {
  constexpr int R = VecF::kWidth == 16 ? N : std::min(N, 2);
  VecF acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = VecF::zero();
  for (int c = 0; c < C; ++c) {
    VecF kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = VecF::load(k + j * k_stride + c * VecF::kWidth);
    for (int r = 0; r < R; ++r) {
      const VecF qv = query(r0 + r, c);
      for (int j = 0; j < 4; ++j) acc[r][j] = fmadd(qv, kv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) _mm_storeu_ps(s + r * s_stride, reduce_add4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  if constexpr (N > R) score_four_keys<N - R, C>(s + R * s_stride, s_stride, query, r0 + R, k, k_stride);
}

// s_r[t] = q_r . k_t for N fp32 query rows q_r (d apart) and count key rows k_t (k_stride apart); score
// rows are s_stride apart. C > 0: d is C whole vectors, four keys at a time: 4 x N independent sums hide
// the multiply-adds' latency, where one key at a time left N chains of C dependent ones (the 1.5B's
// 128-wide heads on AVX2 read their keys at 10 GB/s: docs/JOURNAL.md, session 13). With AVX-512 and few
// enough query vectors (N x C <= 16) the queries are held in registers for the whole call, else loaded
// from L1 as used. Each score is one key's products summed in the same order whichever path takes it.
template <int N, int C, typename T>
inline void score_rows(float* s, int64_t s_stride, const float* q, const T* k, int64_t k_stride, int64_t count,
                       int64_t d) {
  int64_t t = 0;
  if constexpr (C > 0) {
    const auto four_keys = [&](const auto& query) {
      for (; t + 4 <= count; t += 4) score_four_keys<N, C>(s + t, s_stride, query, 0, k + t * k_stride, k_stride);
    };
    if constexpr (VecF::kWidth == 16 && N * C <= 16) {
      VecF qv[N][C];
      for (int r = 0; r < N; ++r)
        for (int c = 0; c < C; ++c) qv[r][c] = VecF::load(q + r * d + c * VecF::kWidth);
      four_keys([&](int r, int c) { return qv[r][c]; });
    } else {
      four_keys([&](int r, int c) { return VecF::load(q + r * d + c * VecF::kWidth); });
    }
  }
  for (; t < count; ++t) {
    alignas(16) float dots[kRows];
    _mm_store_ps(dots, dot_rows<N>(q, k + t * k_stride, d));
    for (int r = 0; r < N; ++r) s[r * s_stride + t] = dots[r];
  }
}

// y_r += sum_j w_r[j] * x_j for N accumulator rows y_r (d apart) and count value rows x_j (x_stride
// apart); weight rows are w_stride apart. C > 0: d is C whole vectors, accumulated G at a time so that
// N x G independent sums hide each fused multiply-add's latency; else one (possibly partial) vector at
// a time.
template <int N, int C, typename T>
inline void accumulate_rows(float* y, const float* w, int64_t w_stride, const T* x, int64_t x_stride,
                            int64_t count, int64_t d) {
  if constexpr (C == 0) {
    for_each_chunk(d, [&](int64_t i, int n) {
      VecF acc[N];
      for (int r = 0; r < N; ++r) acc[r] = load(y + r * d + i, n);
      for (int64_t j = 0; j < count; ++j) {
        const VecF xv = load(x + j * x_stride + i, n);
        for (int r = 0; r < N; ++r) acc[r] = fmadd(VecF::set1(w[r * w_stride + j]), xv, acc[r]);
      }
      for (int r = 0; r < N; ++r) store(acc[r], y + r * d + i, n);
    });
  } else {
    constexpr int G = std::min(C, VecF::kWidth == 16 ? 4 : 2);  // fits the register file with N <= 4
    for (int c0 = 0; c0 < C; c0 += G) {
      const int64_t i = c0 * VecF::kWidth;
      VecF acc[N][G];
      for (int r = 0; r < N; ++r)
        for (int g = 0; g < G; ++g) acc[r][g] = VecF::load(y + r * d + i + g * VecF::kWidth);
      for (int64_t j = 0; j < count; ++j) {
        VecF xv[G];
        for (int g = 0; g < G; ++g) xv[g] = VecF::load(x + j * x_stride + i + g * VecF::kWidth);
        for (int r = 0; r < N; ++r) {
          const VecF wv = VecF::set1(w[r * w_stride + j]);
          for (int g = 0; g < G; ++g) acc[r][g] = fmadd(wv, xv[g], acc[r][g]);
        }
      }
      for (int r = 0; r < N; ++r)
        for (int g = 0; g < G; ++g) acc[r][g].store(y + r * d + i + g * VecF::kWidth);
    }
  }
}

// x[i] = exp(x[i] - max) in place; returns the sum.
inline float exp_shifted_sum(float* x, int64_t count, float max_value) {
  VecF sum = VecF::zero();
  const VecF shift = VecF::set1(max_value);
  for_each_chunk(count, [&](int64_t i, int n) {
    const VecF e = exp(load(x + i, n) - shift);
    store(e, x + i, n);
    sum = sum + (n == VecF::kWidth ? e : load(x + i, n));  // the reload zeroes the lanes past the end
  });
  return reduce_add(sum);
}

// x[t] *= scale[t * stride] for t in [0, count): a quantized block's scales applied to the scores of its
// keys, or to the weights of its values, of one query head.
inline void scale_by_rows(float* x, const float* scale, int64_t stride, int64_t count) {
  for (int64_t t = 0; t < count; ++t) x[t] *= scale[t * stride];
}

// x[t] = cap * tanh(x[t] / cap) for t in [0, count): Gemma 2's soft-capped scores, as cap - 2 cap /
// (exp(2 x / cap) + 1), which exp's clamping keeps finite (within cap of +-cap) for any score.
inline VecF soft_capped(VecF x, float cap) {
  const VecF e = exp(x * VecF::set1(2.f / cap));
  return VecF::set1(cap) - VecF::set1(2.f * cap) / (e + VecF::set1(1.f));
}
inline void soft_cap(float* x, int64_t count, float cap) {
  for_each_chunk(count, [&](int64_t i, int n) { store(soft_capped(load(x + i, n), cap), x + i, n); });
}

// ---- Decode over an int8 cache: integer products (int8_decode.h) ----

// The largest int16 query code, 256 * 127 + 127: both halves of a code c = 256 h + l, h = (c + 128) >> 8
// and l in [-128, 127], are then int8.
constexpr int32_t kQueryLargest = 127 * 257;
constexpr float kWeightLargest = 32767.f;  // the largest int16 weight code
// Query heads whose value sums a tile's widened value rows are shared by (their sums fill half the registers).
constexpr int kValueHeads = VecF::kWidth == 16 ? 8 : 4;

// count floats p[0], p[stride], ... in the first lanes of a vector (zeros after).
inline VecF load_strided(const float* p, int64_t stride, int count) {
  if (stride == 1) return load(p, count);
  alignas(64) float lanes[VecF::kWidth] = {};
  for (int t = 0; t < count; ++t) lanes[t] = p[t * stride];
  return VecF::load(lanes);
}

// A decode row's query heads (scaled, and multiplied by the key smoothing factor) as int16 codes, once a
// step: a float scale a head, max |x| / kQueryLargest, codes x / scale rounded to nearest even (a zero row:
// scale 0, codes 0; a row with a NaN or an infinity: a NaN scale), each split into int8 halves as
// int8_decode::dot_halves reads them, with each half's sum (ops/reference.py int16_decode_query).
struct QueryCodes {
  using VecI = int8_decode::VecI;
  std::vector<VecI> high, low;  // QueryPatterns, per head
  std::vector<float> scale;
  std::vector<int32_t> high_sum, low_sum;
  int64_t chunks = 0;

  void build(const float* query, int64_t heads, int64_t d) {
    namespace i8 = int8_decode;
    chunks = (d + i8::kBytes - 1) / i8::kBytes;
    high.resize(heads * per_head());
    low.resize(heads * per_head());
    scale.resize(heads);
    high_sum.resize(heads);
    low_sum.resize(heads);
    std::vector<int8_t> high_codes(chunks * i8::kBytes, 0), low_codes(chunks * i8::kBytes, 0);  // past d: 0
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = query + h * d;
      float largest = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < d; ++i) {
        largest = std::max(largest, std::fabs(x[i]));
        finite = finite && std::isfinite(x[i]);
      }
      const float s = finite ? largest / kQueryLargest : std::numeric_limits<float>::quiet_NaN();
      scale[h] = s;
      high_sum[h] = low_sum[h] = 0;
      for (int64_t i = 0; i < d; ++i) {
        const int32_t c = s > 0.f ? static_cast<int32_t>(std::nearbyint(x[i] / s)) : 0;
        const int32_t top = (c + 128) >> 8;  // floor((c + 128) / 256)
        high_codes[i] = static_cast<int8_t>(top);
        low_codes[i] = static_cast<int8_t>(c - 256 * top);
        high_sum[h] += high_codes[i];
        low_sum[h] += low_codes[i];
      }
      i8::QueryPatterns::build(high_codes.data(), chunks, high.data() + h * per_head());
      i8::QueryPatterns::build(low_codes.data(), chunks, low.data() + h * per_head());
    }
  }
  int64_t per_head() const { return chunks * int8_decode::QueryPatterns::kPerChunk; }
  const VecI* high_of(int64_t head) const { return high.data() + head * per_head(); }
  const VecI* low_of(int64_t head) const { return low.data() + head * per_head(); }
};

// Reads a byte of each 64-byte line of `bytes` from k and from v, their lines in turn: a block of both
// caches (its codes and scales are one run of memory) brought in ahead of use. Loads, not prefetch
// instructions: on the machine measured, prefetching the next scattered block left the int8 decode's
// time as it was, and these loads cut it (docs/JOURNAL.md, "Int8 KV decode: blocks loaded ahead").
inline void load_ahead(const int8_t* k, const int8_t* v, int64_t bytes) {
  int32_t sink = 0;
  for (int64_t off = 0; off < bytes; off += 64) sink += k[off] + v[off];
  asm volatile("" : : "r"(sink));  // keeps the loads
}

// A decode row over an int8 cache (decode_row's contract), in one pass over its keys, a tile of up to
// kRowsAtOnce keys of a block at a time: the tile's keys are scored in integers against the query's
// int16 codes (QueryCodes) and folded into a running softmax (each head's max so far; the sums so far
// rescaled when it rises); each weight times its value's scale becomes an int16 code on the tile's own
// scale (its largest weight / kWeightLargest), and the value codes are summed in integers under those
// weights, then added to the head's float sums times that scale. What differs from the float path is
// the rounding of the query to int16 codes and of a tile's weights to int16 codes; tests bound both.
template <typename TQ>
void decode_row_int8(const Batch<TQ, int8_t>& b, const WorkItem& it, float* partial) {
  namespace i8 = int8_decode;
  constexpr int W = i8::kRowsAtOnce;
  const KeyRange range = key_range(b, it);
  const int64_t d = b.head_dim, group = b.group, row = b.starts[it.seq] + it.row_begin;
  const int64_t first_head = it.kv_head * group, heads = it.kv_heads * group;
  // A head's float sums: value_chunks chunks of kChannels, each in value_lane order.
  const int64_t value_chunks = (d + i8::kChannels - 1) / i8::kChannels, padded = value_chunks * i8::kChannels;

  thread_local std::vector<float> query, acc, row_max, row_sum, shift, weight_scale;
  thread_local std::vector<int16_t> weights;  // a tile's int16 weight codes, W a head
  thread_local std::vector<i8::VecI> keys;    // a tile's keys, transposed
  thread_local QueryCodes codes;
  query.resize(heads * d);
  acc.assign(heads * padded, 0.f);
  row_max.assign(heads, -std::numeric_limits<float>::infinity());
  row_sum.assign(heads, 0.f);
  shift.assign(heads, 0.f);
  weight_scale.resize(heads);
  weights.assign(heads * W, 0);
  for (int64_t i = 0; i < heads; ++i) {
    const TQ* src = b.q + row * b.q_row_stride + (first_head + i) * b.q_head_stride;
    for (int64_t j = 0; j < d; ++j) query[i * d + j] = static_cast<float>(src[j]) * b.scale * b.key_factor_of(first_head + i, j);
    if (b.softcap > 0) shift[i] = b.mean_score(row, first_head + i);
  }
  codes.build(query.data(), heads, d);
  keys.resize(codes.chunks * i8::kGroups * 4);

  VecF lane;  // lane t holds t
  {
    alignas(64) float index[W];
    for (int t = 0; t < W; ++t) index[t] = static_cast<float>(t);
    lane = VecF::load(index);
  }
  const VecF neg_inf = VecF::set1(-std::numeric_limits<float>::infinity());

  const PagedRows<int8_t> paged = b.paged(it.seq, it.kv_head, it.kv_heads);
  // Block b of both caches, loaded ahead of use (load_ahead) if the item reads it.
  auto load_block = [&](int64_t block) {
    if (block * b.block_size >= range.hi) return;
    const int64_t start = static_cast<int64_t>(paged.table[block]) * b.block_stride;
    load_ahead(b.k_cache + start, b.v_cache + start, b.scales.codes + b.scales.bytes);
  };
  for (int64_t first = range.lo / b.block_size, block = first; block < first + kBlocksAhead; ++block)
    load_block(block);
  paged.for_each_block_kv(b.k_cache, b.v_cache, range.lo, range.hi, [&](int64_t t0, int64_t t1, int64_t block,
                                                                          const int8_t* k_rows, const float* k_scales,
                                                                          const int8_t* v_rows, const float* v_scales) {
    for (int64_t ts = t0; ts < t1; ts += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, t1 - ts));
      const VecF in_tile = VecF::set1(static_cast<float>(n)), begin = VecF::zero();
      if (ts == t0) load_block(block + kBlocksAhead);
      for (int64_t hl = 0; hl < it.kv_heads; ++hl) {
        const int64_t row_offset = hl * b.head_stride + (ts - t0) * b.slot_stride;
        const int64_t scale_offset = hl * b.scales.head_stride + (ts - t0) * b.scales.slot_stride;
        const VecF key_scale = load_strided(k_scales + scale_offset, b.scales.slot_stride, n);
        const VecF value_scale = load_strided(v_scales + scale_offset, b.scales.slot_stride, n);
        i8::transpose_keys(keys.data(), k_rows + row_offset, b.slot_stride, n, d);
        for (int64_t m = hl * group; m < (hl + 1) * group; ++m) {
          i8::VecI high, low;
          i8::dot_halves(keys.data(), codes.high_of(m), codes.low_of(m), codes.chunks, high, low);
          const VecF dot = fmadd(i8::to_float(i8::sub(high, i8::set1(128 * codes.high_sum[m]))), VecF::set1(256.f),
                                 i8::to_float(i8::sub(low, i8::set1(128 * codes.low_sum[m]))));
          VecF s = dot * (key_scale * VecF::set1(codes.scale[m]));
          if (b.softcap > 0) s = soft_capped(s + VecF::set1(shift[m]), b.softcap);
          s = select_in_range(s, lane, begin, in_tile, neg_inf);
          const float tile_max = reduce_max(s);
          if (tile_max > row_max[m]) {  // the sums so far were taken against a smaller max
            if (row_sum[m] > 0.f) {
              const float alpha = std::exp(row_max[m] - tile_max);
              row_sum[m] *= alpha;
              for (int64_t i = 0; i < padded; ++i) acc[m * padded + i] *= alpha;
            }
            row_max[m] = tile_max;
          }
          const VecF p = select_in_range(exp(s - VecF::set1(row_max[m])), lane, begin, in_tile, VecF::zero());
          row_sum[m] += reduce_add(p);
          const VecF w = p * value_scale;
          const float largest = reduce_max(w);
          weight_scale[m] = largest / kWeightLargest;
          store_int16(largest > 0.f ? w * VecF::set1(kWeightLargest / largest) : VecF::zero(), &weights[m * W]);
        }
        for (int64_t m0 = hl * group; m0 < (hl + 1) * group; m0 += kValueHeads) {
          with_count<kValueHeads>((hl + 1) * group - m0, [&](auto nh) {
            const int16_t* w[nh];
            for (int r = 0; r < nh; ++r) w[r] = &weights[(m0 + r) * W];
            for (int64_t ch = 0; ch < value_chunks; ++ch) {
              i8::VecI sums[nh][2];
              const int width = static_cast<int>(std::min<int64_t>(i8::kChannels, d - ch * i8::kChannels));
              i8::accumulate_values<nh>(sums, w, v_rows + row_offset, b.slot_stride, n, ch * i8::kChannels, width);
              for (int r = 0; r < nh; ++r) {
                float* a = &acc[(m0 + r) * padded + ch * i8::kChannels];
                const VecF ws = VecF::set1(weight_scale[m0 + r]);
                fmadd(i8::to_float(sums[r][0]), ws, VecF::load(a)).store(a);
                fmadd(i8::to_float(sums[r][1]), ws, VecF::load(a + W)).store(a + W);
              }
            }
          });
        }
      }
    }
  });

  // Each head's sums in channel order: into `partial` (decode_row's layout), or divided into the output.
  for (int64_t m = 0; m < heads; ++m) {
    const float* sums = &acc[m * padded];
    auto sum_of = [&](int64_t c) {
      return sums[c / i8::kChannels * i8::kChannels + i8::value_lane(static_cast<int>(c % i8::kChannels))];
    };
    if (partial != nullptr) {
      partial[m] = row_max[m];
      partial[b.num_heads + m] = row_sum[m];
      for (int64_t c = 0; c < d; ++c) partial[2 * b.num_heads + m * d + c] = sum_of(c);
    } else {
      TQ* dst = b.out + (row * b.num_heads + first_head + m) * d;
      const float inv = 1.f / row_sum[m];
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<TQ>(sum_of(c) * inv);
    }
  }
}

// One query row (a decode step's, or a prompt tile's when it holds one) against the item's kv heads, both
// passes over its keys blockwise, every kv head's rows of a block in turn. Writes the row to out, or for a
// part of a split row, its partial sums to `partial`. A quantized cache's scales multiply each key's
// scores (q . (c s) = (q . c) s) and each value's weights, so the inner loops only widen codes.
template <int C, typename TQ, typename TKV>
void decode_row(const Batch<TQ, TKV>& b, const WorkItem& it, float* partial) {
  if constexpr (std::is_same_v<TKV, int8_t>) {
    if (b.q_len(it.seq) == 1) return decode_row_int8(b, it, partial);
  }
  const KeyRange range = key_range(b, it);
  const int64_t lo = range.lo, hi = range.hi, span = hi - lo;
  const int64_t d = b.head_dim, group = b.group, row = b.starts[it.seq] + it.row_begin;
  // Score row i is query head first_head + i: the GQA groups of the item's kv heads, one after another.
  const int64_t first_head = it.kv_head * group, heads = it.kv_heads * group;

  thread_local std::vector<float> scores, query, acc, row_max, row_sum;
  scores.resize(heads * span);
  query.resize(heads * d);
  acc.assign(heads * d, 0.f);
  row_max.resize(heads);
  row_sum.resize(heads);
  for (int64_t i = 0; i < heads; ++i) {  // scaled queries kept in fp32
    const TQ* src = b.q + row * b.q_row_stride + (first_head + i) * b.q_head_stride;
    for (int64_t j = 0; j < d; ++j) {
      query[i * d + j] = static_cast<float>(src[j]) * b.scale;
      if constexpr (kScaled<TKV>) query[i * d + j] *= b.key_factor_of(first_head + i, j);
    }
  }
  const PagedRows<TKV> paged = b.paged(it.seq, it.kv_head, it.kv_heads);

  // Pass 1: scores of every head against every key of [lo, hi). Each block of keys is loaded once and
  // scored against all its kv head's query heads, kRows at a time.
  paged.for_each_block(b.k_cache, lo, hi, [&](int64_t t0, int64_t t1, const TKV* k_rows, const float* k_scales) {
    for (int64_t hl = 0; hl < it.kv_heads; ++hl) {
      for (int64_t m0 = hl * group; m0 < (hl + 1) * group; m0 += kRows) {
        with_count<kRows>((hl + 1) * group - m0, [&](auto n) {
          score_rows<n, C>(&scores[m0 * span + t0 - lo], span, &query[m0 * d], k_rows + hl * b.head_stride,
                           b.slot_stride, t1 - t0, d);
        });
      }
      if constexpr (kScaled<TKV>)
        for (int64_t m = hl * group; m < (hl + 1) * group; ++m)
          scale_by_rows(&scores[m * span + t0 - lo], k_scales + hl * b.scales.head_stride, b.scales.slot_stride,
                        t1 - t0);
    }
  });
  if (b.softcap > 0) {
    for (int64_t i = 0; i < heads; ++i) {
      float* s = &scores[i * span];
      if constexpr (kScaled<TKV>) {
        const float shift = b.mean_score(row, first_head + i);
        for (int64_t t = 0; t < span; ++t) s[t] += shift;
      }
      soft_cap(s, span, b.softcap);
    }
  }
  // Softmax: the row sees every key of [lo, hi).
  for (int64_t i = 0; i < heads; ++i) {
    float* s = &scores[i * span];
    row_max[i] = *std::max_element(s, s + span);
    row_sum[i] = exp_shifted_sum(s, span, row_max[i]);
  }
  // Pass 2: weighted sum of V rows, block by block, kRows accumulator rows at a time (for a quantized
  // cache, the weights times the values' scales first: the sums above are of the weights alone).
  paged.for_each_block(b.v_cache, lo, hi, [&](int64_t t0, int64_t t1, const TKV* v_rows, const float* v_scales) {
    for (int64_t hl = 0; hl < it.kv_heads; ++hl) {
      if constexpr (kScaled<TKV>)
        for (int64_t m = hl * group; m < (hl + 1) * group; ++m)
          scale_by_rows(&scores[m * span + t0 - lo], v_scales + hl * b.scales.head_stride, b.scales.slot_stride,
                        t1 - t0);
      for (int64_t m0 = hl * group; m0 < (hl + 1) * group; m0 += kRows) {
        with_count<kRows>((hl + 1) * group - m0, [&](auto n) {
          accumulate_rows<n, C>(&acc[m0 * d], &scores[m0 * span + t0 - lo], span, v_rows + hl * b.head_stride,
                                b.slot_stride, t1 - t0, d);
        });
      }
    }
  });

  if (partial != nullptr) {
    std::copy(row_max.begin(), row_max.begin() + heads, partial);
    std::copy(row_sum.begin(), row_sum.begin() + heads, partial + b.num_heads);
    std::copy(acc.begin(), acc.begin() + heads * d, partial + 2 * b.num_heads);
    return;
  }
  for (int64_t i = 0; i < heads; ++i) {
    TQ* dst = b.out + (row * b.num_heads + first_head + i) * d;
    const VecF inv = VecF::set1(1.f / row_sum[i]);
    for_each_chunk(d, [&](int64_t j, int n) { store(load(&acc[i * d + j], n) * inv, dst + j, n); });
  }
}

// ---- Prefill: a tile of many query rows ----

constexpr int kScoreKeys = VecF::kWidth == 16 ? 8 : 4;  // the score micro-kernel: keys ...
constexpr int kScoreVecs = 3;                           // ... by vectors of query rows
constexpr int kSumRows = VecF::kWidth == 16 ? 6 : 4;    // the weighted-sum micro-kernel: query rows ...
constexpr int kSumVecs = VecF::kWidth == 16 ? 4 : 2;    // ... by vectors of the head

// st[j * mp + m] = sum_i k_j[i] qt[i * mp + m] for NK keys k_j (k_stride apart) and NV vectors of rows m.
template <int NK, int NV>
inline void score_keys(float* st, int64_t mp, const float* qt, const float* k, int64_t k_stride, int64_t d) {
  VecF acc[NK][NV];
  for (auto& row : acc)
    for (auto& a : row) a = VecF::zero();
  for (int64_t i = 0; i < d; ++i) {
    VecF qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = VecF::load(qt + i * mp + v * VecF::kWidth);
    for (int j = 0; j < NK; ++j) {
      const VecF kv = VecF::set1(k[j * k_stride + i]);
      for (int v = 0; v < NV; ++v) acc[j][v] = fmadd(kv, qv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v].store(st + j * mp + v * VecF::kWidth);
}

// dst_r[i0 ...] = inv_r * sum_t w[t * mp + r] x_t[i0 ...] for N rows r, over kSumVecs vectors of the head
// from i0 (those inside d) and the value rows x_t of keys [lo, hi); w points at the tile's row r = 0.
template <int N, typename TQ, typename TKV>
inline void weighted_sum(TQ* const* dst, const float* inv, const float* w, int64_t mp, const PagedRows<TKV>& paged,
                         const TKV* v_cache, int64_t lo, int64_t hi, int64_t i0) {
  constexpr int W = VecF::kWidth;
  int widths[kSumVecs];
  for (int g = 0; g < kSumVecs; ++g)
    widths[g] = static_cast<int>(std::clamp<int64_t>(paged.head_dim - i0 - g * W, 0, W));
  VecF acc[N][kSumVecs];
  for (auto& row : acc)
    for (auto& a : row) a = VecF::zero();
  auto sum_keys = [&](auto full) {
    paged.template for_each_block<false>(v_cache, lo, hi, [&](int64_t t0, int64_t t1, const TKV* v_rows,
                                                              const float* v_scales) {
      for (int64_t t = t0; t < t1; ++t) {
        const TKV* x = v_rows + (t - t0) * paged.slot_stride + i0;
        VecF xv[kSumVecs];
        for (int g = 0; g < kSumVecs; ++g) xv[g] = full ? VecF::load(x + g * W) : VecF::load(x + g * W, widths[g]);
        if constexpr (kScaled<TKV>) {  // the codes dequantized in registers
          const VecF s = VecF::set1(v_scales[(t - t0) * paged.scales.slot_stride]);
          for (int g = 0; g < kSumVecs; ++g) xv[g] = xv[g] * s;
        }
        const float* wt = w + (t - lo) * mp;
        for (int r = 0; r < N; ++r) {
          const VecF wv = VecF::set1(wt[r]);
          for (int g = 0; g < kSumVecs; ++g) acc[r][g] = fmadd(wv, xv[g], acc[r][g]);
        }
      }
    });
  };
  if (widths[kSumVecs - 1] == W) {
    sum_keys(std::true_type{});
  } else {
    sum_keys(std::false_type{});
  }
  for (int r = 0; r < N; ++r)
    for (int g = 0; g < kSumVecs; ++g)
      if (widths[g] > 0) store(acc[r][g] * VecF::set1(inv[r]), dst[r] + i0 + g * W, widths[g]);
}

// Many query rows of one sequence (up to kRowsPerTile) against one kv head. Its M query rows (rows x GQA
// group; row m is query row m / group of the tile, head first_head + m % group) keep their scores
// transposed, st[t * mp + m] for key t (mp: M rounded up to whole vectors), so that every instruction works
// on a vector of rows: scores are a [keys x D] x [D x M] product, a key element broadcast against a vector
// of the transposed queries (no horizontal sums); softmax runs down the columns; the weighted sum of V is
// an [M x keys] x [keys x D] product, a key's weights for a few rows broadcast against its V row. Both
// products keep their sums in registers, tiled like a GEMM.
template <typename TQ, typename TKV>
void prefill_tile(const Batch<TQ, TKV>& b, const WorkItem& it) {
  constexpr int W = VecF::kWidth;
  const KeyRange range = key_range(b, it);
  const int64_t lo = range.lo, hi = range.hi, span = hi - lo;
  const int64_t d = b.head_dim, group = b.group, m_count = it.rows() * group, mp = (m_count + W - 1) / W * W;
  const int64_t first_row = b.starts[it.seq] + it.row_begin, first_head = it.kv_head * group;
  const int64_t first_pos = b.first_pos(it.seq) + it.row_begin;  // the position of the tile's first row
  const float scale = static_cast<float>(b.scale);
  const PagedRows<TKV> paged = b.paged(it.seq, it.kv_head, 1);

  thread_local std::vector<float> qt, st, keys, sums;
  qt.assign(d * mp, 0.f);  // the scaled queries, transposed: qt[i * mp + m]
  st.resize(span * mp);
  sums.resize(mp);
  for (int64_t m = 0; m < m_count; ++m) {
    const int64_t row = first_row + m / group, head = first_head + m % group;
    const TQ* src = b.q + row * b.q_row_stride + head * b.q_head_stride;
    for (int64_t i = 0; i < d; ++i) {
      qt[i * mp + m] = static_cast<float>(src[i]) * scale;
      if constexpr (kScaled<TKV>) qt[i * mp + m] *= b.key_factor_of(head, i);
    }
  }
  // Pass 1: scores, kScoreKeys keys by kScoreVecs vectors of rows at a time; a bf16 block is widened first,
  // a quantized one dequantized.
  paged.template for_each_block<false>(b.k_cache, lo, hi, [&](int64_t t0, int64_t t1, const TKV* k_rows,
                                                              const float* k_scales) {
    const float* k = nullptr;
    int64_t k_stride = d;
    if constexpr (std::is_same_v<TKV, float>) {
      k = k_rows;
      k_stride = paged.slot_stride;
    } else {
      keys.resize((t1 - t0) * d);
      for (int64_t t = 0; t < t1 - t0; ++t) {
        const VecF s = VecF::set1(kScaled<TKV> ? k_scales[t * paged.scales.slot_stride] : 1.f);
        for_each_chunk(d, [&](int64_t i, int n) {
          const VecF x = load(k_rows + t * paged.slot_stride + i, n);
          store(kScaled<TKV> ? x * s : x, &keys[t * d + i], n);
        });
      }
      k = keys.data();
    }
    for (int64_t t = t0; t < t1; t += kScoreKeys) {
      with_count<kScoreKeys>(t1 - t, [&](auto nk) {
        for (int64_t v0 = 0; v0 < mp / W; v0 += kScoreVecs) {
          with_count<kScoreVecs>(mp / W - v0, [&](auto nv) {
            score_keys<nk, nv>(&st[(t - lo) * mp + v0 * W], mp, &qt[v0 * W], k + (t - t0) * k_stride, k_stride, d);
          });
        }
      });
    }
  });
  if (b.softcap > 0) {
    if constexpr (kScaled<TKV>) {
      for (int64_t m = 0; m < m_count; ++m) {
        const float shift = b.mean_score(first_row + m / group, first_head + m % group);
        for (int64_t t = 0; t < span; ++t) st[t * mp + m] += shift;
      }
    }
    soft_cap(st.data(), span * mp, b.softcap);
  }
  // Softmax down each vector of rows over each row's visible keys; the others (and padding rows) weigh 0.
  for (int64_t v = 0; v < mp; v += W) {
    alignas(64) float begin[W], end[W];
    for (int l = 0; l < W; ++l) {
      const int64_t m = v + l, key_end = first_pos + m / group + 1;
      const int64_t key_begin = window_begin(key_end, b.window);
      begin[l] = m < m_count ? static_cast<float>(std::max(key_begin, lo) - lo) : 0.f;
      end[l] = m < m_count ? static_cast<float>(std::min(key_end, hi) - lo) : 0.f;
    }
    const VecF first = VecF::load(begin), last = VecF::load(end);
    const VecF none = VecF::set1(-std::numeric_limits<float>::infinity());
    VecF row_max = none;
    for (int64_t t = 0; t < span; ++t)
      row_max = max(row_max, select_in_range(VecF::load(&st[t * mp + v]), VecF::set1(t), first, last, none));
    VecF row_sum = VecF::zero();
    for (int64_t t = 0; t < span; ++t) {
      const VecF e = exp(VecF::load(&st[t * mp + v]) - row_max);
      const VecF p = select_in_range(e, VecF::set1(t), first, last, VecF::zero());
      p.store(&st[t * mp + v]);
      row_sum = row_sum + p;
    }
    row_sum.store(&sums[v]);
  }
  // Pass 2: each row's weighted sum of V, kSumRows rows by kSumVecs vectors of the head at a time.
  for (int64_t m0 = 0; m0 < m_count; m0 += kSumRows) {
    with_count<kSumRows>(m_count - m0, [&](auto n) {
      TQ* dst[n];
      float inv[n];
      for (int r = 0; r < n; ++r) {
        const int64_t m = m0 + r;
        dst[r] = b.out + ((first_row + m / group) * b.num_heads + first_head + m % group) * d;
        inv[r] = 1.f / sums[m];
      }
      for (int64_t i0 = 0; i0 < d; i0 += kSumVecs * W)
        weighted_sum<n>(dst, inv, &st[m0], mp, paged, b.v_cache, lo, hi, i0);
    });
  }
}

// ---- Combine: the parts of split rows ----

// Each split row's parts merged: every part's sums rescaled to the row's overall max.
template <typename TQ, typename TKV>
void combine_parts(const Batch<TQ, TKV>& b, const std::vector<WorkItem>& items, const std::vector<float>& partials) {
  const int64_t d = b.head_dim, size = partial_size(b);
  std::vector<float> total(d);
  for (size_t first = 0; first < items.size(); first += items[first].parts) {
    const WorkItem& it = items[first];
    if (it.parts == 1) continue;
    const float* part0 = partials.data() + first * size;
    for (int64_t m = 0; m < it.kv_heads * b.group; ++m) {
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < it.parts; ++p) max_score = std::max(max_score, part0[p * size + m]);
      std::fill(total.begin(), total.end(), 0.f);
      float sum = 0.f;
      for (int64_t p = 0; p < it.parts; ++p) {
        const float* part = part0 + p * size;
        const float w = std::exp(part[m] - max_score);
        sum += w * part[b.num_heads + m];
        for (int64_t i = 0; i < d; ++i) total[i] += w * part[2 * b.num_heads + m * d + i];
      }
      TQ* dst = b.out + ((b.starts[it.seq] + it.row_begin) * b.num_heads + it.kv_head * b.group + m) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<TQ>(total[i] / sum);
    }
  }
}

// ---- The kernel: plan, run the items, combine ----

// Calls fn(std::integral_constant<int, C>) with C = head_dim / kWidth for the common head sizes (up to
// 16 whole vectors: 128 with AVX2), else with C = 0 (the general, runtime-sized path).
template <typename F>
inline void with_head_vectors(int64_t head_dim, const F& fn) {
  if (head_dim % VecF::kWidth == 0) {
    switch (head_dim / VecF::kWidth) {
      case 1: return fn(std::integral_constant<int, 1>{});
      case 2: return fn(std::integral_constant<int, 2>{});
      case 4: return fn(std::integral_constant<int, 4>{});
      case 8: return fn(std::integral_constant<int, 8>{});
      case 16: return fn(std::integral_constant<int, 16>{});
      default: break;
    }
  }
  fn(std::integral_constant<int, 0>{});
}

// C: the head dimension in whole SIMD vectors when the micro-kernels specialise on it, else 0.
template <int C, typename TQ, typename TKV>
void attention_kernel(const Batch<TQ, TKV>& b) {
  const Plan plan = plan_items(b);
  const int64_t size = partial_size(b);
  std::vector<float> partials(plan.split ? plan.items.size() * size : 0);
  parallel_dynamic(static_cast<int64_t>(plan.items.size()), plan.work, [&](int64_t idx) {
    const WorkItem& it = plan.items[idx];
    if (it.rows() > 1) {
      prefill_tile(b, it);
    } else {
      decode_row<C>(b, it, it.parts > 1 ? partials.data() + idx * size : nullptr);
    }
  });
  if (plan.split) combine_parts(b, plan.items, partials);
}

void check_int32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.is_contiguous(), name,
              " must be a contiguous int32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

}  // namespace

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: not capped), got ", softcap);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q [T, H, D] and k/v caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) % 8 == 0,
              "head_dim must match the cache and be a multiple of 8, got ", q.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads ", q.size(1), " is not a multiple of num_kv_heads ",
              k_cache.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "out must have q's dtype and the caches one dtype");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous and shaped like q");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
              "the caches must share strides and have contiguous head vectors");
  check_int32_cpu(block_tables, "block_tables");
  check_int32_cpu(query_start_loc, "query_start_loc");
  check_int32_cpu(context_lens, "context_lens");
  TORCH_CHECK(query_start_loc.size(0) == context_lens.size(0) + 1, "query_start_loc must have num_seqs + 1 entries");
  const auto q_type = q.scalar_type(), kv_type = k_cache.scalar_type();
  auto run = [&](auto q_tag, auto kv_tag) {
    using TQ = decltype(q_tag);
    using TKV = decltype(kv_tag);
    if constexpr (kScaled<TKV>) scale_layout(v_cache);  // checked like k_cache's (batch_of)
    const Batch<TQ, TKV> batch =
        batch_of<TQ, TKV>(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window,
                          softcap);
    with_head_vectors(q.size(2), [&](auto c) { attention_kernel<c>(batch); });
  };
  // A quantized cache under either query dtype.
  auto run_quantized = [&](auto q_tag) {
    if (kv_type == at::kChar) return run(q_tag, int8_t{});
    run(q_tag, c10::Float8_e4m3fn{});
  };
  const bool quantized = kv_type == at::kChar || kv_type == at::kFloat8_e4m3fn;
  if (q_type == at::kFloat && kv_type == at::kFloat) {
    run(float{}, float{});
  } else if (q_type == at::kFloat && kv_type == at::kBFloat16) {
    run(float{}, c10::BFloat16{});
  } else if (q_type == at::kFloat && kv_type == at::kHalf) {
    run(float{}, c10::Half{});
  } else if (q_type == at::kBFloat16 && kv_type == at::kBFloat16) {
    run(c10::BFloat16{}, c10::BFloat16{});
  } else if (q_type == at::kFloat && quantized) {
    run_quantized(float{});
  } else if (q_type == at::kBFloat16 && quantized) {
    run_quantized(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "unsupported dtypes: q ", q_type, ", cache ", kv_type,
                " (fp32/fp32, fp32/bf16, fp32/fp16, bf16/bf16, or fp32 or bf16 over an int8 or fp8 e4m3 cache)");
  }
}

// Copies token t's K/V heads ([Hkv, D] each) into flat slot slot_mapping[t] (block slot / block_size,
// row slot % block_size of the [num_blocks, block_size, Hkv, D] cache view, whatever its memory order);
// slot -1 is skipped. Key and value may be strided views of a fused projection (token rows any distance
// apart) and of another dtype than the cache (converted while copying, or quantized into a quantized
// cache: each row's codes, and its scale where ops/kv_cache.py puts it).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "the caches must share strides and a dtype and have contiguous head vectors");
  TORCH_CHECK(key.dim() == 3 && key.sizes().slice(1) == k_cache.sizes().slice(2) && value.sizes() == key.sizes(),
              "expected key/value [T, Hkv, D] matching the cache, got ", key.sizes());
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value must share a dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value head vectors must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be contiguous int64 with one entry per token");
  const int64_t heads = key.size(1), d = key.size(2), block_size = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.size(0); ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " of token ", t, " is out of range (", num_slots, " slots)");
  }
  auto copy = [&](auto src_tag, auto dst_tag) {
    using S = decltype(src_tag);
    using D = decltype(dst_tag);
    ScaleLayout scales;
    const float* smoothing = nullptr;  // a quantized K cache's: mean, then factor
    if constexpr (kScaled<D>) {
      scale_layout(v_cache);
      scales = scale_layout(k_cache);
      smoothing = key_smoothing(k_cache);
    }
    // Tokens split across threads (a prompt's thousands; a decode step's few run inline).
    const int64_t tokens_per_task = grain_by_wake_cost(2 * heads * d, 1 << 15);
    at::parallel_for(0, slot_mapping.size(0), tokens_per_task, [&](int64_t begin, int64_t end) {
      std::vector<float> smoothed(kScaled<D> ? d : 0);
      for (auto [src, dst] : {std::pair{&key, &k_cache}, std::pair{&value, &v_cache}}) {
        const S* s = src->template data_ptr<S>();
        D* base = dst->template data_ptr<D>();
        for (int64_t t = begin; t < end; ++t) {
          if (slots[t] < 0) continue;
          D* block = base + (slots[t] / block_size) * dst->stride(0);
          const int64_t j = slots[t] % block_size;
          for (int64_t h = 0; h < heads; ++h) {
            const S* from = s + t * src->stride(0) + h * src->stride(1);
            D* to = block + j * dst->stride(1) + h * dst->stride(2);
            if constexpr (kScaled<D>) {
              float* scale = reinterpret_cast<float*>(block + scales.codes) + j * scales.slot_stride;
              if (dst == &k_cache) {  // (k - mean) / factor, as reference.py smooth_keys computes it
                const float *mean = smoothing + h * d, *factor = mean + heads * d;
                for (int64_t i = 0; i < d; ++i) smoothed[i] = (static_cast<float>(from[i]) - mean[i]) / factor[i];
                quantize_row(smoothed.data(), to, scale + h * scales.head_stride, d);
              } else {
                quantize_row(from, to, scale + h * scales.head_stride, d);
              }
            } else {
              for_each_chunk(d, [&](int64_t i, int n) { store(load(from + i, n), to + i, n); });
            }
          }
        }
      }
    });
  };
  const auto src_type = key.scalar_type(), dst_type = k_cache.scalar_type();
  if (src_type == at::kFloat && dst_type == at::kFloat) {
    copy(float{}, float{});
  } else if (src_type == at::kFloat && dst_type == at::kBFloat16) {
    copy(float{}, c10::BFloat16{});
  } else if (src_type == at::kFloat && dst_type == at::kHalf) {
    copy(float{}, c10::Half{});
  } else if (src_type == at::kBFloat16 && dst_type == at::kBFloat16) {
    copy(c10::BFloat16{}, c10::BFloat16{});
  } else if ((src_type == at::kFloat || src_type == at::kBFloat16) &&
             (dst_type == at::kChar || dst_type == at::kFloat8_e4m3fn)) {
    auto into = [&](auto src_tag) {
      if (dst_type == at::kChar) return copy(src_tag, int8_t{});
      copy(src_tag, c10::Float8_e4m3fn{});
    };
    if (src_type == at::kFloat) {
      into(float{});
    } else {
      into(c10::BFloat16{});
    }
  } else {
    TORCH_CHECK(false, "unsupported dtypes: key ", src_type, ", cache ", dst_type);
  }
}

}  // namespace pagedllm
