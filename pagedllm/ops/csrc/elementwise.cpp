// Fused elementwise kernels of a decoder layer: each reads its input once and writes its output once,
// where PyTorch would run several ops over memory. Rows are split across the intra-op thread pool.
// Arithmetic is fp32; a bf16 result is rounded where PyTorch's own sequence of bf16 ops would round.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "simd.h"
#include "threads.h"

namespace pagedllm {
namespace {

// Rows of a [..., D] tensor whose last dimension is contiguous: row i of the first leading dims x
// (up to two of them) starts at base + (i / inner) * outer_stride + (i % inner) * inner_stride.
struct Rows {
  int64_t count, inner, outer_stride, inner_stride;

  static Rows of(const at::Tensor& t) {
    TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "expected a [rows, D] or [A, B, D] tensor, got ", t.sizes());
    TORCH_CHECK(t.stride(-1) == 1, "the last dimension must be contiguous");
    if (t.dim() == 2) return {t.size(0), 1, t.stride(0), 0};
    return {t.size(0) * t.size(1), t.size(1), t.stride(0), t.stride(1)};
  }
  int64_t offset(int64_t i) const { return (i / inner) * outer_stride + (i % inner) * inner_stride; }
};

template <typename T>
constexpr bool kIsBF16 = std::is_same_v<T, c10::BFloat16>;

// v rounded to bf16 and back when T is bf16 (PyTorch stores a bf16 op's result before the next op).
template <typename T>
inline VecF round_as(VecF v) {
  if constexpr (kIsBF16<T>) {
    return VecF::round_bf16(v);
  } else {
    return v;
  }
}

template <typename T>
void rms_norm_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, float eps, bool unit_offset) {
  const Rows in_rows = Rows::of(x), out_rows = Rows::of(out);
  const int64_t d = x.size(-1);
  const T* in = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, in_rows.count, grain(d, 1 << 18), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = in + in_rows.offset(r);
      T* y = dst + out_rows.offset(r);
      VecF sum = VecF::zero();
      for_each_chunk(d, [&](int64_t i, int n) {
        const VecF v = load(src + i, n);
        sum = fmadd(v, v, sum);
      });
      const VecF inv = VecF::set1(1.f / std::sqrt(reduce_add(sum) / static_cast<float>(d) + eps));
      for_each_chunk(d, [&](int64_t i, int n) {
        const VecF normed = load(src + i, n) * inv;
        const VecF wv = load(w + i, n);
        // Llama: weight * normed.to(dtype); Gemma: (normed * (1 + weight)).to(dtype).
        store(unit_offset ? normed * (wv + VecF::set1(1.f)) : round_as<T>(normed) * wv, y + i, n);
      });
    }
  });
}

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

inline VecF silu(VecF g) { return g * reciprocal(VecF::set1(1.f) + exp(VecF::zero() - g)); }

inline VecF gelu_tanh(VecF g) {
  // 0.5 g (1 + tanh(z)) = g sigmoid(2z) = g / (1 + exp(-2z)), z = sqrt(2 / pi) (g + 0.044715 g^3).
  const VecF minus_2z = g * fmadd(VecF::set1(-0.0713548162f), g * g, VecF::set1(-1.5957691216f));
  return g * reciprocal(VecF::set1(1.f) + exp(minus_2z));
}

template <typename T>
void act_and_mul_kernel(at::Tensor& out, const at::Tensor& x, int64_t activation) {
  const int64_t rows = x.size(0), d = out.size(1), x_stride = x.stride(0), out_stride = out.stride(0);
  const T* in = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_by_wake_cost(d, 1 << 15), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * x_stride;
      const T* up = gate + d;
      T* y = dst + r * out_stride;
      for_each_chunk(d, [&](int64_t i, int n) {
        const VecF g = load(gate + i, n);
        const VecF a = activation == kSilu ? silu(g) : gelu_tanh(g);
        store(round_as<T>(a) * load(up + i, n), y + i, n);
      });
    }
  });
}

// Rotates [T, H, D] in place by each token's position, pairing dim i with i + D/2 (rotate_half layout).
template <typename T>
void rotary_kernel(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " of token ", t,
                " is outside the rotary table (", max_pos, " positions)");
  }
  T* base = x.data_ptr<T>();
  at::parallel_for(0, tokens, grain(heads * half * 2, 1 << 17), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + pos[t] * 2 * half;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = base + t * token_stride + h * head_stride;
        T* x2 = x1 + half;
        for_each_chunk(half, [&](int64_t i, int n) {
          const VecF a = load(x1 + i, n), b = load(x2 + i, n), c = load(cos + i, n), s = load(sin + i, n);
          store(a * c - b * s, x1 + i, n);
          store(b * c + a * s, x2 + i, n);  // unfused, rounded as PyTorch's x2 * cos + x1 * sin
        });
      }
    }
  });
}

template <typename F>
void dispatch_float(const at::Tensor& t, const char* op, const F& fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type(), " (float32 or bfloat16)");
  }
}

}  // namespace

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must be shaped like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [D] tensor of x's dtype");
  dispatch_float(x, "rms_norm", [&](auto tag) {
    rms_norm_kernel<decltype(tag)>(out, x, weight, static_cast<float>(eps), unit_offset);
  });
}

void act_and_mul(at::Tensor out, const at::Tensor& x, int64_t activation) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1),
              "expected x [T, 2I] and out [T, I], got ", x.sizes(), " and ", out.sizes());
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && x.scalar_type() == out.scalar_type(),
              "x and out must share a dtype and have contiguous rows");
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh, "unknown activation ", activation);
  dispatch_float(x, "act_and_mul", [&](auto tag) { act_and_mul_kernel<decltype(tag)>(out, x, activation); });
}

void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "expected x [T, H, D], D even and contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == x.size(0),
              "positions must be contiguous int64 with one entry per token");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 2 &&
                  cos_sin.size(1) == x.size(2),
              "cos_sin must be a contiguous float32 [max_positions, D] table (cos half, then sin half)");
  dispatch_float(x, "rotary_embedding", [&](auto tag) { rotary_kernel<decltype(tag)>(x, positions, cos_sin); });
}

}  // namespace pagedllm
