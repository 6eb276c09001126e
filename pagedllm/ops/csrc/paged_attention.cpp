// Paged attention on the CPU: K/V are read in place through the block table (no gather copy).
//
// One kernel serves decode and prefill: sequence s owns query rows query_start_loc[s]..[s+1], the last
// rows of its context_lens[s] tokens, causal. Work items are (sequence, kv head, tile of query rows)
// and hold the whole GQA group, so each block of K/V is read from memory once for every head and query
// row that uses it. Softmax is two-pass over a per-thread score buffer: scores, exp/normalise, sum of V.
// fp32 and bf16 caches; arithmetic is fp32 (bf16 is widened in registers). Built with -mavx2 -mfma.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowsPerTile = 16;  // query rows of one sequence handled by one work item

// Eight consecutive elements widened to fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The N <= 4 query rows of a micro-kernel share every K/V load (and its bf16 widening).
constexpr int kRows = 4;

// Calls fn(std::integral_constant<int, N>) for n in 1..kRows, so that N is a compile-time row count.
template <typename F>
inline void with_rows(int64_t n, const F& fn) {
  switch (n) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}

// Dot products of N query rows (head_dim apart) with one key row; lane r holds row r's (0 past N).
template <int N, typename T>
inline __m128 dot_rows(const float* q, const T* k, int64_t d) {
  __m256 acc[kRows] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 kv = load8(k + i);
    for (int r = 0; r < N; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + i), kv, acc[r]);
  }
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// y_r += sum_j w_r[j] * x_j for N accumulator rows y_r (head_dim apart) and count value rows x_j
// (x_stride apart); weight rows are w_stride apart. Accumulates in registers, 8 columns at a time.
template <int N, typename T>
inline void accumulate_rows(float* y, const float* w, int64_t w_stride, const T* x, int64_t x_stride,
                            int64_t count, int64_t d) {
  for (int64_t i = 0; i < d; i += 8) {
    __m256 acc[N];
    for (int r = 0; r < N; ++r) acc[r] = _mm256_loadu_ps(y + r * d + i);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 xv = load8(x + j * x_stride + i);
      for (int r = 0; r < N; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(w[r * w_stride + j]), xv, acc[r]);
    }
    for (int r = 0; r < N; ++r) _mm256_storeu_ps(y + r * d + i, acc[r]);
  }
}

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * exp(r), |r| <= ln2/2, Taylor to r^7.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));  // below this exp underflows to ~0 anyway
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256i two_n = _mm256_slli_epi32(biased, 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// x[i] = exp(x[i] - max) in place; returns the sum.
inline float exp_shifted_sum(float* x, int64_t n, float max) {
  __m256 sum8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(max)));
    _mm256_storeu_ps(x + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - max));
  return sum;
}

// Key/value rows of one sequence and one kv head, addressed through the sequence's block table.
template <typename T>
struct PagedRows {
  const int32_t* table;
  int64_t block_size, slot_stride, head_offset, head_dim;

  const T* block_start(const T* cache, int64_t b) const {
    return cache + static_cast<int64_t>(table[b]) * block_size * slot_stride + head_offset;
  }

  // fn(t0, t1, row_t0) for each block's share [t0, t1) of [lo, hi); token rows are slot_stride apart.
  // Prefetches the next block meanwhile.
  template <typename F>
  void for_each_block(const T* cache, int64_t lo, int64_t hi, const F& fn) const {
    for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
      const int64_t first = b * block_size, next = first + block_size;
      if (next < hi) {
        const char* ahead = reinterpret_cast<const char*>(block_start(cache, b + 1));
        const int64_t rows = std::min(block_size, hi - next), bytes = head_dim * sizeof(T);
        for (int64_t j = 0; j < rows; ++j)
          for (int64_t off = 0; off < bytes; off += 64)
            _mm_prefetch(ahead + j * slot_stride * sizeof(T) + off, _MM_HINT_T0);
      }
      const int64_t t0 = std::max(lo, first);
      fn(t0, std::min(hi, next), block_start(cache, b) + (t0 - first) * slot_stride);
    }
  }
};

// Runs fn(i) for i in [0, n) on the intra-op thread pool, handing out items one at a time so that
// sequences of very different lengths still balance across threads.
template <typename F>
void parallel_dynamic(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

struct WorkItem {
  int64_t seq, kv_head, row_begin, row_end;  // rows relative to the sequence's first query row
};

template <typename T>
void attention_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale,
                      int64_t window) {
  const int64_t num_seqs = context_lens.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive tokens
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();

  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len <= lens[s], "sequence ", s, " has ", q_len, " query rows but context length ",
                lens[s]);
    const int64_t needed_blocks = (lens[s] + block_size - 1) / block_size;
    TORCH_CHECK(needed_blocks <= max_blocks, "context length ", lens[s], " of sequence ", s,
                " needs more blocks than block_tables has columns (", max_blocks, ")");
    for (int64_t b = 0; b < needed_blocks; ++b) {
      const int32_t id = tables[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < k_cache.size(0), "block id ", id, " of sequence ", s, " is out of range");
    }
    for (int64_t r = 0; r < q_len; r += kRowsPerTile) {
      const int64_t end = std::min(q_len, r + kRowsPerTile);
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({s, h, r, end});
    }
  }

  parallel_dynamic(static_cast<int64_t>(items.size()), [&](int64_t idx) {
    const WorkItem& it = items[idx];
    const int64_t context_len = lens[it.seq];
    const int64_t first_row = starts[it.seq];
    const int64_t q_len = starts[it.seq + 1] - first_row;
    const int32_t* table = tables + it.seq * max_blocks;
    const int64_t rows = it.row_end - it.row_begin, m_count = rows * group;
    // Row r sits at absolute position context_len - q_len + r and sees keys (pos - window, pos].
    auto key_end = [&](int64_t r) { return context_len - q_len + r + 1; };
    auto key_begin = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, key_end(r) - window) : 0; };
    const int64_t lo = key_begin(it.row_begin), hi = key_end(it.row_end - 1), span = hi - lo;

    thread_local std::vector<float> scores, query, acc;
    scores.resize(m_count * span);
    query.resize(m_count * head_dim);
    acc.assign(m_count * head_dim, 0.f);
    std::vector<int64_t> row_lo(rows), row_hi(rows);
    for (int64_t r = 0; r < rows; ++r) {
      row_lo[r] = key_begin(it.row_begin + r);
      row_hi[r] = key_end(it.row_begin + r);
    }
    // m = r * group + g is query row r, head kv_head * group + g; scaled queries kept in fp32.
    for (int64_t m = 0; m < m_count; ++m) {
      const T* src = q_ptr + (first_row + it.row_begin + m / group) * num_heads * head_dim +
                     (it.kv_head * group + m % group) * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) query[m * head_dim + i] = static_cast<float>(src[i]) * scale;
    }
    const PagedRows<T> paged{table, block_size, slot_stride, it.kv_head * head_dim, head_dim};

    // Pass 1: scores of every (row, head) against every key of the tile's range. Each block of keys is
    // loaded once and scored against all rows, kRows rows at a time.
    paged.for_each_block(k_ptr, lo, hi, [&](int64_t t0, int64_t t1, const T* k_rows) {
      for (int64_t m0 = 0; m0 < m_count; m0 += kRows) {
        with_rows(m_count - m0, [&](auto n) {
          for (int64_t t = t0; t < t1; ++t) {
            float dots[kRows];
            const T* k_row = k_rows + (t - t0) * slot_stride;
            _mm_storeu_ps(dots, dot_rows<n>(&query[m0 * head_dim], k_row, head_dim));
            for (int r = 0; r < n; ++r) scores[(m0 + r) * span + t - lo] = dots[r];
          }
        });
      }
    });
    // Softmax over each row's own visible range; invisible keys get weight 0.
    std::vector<float> inv_sum(m_count);
    for (int64_t m = 0; m < m_count; ++m) {
      float* row = &scores[m * span];
      const int64_t a = row_lo[m / group] - lo, b = row_hi[m / group] - lo;
      const float max_score = *std::max_element(row + a, row + b);
      const float sum = exp_shifted_sum(row + a, b - a, max_score);
      std::fill(row, row + a, 0.f);
      std::fill(row + b, row + span, 0.f);
      inv_sum[m] = 1.f / sum;
    }
    // Pass 2: weighted sum of V rows, block by block, kRows accumulator rows at a time.
    paged.for_each_block(v_ptr, lo, hi, [&](int64_t t0, int64_t t1, const T* v_rows) {
      for (int64_t m0 = 0; m0 < m_count; m0 += kRows) {
        with_rows(m_count - m0, [&](auto n) {
          accumulate_rows<n>(&acc[m0 * head_dim], &scores[m0 * span + t0 - lo], span, v_rows, slot_stride,
                             t1 - t0, head_dim);
        });
      }
    });
    for (int64_t m = 0; m < m_count; ++m) {
      T* dst = out_ptr + (first_row + it.row_begin + m / group) * num_heads * head_dim +
               (it.kv_head * group + m % group) * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<T>(acc[m * head_dim + i] * inv_sum[m]);
    }
  });
}

void check_int32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.is_contiguous(), name,
              " must be a contiguous int32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale,
                     int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q [T, H, D] and k/v caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) % 8 == 0,
              "head_dim must match the cache and be a multiple of 8, got ", q.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads ", q.size(1),
              " is not a multiple of num_kv_heads ", k_cache.size(2));
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, out and the caches must share one dtype");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  check_int32_cpu(block_tables, "block_tables");
  check_int32_cpu(query_start_loc, "query_start_loc");
  check_int32_cpu(context_lens, "context_lens");
  TORCH_CHECK(query_start_loc.size(0) == context_lens.size(0) + 1,
              "query_start_loc must have num_seqs + 1 entries");
  if (q.scalar_type() == at::kFloat) {
    attention_kernel<float>(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                            window);
  } else if (q.scalar_type() == at::kBFloat16) {
    attention_kernel<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                    scale, window);
  } else {
    TORCH_CHECK(false, "unsupported dtype ", q.scalar_type(), " (fp32 or bf16)");
  }
}

// Copies token t's K/V rows ([Hkv * D] each) into flat slot slot_mapping[t]; slot -1 is skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "key, value and the caches must be contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              "key/value dtype must match the cache dtype");
  TORCH_CHECK(key.dim() == 3 && key.sizes().slice(1) == k_cache.sizes().slice(2) &&
                  value.sizes() == key.sizes(),
              "expected key/value [T, Hkv, D] matching the cache, got ", key.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be int64 with one entry per token");
  // Not key.stride(0): a one-token view keeps its parent's stride there and still counts as contiguous.
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < slot_mapping.size(0); ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot ", slot, " of token ", t, " is out of range (", num_slots, " slots)");
    std::memcpy(k_dst + slot * row_bytes, k_src + t * row_bytes, row_bytes);
    std::memcpy(v_dst + slot * row_bytes, v_src + t * row_bytes, row_bytes);
  }
}

}  // namespace

TORCH_LIBRARY(pagedllm, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor context_lens, float scale, int window) -> ()");
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}
