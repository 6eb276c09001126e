// A decoder layer in one call: the kernels a model's layer calls one by one (rms_norm, linear,
// rotary_embedding, write_kv, paged_attention, act_and_mul; linear being pagedllm's kernel, or oneDNN's for
// prepacked weights; torch's add for Gemma's residuals), in the same order on the same tensors, so its
// result is the same to the bit. It exists for speed alone: at one decode row a layer's ten op calls from
// Python cost ~80 us, a quarter of a step on 4-bit weights; here, one call.
//
//   x = rms_norm(h) ; q, k, v = split(x Wqkv^T) ; [q, k = rms_norm(q), rms_norm(k)] ; rotate q, k
//   store k, v ; a = attention(q)
//   Llama: h = h + a Wo^T ; x = rms_norm(h) ; h = h + act_and_mul(x Wgate_up^T) Wdown^T
//   Gemma: h = h + rms_norm(a Wo^T) ; x = rms_norm(h) ; h = h + rms_norm(act_and_mul(x Wgate_up^T) Wdown^T)
//
// A step with LoRA adapters passes each row's adapter and, per adapter, (a, b, spans) for each of the four
// projections (12 tensors, absent where it does not adapt one): lora_add follows each projection, as
// models/linear.py's Linear.matmul follows its matmul with the adapters' update.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>

#include <string_view>

#include "ops.h"

#define PAGEDLLM_STRINGIFY(x) #x
#define PAGEDLLM_OP_NAME(ns, op) PAGEDLLM_STRINGIFY(ns) "::" op
#define OP(op) PAGEDLLM_OP_NAME(PAGEDLLM_NAMESPACE, op)

namespace pagedllm {
namespace {

// Runs fn() as a range of torch's profiler named like the op it calls (OP("linear"): e.g.
// pagedllm_avx512::linear), so that `bench --profile` still shows a one-call layer's time op by op. With no
// profiler running, the guard only asks torch whether any callbacks are registered, as every dispatcher
// call does.
template <typename F>
auto profiled(std::string_view name, const F& fn) {
  RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{});
  return fn();
}

// group_size of a weight in oneDNN's prepacked layout (models/linear.py OneDNNLinear), multiplied by
// torch's mkldnn::_linear_pointwise ops as that class does from Python, the residual add fused.
constexpr int64_t kOneDNNPacked = -1;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& residual) {
  if (residual.has_value()) {
    static const auto add = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const c10::optional<at::Tensor>&, c10::string_view)>();
    return add.call(x, *residual, packed, bias, "add");
  }
  static const auto plain =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                            c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return plain.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
}

// One linear layer's storage as csrc/linear.cpp reads it: weights[4 * i ...] = data, scales, mins, bias;
// or, with group_size kOneDNNPacked, oneDNN's packed weight and the bias.
at::Tensor project(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& weights, int64_t i,
                   int64_t group_size, const c10::optional<at::Tensor>& residual) {
  const c10::optional<at::Tensor> data = weights.get(4 * i);
  TORCH_CHECK(data.has_value(), "linear layer ", i, " has no weight");
  if (group_size == kOneDNNPacked) return onednn_linear(x, *data, weights.get(4 * i + 3), residual);
  return profiled(OP("linear"), [&] {
    return linear(x, *data, weights.get(4 * i + 1), weights.get(4 * i + 2), group_size, weights.get(4 * i + 3),
                  residual);
  });
}

// Adds the adapters' update of projection i (qkv, o, gate_up, down) to its output y of input x.
constexpr int64_t kLoRAPerAdapter = 12;  // (a, b, spans) for each of the 4 projections

void adapt(const at::Tensor& y, const at::Tensor& x, const c10::optional<at::Tensor>& adapters,
           const c10::List<c10::optional<at::Tensor>>& lora, int64_t i) {
  if (!adapters.has_value()) return;
  profiled(OP("lora_add"), [&] { lora_add_strided(y, x, *adapters, lora, 3 * i, kLoRAPerAdapter); });
}

// The layer's norms, in this order: input, post_attention, pre_feedforward, post_feedforward (the last
// two Gemma's, around the MLP), q, k (per-head QK-norm); the last four may be absent.
enum Norm : int64_t { kInput, kPostAttention, kPreFeedforward, kPostFeedforward, kQuery, kKey, kNorms };

}  // namespace

DecoderLayerWeights::DecoderLayerWeights(at::Tensor cos_sin, c10::List<c10::optional<at::Tensor>> norms,
                                         c10::List<c10::optional<at::Tensor>> weights,
                                         std::vector<int64_t> group_sizes, double eps, bool unit_offset,
                                         int64_t num_heads, int64_t num_kv_heads, int64_t activation)
    : cos_sin(std::move(cos_sin)),
      norms(std::move(norms)),
      weights(std::move(weights)),
      group_sizes(std::move(group_sizes)),
      eps(eps),
      unit_offset(unit_offset),
      num_heads(num_heads),
      num_kv_heads(num_kv_heads),
      activation(activation) {
  TORCH_CHECK(this->weights.size() == 16 && this->group_sizes.size() == 4,
              "expected 4 linear layers (qkv, o, gate_up, down) as 16 tensors and 4 group sizes, got ",
              this->weights.size(), " and ", this->group_sizes.size());
  const auto& n = this->norms;
  TORCH_CHECK(n.size() == kNorms && n.get(kInput).has_value() && n.get(kPostAttention).has_value(),
              "expected 6 norms (input, post_attention, pre_feedforward, post_feedforward, q, k), the first two "
              "present, got ", n.size());
  TORCH_CHECK(n.get(kPreFeedforward).has_value() == n.get(kPostFeedforward).has_value() &&
                  n.get(kQuery).has_value() == n.get(kKey).has_value(),
              "the feedforward norms and the QK-norms come in pairs");
}

at::Tensor decoder_layer(const at::Tensor& h, const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                         const c10::intrusive_ptr<DecoderLayerWeights>& layer, double scale, int64_t window,
                         double softcap, const c10::optional<at::Tensor>& lora_adapters,
                         const c10::List<c10::optional<at::Tensor>>& lora) {
  TORCH_CHECK(h.dim() == 2, "h must be [T, hidden], got ", h.sizes());
  const auto& norms = layer->norms;
  const auto& weights = layer->weights;
  const auto& group_sizes = layer->group_sizes;
  const auto& cos_sin = layer->cos_sin;
  const double eps = layer->eps;
  const bool unit_offset = layer->unit_offset;
  const int64_t num_heads = layer->num_heads, num_kv_heads = layer->num_kv_heads, activation = layer->activation;
  const bool sandwich = norms.get(kPreFeedforward).has_value();
  const int64_t tokens = h.size(0), head_dim = k_cache.size(3);
  // out = rms_norm(x) with the layer's norm `which`
  const auto normalize = [&](const at::Tensor& out, const at::Tensor& x, Norm which) {
    profiled(OP("rms_norm"), [&] { rms_norm(out, x, *norms.get(which), eps, unit_offset); });
  };
  // projection i of `in` (+ residual), with the adapters' update
  const auto adapted = [&](const at::Tensor& in, int64_t i, const c10::optional<at::Tensor>& residual) {
    at::Tensor y = project(in, weights, i, group_sizes[i], residual);
    adapt(y, in, lora_adapters, lora, i);
    return y;
  };
  at::Tensor x = at::empty(h.sizes(), h.options());
  normalize(x, h, kInput);
  const at::Tensor heads = adapted(x, 0, c10::nullopt).view({tokens, num_heads + 2 * num_kv_heads, head_dim});
  at::Tensor qk = heads.narrow(1, 0, num_heads + num_kv_heads);
  if (norms.get(kQuery).has_value()) {  // each head normed into a fresh tensor, as torch.cat makes one
    const at::Tensor normed = at::empty(qk.sizes(), qk.options());
    normalize(normed.narrow(1, 0, num_heads), qk.narrow(1, 0, num_heads), kQuery);
    normalize(normed.narrow(1, num_heads, num_kv_heads), qk.narrow(1, num_heads, num_kv_heads), kKey);
    qk = normed;
  }
  profiled(OP("rotary_embedding"), [&] { rotary_embedding(qk, positions, cos_sin); });
  const at::Tensor q = qk.narrow(1, 0, num_heads);
  profiled(OP("write_kv"), [&] {
    write_kv(qk.narrow(1, num_heads, num_kv_heads), heads.narrow(1, num_heads + num_kv_heads, num_kv_heads),
             k_cache, v_cache, slot_mapping);
  });
  at::Tensor attended = at::empty(q.sizes(), q.options());
  profiled(OP("paged_attention"), [&] {
    paged_attention(attended, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window,
                    softcap);
  });
  const at::Tensor flat = attended.view({tokens, num_heads * head_dim});
  // act_and_mul(in Wgate_up^T) Wdown^T (+ residual)
  const auto mlp = [&](const at::Tensor& in, const c10::optional<at::Tensor>& residual) {
    const at::Tensor gate_up = adapted(in, 2, c10::nullopt);
    at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
    profiled(OP("act_and_mul"), [&] { act_and_mul(act, gate_up, activation); });
    return adapted(act, 3, residual);
  };
  if (!sandwich) {  // the residual adds inside the projections
    const at::Tensor mid = adapted(flat, 1, h);
    normalize(x, mid, kPostAttention);
    return mlp(x, mid);
  }
  normalize(x, adapted(flat, 1, c10::nullopt), kPostAttention);
  const at::Tensor mid = at::add(h, x);
  normalize(x, mid, kPreFeedforward);
  normalize(x, mlp(x, c10::nullopt), kPostFeedforward);
  return at::add(mid, x);
}

}  // namespace pagedllm
