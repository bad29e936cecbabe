"""The kvstore protocol's calls (client -> daemon), with the pool's description the daemon
hands back at registration. Part of ``kvstore.protocol``, which every user imports."""

from __future__ import annotations

import msgspec

from kvstore.protocol.base import (
    PoolKind,
    ProfileSource,
    RoutingPolicy,
    Tier,
    _Item,
    _Msg,
)


# ---------------------------------------------------------------- pool description
class CudaIpcHandle(_Item):
    """What ``UntypedStorage._share_cuda_()`` yields, plus the GPU's UUID (device indices differ
    between processes with different ``CUDA_VISIBLE_DEVICES``)."""

    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class PoolInfo(_Item):
    """How a worker maps the pool: ``shm_path`` (CPU) or ``cuda`` (CUDA IPC), and its geometry.
    Layout: ``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``. With
    tensor parallelism (``--tensor-parallel-size``), ``ranks``: each rank's pool (its KV heads,
    the same block ids), of which this one is rank 0's."""

    kind: PoolKind
    shape: list[int]
    dtype: str
    block_size: int
    shm_path: str = ""
    cuda: CudaIpcHandle | None = None
    ranks: list[PoolInfo] = []


class ProfileOrigin(_Item):
    """Where the profiles of a ``Register`` came from: ``measured_at`` (unix time; 0 for a
    prior), ``measure_s`` (seconds the measuring took then), ``skipped`` (points its time
    budget left out: the kvstore extrapolates over them)."""

    source: ProfileSource
    measured_at: float
    measure_s: float
    skipped: int


# ---------------------------------------------------------------- requests (client -> daemon)
class Register(_Msg):
    """A compute worker joins. ``prefill_profile``: its measured ``(tokens, seconds)`` prefill
    times from an empty context, eagerly (the recompute side of a preemption's price);
    ``recompute_profile``: ``(tokens, context, seconds)`` of forwards prefilling ``tokens`` after
    ``context`` cached, as the worker runs them (CUDA graphs included; a prefix load's price);
    ``graph_token_buckets``: the token counts of its CUDA graphs of prefill steps (none: eager);
    ``profile_origin``: where the profiles came from (None: a client that does not say)."""

    worker_id: str
    prefill_profile: list[tuple[int, float]] = []
    device: str = ""
    pid: int = 0
    recompute_profile: list[tuple[int, int, float]] = []
    graph_token_buckets: list[int] = []
    profile_origin: ProfileOrigin | None = None
    pool: int = 0  # the host's pool (GPU) the worker runs on; it reads that pool's stream


class Heartbeat(_Msg):
    worker_id: str


class Unregister(_Msg):
    """A worker leaves cleanly: its requests are orphaned at once (another may adopt them)."""

    worker_id: str


class AdmitItem(_Item):
    """A new request, or with ``adopt`` one whose worker died (``token_ids``: what it streamed).
    ``reuse_prefix`` False: no cached prefix is looked up, and an adopted request drops what it
    computed (the worker computes every token; the blocks still join the prefix index)."""

    req_id: str
    token_ids: list[int]
    salt: bytes | None = None
    adopt: bool = False
    reuse_prefix: bool = True


class AppendItem(_Item):
    """``token_ids`` join the request; the KV of its first ``num_computed`` tokens is written
    (which may include some of ``token_ids``: fed from the device, computed before reported)."""

    req_id: str
    token_ids: list[int]
    num_computed: int


class TokenBatch(_Item):
    """One new token for each of many requests, columnar: the decode step's bulk (three lists of
    one length; ``num_computed[i]`` as in ``AppendItem``). Cheaper to encode, decode and apply
    than one ``AppendItem`` per request."""

    req_ids: list[str]
    token_ids: list[int]
    num_computed: list[int]


class StepTimeline(_Item):
    """A worker's running totals since it started: steps, tokens computed, device seconds,
    host seconds per engine phase (``compute.loop.engine``) and steps whose prompts were held back
    (``--prefill-interval``). The admin page turns two of them into per-step milliseconds."""

    steps: int
    tokens: int
    device_s: float
    phase_s: dict[str, float]
    held_steps: int = 0


class ForkItem(_Item):
    parent_id: str
    child_ids: list[str]


class CostReport(_Item):
    """Seconds a worker spent recomputing a preempted request (actual cost of the decision)."""

    req_id: str
    seconds: float


class Step(_Msg):
    """One engine step's KV work, applied in this order: costs, copied, forks, finals, frees,
    preempts, appends, tokens, resumes, admits. ``copied``: the blocks whose copy-on-write copy
    (``Grown.copies``' destinations) the worker has performed and seen complete; until then a
    block's content is not trusted (``kvstore.block_pool``: never registered in the prefix index,
    computed again after a take-over or a swap). Forks allocate nothing, so they come first: a
    sequence may be forked and freed in the same step (a branch that ends on its first token, or a
    parent that ends while its children go on). ``finals``: the last progress of sequences that
    ended (no tokens, only ``num_computed``), so that blocks they computed but never reported (a
    request that ends on the token its prompt's last chunk drew) join the prefix index before they
    are freed. Running requests grow before preempted ones resume, and those come back before new
    ones are admitted. Each item succeeds or fails alone (``StepReply.errors``), except that
    placements (resumes, then admits) are first come, first served: once one is refused for lack of
    space, the later ones are refused too (``no_space``), so a large request at the head is never
    starved by smaller ones behind it."""

    worker_id: str
    frees: list[str] = []
    preempts: list[str] = []
    resumes: list[str] = []
    forks: list[ForkItem] = []
    admits: list[AdmitItem] = []
    appends: list[AppendItem] = []
    costs: list[CostReport] = []
    tokens: TokenBatch | None = None
    finals: list[AppendItem] = []
    timeline: StepTimeline | None = None  # at most about once a second
    copied: list[int] = []


class GetStats(_Msg):
    top_prefixes: int = 10


class ResetCache(_Msg):
    pass


class Ping(_Msg):
    pass


class GetBlockMap(_Msg):
    """Every block's state, one byte each (an index into ``BLOCK_STATES``), for both tiers of
    ``pool``."""

    pool: int = 0


class GetBlockInfo(_Msg):
    """What one block holds: its owners, and the prefix it caches if any."""

    tier: Tier
    block: int
    pool: int = 0


class RouteItem(_Item):
    """One request to place: its prompt's ``token_ids`` and its cache ``salt``."""

    req_id: str
    token_ids: list[int]
    salt: bytes | None = None


class Route(_Msg):
    """Which of the host's pools should serve each request of ``items``? The daemon answers from
    what it knows now (``kvstore.placement``), one after the other (each counts as queued on its
    pool, until a worker admits it there, before the next is placed). ``book=False``: a quote,
    placed the same way but counted nowhere (a gateway routing across hosts asks each host's
    kvstore for one, then books the items on the host it chose)."""

    items: list[RouteItem]
    policy: RoutingPolicy = "prefix"
    book: bool = True


Request = (
    Register
    | Heartbeat
    | Unregister
    | Step
    | GetStats
    | ResetCache
    | Ping
    | GetBlockMap
    | GetBlockInfo
    | Route
)


class Call(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The envelope of every call. ``token``: the shared secret of a daemon started with
    ``$PAGEDSERVE_KVSTORE_TOKEN`` set (``contracts.endpoints.TOKEN_ENV``); such a daemon answers
    ``Error("unauthorized")`` to a call whose token differs, and changes nothing."""

    version: int
    call_id: int
    body: Request
    token: str = ""
