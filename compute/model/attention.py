"""The paged attention function that transformers models call in place of SDPA/eager.

``import compute.model.attention`` registers it as ``attn_implementation="paged"`` (``ATTN_NAME``)
in transformers' global ``AttentionInterface``. Each decoder layer then calls
``paged_attention_forward(module, query, key, value, attention_mask, scaling=..., **kwargs)``, where
``kwargs`` are the extra keyword arguments of ``model(...)`` (transformers 5 passes them through to
the attention function). The runner passes one of them, ``paged=PagedBatch(...)``, with everything
the forward needs.

Inputs are packed: ``input_ids [1, T]`` holds every scheduled token of every request (prefill
chunks and decodes alike), request ``b`` owning rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``;
``position_ids [1, T]`` are per-request positions, so rotary is right without any mask.

The function writes the layer's new K/V into the paged pool (``slot_mapping``) and then attends
through the block tables (``attend``): the step's leading one-token chunks (its decodes: the
scheduler puts them first) with the split-K ``paged_decode``, the rest with ``paged_prefill``.
The prefill kernel gives every chunk whole query tiles, so a decode row run through it would
waste most of a tile: a step of 255 decodes beside one prompt spent 3.9 of its 7.0 ms there
(BENCHMARKS-archive.md). On CUDA it runs the Triton kernels of ``kernels``; on CPU the pure-torch
references of ``kernels.reference`` (with an in-place store, since the reference store returns
new tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AttentionInterface

from kernels.reference import paged_decode_reference, paged_prefill_reference

__all__ = [
    "ATTN_NAME",
    "PagedBatch",
    "attend",
    "check_window",
    "copy_blocks_inplace",
    "paged_attention_forward",
    "paged_layer",
    "store_kv_inplace",
]

ATTN_NAME = "paged"


@dataclass(frozen=True)
class PagedBatch:
    """Per-forward metadata shared by every layer (built once per step by ``ModelRunner``).

    T = packed tokens of the step, B = requests in it.
    """

    slot_mapping: torch.Tensor  # [T] int64: pool slot (block * block_size + offset) of each token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each request's blocks
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: row offsets of each request in the packed batch
    context_lens: torch.Tensor  # [B] int32: tokens of context after this step (chunk included)
    max_query_len: int  # largest chunk in the batch (host int: no device sync in the kernel)
    max_context_len: int  # largest context_lens entry (host int)
    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    num_decodes: int = 0  # the first chunks that are one token each (rows 0..num_decodes-1)
    # Set in a CUDA graph of mixed steps (``compute.model.mixed_graphs``), where the step's work is
    # read on the device: decode_count [1] int32 (the leading one-token chunks), tiles [N, 2]
    # int32 (the prompt chunks' (chunk, query tile) pairs) and tile_count [1] int32 (how many
    # of them are the step's); ``num_decodes`` and ``max_query_len`` are unused then.
    decode_count: torch.Tensor | None = None
    tiles: torch.Tensor | None = None
    tile_count: torch.Tensor | None = None
    # Called by every layer before it attends, with its index and sliding window: a graph
    # learns the windows it must check on the host when it replays.
    observe: Callable[[int, int | None], None] | None = None


def store_kv_inplace(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """CPU ``store_kv``: key[t]/value[t] into slot slot_mapping[t] of the cache views, in place.

    Same contract as ``kernels.reference.store_kv_reference`` (slot -1 skipped) but writes through
    the views into the pool instead of cloning the whole cache of a layer on every call.
    key, value: [T, kv_heads, D]; k_cache, v_cache: [num_blocks, block_size, kv_heads, D].
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep].long()  # [T']
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def copy_blocks_inplace(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy-on-write: pool[dst[i]] = pool[src[i]] (every layer, K and V), in place.

    Triton ``copy_blocks`` on CUDA; on CPU the same semantics as ``copy_blocks_reference``
    (sources read before any write). pool: [num_blocks, ...]; src, dst: [N] int64.
    """
    if src.numel() == 0:
        return
    if pool.is_cuda:
        from kernels import copy_blocks

        copy_blocks(pool, src, dst)
    else:
        pool[dst] = pool[src]  # advanced indexing gathers a copy of the sources first


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedBatch | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Stores this layer's K/V in the pool, then attends through the block tables.

    query: [1, Hq, T, D]; key, value: [1, Hkv, T, D] (rotary applied); ``module.layer_idx`` picks
    the layer's pool views. Returns ([1, T, Hq, D], None). ``attention_mask`` must be None: the
    causal structure comes from ``paged`` (positions and context lengths), not from a mask.
    """
    del dropout, kwargs  # inference only; other model kwargs (position_ids, ...) are not needed
    layer = paged_layer(module, attention_mask, paged, sliding_window, softcap)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    assert query.shape[0] == 1, f"packed batch expected, got query {tuple(query.shape)}"
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)  # [T, Hkv, D]
    if q.is_cuda:
        from kernels import store_kv as store
    else:
        store = store_kv_inplace
    assert paged is not None  # paged_layer refuses None
    store(k, v, paged.pool[:, layer, 0], paged.pool[:, layer, 1], paged.slot_mapping)
    return attend(q, layer, paged, scaling).unsqueeze(0), None  # [1, T, Hq, D]


def paged_layer(
    module: torch.nn.Module,
    attention_mask: torch.Tensor | None,
    paged: PagedBatch | None,
    sliding_window: int | None,
    softcap: float | None,
) -> int:
    """What every paged attention call checks first (a ``paged`` batch, no mask, no softcap, a
    window no context reaches); reports the layer to ``paged.observe``; returns the layer
    index (``module.layer_idx``), which picks the layer's pool views."""
    if paged is None:
        raise ValueError(
            f"attn_implementation={ATTN_NAME!r} needs model(..., paged=PagedBatch(...))"
        )
    if attention_mask is not None:
        raise ValueError("paged attention takes no attention_mask (packed batch, causal by rows)")
    if softcap is not None:
        raise NotImplementedError("paged attention does not support logit softcapping")
    check_window(sliding_window, paged.max_context_len)  # 0 in a graph: checked at replay
    layer = cast(int, module.layer_idx)  # torch types a Module's attributes Tensor | Module
    if paged.observe is not None:
        paged.observe(layer, sliding_window)
    return layer


def check_window(sliding_window: int | None, max_context_len: int) -> None:
    """Sliding-window attention is not implemented: a window no context reaches is causal."""
    if sliding_window is not None and max_context_len > sliding_window:
        raise NotImplementedError(
            f"sliding window {sliding_window} < context {max_context_len} is not supported"
        )


def attend(
    q: torch.Tensor,
    layer: int,
    paged: PagedBatch,
    scaling: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's packed queries q [T, Hq, D] over the pool's layer ``layer`` (its
    K/V already stored): ``paged.num_decodes`` leading decodes through the decode kernel, the
    other chunks through the prefill kernel (their graph forms when ``paged.tiles`` is set).
    Writes into ``out`` ([T, Hq, D], q's dtype) if given, else a new tensor; returns it."""
    k_cache = paged.pool[:, layer, 0]  # [num_blocks, block_size, Hkv, D]
    v_cache = paged.pool[:, layer, 1]
    out = torch.empty_like(q) if out is None else out
    if paged.tiles is not None:  # a mixed step's CUDA graph: counts and tiles on the device
        from kernels import paged_decode, paged_prefill

        tables, cu, lens = paged.block_tables, paged.cu_seqlens_q, paged.context_lens
        rows = lens.shape[0]  # as many as the bucket can have chunks; the first `count` decode
        paged_decode(q[:rows], k_cache, v_cache, tables, lens, scaling, out=out[:rows],
                     count=paged.decode_count)  # fmt: skip
        paged_prefill(q, k_cache, v_cache, tables, cu, lens, scaling, out=out, tiles=paged.tiles,
                      num_tiles=paged.tile_count)  # fmt: skip
        return out
    if q.is_cuda:
        from kernels import paged_decode as decode
        from kernels import paged_prefill as prefill
    else:
        decode, prefill = paged_decode_reference, paged_prefill_reference
    d, batch = paged.num_decodes, paged.context_lens.shape[0]
    if d > 0:
        tables, lens = paged.block_tables[:d], paged.context_lens[:d]
        decode(q[:d], k_cache, v_cache, tables, lens, scaling, out=out[:d])
    if d < batch:
        prefill(
            q,
            k_cache,
            v_cache,
            paged.block_tables,
            paged.cu_seqlens_q,
            paged.context_lens,
            scaling,
            paged.max_query_len,
            out=out,
            first=d,
        )
    return out


AttentionInterface.register(ATTN_NAME, paged_attention_forward)
