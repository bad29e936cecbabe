"""Every message between the kvstore daemon and its clients: msgspec Structs on MessagePack.

Wire: a ZeroMQ DEALER (client) -> ROUTER (daemon); one frame of payload per message. A call is a
``Call`` envelope carrying a ``version``, a client-chosen ``call_id`` and one request body; the
answer is a ``Reply`` with the same ``call_id`` and one reply body, ``Error`` included. Structs
are tagged (``type`` = class name) and array-encoded, so a step carrying 256 requests stays small.
No pickle anywhere. Torch-free.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 9  # 2: Call.token; the wire's codes and kinds are closed sets (Literal).
# 3: AdmitItem.reuse_prefix, Step.finals. 4: the CPU prefix tier (Stats fields, DecisionRow.kind,
# GetBlockMap, GetBlockInfo, Step.timeline, WorkerRow.timeline). 5: Register.recompute_profile
# and .graph_token_buckets, WorkerRow.recompute_profile. 6: LOOKAHEAD_SLOTS.
# 7: StepTimeline.held_steps. 8: Register.profile_origin, WorkerRow.profile_origin.
# 9: Step.copied.

# A running request's block table holds the slots of its known tokens and of this many after
# them: a worker may compute that many tokens the kvstore has not heard of yet (sampled tokens
# fed from the device, in a step launched before the reply to its last report is applied).
LOOKAHEAD_SLOTS = 2

# The daemon's default --lease-timeout-s, its failure detector: a worker silent this long (it
# sends a Step every engine step, every 100 ms when idle) is dead, and others may adopt its
# requests; workers take a dead one's requests over in Redis after as long (compute/loop/intake.py).
LEASE_TIMEOUT_S = 6.0

PoolKind = Literal["shm", "cuda_ipc"]
ErrorCode = Literal["bad_message", "version", "unauthorized", "unknown_worker", "internal"]
ItemOp = Literal["cost", "fork", "final", "free", "preempt", "append", "resume", "admit"]
ItemCode = Literal[
    "no_space",  # not now: the request waits (for an append, the worker preempts)
    "too_large",  # never: more blocks than the pool can give one request
    "unknown_request",
    "duplicate_request",
    "not_owner",
    "wrong_state",
    "conflict",  # an adopt of a request that a live worker still holds
    "bad_argument",
]
PreemptMode = Literal["swap", "recompute"]
# What a decision chose: a preemption swaps or drops; a prefix hit in the CPU tier loads the
# blocks back ("load") or lets the worker recompute their tokens ("recompute").
DecisionMode = Literal["swap", "recompute", "load"]
DecisionKind = Literal["preempt", "prefix"]
# One byte per block in ``BlockMap``: what the block holds now.
BlockState = Literal["free", "running", "cached", "swapped", "demoted"]
BLOCK_STATES: tuple[BlockState, ...] = ("free", "running", "cached", "swapped", "demoted")
RequestStatus = Literal["running", "swapped", "dropped"]
Tier = Literal["gpu", "cpu"]
# Where a worker's cost-model profile came from: timed at this start-up, read from its on-disk
# cache, or none at all (the kvstore prices by its priors).
ProfileSource = Literal["measured", "cached", "prior"]


class _Msg(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag=True):
    """A message body: tagged with its class name."""


class _Item(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A part of a body (untagged, not tracked by the GC: half the codec time of a body)."""


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
    Layout: ``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``."""

    kind: PoolKind
    shape: list[int]
    dtype: str
    block_size: int
    shm_path: str = ""
    cuda: CudaIpcHandle | None = None


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
    """Every block's state, one byte each (an index into ``BLOCK_STATES``), for both tiers."""


class GetBlockInfo(_Msg):
    """What one block holds: its owners, and the prefix it caches if any."""

    tier: Tier
    block: int


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
)


class Call(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The envelope of every call. ``token``: the shared secret of a daemon started with
    ``$PAGEDSERVE_KVSTORE_TOKEN`` set (``contracts.endpoints.TOKEN_ENV``); such a daemon answers
    ``Error("unauthorized")`` to a call whose token differs, and changes nothing."""

    version: int
    call_id: int
    body: Request
    token: str = ""


# ---------------------------------------------------------------- replies (daemon -> client)
class Error(_Msg):
    """``code``: bad_message | version | unauthorized (the call's token is missing or wrong) |
    unknown_worker | internal."""

    code: ErrorCode
    message: str


class Ack(_Msg):
    pass


class Registered(_Msg):
    """``admission_limit_blocks``: the most blocks a request may need and still be placed
    (admitted or resumed): the pool less the admission watermark. A request that needs more can
    never run and is refused with ``too_large``. Registering again under the same ``worker_id``
    (a restarted worker, or one that lost track of the daemon) orphans every request the daemon
    still holds for that id, so they can be adopted."""

    pool: PoolInfo
    num_gpu_blocks: int
    num_cpu_blocks: int
    lease_timeout_s: float
    admission_limit_blocks: int


class Placed(_Item):
    """A block table after admit / adopt / resume / fork. Compute from ``num_computed``."""

    req_id: str
    block_ids: list[int]
    num_computed: int
    num_cached_tokens: int


class Grown(_Item):
    """Blocks appended to the table, and copy-on-write ``(table position, src, dst)`` copies
    the worker performs before its forward writes them."""

    req_id: str
    new_block_ids: list[int]
    copies: list[tuple[int, int, int]]


class ItemError(_Item):
    """``code``: no_space | too_large (more blocks than the pool can ever give one request) |
    unknown_request | duplicate_request | not_owner | wrong_state | conflict | bad_argument."""

    req_id: str
    op: ItemOp
    code: ItemCode
    message: str


class StepReply(_Msg):
    preempted: list[tuple[str, PreemptMode]] = []  # (req_id, how)
    resumed: list[Placed] = []
    forked: list[Placed] = []
    admitted: list[Placed] = []
    appended: list[Grown] = []  # only the requests whose table changed
    errors: list[ItemError] = []


class TierStats(_Item):
    total: int
    free: int
    used: int
    cached: int


class PrefixRow(_Item):
    key: str
    tokens: int
    hits: int
    block: int
    tier: Tier


class RequestRow(_Item):
    req_id: str
    worker: str
    status: RequestStatus
    tokens: int
    num_computed: int
    gpu_blocks: int
    cpu_blocks: int
    cached_tokens: int
    preemptions: int
    orphaned: bool


class DecisionRow(_Item):
    id: int
    kind: DecisionKind
    req_id: str
    at: float
    mode: DecisionMode
    reason: str
    blocks: int
    tokens: int
    predicted_swap_s: float | None
    predicted_recompute_s: float | None
    actual_s: float | None


class Calibration(_Item):
    block_bytes: int
    swap_out_fixed_s: float
    swap_out_per_block_s: float
    swap_in_fixed_s: float
    swap_in_per_block_s: float
    samples: list[tuple[int, float, float]]  # (blocks, out seconds, in seconds)


class WorkerRow(_Item):
    worker_id: str
    device: str
    pid: int
    idle_s: float
    requests: int
    prefill_profile: list[tuple[int, float]]
    recompute_profile: list[tuple[int, int, float]]
    timeline: StepTimeline | None  # the last one the worker sent
    timeline_age_s: float  # how long ago it came
    profile_origin: ProfileOrigin | None = None  # of the profiles in force


class Stats(_Msg):
    block_size: int
    block_bytes: int
    admission_limit_blocks: int  # as in Registered
    gpu: TierStats
    cpu: TierStats
    prefix_lookups: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_stops: dict[str, int]
    top_prefixes: list[PrefixRow]
    requests: list[RequestRow]
    workers: list[WorkerRow]
    calibration: Calibration | None
    decisions: list[DecisionRow]
    preemptions: dict[str, int]
    prefix_hit_tokens_cpu: int  # of prefix_hit_tokens, those loaded back from the CPU tier
    tier_counts: dict[str, int]  # demoted, demoted_at_eviction, dropped, loaded, recomputed
    cpu_prefix_cache: bool  # whether evicted prefixes are kept in the CPU tier


class BlockMap(_Msg):
    """``gpu``/``cpu``: one byte per block, an index into ``BLOCK_STATES``."""

    gpu: bytes
    cpu: bytes


class BlockInfo(_Msg):
    tier: Tier
    block: int
    state: BlockState
    owners: list[str]  # requests whose block table (or swap table) names it
    prefix_key: str | None  # hex of its prefix-index key (first 16 digits), if cached
    prefix_tokens: int  # tokens of the prefix that ends with this block; 0 if not cached
    hits: int  # prefix-cache hits of this block
    other_tier_block: int | None  # the same prefix's copy in the other tier, if any


class CacheReset(_Msg):
    blocks: int


class Pong(_Msg):
    uptime_s: float


ReplyBody = Error | Ack | Registered | StepReply | Stats | CacheReset | Pong | BlockMap | BlockInfo

# The reply each request gets when it succeeds (else an Error); the clients check it.
REPLY_OF: dict[type[Request], type[ReplyBody]] = {
    Register: Registered,
    Heartbeat: Ack,
    Unregister: Ack,
    Step: StepReply,
    GetStats: Stats,
    ResetCache: CacheReset,
    Ping: Pong,
    GetBlockMap: BlockMap,
    GetBlockInfo: BlockInfo,
}


class Reply(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    call_id: int
    body: ReplyBody


_call_decoder = msgspec.msgpack.Decoder(Call)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def encode(message: Call | Reply) -> bytes:
    return _encoder.encode(message)


def decode_call(data: bytes) -> Call:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on anything that is not a ``Call``."""
    return _call_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)


def peek_header(data: bytes) -> tuple[int | None, int | None]:
    """``(version, call_id)`` of a frame that failed to decode, if it gets that far."""
    try:
        head = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None, None
    if isinstance(head, list) and len(head) >= 2 and all(isinstance(x, int) for x in head[:2]):
        return head[0], head[1]
    return None, None
