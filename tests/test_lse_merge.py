"""A cascade's merge in C (cpu_kernels/lse_merge.c): a shared prefix's attention merged into a
step's rows in place computes what merge_by_lse computes between gathers, in bf16 and float32,
for any rows in any order, and leaves every other row alone."""

from __future__ import annotations

import pytest
import torch
from bf16_kernel_marks import EMULATED

from vacpack.attention import cascade
from vacpack.attention.cascade import merge_by_lse, merge_prefix_into
from vacpack.cpu_kernels.lse_merge import lse_merge_supported, merge_rows_by_lse_


@EMULATED  # a portable kernel: any CPU with a C compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_the_merge_in_c_computes_what_merge_by_lse_computes(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    out = torch.randn(40, 6, 32, generator=generator).to(dtype)
    assert lse_merge_supported(out, out)
    # Log-sum-exps far apart too: either side may carry all of the weight.
    lse = torch.randn(40, 6, generator=generator) * 30
    rows = torch.tensor([17, 3, 39, 0, 22])
    prefix_out = torch.randn(5, 6, 32, generator=generator).to(dtype)
    prefix_lse = torch.randn(5, 6, generator=generator) * 30
    expected = out.clone()
    expected[rows] = merge_by_lse(prefix_out, prefix_lse, out[rows], lse[rows])
    merge_rows_by_lse_(out, lse, rows, prefix_out, prefix_lse)
    tolerance = {torch.bfloat16: 1e-2, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(out[untouched], expected[untouched])


def test_a_cascade_merges_the_same_without_the_c_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(1)
    out = torch.randn(12, 4, 64, generator=generator).bfloat16()
    lse = torch.randn(12, 4, generator=generator)
    rows = torch.tensor([5, 6, 7, 1])
    prefix_out = torch.randn(4, 4, 64, generator=generator).bfloat16()
    prefix_lse = torch.randn(4, 4, generator=generator)
    in_c = merge_prefix_into(out.clone(), lse, rows, prefix_out, prefix_lse)
    monkeypatch.setattr(cascade, "lse_merge_supported", lambda *args: False)
    in_torch = merge_prefix_into(out.clone(), lse, rows, prefix_out, prefix_lse)
    torch.testing.assert_close(in_c.float(), in_torch.float(), atol=1e-2, rtol=1e-2)


@EMULATED
def test_the_merge_refuses_prefix_rows_that_do_not_match() -> None:
    out = torch.zeros(8, 2, 32)
    with pytest.raises(ValueError, match="prefix rows"):
        merge_rows_by_lse_(
            out, torch.zeros(8, 2), torch.tensor([1, 2]), torch.zeros(3, 2, 32), torch.zeros(3, 2)
        )
