"""The decode attention benchmark's paths: the SDPA decode path this backend had before
(its metadata, slot mapping and forward, rebuilt here), and every path compared against it
(paged matmul, cascade, paged SDPA, the portable C decode kernel, the AVX512-BF16 C paged
kernel, the VDPBF16PS decode kernel on AVX512-BF16 CPUs, and on AMX CPUs the AMX decode kernel
and the C paged kernel on AMX tiles), each built as a function that runs one step through every
layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from decode_attention_workload import (
    CPU,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    PAGE_SIZE,
    DecodeBatch,
    Step,
    pages_for,
)

from vacpack.attention.backend import AttentionBackend
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY, CascadePolicy
from vacpack.attention.cpu_kernel_backend import CpuKernelBackend
from vacpack.attention.paged_decode import kernel_form_supported
from vacpack.attention.torch_sdpa import TorchSdpaBackend
from vacpack.cpu_kernels import varlen_attention_supported
from vacpack.cpu_kernels.attention import tile_kernel_ready
from vacpack.cpu_kernels.packed_keys import pack_keys
from vacpack.cpu_kernels.paged_decode import paged_decode_supported
from vacpack.kvcache.paged_cache import KVLayer

# vacpack/cpu_kernels' varlen kernel: bf16 where this CPU has AVX512-BF16, float32 on any CPU.
# It reads the cache in the layout the engine gives it: keys packed in bf16.
C_KERNEL = "C paged kernel"
TOKEN_ROWS = "keys in token rows"  # the C kernel over a cache of token rows (its transposes)
PORTABLE_KERNEL = "portable C decode kernel"  # cpu_kernels/paged_decode.c, any CPU
LANES = "heads in lanes"  # the kernel's other form (decode_form="kernel_lanes")
DPBF16_KERNEL = "VDPBF16PS decode kernel"  # cpu_kernels/paged_decode_bf16.c, AVX512-BF16
AMX_KERNEL = "AMX decode kernel"  # cpu_kernels/paged_decode_amx.c, bf16 on AMX CPUs

# ---------------------------------------------------------------------------- the old path


def legacy_metadata(batch: DecodeBatch) -> list[dict[str, Any]]:
    """The decode groups of the SDPA path this backend had before (commit fa60270): contexts
    grouped longest first, a group closing below 70% of its longest once it has 8 members."""
    order = sorted(range(len(batch.context_lens)), key=lambda i: -batch.context_lens[i])
    members_by_group: list[list[int]] = []
    for i in order:
        group = members_by_group[-1] if members_by_group else None
        longest = batch.context_lens[group[0]] if group else 0
        if group is None or (len(group) >= 8 and batch.context_lens[i] < 0.7 * longest):
            members_by_group.append([i])
        else:
            group.append(i)
    groups = []
    for members in members_by_group:
        lens = torch.tensor([batch.context_lens[i] for i in members])
        longest = int(lens[0])
        pages = torch.zeros(len(members), pages_for(longest), dtype=torch.int64)
        for row, i in enumerate(members):
            used = batch.page_tables[i][: pages_for(longest)]
            pages[row, : len(used)] = torch.tensor(used)
        mask = None
        if int(lens[-1]) != longest:
            mask = (torch.arange(longest) < lens.unsqueeze(1))[:, None, None, :]
        groups.append({"rows": torch.tensor(members), "pages": pages.flatten(), "len": longest})
        groups[-1]["mask"] = mask
    return groups


def legacy_slot_mapping(batch: DecodeBatch) -> torch.Tensor:
    """Where each decode's new key and value go, computed as the old path did (for its host
    time only)."""
    slots = []
    for context_len, pages in zip(batch.context_lens, batch.page_tables, strict=True):
        positions = torch.arange(context_len - 1, context_len)
        page_ids = torch.tensor(pages, dtype=torch.int64)[positions // PAGE_SIZE]
        slots.append(page_ids * PAGE_SIZE + positions % PAGE_SIZE)
    return torch.cat(slots)


def legacy_forward(
    q: torch.Tensor, kv_layer: KVLayer, groups: list[dict[str, Any]]
) -> torch.Tensor:
    """Gathers each group's pages into [seqs, kv_heads, longest, head_dim] and runs SDPA."""

    def gathered(cache: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        num_seqs = group["rows"].shape[0]
        paged = cache.view(-1, PAGE_SIZE, *cache.shape[1:]).index_select(0, group["pages"])
        run = paged.view(num_seqs, -1, *cache.shape[1:])[:, : group["len"]]
        # A cache kept in bf16 under float32 queries is widened as it is gathered.
        return run.transpose(1, 2).contiguous().to(q.dtype)

    out = torch.empty_like(q)
    for group in groups:
        num_seqs = group["rows"].shape[0]
        grouped_q = q.index_select(0, group["rows"]).view(
            num_seqs, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM
        )
        keys, values = gathered(kv_layer.keys, group), gathered(kv_layer.values, group)
        attn = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=group["mask"])
        out.index_copy_(0, group["rows"], attn.reshape(num_seqs, NUM_HEADS, HEAD_DIM))
    return out


# ---------------------------------------------------------------------------- every path


def step_runners(
    batch: DecodeBatch, step: Step, cascade_policy: CascadePolicy = DEFAULT_CASCADE_POLICY
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Each path as a function that runs one step through every layer."""
    runners = {}
    legacy = legacy_metadata(batch)
    slot_mapping = TorchSdpaBackend().build_metadata(batch.layout, CPU).slot_mapping

    def old() -> list[torch.Tensor]:
        outs = []
        for layer, q, k, v in zip(
            step.kv_layers, step.queries, step.new_keys, step.new_values, strict=True
        ):
            layer.write(slot_mapping, k, v)
            outs.append(legacy_forward(q, layer, legacy))
        return outs

    runners["sdpa (before)"] = old
    backends: list[tuple[str, AttentionBackend]] = [
        ("paged matmul", TorchSdpaBackend(cascade=None)),
        ("paged matmul + cascade", TorchSdpaBackend(cascade_policy)),
    ]
    dtype = step.queries[0].dtype
    backends.append(("paged sdpa", TorchSdpaBackend(cascade=None, decode_form="sdpa")))
    if paged_decode_supported(CPU, dtype, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM):
        backends.append((PORTABLE_KERNEL, TorchSdpaBackend(cascade=None, decode_form="kernel")))
        backends.append(
            (f"{PORTABLE_KERNEL} + cascade", TorchSdpaBackend(cascade_policy, decode_form="kernel"))
        )
        lanes_only = TorchSdpaBackend(cascade=None, decode_form="kernel_lanes")
        backends.append((f"{PORTABLE_KERNEL}, {LANES}", lanes_only))
    for name, form in ((DPBF16_KERNEL, "kernel_bf16"), (AMX_KERNEL, "kernel_amx")):
        if kernel_form_supported(form, CPU, dtype, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM):
            backends.append((name, TorchSdpaBackend(cascade=None, decode_form=form)))
    token_rows = {f"{C_KERNEL}, {TOKEN_ROWS}"}
    if varlen_attention_supported(CPU, dtype, HEAD_DIM):
        backends.append((C_KERNEL, CpuKernelBackend()))
        if CpuKernelBackend().packs_keys(dtype, step.kv_layers[0].keys.dtype, PAGE_SIZE):
            backends.append((f"{C_KERNEL}, {TOKEN_ROWS}", CpuKernelBackend()))
    if dtype == torch.bfloat16 and tile_kernel_ready("amx"):
        backends.append((f"{C_KERNEL}, AMX", CpuKernelBackend(bf16_kernel="amx")))
        if paged_decode_supported(CPU, dtype, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM):
            # The cascade's shared prefixes through the varlen kernel (cascade_prefix).
            cascading = TorchSdpaBackend(cascade_policy, decode_form="kernel", prefix_form="kernel")
            backends.append((f"{PORTABLE_KERNEL} + kernel cascade", cascading))
            in_lanes = TorchSdpaBackend(
                cascade_policy, decode_form="kernel_lanes", prefix_form="kernel"
            )
            backends.append((f"{PORTABLE_KERNEL}, {LANES} + kernel cascade", in_lanes))
    packed_layers: list[KVLayer] = []
    for name, backend in backends:
        metadata = backend.build_metadata(batch.layout, CPU)
        layers = step.kv_layers
        if name not in token_rows and backend.packs_keys(dtype, layers[0].keys.dtype, PAGE_SIZE):
            packed_layers = packed_layers or [
                KVLayer(pack_keys(layer.keys, PAGE_SIZE), layer.values, PAGE_SIZE, True)
                for layer in layers
            ]
            layers = packed_layers

        def new(
            backend: AttentionBackend = backend,
            metadata: Any = metadata,
            layers: list[KVLayer] = layers,
        ) -> list[torch.Tensor]:
            return [
                backend.forward(q, k, v, layer, metadata)
                for layer, q, k, v in zip(
                    layers, step.queries, step.new_keys, step.new_values, strict=True
                )
            ]

        runners[name] = new
    return runners
