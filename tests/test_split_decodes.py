"""Split-K in the bf16 varlen kernel: where a call has too few tasks for the threads (a few long
decodes), each decode's keys are split over several tasks whose partial results merge by their
log-sum-exps. With two threads and a lone decode on 2 KV heads the policy wants 4 tasks per
thread (split_policy.h), so a decode of 3,000 keys runs as 4 splits of 768 per KV head; the
results must equal float32 attention over all the keys, log-sum-exps included, from either key
layout, with prefill chunks and short decodes in the same call left whole, and whatever order
the kernel runs its tasks in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from asan_build import VARLEN_BF16_PRELUDE, worst_difference_under_asan
from bf16_kernel_marks import ON_AVX512_BF16
from test_cpu_kernels import _cu, _random, _reference

from vacpack.cpu_kernels import paged_sequences
from vacpack.cpu_kernels.attention import attend_with_lse
from vacpack.cpu_kernels.packed_keys import pack_keys

PAGE_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


def _paged_step(query_lens: list[int], context_lens: list[int], seed: int) -> dict:
    """Sequences whose pages are scattered through a cache, with their float32 attention."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // PAGE_SIZE) for n in context_lens]
    num_pages = sum(pages_per_seq)
    order = torch.randperm(num_pages, generator=generator).tolist()
    tables = [order[sum(pages_per_seq[:i]) :][:n] for i, n in enumerate(pages_per_seq)]
    table = torch.zeros(len(tables), max(pages_per_seq), dtype=torch.int64)
    for row, pages in enumerate(tables):
        table[row, : len(pages)] = torch.tensor(pages)
    keys = _random(num_pages * PAGE_SIZE, KV_HEADS, HEAD_DIM, generator)
    values = _random(num_pages * PAGE_SIZE, KV_HEADS, HEAD_DIM, generator)
    q = _random(sum(query_lens), HEADS, HEAD_DIM, generator)
    slots = torch.cat(
        [
            (torch.tensor(pages)[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()[:n]
            for pages, n in zip(tables, context_lens, strict=True)
        ]
    )
    seen_keys, seen_values = keys[slots], values[slots]
    expected = _reference(q, seen_keys, seen_values, query_lens, context_lens, causal=True)
    sequences = paged_sequences(_cu(query_lens), torch.tensor(context_lens), table, PAGE_SIZE)
    return {
        "q": q,
        "keys": keys,
        "values": values,
        "sequences": sequences,
        "expected": expected,
        "expected_lse": _reference_lse(q, seen_keys, query_lens, context_lens),
    }


def _reference_lse(
    q: torch.Tensor, keys: torch.Tensor, query_lens: list[int], context_lens: list[int]
) -> torch.Tensor:
    """Each row's float32 log-sum-exp of its scaled, causally visible scores."""
    rows, start_q, start_k = [], 0, 0
    group = HEADS // KV_HEADS
    for n_q, n_k in zip(query_lens, context_lens, strict=True):
        queries = q[start_q : start_q + n_q].float()
        seen = keys[start_k : start_k + n_k].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->qhk", queries, seen) * HEAD_DIM**-0.5
        visible = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        rows.append(torch.logsumexp(scores, dim=-1))
        start_q, start_k = start_q + n_q, start_k + n_k
    return torch.cat(rows)


CASES = {
    "a lone long decode": ([1], [3000]),
    "a long decode beside a short one": ([1, 1], [5000, 20]),
    "decodes beside a prefill chunk over cached pages": ([1, 40, 1], [2100, 700, 1]),
    # Too many tasks to split, in an order the kernel changes: it runs them by size class,
    # largest first (varlen_tasks.h, order_by_work), the prefill chunk's among the decodes'.
    "decodes of many lengths in mixed order": (
        [1] * 9 + [33] + [1] * 9,
        [(index * 397) % 1500 + 1 for index in range(9)] + [530] + [3, 1200, 64, 17] * 2 + [1],
    ),
}


@ON_AVX512_BF16
@pytest.mark.parametrize("keys_packed", [False, True], ids=["token-rows", "packed-keys"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_split_decodes_equal_attention_over_all_their_keys(
    case: str, keys_packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the policy's thread count
    step = _paged_step(*CASES[case], seed=len(case))
    keys = pack_keys(step["keys"], PAGE_SIZE) if keys_packed else step["keys"]
    out, lse = attend_with_lse(
        step["q"], keys, step["values"], step["sequences"], keys_packed=keys_packed
    )
    torch.testing.assert_close(out.float(), step["expected"], atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, step["expected_lse"], atol=2e-2, rtol=0)


ASAN_SCRIPT = (
    VARLEN_BF16_PRELUDE
    + """
from vacpack.cpu_kernels.packed_keys import pack_keys
import test_split_decodes as cases

worst = 0.0
for index, (query_lens, context_lens) in enumerate(cases.CASES.values()):
    step = cases._paged_step(query_lens, context_lens, seed=index)
    for packed in (False, True):
        keys = pack_keys(step["keys"], cases.PAGE_SIZE) if packed else step["keys"]
        out, lse = attention.attend_with_lse(
            step["q"], keys, step["values"], step["sequences"], keys_packed=packed
        )
        worst = max(worst, float((out.float() - step["expected"]).abs().max()))
        worst = max(worst, float((lse - step["expected_lse"]).abs().max()))
print("worst difference", worst)
"""
)


@ON_AVX512_BF16
def test_split_decodes_stay_inside_their_buffers(tmp_path: Path) -> None:
    """The kernel built with AddressSanitizer on the cases above: the splits' partial results,
    their merges and the shifted page tables stay inside the memory they were given."""
    worst = worst_difference_under_asan(tmp_path, "varlen_attention", "VACPACK_ASAN", ASAN_SCRIPT)
    assert worst < 2e-2
