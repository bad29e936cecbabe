"""The kvstore protocol's replies (daemon -> client), the stats and block views included. Part
of ``kvstore.protocol``, which every user imports."""

from __future__ import annotations

from kvstore.protocol.base import (
    BlockState,
    Bring,
    DecisionKind,
    DecisionMode,
    ErrorCode,
    ItemCode,
    ItemOp,
    PreemptMode,
    RequestStatus,
    Tier,
    _Item,
    _Msg,
)
from kvstore.protocol.calls import (
    PoolInfo,
    ProfileOrigin,
    StepTimeline,
)


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


class PoolRow(_Item):
    """One pool of the host: its device, its GPU tier, its workers (those with a live lease), the
    requests it runs and those routed to it that no worker admitted yet, the prefix tokens it was
    asked for and hit, and the blocks copied into it from other pools (``loaded_in_blocks`` of
    them from another pool's CPU tier)."""

    pool: int
    device: str
    gpu: TierStats
    workers: list[str]
    running: int
    queued: int
    queued_tokens: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    copied_in_blocks: int
    loaded_in_blocks: int = 0


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
    pools: list[PoolRow] = []  # one per pool of the host; the fields above sum them
    # the daemon's seconds since its start: handling each message kind (``Step``, ``Route``, ...)
    # and writing back between calls (``between_calls``); within those, its copies by kind
    # (``tier_copies``: demotions and prefix loads; ``swaps``; ``peer_copies``; ``write_back``)
    busy_s: dict[str, float] = {}


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
    pools: int = 1  # the host's pools: the gateway routes each request when there are several


class RoutedItem(_Item):
    """Where one request goes: the ``pool``, the prefix tokens that pool will hold for it
    (``cached_tokens``), how they get there (``bring``), why (``reason``), and the predicted
    seconds of each pool (bringing the prefix, prefilling, waiting), in pool order."""

    pool: int
    cached_tokens: int
    bring: Bring
    reason: str
    predicted_s: list[float] = []


class Routed(_Msg):
    """``Route``'s answer: an item for each of its items, in order."""

    items: list[RoutedItem]
