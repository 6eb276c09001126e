"""LoRA updates of a projection's output (ops.lora_add): the C++ kernel (csrc/lora.cpp) against the torch
reference on every instruction-set build this CPU runs, and both against the plain per-adapter matmuls
they replace; bad operands refused by name."""

import pytest
import torch

from pagedllm.ops import cpu, reference

IN, OUT = 72, 40  # 72 leaves a partial SIMD chunk on both builds
# Pieces of a fused projection an adapter updates: all three (q, k, v), two with a gap (q, v), one whole.
SPANS = {"qkv": [(0, 24), (24, 8), (32, 8)], "qv": [(0, 24), (32, 8)], "whole": [(0, OUT)]}


def adapter(spans: list[tuple[int, int]], rank: int, dtype: torch.dtype, gen: torch.Generator):
    """(a, b, spans) as lora_add takes them, and each piece's (first row, A, B) for the oracle."""
    pieces = [(first, torch.randn(rank, IN, generator=gen), torch.randn(rows, rank, generator=gen) / 4)
              for first, rows in spans]  # fmt: skip
    a = torch.cat([a for _, a, _ in pieces]).to(dtype)
    b = torch.cat([b.t() for _, _, b in pieces], dim=1).to(dtype).contiguous()
    return (a, b, torch.tensor(spans, dtype=torch.int64)), pieces


def plain_updates(y, x, rows, pieces_by_adapter):
    """The oracle: for each adapter, its rows' x A^T B^T added to each piece's columns, float64."""
    out = y.double().clone()
    for index, pieces in enumerate(pieces_by_adapter):
        mine = (rows == index).nonzero().squeeze(1)
        for first, a, b in pieces:
            out[mine, first : first + b.shape[0]] += x[mine].double() @ a.double().t() @ b.double().t()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 4, 9, 33])
def test_the_kernel_and_the_reference_add_each_rows_own_adapter(kernels, dtype, num_rows):
    """Rows of three adapters (all pieces, a gap, one whole projection), of one that does not adapt this
    projection, and of the base, interleaved: each row gets its own adapter's update and no other."""
    gen = torch.Generator().manual_seed(num_rows)
    made = [adapter(SPANS[kind], rank, dtype, gen) for kind, rank in (("qkv", 8), ("qv", 4), ("whole", 16))]
    weights = [t for operands, _ in made for t in operands] + [None, None, None]
    rows = torch.randint(-1, 4, (num_rows,), generator=gen, dtype=torch.int64)
    rows[0] = 0
    x = torch.randn(num_rows, IN, generator=gen).to(dtype)
    y = torch.randn(num_rows, OUT, generator=gen).to(dtype)
    expected = plain_updates(y, x.float(), rows, [pieces for _, pieces in made] + [[]])
    by_kernel, by_reference = y.clone(), y.clone()
    cpu.lora_add(by_kernel, x, rows, weights)
    reference.lora_add(by_reference, x, rows, weights)
    untouched = rows >= 3
    assert torch.equal(by_kernel[untouched], y[untouched])
    assert torch.equal(by_reference[untouched], y[untouched])
    assert not torch.equal(by_kernel[rows == 0], y[rows == 0])
    # bf16: the operands are rounded, and y once more after the float32 update
    tolerance = {"atol": 0.25, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-5}
    if dtype == torch.bfloat16:
        expected = plain_updates(y, x.float(), rows, [_rounded(p) for _, p in made] + [[]])
    torch.testing.assert_close(by_kernel.double(), expected, **tolerance)
    torch.testing.assert_close(by_reference.double(), expected, **tolerance)


def _rounded(pieces):
    return [(first, a.bfloat16().float(), b.bfloat16().float()) for first, a, b in pieces]


def test_a_row_is_the_same_whatever_rows_share_its_step(kernels):
    """Tiles of four rows and threads split the work; a row's bits must not depend on its neighbours."""
    gen = torch.Generator().manual_seed(5)
    (operands, _), rows = adapter(SPANS["qkv"], 8, torch.float32, gen), torch.zeros(13, dtype=torch.int64)
    x, y = torch.randn(13, IN, generator=gen), torch.randn(13, OUT, generator=gen)
    together = y.clone()
    cpu.lora_add(together, x, rows, list(operands))
    for i in range(13):
        alone = y[i : i + 1].clone()
        cpu.lora_add(alone, x[i : i + 1], rows[:1], list(operands))
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda w, r: (w[:2], r), "weights must hold"),
        (lambda w, r: ([w[0].t().contiguous(), *w[1:]], r), "a must be a contiguous"),
        (lambda w, r: ([w[0], w[1][:, :-1].contiguous(), w[2]], r), "spans cover"),
        (lambda w, r: ([w[0], w[1], torch.tensor([[30, 24], [24, 8], [32, 8]])], r), "outside y's"),
        (lambda w, r: (w, r + 1), "names adapter 1"),
    ],
)
def test_bad_operands_are_refused_naming_what_is_wrong(kernels, break_it, message):
    gen = torch.Generator().manual_seed(9)
    (operands, _), rows = adapter(SPANS["qkv"], 8, torch.float32, gen), torch.zeros(2, dtype=torch.int64)
    weights, rows = break_it(list(operands), rows)
    with pytest.raises(RuntimeError, match=message):
        cpu.lora_add(torch.zeros(2, OUT), torch.zeros(2, IN), rows, weights)
