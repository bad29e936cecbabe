"""Pure-torch references for every kernel in this package: the only oracle of tests and benchmarks.

One per launcher, covering its Triton kernels: ``paged_decode_reference`` (``_decode_kernel`` and
its split-K ``_reduce_kernel``), ``paged_prefill_reference`` (``_prefill_kernel``),
``store_kv_reference`` (``_store_kv_kernel``), ``copy_blocks_reference``
(``_copy_blocks_kernel``), ``copy_blocks_between_reference`` (the same kernel across two pools),
``rms_norm_reference``, ``rotary_store_reference`` and
``silu_mul_reference`` (``kernels.layer_ops``). ``gather_kv`` is their shared helper, not an oracle.

Every function here computes in fp32, returns the input dtype, and never mutates its inputs
(``store_kv_reference`` and ``copy_blocks_reference`` return new tensors) except the ``out`` an
attention reference is given to write into. They are also the CPU
implementation the compute worker runs, so they loop over requests, never over tokens, and use
torch alone (importing this module must not import triton).

Cache layout (docs/architecture.md, "The pool"): ``k_cache``/``v_cache`` are ``[num_blocks,
block_size, kv_heads, head_dim]`` views, usually ``pool[:, layer, 0]`` / ``pool[:, layer, 1]`` of
the block-major pool ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``. A slot is
``block_id * block_size + offset_in_block``.
"""

from __future__ import annotations

import torch

__all__ = [
    "copy_blocks_between_reference",
    "copy_blocks_reference",
    "gather_kv",
    "paged_decode_reference",
    "paged_prefill_reference",
    "rms_norm_reference",
    "rotary_store_reference",
    "silu_mul_reference",
    "store_kv_reference",
]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request, in position order.

    cache: [num_blocks, block_size, kv_heads, head_dim]; block_table: [max_blocks] (any int dtype).
    Returns a new tensor [length, kv_heads, head_dim] in the cache dtype.
    """
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    ids = block_table[:n_blocks].to(device=cache.device, dtype=torch.long)
    # kv: [n_blocks * block_size, kv_heads, head_dim]
    kv = cache.index_select(0, ids).reshape(-1, cache.shape[2], cache.shape[3])
    return kv[:length]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal GQA attention of one request in fp32.

    q: [q_len, q_heads, D]; k, v: [kv_len, kv_heads, D]; q_pos: [q_len] absolute positions.
    Query at position p sees keys 0..p. Returns [q_len, q_heads, D] fp32.
    """
    q_heads, kv_heads = q.shape[1], k.shape[1]
    group = q_heads // kv_heads
    qf = q.float().permute(1, 0, 2)  # [q_heads, q_len, D]
    kf = k.float().permute(1, 0, 2).repeat_interleave(group, dim=0)  # [q_heads, kv_len, D]
    vf = v.float().permute(1, 0, 2).repeat_interleave(group, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [q_heads, q_len, kv_len]
    k_pos = torch.arange(k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, kv_len]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).permute(1, 0, 2)  # [q_len, q_heads, D]


def paged_decode_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request over its ``context_lens[b]`` cached tokens.

    query: [B, q_heads, D]; block_tables: [B, max_blocks]; context_lens: [B].
    Returns [B, q_heads, D] in query.dtype; a request with context 0 gets zeros. ``out``: the
    tensor to write the rows into and return (the launcher's parameter; the only argument this
    module writes); None returns a new one. ``num_splits`` is accepted for signature parity and
    ignored.
    """
    del num_splits
    target = torch.zeros_like(query) if out is None else out
    lens = context_lens.tolist()
    for b, ctx in enumerate(lens):
        if ctx <= 0:
            target[b] = 0
            continue
        k = gather_kv(k_cache, block_tables[b], ctx)
        v = gather_kv(v_cache, block_tables[b], ctx)
        pos = torch.tensor([ctx - 1], device=query.device)
        target[b] = _attend(query[b : b + 1], k, v, pos, scale)[0].to(target.dtype)
    return target


def paged_prefill_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    first: int = 0,
) -> torch.Tensor:
    """Packed chunks attending causally to themselves and to their cached context.

    query: [T, q_heads, D] packed; request b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
    context_lens[b] counts all of b's keys, its new tokens included (already in the cache);
    query row i of b sits at position context_lens[b] - q_len_b + i.
    Returns [T, q_heads, D] in query.dtype; rows past cu_seqlens_q[-1] are zeros. ``out``: the
    tensor to write the chunks' rows into and return (its other rows are left as they are);
    None returns a new one. ``first``: chunks before it are skipped (their rows left as they are).
    """
    del max_query_len
    target = torch.zeros_like(query) if out is None else out
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, ctx in enumerate(lens):
        if b < first:
            continue
        q0, q1 = cu[b], cu[b + 1]
        q_len = q1 - q0
        if q_len <= 0:
            continue
        if ctx < q_len:
            raise ValueError(f"request {b}: context {ctx} shorter than its {q_len} query tokens")
        k = gather_kv(k_cache, block_tables[b], ctx)
        v = gather_kv(v_cache, block_tables[b], ctx)
        pos = torch.arange(ctx - q_len, ctx, device=query.device)
        target[q0:q1] = _attend(query[q0:q1], k, v, pos, scale).to(target.dtype)
    return target


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (k_cache, v_cache) with key[t]/value[t] written at slot_mapping[t]; slot -1 is skipped.

    key, value: [T, kv_heads, D]; caches: [num_blocks, block_size, kv_heads, D]; slot_mapping: [T].
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offs = slots // block_size, slots % block_size
    k_new, v_new = k_cache.clone(), v_cache.clone()
    k_new[blocks, offs] = key[keep].to(k_cache.dtype)
    v_new[blocks, offs] = value[keep].to(v_cache.dtype)
    return k_new, v_new


def copy_blocks_reference(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """New pool with pool[dst[i]] = pool[src[i]] (every layer, K and V), read before any write.

    pool: [num_blocks, num_layers, 2, block_size, kv_heads, D]; src, dst: [N].
    """
    out = pool.clone()
    out[dst.long()] = pool[src.long()]
    return out


def copy_blocks_between_reference(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> torch.Tensor:
    """New ``dst_pool`` with dst_pool[dst[i]] = src_pool[src[i]] (every layer, K and V); the
    pools may be on two devices. src_pool, dst_pool: [*, num_layers, 2, block_size, kv_heads, D].
    """
    out = dst_pool.clone()
    out[dst.long().to(out.device)] = src_pool[src.long().to(src_pool.device)].to(out.device)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim. x: [..., H]; weight: [H]."""
    x32 = x.float()
    return (weight.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_store_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rotated q, new k_cache, new v_cache): x * cos + rotate_half(x) * sin for x in q, k, with
    rotate_half(x) = cat(-x2, x1), and the rotated k and v stored as ``store_kv_reference``
    does. q: [T, q_heads, D]; k, v: [T, kv_heads, D]; cos, sin: [T, D]; caches: [num_blocks,
    block_size, kv_heads, D]; slot_mapping: [T] (-1 skipped)."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x32 = x.float()
        turned = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
        return (x32 * cos.float()[:, None] + turned * sin.float()[:, None]).to(x.dtype)

    return rotate(q), *store_kv_reference(rotate(k), v, k_cache, v_cache, slot_mapping)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate_up = cat(gate, up) on the last dim: [T, 2 * I] -> [T, I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
