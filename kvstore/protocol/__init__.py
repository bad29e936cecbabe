"""Every message between the kvstore daemon and its clients: msgspec Structs on MessagePack.

Wire: a ZeroMQ DEALER (client) -> ROUTER (daemon); one frame of payload per message. A call is a
``Call`` envelope carrying a ``version``, a client-chosen ``call_id`` and one request body; the
answer is a ``Reply`` with the same ``call_id`` and one reply body, ``Error`` included. Structs
are tagged (``type`` = class name) and array-encoded, so a step carrying 256 requests stays small.
No pickle anywhere. Torch-free.

One protocol, imported as ``kvstore.protocol``: its version, limits and code sets (``base``),
the calls (``calls``), the replies (``replies``), and here the envelopes and the codec.
"""

from __future__ import annotations

import msgspec

from kvstore.protocol.base import (
    BLOCK_STATES,
    LEASE_TIMEOUT_S,
    LOOKAHEAD_SLOTS,
    PROTOCOL_VERSION,
    BlockState,
    Bring,
    DecisionKind,
    DecisionMode,
    ErrorCode,
    ItemCode,
    ItemOp,
    PoolKind,
    PreemptMode,
    ProfileSource,
    RequestStatus,
    RoutingPolicy,
    Tier,
)
from kvstore.protocol.calls import (
    AdmitItem,
    AppendItem,
    Call,
    CostReport,
    CudaIpcHandle,
    ForkItem,
    GetBlockInfo,
    GetBlockMap,
    GetStats,
    Heartbeat,
    Ping,
    PoolInfo,
    ProfileOrigin,
    Register,
    Request,
    ResetCache,
    Route,
    RouteItem,
    Step,
    StepTimeline,
    TokenBatch,
    Unregister,
)
from kvstore.protocol.replies import (
    Ack,
    BlockInfo,
    BlockMap,
    CacheReset,
    Calibration,
    DecisionRow,
    Error,
    Grown,
    ItemError,
    Placed,
    Pong,
    PoolRow,
    PrefixRow,
    Registered,
    RequestRow,
    Routed,
    RoutedItem,
    Stats,
    StepReply,
    TierStats,
    WorkerRow,
)

__all__ = [
    "BLOCK_STATES",
    "LEASE_TIMEOUT_S",
    "LOOKAHEAD_SLOTS",
    "PROTOCOL_VERSION",
    "REPLY_OF",
    "Ack",
    "AdmitItem",
    "AppendItem",
    "BlockInfo",
    "BlockMap",
    "BlockState",
    "Bring",
    "CacheReset",
    "Calibration",
    "Call",
    "CostReport",
    "CudaIpcHandle",
    "DecisionKind",
    "DecisionMode",
    "DecisionRow",
    "Error",
    "ErrorCode",
    "ForkItem",
    "GetBlockInfo",
    "GetBlockMap",
    "GetStats",
    "Grown",
    "Heartbeat",
    "ItemCode",
    "ItemError",
    "ItemOp",
    "Ping",
    "Placed",
    "Pong",
    "PoolInfo",
    "PoolKind",
    "PoolRow",
    "PreemptMode",
    "PrefixRow",
    "ProfileOrigin",
    "ProfileSource",
    "Register",
    "Registered",
    "Reply",
    "ReplyBody",
    "Request",
    "RequestRow",
    "RequestStatus",
    "ResetCache",
    "Route",
    "RouteItem",
    "Routed",
    "RoutedItem",
    "RoutingPolicy",
    "Stats",
    "Step",
    "StepReply",
    "StepTimeline",
    "Tier",
    "TierStats",
    "TokenBatch",
    "Unregister",
    "WorkerRow",
    "decode_call",
    "decode_reply",
    "encode",
    "peek_header",
]

ReplyBody = (
    Error | Ack | Registered | StepReply | Stats | CacheReset | Pong | BlockMap | BlockInfo | Routed
)

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
    Route: Routed,
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
