"""Log-probabilities of given tokens, with each row's log-sum-exp, the tokens' ranks, each row's
argmax and its top-k logprobs where asked, straight from [rows, vocab] CPU logits
(token_logprobs.c): one read of each row instead of a log-softmax written whole, a gather, a
rank count, an argmax and a top-k. float32 or bf16 logits, any CPU with a C compiler."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.profiler_range import profiler_range

LIBRARY = "token_logprobs"
PROFILER_NAME = "vacpack::token_logprobs"
_FUNCTIONS = {torch.float32: "token_logprobs_f32", torch.bfloat16: "token_logprobs_bf16"}
# logits, rows, vocab, row stride, targets, then the outputs (logprobs, logsumexp, ranks,
# argmax: NULL for those not wanted), top k, top-k logprobs and ids, threads
_ARGTYPES = [
    ctypes.c_void_p,
    *[ctypes.c_int64] * 3,
    *[ctypes.c_void_p] * 5,
    ctypes.c_int64,
    *[ctypes.c_void_p] * 2,
    ctypes.c_int,
]


@dataclass(frozen=True)
class RowScores:
    """Per row of the logits, on the host; None where not asked for."""

    logprobs: torch.Tensor  # [rows] float32: log_softmax(row)[target]
    logsumexp: torch.Tensor | None  # [rows] float32: the row's log-softmax is row - this
    ranks: torch.Tensor | None  # [rows] int64: logits >= the target's, the target included
    argmax: torch.Tensor | None  # [rows] int64: the first index of the row's maximum
    # [rows, top_k] float32 and int64: the row's largest logprobs, best first (equal ones in
    # token order), and their token ids
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor


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
    top_k: int = 0,
) -> RowScores:
    """log_softmax(logits.float(), -1)[i, targets[i]] for every row i, and what else is asked.
    A row holding a NaN, or whose maximum is infinite, scores NaN and ranks 0, as torch's
    log-softmax makes it; a row holding a NaN has its top k from torch.topk (NaN first)."""
    kernel = _kernel(logits.dtype)
    if kernel is None or not token_logprobs_supported(logits):
        raise RuntimeError("token_logprobs needs a 2-D float32 or bf16 CPU tensor and its kernel")
    num_rows, vocab = logits.shape
    if targets.shape != (num_rows,):
        raise ValueError(f"targets {tuple(targets.shape)} for {num_rows} rows")
    targets = targets.to(device="cpu", dtype=torch.int64).contiguous()
    if num_rows and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"a target is outside the vocabulary of {vocab}")
    if not 0 <= top_k <= vocab:
        raise ValueError(f"top_k {top_k} is not within the vocabulary of {vocab}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()

    def output(wanted: bool, dtype: torch.dtype) -> torch.Tensor | None:
        return torch.empty(num_rows, dtype=dtype) if wanted else None

    scores = RowScores(
        torch.empty(num_rows, dtype=torch.float32),
        output(with_logsumexp, torch.float32),
        output(with_ranks, torch.int64),
        output(with_argmax, torch.int64),
        torch.empty(num_rows, top_k, dtype=torch.float32),
        torch.empty(num_rows, top_k, dtype=torch.int64),
    )
    if num_rows:
        with profiler_range(PROFILER_NAME):
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
                top_k,
                scores.top_logprobs.data_ptr(),
                scores.top_ids.data_ptr(),
                torch.get_num_threads(),
            )
        if top_k:
            _top_k_of_rows_with_nan(logits, scores)
    return scores


def _top_k_of_rows_with_nan(logits: torch.Tensor, scores: RowScores) -> None:
    """The kernel stops at a row's first NaN; those rows' top k as torch's log-softmax gives
    them (all NaN, NaN's indices first)."""
    # Such rows score NaN (so do rows whose maximum is infinite): only those are searched.
    rows = torch.isnan(scores.logprobs).nonzero().flatten()
    rows = rows[torch.isnan(logits[rows]).any(dim=1)]
    if rows.numel():
        top_logprobs, top_ids = torch.log_softmax(logits[rows].float(), dim=-1).topk(
            scores.top_ids.shape[1], dim=1
        )
        scores.top_logprobs[rows] = top_logprobs
        scores.top_ids[rows] = top_ids
