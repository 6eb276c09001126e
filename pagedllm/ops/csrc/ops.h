// The operators this extension registers (see register.cpp for their schemas).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/util/Optional.h>
#include <torch/custom_class.h>

#include <vector>

namespace pagedllm {

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& context_lens, double scale, int64_t window, double softcap);
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping);
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
void act_and_mul(at::Tensor out, const at::Tensor& x, int64_t activation);
void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                  const c10::optional<at::Tensor>& mins, int64_t group_size, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& residual);
// Whether the calling thread's GGUF matmuls may take the bf16 path at many rows (linear.cpp); returns the
// previous setting.
bool set_blocks_bf16(bool enabled);
bool set_blocks_invariant(bool enabled);
bool set_blocks_int8(bool enabled);
bool blocks_amx();
void dequantize_rows(at::Tensor out, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                     const c10::optional<at::Tensor>& mins, int64_t group_size, const at::Tensor& ids);
// y[t] += x[t]'s LoRA update by adapter adapters[t] (-1: none); weights holds (a, b, spans) per adapter,
// absent where it does not adapt this projection (csrc/lora.cpp).
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& adapters,
              const c10::List<c10::optional<at::Tensor>>& weights);
// The same with adapter g's three tensors at weights[stride * g + offset ...] (decoder_layer's lists).
void lora_add_strided(at::Tensor y, const at::Tensor& x, const at::Tensor& adapters,
                      const c10::List<c10::optional<at::Tensor>>& weights, int64_t offset, int64_t stride);
// A decoder layer's operands that stay the same from step to step (cpu.CpuDecoderLayer makes one after
// loading): a step's call passes this one object, not the ~25 tensors and lists whose conversion from
// Python cost more than the rest of the call's overhead.
// Its C++ name differs by build (an inline namespace per instruction set): torch keys custom classes by
// their C++ type, and builds for several instruction sets load into one process side by side.
inline namespace PAGEDLLM_NAMESPACE {
struct DecoderLayerWeights : torch::CustomClassHolder {
  // norms: input, post_attention, pre_feedforward, post_feedforward, q, k (the last four may be absent);
  // weights: per projection (qkv, o, gate_up, down) its data, scales, mins, bias as linear() takes them
  DecoderLayerWeights(at::Tensor cos_sin, c10::List<c10::optional<at::Tensor>> norms,
                      c10::List<c10::optional<at::Tensor>> weights, std::vector<int64_t> group_sizes, double eps,
                      bool unit_offset, int64_t num_heads, int64_t num_kv_heads, int64_t activation);
  at::Tensor cos_sin;
  c10::List<c10::optional<at::Tensor>> norms, weights;
  std::vector<int64_t> group_sizes;
  double eps;
  bool unit_offset;
  int64_t num_heads, num_kv_heads, activation;
};
}  // namespace PAGEDLLM_NAMESPACE

at::Tensor decoder_layer(const at::Tensor& h, const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                         const c10::intrusive_ptr<DecoderLayerWeights>& layer, double scale, int64_t window,
                         double softcap, const c10::optional<at::Tensor>& lora_adapters,
                         const c10::List<c10::optional<at::Tensor>>& lora);

}  // namespace pagedllm
