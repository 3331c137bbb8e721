"""One step's token constraints: a bitmask filled on the host, applied to logits on the device.

Row i of the bitmask belongs to the step's i-th sampled row; bit j of 32-bit word w allows token
32 * w + j (the layout llguidance and xgrammar fill). An unconstrained row is all ones. The
bitmask is 1/32 of a float32 logits row, so it goes to the device in one small copy and is
expanded there (through a 256 x 8 table: byte value -> its 8 bits) into the boolean mask that
sets every other logit to -inf. On a CPU a C kernel (vacpack/cpu_kernels/token_mask.c) writes
the -inf in place instead, touching only forbidden logits: the dense expansion and masked_fill
cost about as much as the step's argmax over G1's 64 x 151,936 logits.

With async scheduling a step can be launched before its bitmask is filled: the masks of step
N+1 depend on the tokens step N samples, which the host reads while the device runs step N+1's
forward. The device work then waits in `wait()` between the forward and the sampling, and the
host fills the bitmask as soon as it has accepted step N's tokens (see manager.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.token_mask import apply_token_bitmask_, token_mask_supported

# A device step never waits longer than this for its masks: only a host that died between
# launching a step and filling its masks would make it, and then the step fails loudly.
MASK_WAIT_TIMEOUT_S = 300.0


def bitmask_num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bit_table(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: row b holds the bits of byte b, least significant first."""
    return ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool().to(device)


@dataclass(frozen=True)
class LogitBias:
    """Additive biases as three parallel lists: (row, token id, value)."""

    rows: list[int]
    token_ids: list[int]
    values: list[float]


class StepTokenMasks:
    """The masks and biases for one step's sampled rows."""

    def __init__(
        self,
        num_rows: int,
        vocab_size: int,
        masked_rows: list[int],
        bias: LogitBias | None,
        pin: bool,
    ) -> None:
        self.vocab_size = vocab_size
        self.masked_rows = masked_rows  # rows with a mask to fill; the others allow everything
        self.bias = bias
        self.bitmask: torch.Tensor | None = None
        if masked_rows:
            shape = (num_rows, bitmask_num_words(vocab_size))
            self.bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
        self._filled = threading.Event()
        self.fill_start_s = 0.0  # host perf_counter clock; both 0 until filled
        self.fill_end_s = 0.0

    @property
    def is_filled(self) -> bool:
        return self._filled.is_set()

    def mark_filled(self, fill_start_s: float) -> None:
        self.fill_start_s = fill_start_s
        self.fill_end_s = time.perf_counter()
        self._filled.set()

    def wait(self) -> None:
        """Blocks until the host has filled the bitmask (at once when it already has)."""
        if not self._filled.wait(MASK_WAIT_TIMEOUT_S):
            raise RuntimeError(
                f"a step's token masks were not filled within {MASK_WAIT_TIMEOUT_S} s"
            )

    def apply_mask(self, logits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Logits with every token the bitmask forbids at -inf, same dtype: on a CPU these very
        logits, changed in place; elsewhere a new tensor."""
        if self.bitmask is None:
            return logits
        if token_mask_supported(logits):
            apply_token_bitmask_(logits, self.bitmask)
            return logits
        pin = logits.device.type == "cuda"
        bitmask = self.bitmask.to(logits.device, non_blocking=pin)
        num_rows = bitmask.shape[0]
        allowed = table[bitmask.view(torch.uint8).long()].view(num_rows, -1)
        # A model's vocabulary may be padded past the tokenizer's: the mask covers the logits.
        allowed = allowed[:, : logits.shape[1]]
        return logits.masked_fill(~allowed, float("-inf"))

    def apply_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits plus the biases (float32 logits; a new tensor)."""
        if self.bias is None:
            return logits
        bias = self.bias
        index = torch.tensor([bias.rows, bias.token_ids], dtype=torch.int64).to(logits.device)
        values = torch.tensor(bias.values, dtype=logits.dtype).to(logits.device)
        return logits.index_put((index[0], index[1]), values, accumulate=True)
