"""`pagedllm bench linear`: the matmul kernels a Linear could use, on the model's own shapes.

Each method multiplies x [M, K] by a weight W [N, K] made from the same random float32 values:

  F.linear / onednn     torch's plain matmul and oneDNN on a prepacked weight (float32 and bf16)
  int8pack / int4pack   torch's weight-only ops (gpt-fast's), `_weight_int8pack_mm` (per-row int8) and
                        `_weight_int4pack_mm_for_cpu` (groups of 32), with float32 and bf16 activations
  fbgemm-dyn            `quantized::linear_dynamic`: int8 weights and activations quantized per call
  kernel / int8 / int4  pagedllm's C++ kernel (ops/csrc/linear.cpp) on its float32, bf16, int8 and int4
                        storage, laid out on huge pages as a loaded model's weights are

M = 1 is a decode step: every layer of the model (each with its own weights, so they stream from
memory as a model's do) and the LM head, back to back; printed as ms per pass and weight bytes read
per second. M > 1: GFLOP/s per shape, each weight hot in the cache. Timings: compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.bench import flags

Matmul = Callable[[torch.Tensor], torch.Tensor]


def _onednn(w: torch.Tensor) -> Matmul:
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _int8pack(w: torch.Tensor, dtype: torch.dtype) -> Matmul:
    scales = w.abs().amax(dim=1) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    scales = scales.to(dtype)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales)


def _int4pack(w: torch.Tensor, dtype: torch.dtype, group: int = 32) -> Matmul:
    n, k = w.shape
    groups = w.reshape(n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-8)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).reshape(n, k).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_zeros = torch.stack([scales, low + 8 * scales], -1).transpose(0, 1).contiguous().to(dtype)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def _fbgemm_dynamic(w: torch.Tensor) -> Matmul:
    scales = (w.abs().amax(dim=1) / 127).double()
    qw = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed)


def _pagedllm(method_name: str) -> Callable[[list[torch.Tensor]], list[Matmul]]:
    """Layers of one model under a pagedllm method, their storage packed on huge pages together."""

    def build(weights: list[torch.Tensor]) -> list[Matmul]:
        from pagedllm.models.linear import KernelLinear, Linear, process_linear_layers
        from pagedllm.models.quantization import Int4Linear, Int8Linear

        method = {"kernel": KernelLinear, "int8": Int8Linear, "int4": Int4Linear}[method_name]()
        model = torch.nn.ModuleList()
        for w in weights:
            layer = Linear(w.shape[1], w.shape[0]).to(w.dtype)
            layer.weight.data = w
            layer.method = method
            model.append(layer)
        process_linear_layers(model)
        return [lambda x, layer=layer: layer(x) for layer in model]

    return build


def _each(make: Callable[[torch.Tensor], Matmul]) -> Callable[[list[torch.Tensor]], list[Matmul]]:
    return lambda weights: [make(w) for w in weights]


@dataclass
class Method:
    x_dtype: torch.dtype  # activations
    w_dtype: torch.dtype  # the weights it is given (quantizing methods take float32)
    build: Callable[[list[torch.Tensor]], list[Matmul]]


FP32, BF16 = torch.float32, torch.bfloat16
METHODS: dict[str, Method] = {
    "F.linear fp32": Method(FP32, FP32, _each(lambda w: lambda x: F.linear(x, w))),
    "onednn fp32": Method(FP32, FP32, _each(_onednn)),
    "kernel fp32": Method(FP32, FP32, _pagedllm("kernel")),
    "F.linear bf16": Method(BF16, BF16, _each(lambda w: lambda x: F.linear(x, w))),
    "onednn bf16": Method(BF16, BF16, _each(_onednn)),
    "kernel bf16": Method(BF16, BF16, _pagedllm("kernel")),
    "int8pack fp32": Method(FP32, FP32, _each(lambda w: _int8pack(w, FP32))),
    "int8pack bf16": Method(BF16, FP32, _each(lambda w: _int8pack(w, BF16))),
    "int4pack fp32": Method(FP32, FP32, _each(lambda w: _int4pack(w, FP32))),
    "int4pack bf16": Method(BF16, FP32, _each(lambda w: _int4pack(w, BF16))),
    "fbgemm-dyn int8": Method(FP32, FP32, _each(_fbgemm_dynamic)),
    "kernel int8": Method(FP32, FP32, _pagedllm("int8")),
    "kernel int4": Method(FP32, FP32, _pagedllm("int4")),
}


def unavailable(name: str) -> str | None:
    """Why a method cannot run here as named (None: it can): a benchmark never times a fallback."""
    family = name.split()[0]
    if family == "kernel":
        from pagedllm.ops import native

        return native.unavailable_reason()
    if family == "onednn" and not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    if family == "fbgemm-dyn" and "fbgemm" not in torch.backends.quantized.supported_engines:
        return f"torch's quantized engines are {torch.backends.quantized.supported_engines}, without fbgemm"
    return None


def kernel_build() -> str:
    """The C++ kernels' instruction-set build, for the header."""
    from pagedllm.ops import native

    isa = native.built_isa()
    return f"kernels built for {isa}" if isa else "no kernels"


def model_shapes(model: str) -> tuple[dict[str, tuple[int, int]], int, tuple[int, int]]:
    """(N, K) of one decoder layer's projections, the layer count, and the LM head's (N, K)."""
    from pagedllm.models.loader import read_config, resolve_checkpoint

    cfg = read_config(resolve_checkpoint(model))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = {
        "qkv": (q + 2 * kv, cfg.hidden_size),
        "o": (cfg.hidden_size, q),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
    }
    return layer, cfg.num_layers, (cfg.vocab_size, cfg.hidden_size)


def _weight(shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)


def _median_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_pass(
    method: Method, layer_shapes, num_layers: int, head: tuple[int, int], reps: int
) -> tuple[float, int]:
    """Seconds for one M = 1 pass over every layer and the LM head, and the number of weights it reads."""
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(num_layers) for s in layer_shapes.values()] + [head]
    matmuls = method.build([_weight(s, method.w_dtype, gen) for s in shapes])
    inputs = {k: torch.randn(1, k).to(method.x_dtype) for k in {s[1] for s in shapes}}
    feed = [(m, inputs[s[1]]) for m, s in zip(matmuls, shapes, strict=True)]
    seconds = _median_time(lambda: [m(x) for m, x in feed], reps)
    return seconds, sum(n * k for n, k in shapes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench linear",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model(parser, help="whose layer shapes to use")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512], help="M values")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    flags.add_threads(parser)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers at M = 1 (default: the model's)"
    )
    args = parser.parse_args(argv)
    flags.apply_threads(args)
    for name in args.methods:
        if (reason := unavailable(name)) is not None:
            parser.error(f"--methods {name!r} cannot run here: {reason}")
    layer_shapes, num_layers, head = model_shapes(args.model)
    num_layers = args.layers or num_layers
    print(
        f"model {args.model}: {num_layers} layers of {layer_shapes}, LM head {head}; "
        f"{torch.get_num_threads()} threads, {kernel_build()}"
    )
    if 1 in args.rows:
        print("M = 1, every layer + LM head back to back (a decode step's matmuls):")
        for name in args.methods:
            seconds, weights = decode_pass(METHODS[name], layer_shapes, num_layers, head, args.reps)
            print(f"  {name:<17}{seconds * 1e3:9.2f} ms {weights / seconds / 1e9:7.2f} G weights/s")
    shapes = {**layer_shapes, "lm_head": head}
    for rows in (m for m in args.rows if m > 1):
        print(f"M = {rows}, GFLOP/s per shape (weights hot): " + " ".join(f"{s:>9}" for s in shapes))
        for name in args.methods:
            method, gen, rates = METHODS[name], torch.Generator().manual_seed(0), []
            for n, k in shapes.values():
                (matmul,) = method.build([_weight((n, k), method.w_dtype, gen)])
                x = torch.randn(rows, k).to(method.x_dtype)
                seconds = _median_time(lambda matmul=matmul, x=x: matmul(x), args.reps)
                rates.append(2 * rows * n * k / seconds / 1e9)
            print(f"  {name:<17}" + " ".join(f"{r:9.1f}" for r in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
