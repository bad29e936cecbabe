"""Taking over an orphaned request (its worker died): the block work of ``KVCacheManager.adopt``.

Helpers of the manager, as ``kvstore.request_blocks``: they mutate the ``Request`` and the store
they are handed, and are called only from the manager (``adopt``, and its orphans: ``orphan``,
``expired_orphans``).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.block_store import BlockStore
from kvstore.request_blocks import must_copy, trusted_blocks
from kvstore.requests import KVError, Request, Status, table_blocks


def shared_prefix(request: Request, token_ids: list[int]) -> int:
    """How many leading tokens the stored request shares with ``token_ids`` (what the new worker
    read back); raises bad_argument if none."""
    common = 0
    for mine, theirs in zip(request.token_ids, token_ids, strict=False):
        if mine != theirs:
            break
        common += 1
    if common == 0:
        raise KVError(
            "bad_argument", f"tokens of {request.req_id!r} share no prefix with the kvstore's"
        )
    return common


def check_room(
    store: BlockStore,
    request: Request,
    token_ids: list[int],
    common: int,
    reuse_prefix: bool,
    bs: int,
) -> None:
    """Raises no_space, before anything changes, if the pool lacks the blocks a running
    request's take-over needs: for the streamed tokens (and a fresh one where writing resumes),
    for a last block reopened into a fresh one, for blocks whose copy was never confirmed."""
    if request.status is not Status.RUNNING or not reuse_prefix:
        return
    streamed = len(token_ids) > common
    last_block = request.block_ids[(common - 1) // bs] if request.block_ids else 0
    reopens_in_a_fresh_block = (
        not streamed
        and min(request.num_computed, common) == common
        and must_copy(store, last_block)
    )
    kept = min(len(request.block_ids), table_blocks(common, bs))
    grows = table_blocks(len(token_ids), bs) - kept + 1 if streamed else 0
    untrusted = max(0, kept - trusted_blocks(store, request))
    needed = int(reopens_in_a_fresh_block) + grows + untrusted
    if needed > store.pool.num_available:
        raise KVError("no_space", f"no {needed} blocks to take {request.req_id!r} over")


def drop_computed(store: BlockStore, request: Request) -> None:
    """The new worker needs every token's logits: the request's blocks and computed work go, and
    it is placed again (as dropped) without a prefix lookup."""
    store.pool.release(request.block_ids)
    store.cpu.release(request.cpu_block_ids)
    request.block_ids, request.cpu_block_ids = [], []
    request.num_computed = request.num_registered = 0
    request.status, request.reuse_prefix = Status.DROPPED, False


def replace_untrusted(store: BlockStore, request: Request, bs: int) -> None:
    """A running request taken over: its blocks from the first whose copy-on-write copy was never
    confirmed (the worker may have died before making it) are replaced by fresh ones, computed
    again by the new worker. ``check_room`` made sure the pool has the blocks."""
    first, table = trusted_blocks(store, request), request.block_ids
    if first == len(table):
        return
    fresh = store.allocate(len(table) - first)
    store.pool.release(table[first:])
    table[first:] = fresh
    request.num_computed = min(request.num_computed, first * bs)
    request.num_registered = min(request.num_registered, first)


def make_room_for_streamed(store: BlockStore, request: Request, bs: int) -> None:
    """A running request whose tokens outgrew its table (its dead worker streamed tokens it
    never reported): blocks for them, and a private block where the new worker starts writing
    (a shared or registered one is replaced, its tokens computed again). ``check_room`` made
    sure the pool has the blocks."""
    table = request.block_ids
    table.extend(store.allocate(table_blocks(len(request.token_ids), bs) - len(table)))
    first = request.num_computed // bs  # the first block the new worker writes
    if first < len(table) and must_copy(store, table[first]):
        [fresh] = store.allocate(1)
        store.pool.release([table[first]])
        table[first] = fresh
        request.num_computed = first * bs
        request.num_registered = min(request.num_registered, first)


def orphan(store: BlockStore, requests: Iterable[Request], worker: str, now: float) -> list[str]:
    """Marks a dead ``worker``'s requests orphaned at ``now``; their ids. The copies it did not
    confirm stay untrusted (``BlockPool.forget_worker``)."""
    store.pool.forget_worker(worker)
    orphaned = [r for r in requests if r.worker == worker and r.orphaned_at is None]
    for request in orphaned:
        request.orphaned_at = now
    return [r.req_id for r in orphaned]


def expired_orphans(requests: Iterable[Request], now: float, grace_s: float) -> list[str]:
    """The ids of the requests orphaned for ``grace_s`` or longer."""
    return [
        r.req_id for r in requests if r.orphaned_at is not None and now - r.orphaned_at >= grace_s
    ]
