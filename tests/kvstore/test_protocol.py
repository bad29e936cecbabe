"""Every protocol message round-trips through MessagePack; no message type is left out."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from kvstore import protocol as p

HANDLE = p.CudaIpcHandle("GPU-1234", b"\x01" * 64, 1 << 30, 0, b"ref", 8, b"\x02" * 64, True)
POOL = p.PoolInfo("cuda_ipc", [4, 2, 2, 16, 2, 64], "bfloat16", 16, cuda=HANDLE)
PLACED = p.Placed("r1", [3, 4], 16, 16)
SAMPLES: list[msgspec.Struct] = [
    HANDLE,
    POOL,
    p.PoolInfo("shm", [4, 2, 2, 16, 2, 64], "float32", 16, shm_path="/dev/shm/x"),
    p.Register("w1", [(16, 0.001), (1024, 0.02)], "cuda:0", 42),
    p.Register("w1", [], "cpu", 1, [], [], p.ProfileOrigin("cached", 1.7e9, 8.5, 2)),
    p.ProfileOrigin("prior", 0.0, 0.0, 0),
    p.Heartbeat("w1"),
    p.Unregister("w1"),
    p.AdmitItem("r1", [1, 2, 3], b"salt", adopt=True),
    p.AppendItem("r1", [9], 3),
    p.ForkItem("r1", ["r1.1", "r1.2"]),
    p.TokenBatch(["r1", "r2"], [5, 6], [10, 20]),
    p.CostReport("r1", 0.25),
    p.Step(
        "w1",
        ["a"],
        ["b"],
        ["c"],
        [p.ForkItem("d", ["e"])],
        [p.AdmitItem("f", [1])],
        [p.AppendItem("g", [2], 1)],
        [p.CostReport("h", 1.5)],
        p.TokenBatch(["i"], [3], [4]),
        [p.AppendItem("j", [], 5)],
    ),
    p.GetStats(3),
    p.ResetCache(),
    p.Ping(),
    p.Error("bad_message", "nope"),
    p.Ack(),
    p.Registered(POOL, 100, 50, 10.0, 99),
    PLACED,
    p.Grown("r1", [7], [(2, 3, 8)]),
    p.ItemError("r1", "append", "no_space", "full"),
    p.StepReply(
        [("r1", "swap")],
        [PLACED],
        [PLACED],
        [PLACED],
        [p.Grown("r1", [], [])],
        [p.ItemError("x", "free", "unknown_request", "?")],
    ),
    p.TierStats(10, 5, 3, 2),
    p.PrefixRow("abcd", 2048, 99, 7, "gpu"),
    p.RequestRow("r1", "w1", "running", 40, 40, 3, 0, 16, 1, False),
    p.DecisionRow(0, "preempt", "r1", 1.0, "swap", "swap is cheaper", 3, 40, 0.001, 0.01, None),
    p.DecisionRow(1, "prefix", "r2", 2.0, "load", "loading is cheaper", 4, 64, 0.001, 0.01, 0.002),
    p.Calibration(1024, 1e-5, 1e-6, 1e-5, 1e-6, [(1, 1e-5, 2e-5)]),
    p.StepTimeline(3, 20, 0.01, {"launch": 0.002, "process": 0.001}, 2),
    p.WorkerRow("w1", "cuda:0", 42, 0.5, 3, [(16, 0.001)], [(16, 0, 0.001)], None, 0.0),
    p.WorkerRow(
        "w3", "cpu", 8, 0.1, 0, [], [], None, 0.0, p.ProfileOrigin("measured", 1.0, 2.0, 0)
    ),
    p.WorkerRow("w2", "cpu", 7, 0.1, 0, [], [], p.StepTimeline(10, 80, 0.5, {"launch": 0.1}), 0.4),
    p.Stats(
        16,
        1024,
        1,
        p.TierStats(1, 1, 0, 0),
        p.TierStats(0, 0, 0, 0),
        1,
        10,
        0,
        {"no_entry": 1},
        [],
        [],
        [],
        None,
        [],
        {"swap": 0},
        16,
        {"demoted": 2, "loaded": 1},
        True,
    ),
    p.CacheReset(3),
    p.Pong(1.5),
    p.Pong(2.5, 2),
    p.GetBlockMap(),
    p.GetBlockMap(1),
    p.GetBlockInfo("cpu", 3),
    p.GetBlockInfo("gpu", 3, 1),
    p.Register("w4", [], "cuda:0", 5, pool=1),
    p.Route([p.RouteItem("r1", [1, 2, 3]), p.RouteItem("r2", [4], b"salt")], "round_robin"),
    p.RouteItem("r3", [5, 6]),
    p.Routed([p.RoutedItem(1, 32, "copy", "cheapest (copy)", [0.5, 0.1])]),
    p.RoutedItem(0, 0, "none", "round robin"),
    p.PoolRow(1, "cuda:1", p.TierStats(8, 4, 2, 2), ["w4"], 2, 1, 300, 600, 320, 12),
    p.DecisionRow(2, "peer", "r3", 3.0, "copy", "copying is cheaper", 12, 192, 0.001, 0.01, 0.001),
    p.BlockMap(b"\x00\x01\x02", b"\x03\x04"),
    p.BlockInfo("gpu", 2, "cached", [], "abcd", 32, 5, 7),
]


def _structs() -> set[type]:
    return {
        cls
        for _, cls in inspect.getmembers(p, inspect.isclass)
        if issubclass(cls, msgspec.Struct)
        and cls.__module__.startswith(p.__name__)  # the package and its modules
        and not cls.__name__.startswith("_")
        and cls not in (p.Call, p.Reply)
    }


def test_every_message_type_has_a_sample() -> None:
    assert _structs() == {type(s) for s in SAMPLES}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(sample: msgspec.Struct) -> None:
    data = msgspec.msgpack.encode(sample)
    assert msgspec.msgpack.decode(data, type=type(sample)) == sample
    if isinstance(sample, p.Request):
        call = p.Call(p.PROTOCOL_VERSION, 7, sample)
        assert p.decode_call(p.encode(call)) == call
    if isinstance(sample, p.ReplyBody):
        reply = p.Reply(p.PROTOCOL_VERSION, 7, sample)
        assert p.decode_reply(p.encode(reply)) == reply


def test_garbage_is_a_decode_error_not_a_crash() -> None:
    for junk in (
        b"",
        b"\xc1",
        b"\x93\x01\x02",
        msgspec.msgpack.encode([1, 2, ["Nope"]]),
        msgspec.msgpack.encode({"version": 1}),
    ):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            p.decode_call(junk)
    assert p.peek_header(b"\xc1") == (None, None)
    assert p.peek_header(p.encode(p.Call(9, 4, p.Ping()))) == (9, 4)
