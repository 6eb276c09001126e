// The operators this extension registers (see register.cpp for their schemas).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/util/Optional.h>

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
bool blocks_amx();
void dequantize_rows(at::Tensor out, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                     const c10::optional<at::Tensor>& mins, int64_t group_size, const at::Tensor& ids);
at::Tensor decoder_layer(const at::Tensor& h, const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& context_lens, const at::Tensor& cos_sin,
                         const c10::List<c10::optional<at::Tensor>>& norms,
                         const c10::List<c10::optional<at::Tensor>>& weights, at::IntArrayRef group_sizes,
                         double eps, bool unit_offset, int64_t num_heads, int64_t num_kv_heads, double scale,
                         int64_t window, double softcap, int64_t activation);

}  // namespace pagedllm
