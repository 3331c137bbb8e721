"""Token bitmasks: the CPU kernel against the dense PyTorch expansion, and the token lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vacpack.cpu_kernels.token_mask import apply_token_bitmask_, token_mask_supported
from vacpack.structured.constraints import allowed_tokens_mask
from vacpack.structured.token_masks import bit_table, bitmask_num_words


def _dense_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    table = bit_table(torch.device("cpu"))
    allowed = table[bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)
    return logits.masked_fill(~allowed[:, : logits.shape[1]], float("-inf"))


@pytest.mark.skipif(
    not token_mask_supported(torch.zeros(1, 32)), reason="no C compiler (or kernels turned off)"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab_size", [2048, 1000, 151936])
def test_kernel_matches_the_dense_mask(dtype: torch.dtype, vocab_size: int) -> None:
    generator = torch.Generator().manual_seed(vocab_size)
    num_rows = 6
    shape = (num_rows, bitmask_num_words(vocab_size))
    bitmask = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=generator)
    bitmask[0] = -1  # all allowed
    bitmask[1] = 0  # all banned
    bitmask[2, ::2] = 0
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(dtype)
    expected = _dense_reference(logits, bitmask)
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)


def test_allowed_and_banned_tokens_as_a_bitmask() -> None:
    vocab_size = 100
    words = allowed_tokens_mask(vocab_size, [3, 40, 99], banned_token_ids=[40])
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [3, 99]
    only_banned = allowed_tokens_mask(vocab_size, None, banned_token_ids=[0, 64])
    bits = np.unpackbits(only_banned.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits[:vocab_size] == 0).tolist() == [0, 64]
    assert not bits[vocab_size:].any()  # padding past the vocabulary allows nothing
    assert allowed_tokens_mask(vocab_size, None, []) is None
