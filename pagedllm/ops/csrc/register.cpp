// Registers the operators under a namespace named for this build's instruction set (PAGEDLLM_NAMESPACE,
// e.g. pagedllm_avx512), so that builds for several instruction sets can be loaded side by side.

#include <torch/library.h>

#include "ops.h"

// One level of indirection, so that PAGEDLLM_NAMESPACE is expanded before TORCH_LIBRARY pastes it.
#define PAGEDLLM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDLLM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
#define PAGEDLLM_STRINGIFY(x) #x
#define PAGEDLLM_STRING(x) PAGEDLLM_STRINGIFY(x)

PAGEDLLM_LIBRARY(PAGEDLLM_NAMESPACE, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor context_lens, float scale, int window, float softcap) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool unit_offset) -> ()");
  m.def("act_and_mul(Tensor(a!) out, Tensor x, int activation) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos_sin) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def(
      "linear(Tensor x, Tensor weight, Tensor? scales, Tensor? mins, int group_size, Tensor? bias, "
      "Tensor? residual) -> Tensor");
  m.def("set_blocks_bf16(bool enabled) -> bool", &pagedllm::set_blocks_bf16);
  m.def("set_blocks_invariant(bool enabled) -> bool", &pagedllm::set_blocks_invariant);
  m.def("set_blocks_int8(bool enabled) -> bool", &pagedllm::set_blocks_int8);
  m.def("blocks_amx() -> bool", &pagedllm::blocks_amx);
  m.def(
      "dequantize_rows(Tensor(a!) out, Tensor weight, Tensor? scales, Tensor? mins, int group_size, "
      "Tensor ids) -> ()");
  m.class_<pagedllm::DecoderLayerWeights>("DecoderLayerWeights")
      .def(torch::init<at::Tensor, c10::List<c10::optional<at::Tensor>>, c10::List<c10::optional<at::Tensor>>,
                       std::vector<int64_t>, double, bool, int64_t, int64_t, int64_t>());
  m.def(
      "decoder_layer(Tensor h, Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor query_start_loc, Tensor context_lens, "
      "__torch__.torch.classes." PAGEDLLM_STRING(PAGEDLLM_NAMESPACE) ".DecoderLayerWeights layer, float scale, "
      "int window, float softcap, Tensor? lora_adapters, Tensor?[] lora) -> Tensor");
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor adapters, Tensor?[] weights) -> ()");
}

PAGEDLLM_LIBRARY_IMPL(PAGEDLLM_NAMESPACE, CPU, m) {
  m.impl("paged_attention", &pagedllm::paged_attention);
  m.impl("write_kv", &pagedllm::write_kv);
  m.impl("rms_norm", &pagedllm::rms_norm);
  m.impl("act_and_mul", &pagedllm::act_and_mul);
  m.impl("rotary_embedding", &pagedllm::rotary_embedding);
  m.impl("argmax_rows", &pagedllm::argmax_rows);
  m.impl("linear", &pagedllm::linear);
  m.impl("dequantize_rows", &pagedllm::dequantize_rows);
  m.impl("decoder_layer", &pagedllm::decoder_layer);
  m.impl("lora_add", &pagedllm::lora_add);
}

