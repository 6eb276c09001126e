"""Mixture of experts (Qwen3-MoE, Mixtral): a router picks the top k of E expert MLPs for each token.

Each expert is a plain GatedMLP. A forward sorts the (token, expert) pairs by expert and runs each chosen
expert once, on the rows of the tokens routed to it (one matmul batch per expert, as vLLM's fused MoE and
llama.cpp's mul_mat_id group them); experts no token chose do not run. Under tensor parallelism every rank
routes the same way (the router is replicated) and holds a slice of every expert, like a dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.config import ModelConfig
from pagedllm.models.layers import GatedMLP
from pagedllm.models.linear import Linear
from pagedllm.models.parallel import TensorParallel


class SparseMoE(nn.Module):
    """sum over the token's top-k experts e of p_e * expert_e(x), p = softmax(router(x)) (renormalized over
    the k chosen where the config says so)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)  # the router (checkpoint name: mlp.gate)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act, tp=tp)
            for _ in range(config.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> the k experts of each token [T, k] and their weights [T, k] (x's dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum for each token of x [T, hidden], plus `residual` if given."""
        experts, weights = self.route(x)
        # The T * k (token, expert) pairs sorted by expert: pairs[start:end] are one expert's tokens.
        pairs = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).tolist()
        tokens, pair_weights = pairs // self.top_k, weights.flatten()[pairs, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = tokens[start : start + count]
                out.index_add_(0, rows, expert(x[rows]) * pair_weights[start : start + count])
                start += count
        return out if residual is None else out + residual
