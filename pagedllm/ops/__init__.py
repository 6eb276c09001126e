"""Attention that reads K/V through block tables, and the store of new K/V into slots.

Tensors in, tensors out: no engine concepts here. The public functions dispatch to a backend
(`torch` reference, `cpu` C++ kernel, `triton` GPU kernels) chosen by PAGEDLLM_ATTN_BACKEND or by device.
"""

from pagedllm.ops.reference import (
    copy_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

__all__ = ["copy_blocks", "paged_decode_attention", "paged_prefill_attention", "write_kv"]
