"""Log-probabilities of given tokens, with each row's log-sum-exp, the tokens' ranks and each
row's argmax where asked, straight from [rows, vocab] CPU logits (token_logprobs.c): one read
of each row instead of a log-softmax written whole, a gather, a rank count and an argmax.
float32 or bf16 logits, any CPU with a C compiler."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function

LIBRARY = "token_logprobs"
PROFILER_NAME = "vacpack::token_logprobs"
_FUNCTIONS = {torch.float32: "token_logprobs_f32", torch.bfloat16: "token_logprobs_bf16"}
# logits, rows, vocab, row stride, targets, then the outputs (logprobs, logsumexp, ranks,
# argmax: NULL for those not wanted), threads
_ARGTYPES = [ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 5, ctypes.c_int]


@dataclass(frozen=True)
class RowScores:
    """Per row of the logits, on the host; None where not asked for."""

    logprobs: torch.Tensor  # [rows] float32: log_softmax(row)[target]
    logsumexp: torch.Tensor | None  # [rows] float32: the row's log-softmax is row - this
    ranks: torch.Tensor | None  # [rows] int64: logits >= the target's, the target included
    argmax: torch.Tensor | None  # [rows] int64: the first index of the row's maximum


def _kernel(dtype: torch.dtype) -> KernelFunction | None:
    function = _FUNCTIONS.get(dtype)
    if function is None:
        return None
    return kernel_function(LIBRARY, function, _ARGTYPES, portable=True)


def token_logprobs_supported(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dim() == 2 and _kernel(logits.dtype) is not None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_logsumexp: bool = False,
    with_ranks: bool = False,
    with_argmax: bool = False,
) -> RowScores:
    """log_softmax(logits.float(), -1)[i, targets[i]] for every row i, and what else is asked.
    A row holding a NaN, or whose maximum is infinite, scores NaN and ranks 0, as torch's
    log-softmax makes it."""
    kernel = _kernel(logits.dtype)
    if kernel is None or not token_logprobs_supported(logits):
        raise RuntimeError("token_logprobs needs a 2-D float32 or bf16 CPU tensor and its kernel")
    num_rows, vocab = logits.shape
    if targets.shape != (num_rows,):
        raise ValueError(f"targets {tuple(targets.shape)} for {num_rows} rows")
    targets = targets.to(device="cpu", dtype=torch.int64).contiguous()
    if num_rows and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"a target is outside the vocabulary of {vocab}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()

    def output(wanted: bool, dtype: torch.dtype) -> torch.Tensor | None:
        return torch.empty(num_rows, dtype=dtype) if wanted else None

    scores = RowScores(
        torch.empty(num_rows, dtype=torch.float32),
        output(with_logsumexp, torch.float32),
        output(with_ranks, torch.int64),
        output(with_argmax, torch.int64),
    )
    if num_rows:
        # Named for torch.profiler, which cannot see into a ctypes call otherwise.
        with torch.profiler.record_function(PROFILER_NAME):
            kernel(
                logits.data_ptr(),
                num_rows,
                vocab,
                logits.stride(0),
                targets.data_ptr(),
                *(
                    None if tensor is None else tensor.data_ptr()
                    for tensor in (scores.logprobs, scores.logsumexp, scores.ranks, scores.argmax)
                ),
                torch.get_num_threads(),
            )
    return scores
