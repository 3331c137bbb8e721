"""Decode attention over paged keys and values: plain batched matmuls, SDPA, or a C kernel.

A decode has one query token, so each KV head meets only its few grouped query heads (7 for
Qwen2.5-0.5B). Four ways to run that shape (DECODE_FORMS), and none wins on every CPU:
- "matmuls": plain batched matmuls around a softmax over the gathered keys (scores by
  `baddbmm` to float32 precision, softmax in float32, probabilities times values by `bmm` in
  the cache's dtype), measured several times faster than torch's SDPA kernel on a Zen 4 with
  AVX512-BF16;
- "sdpa": SDPA over the gathered keys, whose fused kernel measured 3x (float32) to 15x
  (bfloat16) faster than the matmuls on a Zen 3 without AVX-512, where bf16 matmuls are
  emulated;
- "kernel" and "kernel_lanes": vacpack/cpu_kernels/paged_decode.c, which reads each key and
  value once from its page, with no gather, vectorised for the CPU it was built on; where it
  builds. Its two forms keep a KV head's grouped query heads apart (dot products along
  head_dim) or in vector lanes (no horizontal sums; idle lanes where a group has fewer than
  eight heads);
- "kernel_bf16" and "kernel_amx", for bf16 models: the same reads with both products on the
  bf16 dot-product instruction, heads in lanes (paged_decode_bf16.c, x86 with AVX512-BF16), or
  on AMX tiles (paged_decode_amx.c, x86 with AMX).
So the backend's decode form is measured at the model's shapes (attention/selection.py). The
matmuls stay where scores are soft-capped, and stand in for SDPA where a cascade needs the
log-sum-exp (the kernel returns one).

Decodes run in chunks, longest context first, each padded to its longest member and capped at
a budget of padded key tokens: a chunk's gathered keys and values stay in the CPU's caches
between the gather and the matmuls that read them, and sorting keeps the padding small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from vacpack.attention.backend import FULL_ATTENTION, AttentionSpec
from vacpack.attention.page_tables import padded_page_table
from vacpack.cpu_kernels.paged_decode import paged_decode_attention, paged_decode_supported
from vacpack.kvcache.paged_cache import KVLayer

DECODE_FORMS = ("matmuls", "sdpa", "kernel", "kernel_lanes", "kernel_bf16", "kernel_amx")


@dataclass(frozen=True)
class KernelForm:
    """How a decode form calls the C kernels (paged_decode_attention's arguments)."""

    heads_in_lanes: bool
    # A bf16-only implementation (cpu_kernels.paged_decode.BF16_DECODE_KERNELS), else the
    # portable kernel.
    bf16_kernel: str | None = None


KERNEL_FORMS = {
    "kernel": KernelForm(heads_in_lanes=False),
    "kernel_lanes": KernelForm(heads_in_lanes=True),
    "kernel_bf16": KernelForm(heads_in_lanes=True, bf16_kernel="avx512_bf16"),
    "kernel_amx": KernelForm(heads_in_lanes=False, bf16_kernel="amx"),
}


def kernel_form_supported(
    form: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> bool:
    """Whether the C kernel form `form` runs these decodes here."""
    return form in KERNEL_FORMS and paged_decode_supported(
        device, dtype, num_heads, num_kv_heads, head_dim, KERNEL_FORMS[form].bf16_kernel
    )


# Padded key tokens per chunk. A 2-KV-head, 64-dim bf16 token is 256 bytes of keys and as much
# of values, so 8,192 tokens gather 4 MiB, which the matmuls then read from cache. On the 2-core
# CPU this was tuned on (bench/decode_attention.py's batches, one thread), 4,096 and 8,192 ran
# within 7% of each other, 16,384 up to 25% and 32,768 up to 2x slower: smaller chunks cost
# more kernel launches than the cache misses they save.
DECODE_CHUNK_KEY_TOKENS = 8192


@dataclass(frozen=True)
class KeyPadding:
    """Which of a padded batch's keys no row may see: padding past a member's own keys, and,
    with a sliding window, the leading keys of its first page that fall before the window. Keys
    before `first_padded_key` are seen by every member, so the mask covers only those after."""

    first_padded_key: int  # the shortest member's number of keys, or 0 with hidden leading keys
    mask: torch.Tensor  # [seqs, 1, num_keys - first_padded_key] True where hidden


@dataclass(frozen=True)
class DecodeChunk:
    """Decodes attended together: their keys gathered into one padded batch, or read in place
    by the C kernel."""

    rows: torch.Tensor  # [seqs] stream rows of the chunk's query tokens
    pages: torch.Tensor  # [seqs * pages per seq] page ids, row-major, padded with page 0
    num_keys: int  # the longest member's keys, in tokens; the others are padded to it
    padding: KeyPadding | None  # None when all members have num_keys keys (or no masks built)
    # SDPA's form of the padding: [seqs, 1, 1, num_keys], True where a row sees the key.
    visible: torch.Tensor | None = None
    # The C kernel's: [seqs, 2] int64, each member's first visible key and its number of keys.
    key_ranges: torch.Tensor | None = None
    # False for a chunk built for the C kernel alone, which reads key_ranges: `with_masks`
    # builds padding and visible when a layer the kernel cannot run needs them.
    has_masks: bool = True

    def with_masks(self) -> DecodeChunk:
        """This chunk with its padding masks, built from key_ranges where they were not."""
        if self.has_masks:
            return self
        assert self.key_ranges is not None, "a chunk without masks has key ranges"
        hidden_keys, num_keys = self.key_ranges.cpu().T.tolist()
        padding, visible = _padding_masks(num_keys, hidden_keys, self.rows.device)
        return replace(self, padding=padding, visible=visible, has_masks=True)


def plan_chunks(
    num_keys: Sequence[int], budget_tokens: int = DECODE_CHUNK_KEY_TOKENS
) -> list[list[int]]:
    """Indices longest first, cut into chunks whose padded keys (members times the longest)
    fit in budget_tokens; a chunk holds at least one member."""
    order = sorted(range(len(num_keys)), key=lambda i: -num_keys[i])
    chunks: list[list[int]] = []
    for index in order:
        chunk = chunks[-1] if chunks else None
        if chunk is not None and (len(chunk) + 1) * num_keys[chunk[0]] <= budget_tokens:
            chunk.append(index)
        else:
            chunks.append([index])
    return chunks


def build_chunks(
    rows: Sequence[int],
    page_runs: Sequence[Sequence[int]],
    num_keys: Sequence[int],
    page_size: int,
    device: torch.device,
    form: str,
    num_hidden_keys: Sequence[int] | None = None,
) -> tuple[DecodeChunk, ...]:
    """The chunks that decode i (stream row rows[i], attending to the first num_keys[i] tokens
    of page_runs[i], less the first num_hidden_keys[i]) runs in, for a decode form.

    The C kernel reads every member's pages in place and spreads its work over the threads
    itself, so all decodes are one chunk, longest first for its dynamic schedule, without the
    padding masks: one kernel call per layer, and a step's metadata for 256 decodes in a
    fraction of the host time (19 chunks with masks took 3.8 ms on a 2-core EPYC). The other
    forms gather each chunk's keys into a padded batch, so chunks are cut to a budget of padded
    keys (plan_chunks)."""
    hidden = num_hidden_keys if num_hidden_keys is not None else [0] * len(num_keys)
    if form in KERNEL_FORMS:
        plans = [sorted(range(len(num_keys)), key=lambda i: -num_keys[i])] if num_keys else []
    else:
        plans = plan_chunks(num_keys)
    return tuple(
        build_chunk(
            [rows[i] for i in members],
            [page_runs[i] for i in members],
            [num_keys[i] for i in members],
            page_size,
            device,
            [hidden[i] for i in members],
            masks=form not in KERNEL_FORMS,
        )
        for members in plans
    )


def build_chunk(
    rows: Sequence[int],
    page_runs: Sequence[Sequence[int]],
    num_keys: Sequence[int],
    page_size: int,
    device: torch.device,
    num_hidden_keys: Sequence[int] | None = None,
    masks: bool = True,
) -> DecodeChunk:
    """A chunk of decodes: row i attends to the first num_keys[i] tokens of page_runs[i], less
    the first num_hidden_keys[i] of them (those before its sliding window). masks=False leaves
    the padding masks out (the C kernel reads key_ranges instead; see DecodeChunk.with_masks)."""
    hidden_keys = num_hidden_keys if num_hidden_keys is not None else [0] * len(num_keys)
    used = [run[: -(-count // page_size)] for run, count in zip(page_runs, num_keys, strict=True)]
    padding = visible = None
    if masks:
        padding, visible = _padding_masks(num_keys, hidden_keys, device)
    key_ranges = torch.tensor([hidden_keys, num_keys], dtype=torch.int64).T.contiguous()
    return DecodeChunk(
        rows=torch.tensor(rows, dtype=torch.int64).to(device),
        pages=padded_page_table(used, fill_page=0, dtype=torch.int64).flatten().to(device),
        num_keys=max(num_keys),
        padding=padding,
        visible=visible,
        key_ranges=key_ranges.to(device),
        has_masks=masks,
    )


def _padding_masks(
    num_keys: Sequence[int], num_hidden_keys: Sequence[int], device: torch.device
) -> tuple[KeyPadding | None, torch.Tensor | None]:
    """The padding of decodes gathered to the longest of num_keys, less each one's hidden
    leading keys, as attend's KeyPadding and SDPA's visible mask; (None, None) when every
    member sees all of the padded keys."""
    longest, shortest = max(num_keys), min(num_keys)
    hides_leading = max(num_hidden_keys) > 0
    if shortest == longest and not hides_leading:
        return None, None
    first = 0 if hides_leading else shortest
    positions = torch.arange(first, longest)
    mask = positions >= torch.tensor(num_keys).unsqueeze(1)
    if hides_leading:
        mask |= positions < torch.tensor(num_hidden_keys).unsqueeze(1)
    padding = KeyPadding(first, mask.unsqueeze(1).to(device))
    hidden = torch.cat([torch.zeros(len(num_keys), first, dtype=torch.bool), mask], dim=1)
    visible = hidden.logical_not_().view(len(num_keys), 1, 1, longest).to(device)
    return padding, visible


def gather_pages(
    cache: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    num_seqs: int,
    num_keys: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[seqs, kv_heads, num_keys, head_dim], contiguous, in `dtype` (the attention's, which a
    cache kept in bf16 under float32 arithmetic is widened to), from whole pages of a layer's
    cache.

    Each head's keys end up contiguous, the layout the score matmul reads fastest; gathering
    whole pages and transposing once measured faster than gathering one head at a time.
    """
    paged = cache.view(-1, page_size, *cache.shape[1:])
    gathered = paged.index_select(0, pages).view(num_seqs, -1, *cache.shape[1:])
    transposed = gathered[:, :num_keys].transpose(1, 2)
    if dtype == cache.dtype:
        return transposed.contiguous()
    # Transposed and widened in one copy.
    return torch.empty(transposed.shape, dtype=dtype, device=cache.device).copy_(transposed)


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    padding: KeyPadding | None = None,
    with_lse: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention, batch by batch: queries [batch, rows, dim] against keys and values
    [batch, num_keys, dim]. Returns [batch, rows, dim] and, when asked, each row's log-sum-exp
    of its scaled scores in float32, [batch, rows].

    padding, when given, marks keys no row may see; its mask broadcasts against the scores
    viewed as [mask.shape[0], -1, num_keys]. Every row must keep at least one key. scale is
    the factor on the scores (default head_dim ** -0.5); softcap, when given, squashes them
    to softcap * tanh(score / softcap) before the softmax.
    """
    scores = _scores(queries, keys, scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if padding is not None:
        by_seq = scores.view(padding.mask.shape[0], -1, keys.shape[1])
        by_seq[..., padding.first_padded_key :].masked_fill_(padding.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    lse = None
    if with_lse:
        # The largest probability is exp(max score - lse): two max passes instead of torch's
        # unfused logsumexp.
        lse = scores.amax(dim=-1) - torch.log(probs.amax(dim=-1))
    # Probabilities meet the values in their dtype, as in SDPA's own CPU kernel.
    return torch.bmm(probs.to(values.dtype), values), lse


def _scores(queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Scaled scores [batch, rows, num_keys] in float32.

    A bf16 matmul accumulates in float32 but rounds its output to 8 bits, an error of up to
    |score| / 512, several percent of a weight once scores reach tens. So a second matmul
    computes what that rounding lost (the subtraction happens before its own rounding), and
    the two sum to within |score| / 2**17: float32 precision where it matters, for the cost of
    reading the keys twice from cache, measured cheaper than converting them to float32.
    """
    batch, num_rows, head_dim = queries.shape
    keys_t = keys.transpose(1, 2)
    scale = head_dim**-0.5 if scale is None else scale
    scores = torch.baddbmm(
        queries.new_empty(batch, num_rows, keys.shape[1]), queries, keys_t, beta=0.0, alpha=scale
    )
    if scores.dtype == torch.float32:
        return scores
    lost = torch.baddbmm(scores, queries, keys_t, beta=-1.0, alpha=scale)
    # Both converted first: an add mixing bf16 into float32 runs unvectorised, 2.5x slower.
    return scores.float().add_(lost.float())


def chunk_attention(
    q: torch.Tensor,
    kv_layer: KVLayer,
    chunk: DecodeChunk,
    with_lse: bool = False,
    spec: AttentionSpec = FULL_ATTENTION,
    form: str = "matmuls",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [seqs, heads, head_dim], the chunk's query rows. Returns the attention output shaped
    like q and, when asked, the float32 log-sum-exp of each head's scores, [seqs, heads]. The
    chunk's keys are already cut to each row's sliding window; spec gives scale and softcap.
    `form` (one of DECODE_FORMS) runs the C kernel instead of the matmuls where it can (no
    softcap), SDPA where it can (no softcap, no log-sum-exp asked for)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.num_kv_heads
    page_size = kv_layer.page_size
    if form in KERNEL_FORMS and spec.logit_softcap is None:
        assert chunk.key_ranges is not None, "built by build_chunk"
        return paged_decode_attention(
            q,
            kv_layer.key_rows(),
            kv_layer.values,
            chunk.pages.view(num_seqs, -1),
            chunk.key_ranges,
            page_size,
            spec.scale_for(head_dim),
            with_lse,
            heads_in_lanes=KERNEL_FORMS[form].heads_in_lanes,
            bf16_kernel=KERNEL_FORMS[form].bf16_kernel,
        )
    chunk = chunk.with_masks()
    keys = gather_pages(
        kv_layer.key_rows(), chunk.pages, page_size, num_seqs, chunk.num_keys, q.dtype
    )
    values = gather_pages(
        kv_layer.values, chunk.pages, page_size, num_seqs, chunk.num_keys, q.dtype
    )
    if form == "sdpa" and not with_lse and spec.logit_softcap is None:
        # Each KV head's grouped query heads are its query block: [seqs, kv_heads, group, dim].
        out = F.scaled_dot_product_attention(
            q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
            keys,
            values,
            attn_mask=chunk.visible,
            scale=spec.scale,
        )
        return out.view(num_seqs, num_heads, head_dim), None
    # Each KV head's grouped query heads are the rows of one small matmul: [seqs * kv_heads, ...].
    out, lse = attend(
        q.reshape(num_seqs * num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.view(num_seqs * num_kv_heads, chunk.num_keys, head_dim),
        values.view(num_seqs * num_kv_heads, chunk.num_keys, head_dim),
        chunk.padding,
        with_lse,
        spec.scale,
        spec.logit_softcap,
    )
    if lse is not None:
        lse = lse.view(num_seqs, num_heads)
    return out.view(num_seqs, num_heads, head_dim), lse
