// LoRA updates of one projection's output for a step whose rows belong to several adapters (punica's
// SGMV on a CPU): y[t] += B (A x[t]) with adapter g = adapters[t]'s A and B, nothing where g is -1 (the
// base). The base matmul ran once for every row before; this adds rank-r work per row, so it is small
// next to the base's but was ~15 torch calls per projection and adapter when written from Python.
//
// An adapter's operands for one projection (models/lora.py LoRALayer): a [P * r, in] (the A of each of
// its P pieces stacked), b [r, N] (each piece's B transposed, side by side, the scale folded in), spans
// [P, 2] int64 (each piece's first output row and its N_p rows). Pieces exist because pagedllm fuses
// q / k / v and gate / up into one matmul: an adapter of q_proj and v_proj updates two row ranges of it.
//
// Rows of one adapter go in tiles of up to kTile, so that each A row read serves the tile. Each row's
// arithmetic is fp32 in a fixed order (the same whatever the tiling or threads); a bf16 y is rounded once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <vector>

#include "ops.h"
#include "simd.h"
#include "threads.h"

namespace pagedllm {
namespace {

constexpr int kTile = 4;

struct Adapter {
  const at::Tensor* a = nullptr;  // null: the adapter does not adapt this projection
  const at::Tensor* b = nullptr;
  const int64_t* spans = nullptr;
  int64_t pieces = 0, rank = 0;
};

// One tile: rows[0..N) of one adapter.
template <typename T, int N>
void update_tile(T* y, int64_t y_stride, const T* x, int64_t x_stride, const int64_t* rows, const Adapter& ad,
                 std::vector<float>& shrunk) {
  const int64_t in = ad.a->size(1), ranks = ad.a->size(0), cols = ad.b->size(1);
  const T* a = ad.a->data_ptr<T>();
  const T* b = ad.b->data_ptr<T>();
  shrunk.resize(static_cast<size_t>(N * ranks));
  for (int64_t j = 0; j < ranks; ++j) {  // shrunk[i][j] = A[j] . x[rows[i]]
    VecF acc[N];
    for (int i = 0; i < N; ++i) acc[i] = VecF::zero();
    for_each_chunk(in, [&](int64_t k, int w) {
      const VecF av = load(a + j * in + k, w);
      for (int i = 0; i < N; ++i) acc[i] = fmadd(load(x + rows[i] * x_stride + k, w), av, acc[i]);
    });
    for (int i = 0; i < N; ++i) shrunk[i * ranks + j] = reduce_add(acc[i]);
  }
  int64_t col = 0;
  for (int64_t p = 0; p < ad.pieces; ++p) {  // y[rows[i], piece rows] += B_p shrunk[i][piece ranks]
    const int64_t first = ad.spans[2 * p], count = ad.spans[2 * p + 1];
    const float* s = shrunk.data() + p * ad.rank;
    for_each_chunk(count, [&](int64_t o, int w) {
      for (int i = 0; i < N; ++i) {
        VecF delta = VecF::zero();
        for (int64_t j = 0; j < ad.rank; ++j) {
          delta = fmadd(VecF::set1(s[i * ranks + j]), load(b + j * cols + col + o, w), delta);
        }
        T* out = y + rows[i] * y_stride + first + o;
        store(load(out, w) + delta, out, w);
      }
    });
    col += count;
  }
}

template <typename T>
void lora_kernel(at::Tensor& y, const at::Tensor& x, const at::Tensor& adapters, const std::vector<Adapter>& by_id) {
  // Each adapter's rows, then tiles of them: (adapter, first index into its rows, count).
  std::vector<std::vector<int64_t>> rows(by_id.size());
  const int64_t* of = adapters.data_ptr<int64_t>();
  for (int64_t t = 0; t < adapters.size(0); ++t) {
    if (of[t] >= 0 && by_id[of[t]].a != nullptr) rows[of[t]].push_back(t);
  }
  struct Tile {
    int64_t adapter, start, count;
  };
  std::vector<Tile> tiles;
  int64_t work = 0;  // multiply-adds per row, the largest of the step's adapters
  for (size_t g = 0; g < rows.size(); ++g) {
    for (size_t i = 0; i < rows[g].size(); i += kTile) {
      tiles.push_back({static_cast<int64_t>(g), static_cast<int64_t>(i),
                       std::min<int64_t>(kTile, static_cast<int64_t>(rows[g].size() - i))});
    }
    if (!rows[g].empty()) work = std::max(work, by_id[g].a->numel() + by_id[g].b->numel());
  }
  if (tiles.empty()) return;
  T* out = y.data_ptr<T>();
  const T* in = x.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), grain(kTile * work, 1 << 17), [&](int64_t begin, int64_t end) {
    std::vector<float> shrunk;
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tile = tiles[i];
      const int64_t* tile_rows = rows[tile.adapter].data() + tile.start;
      with_count<kTile>(tile.count, [&](auto n) {
        update_tile<T, decltype(n)::value>(out, y.stride(0), in, x.stride(0), tile_rows, by_id[tile.adapter], shrunk);
      });
    }
  });
}

}  // namespace

void lora_add_strided(at::Tensor y, const at::Tensor& x, const at::Tensor& adapters,
                      const c10::List<c10::optional<at::Tensor>>& weights, int64_t offset, int64_t stride) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "expected x [T, in] and y [T, out] with contiguous rows, got ", x.sizes(), " and ", y.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(adapters.scalar_type() == at::kLong && adapters.is_contiguous() && adapters.dim() == 1 &&
                  adapters.size(0) == x.size(0),
              "adapters must be contiguous int64 with one entry per row");
  TORCH_CHECK(stride >= 3 && offset >= 0 && offset + 3 <= stride && weights.size() % stride == 0,
              "weights must hold (a, b, spans) per adapter, got ", weights.size());
  std::vector<at::Tensor> held(3 * (weights.size() / stride));
  std::vector<Adapter> by_id(weights.size() / stride);
  for (size_t g = 0; g < by_id.size(); ++g) {
    const int64_t first = stride * g + offset;
    const c10::optional<at::Tensor> a = weights.get(first), b = weights.get(first + 1), spans = weights.get(first + 2);
    if (!a.has_value()) continue;
    TORCH_CHECK(b.has_value() && spans.has_value(), "adapter ", g, " has a but not b and spans");
    held[3 * g] = *a, held[3 * g + 1] = *b, held[3 * g + 2] = *spans;
    const int64_t pieces = spans->size(0);
    TORCH_CHECK(a->dim() == 2 && a->size(1) == x.size(1) && a->is_contiguous() && a->scalar_type() == x.scalar_type(),
                "adapter ", g, ": a must be a contiguous [P * r, ", x.size(1), "] tensor of x's dtype, got ", a->sizes());
    TORCH_CHECK(spans->dim() == 2 && spans->size(1) == 2 && pieces > 0 && spans->scalar_type() == at::kLong &&
                    spans->is_contiguous() && a->size(0) % pieces == 0,
                "adapter ", g, ": spans must be a contiguous int64 [P, 2] tensor dividing a's rows");
    const int64_t rank = a->size(0) / pieces;
    TORCH_CHECK(b->dim() == 2 && b->size(0) == rank && b->is_contiguous() && b->scalar_type() == x.scalar_type(),
                "adapter ", g, ": b must be a contiguous [", rank, ", N] tensor of x's dtype, got ", b->sizes());
    const int64_t* s = spans->data_ptr<int64_t>();
    int64_t total = 0;
    for (int64_t p = 0; p < pieces; ++p) {
      TORCH_CHECK(s[2 * p] >= 0 && s[2 * p + 1] > 0 && s[2 * p] + s[2 * p + 1] <= y.size(1),
                  "adapter ", g, ": piece ", p, " rows [", s[2 * p], ", +", s[2 * p + 1], ") outside y's ", y.size(1));
      total += s[2 * p + 1];
    }
    TORCH_CHECK(total == b->size(1), "adapter ", g, ": spans cover ", total, " rows, b has ", b->size(1));
    by_id[g] = {&held[3 * g], &held[3 * g + 1], s, pieces, rank};
  }
  const int64_t* of = adapters.data_ptr<int64_t>();
  for (int64_t t = 0; t < adapters.size(0); ++t) {
    TORCH_CHECK(of[t] >= -1 && of[t] < static_cast<int64_t>(by_id.size()), "row ", t, " names adapter ", of[t],
                " of ", by_id.size());
  }
  if (x.scalar_type() == at::kFloat) {
    lora_kernel<float>(y, x, adapters, by_id);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_add: unsupported dtype ", x.scalar_type());
    lora_kernel<c10::BFloat16>(y, x, adapters, by_id);
  }
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& adapters,
              const c10::List<c10::optional<at::Tensor>>& weights) {
  lora_add_strided(std::move(y), x, adapters, weights, 0, 3);
}

}  // namespace pagedllm
