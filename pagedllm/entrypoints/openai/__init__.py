"""OpenAI-compatible HTTP server (`pagedllm serve`): /v1/completions, /v1/chat/completions, /metrics."""
