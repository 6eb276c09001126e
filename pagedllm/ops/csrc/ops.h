// The operators this extension registers (see register.cpp for their schemas).
#pragma once

#include <ATen/core/Tensor.h>

namespace pagedllm {

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& context_lens, double scale, int64_t window);
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping);
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
void act_and_mul(at::Tensor out, const at::Tensor& x, int64_t activation);
void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin);

}  // namespace pagedllm
