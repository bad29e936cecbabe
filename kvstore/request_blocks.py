"""One request's block table against the ``BlockStore``: its block hashes, the blocks it offers
the prefix index, its last token reopened for the worker, its truncation.

Helpers of ``KVCacheManager``, the owner of both the requests and the store: they mutate the
``Request`` and the store they are handed, and are called only from the manager's methods
(``grow`` and ``append_decodes`` are its ``append`` and ``append_tokens``).
"""

from __future__ import annotations

from kvstore.block_pool import BlockPool
from kvstore.block_store import BlockStore
from kvstore.prefix_index import content_hash, index_key
from kvstore.protocol import LOOKAHEAD_SLOTS
from kvstore.requests import Growth, KVError, Request, Status, cdiv, table_blocks


def must_copy(store: BlockStore, block: int) -> bool:
    """Whether writing ``block`` needs a fresh copy first: shared, or registered in the index."""
    return store.pool.ref_counts[block] > 1 or store.pool.cached[block]


def extend_hashes(request: Request, block_size: int) -> None:
    """Hashes every full block of known tokens not hashed yet."""
    bs = block_size
    for i in range(len(request.contents), len(request.token_ids) // bs):
        parent = request.contents[i - 1] if i else b""
        content = content_hash(parent, request.token_ids[i * bs : (i + 1) * bs])
        request.contents.append(content)
        request.keys.append(index_key(content, request.salt))


def register_computed(store: BlockStore, request: Request, block_size: int) -> None:
    """Offers newly computed full blocks to the prefix index (duplicates stay unregistered), up
    to the first one whose copy-on-write copy is not confirmed."""
    end = min(request.num_computed // block_size, trusted_blocks(store, request))
    for i in range(request.num_registered, end):
        parent = request.keys[i - 1] if i else None
        store.register(request.block_ids[i], request.keys[i], request.contents[i], parent, i)
    request.num_registered = max(request.num_registered, end)


def trusted_blocks(store: BlockStore, request: Request) -> int:
    """How many of the request's leading GPU blocks hold what was computed into them: all but
    those from the first whose copy-on-write copy the worker has not confirmed."""
    table, pool = request.block_ids, store.pool
    if not pool.num_copying:  # the common case: no copy awaits a confirmation
        return len(table)
    return next((i for i, block in enumerate(table) if pool.is_copying(block)), len(table))


def reopen_last_token(store: BlockStore, request: Request, block_size: int) -> None:
    """A placed request's last token is never counted as computed: the worker needs its
    logits to sample, so it runs it again. Its slot must then be writable: if the block is
    shared or registered in the prefix index, the request gets a fresh block and recomputes
    that block (at most ``block_size`` tokens). Raises no_space, changing nothing, if no
    block is left for that."""
    last = len(request.token_ids) - 1
    if request.num_computed <= last:
        return
    position = last // block_size
    block = request.block_ids[position]
    request.num_registered = min(request.num_registered, position)  # it is written again
    if not must_copy(store, block):
        request.num_computed = last
        return
    if store.pool.num_available < 1:
        raise KVError("no_space", f"no block to reopen the last token of {request.req_id!r}")
    [fresh] = store.allocate(1)
    store.pool.release([block])
    request.block_ids[position] = fresh
    request.num_computed = position * block_size


def truncate(store: BlockStore, request: Request, length: int, block_size: int) -> None:
    """Forgets tokens past ``length`` and the blocks (GPU or CPU) no longer needed (a running
    request keeps its lookahead slot, ``table_blocks``)."""
    if length >= len(request.token_ids):
        return
    keep_blocks = cdiv(length, block_size)
    if request.status is Status.RUNNING:
        keep_blocks = table_blocks(length, block_size)
    del request.token_ids[length:]
    del request.contents[length // block_size :]
    del request.keys[length // block_size :]
    request.num_computed = min(request.num_computed, length)
    request.num_registered = min(request.num_registered, length // block_size)
    if request.status is Status.RUNNING:
        store.pool.release(request.block_ids[keep_blocks:])
        del request.block_ids[keep_blocks:]
    elif request.status is Status.SWAPPED:
        store.cpu.release(request.cpu_block_ids[keep_blocks:])
        del request.cpu_block_ids[keep_blocks:]


def grow(
    store: BlockStore, request: Request, new_token_ids: list[int], num_computed: int, bs: int
) -> Growth:
    """``KVCacheManager.append`` of a running request: the new tokens, their blocks, the
    copy-on-write copies of shared blocks about to be written, newly computed blocks offered to
    the prefix index. All or nothing."""
    req_id = request.req_id
    tokens, table = request.token_ids, request.block_ids
    if not request.num_computed <= num_computed <= len(tokens) + len(new_token_ids):
        raise KVError(
            "bad_argument",
            f"num_computed {num_computed} outside [{request.num_computed}, "
            f"{len(tokens) + len(new_token_ids)}] for {req_id!r}",
        )
    blocks_needed = table_blocks(len(tokens) + len(new_token_ids), bs)
    last = min(blocks_needed, len(table))
    to_copy = [i for i in range(num_computed // bs, last) if must_copy(store, table[i])]
    extra = blocks_needed - len(table)
    copies: list[tuple[int, int, int]] = []
    new_blocks: list[int] = []
    if extra > 0 or to_copy:  # the common decode step allocates nothing
        needed = max(extra, 0) + len(to_copy)
        if needed > store.pool.num_available:
            raise KVError(
                "no_space",
                f"{req_id!r} needs {needed} blocks, {store.pool.num_available} available",
            )
        fresh = store.allocate(needed)
        for position, dst in zip(to_copy, fresh, strict=False):
            src = table[position]
            store.pool.release([src])
            store.pool.mark_copying(dst, request.worker)  # trusted once confirmed
            table[position] = dst
            copies.append((position, src, dst))
        new_blocks = fresh[len(to_copy) :]
        table.extend(new_blocks)
    tokens.extend(new_token_ids)
    request.num_computed = num_computed
    if len(tokens) // bs > len(request.contents):
        extend_hashes(request, bs)
    if num_computed // bs > request.num_registered:
        register_computed(store, request, bs)
    return Growth(req_id, new_blocks, copies)


def append_decodes(
    requests: dict[str, Request],
    pool: BlockPool,
    bs: int,
    worker: str,
    req_ids: list[str],
    token_ids: list[int],
    num_computed: list[int],
) -> list[int]:
    """``KVCacheManager.append_tokens``: one token for each request that takes the common path,
    in a tight loop; the indices of the others."""
    running = Status.RUNNING
    refs, cached = pool.ref_counts, pool.cached
    general: list[int] = []
    for i, (req_id, token, computed) in enumerate(
        zip(req_ids, token_ids, num_computed, strict=True)
    ):
        r = requests.get(req_id)
        if r is None or r.worker != worker or r.status is not running:
            general.append(i)
            continue
        tokens, table = r.token_ids, r.block_ids
        n = len(tokens)
        block, last = table[n // bs], table[-1]
        if (
            computed != n
            or (n + 1) % bs == 0  # fills its block: to hash
            or len(table) * bs < n + 1 + LOOKAHEAD_SLOTS  # the table must grow
            or n // bs != r.num_registered
            or refs[block] > 1
            or cached[block]
            or refs[last] > 1
        ):
            general.append(i)
            continue
        tokens.append(token)
        r.num_computed = n
    return general
