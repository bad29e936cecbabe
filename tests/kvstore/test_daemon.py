"""The kvstore daemon as a real process, over its real ZeroMQ socket."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvstore import protocol as p
from kvstore.client import KVClient, KVStoreError
from tests.conftest import ROOT, start_kvstore, stop_process


@pytest.fixture(scope="module")
def daemon() -> Iterator[str]:
    process, endpoint = start_kvstore(
        "--kv-memory",
        "0.01GiB",
        "--swap-memory",
        "0.005GiB",
        "--lease-timeout-s",
        "1",
        "--orphan-grace-s",
        "1",
    )
    yield endpoint
    log = stop_process(process)
    assert process.returncode == 0, log
    assert "kvstore stopped" in log


@pytest.fixture
def client(daemon: str) -> Iterator[KVClient]:
    with KVClient(daemon, timeout_s=10) as c:
        yield c


def register(client: KVClient, worker: str) -> p.Registered:
    reply = client.call(p.Register(worker, [(16, 0.001), (256, 0.01)], "cpu", 1))
    assert isinstance(reply, p.Registered)
    return reply


def test_register_admit_append_fork_free(client: KVClient) -> None:
    reg = register(client, "w-basic")
    assert reg.pool.kind == "shm" and reg.pool.shape[0] == reg.num_gpu_blocks
    prompt = list(range(1000, 1040))
    reply = client.call(p.Step("w-basic", admits=[p.AdmitItem("b1", prompt)]))
    assert isinstance(reply, p.StepReply) and not reply.errors
    [placed] = reply.admitted
    assert len(placed.block_ids) == 3 and placed.num_cached_tokens == 0
    # Forks run before appends in a step: b1's next write goes into block 2, now shared.
    reply = client.call(
        p.Step("w-basic", appends=[p.AppendItem("b1", [5], 40)], forks=[p.ForkItem("b1", ["b1.1"])])
    )
    assert reply.forked[0].block_ids == placed.block_ids
    [grown] = reply.appended
    assert grown.new_block_ids == [] and grown.copies[0][:2] == (2, placed.block_ids[2])
    reply = client.call(p.Step("w-basic", appends=[p.AppendItem("b1", [6], 41)]))
    assert reply.appended == []  # block 2 is private now and has room: nothing changed
    reply = client.call(p.Step("w-basic", admits=[p.AdmitItem("b2", prompt)]))
    assert reply.admitted[0].num_cached_tokens == 32
    reply = client.call(p.Step("w-basic", frees=["b1", "b1.1", "b2", "nope"]))
    assert [(e.req_id, e.code) for e in reply.errors] == [("nope", "unknown_request")]


def test_calls_may_overlap_and_each_reply_reaches_its_receive(client: KVClient) -> None:
    """A worker sends its Step and takes the reply a step later; other calls in between (the
    bench's stats, a retry) keep it for that ``receive`` instead of dropping it."""
    register(client, "w-overlap")
    admit = p.Step("w-overlap", admits=[p.AdmitItem("o1", list(range(3000, 3020)))])
    call_id = client.send(admit)
    stats = client.call(p.GetStats(0))  # answered after the Step: its reply is kept
    assert isinstance(stats, p.Stats) and any(r.req_id == "o1" for r in stats.requests)
    reply = client.receive(admit, call_id)
    assert isinstance(reply, p.StepReply) and [a.req_id for a in reply.admitted] == ["o1"]
    forgotten = client.send(p.Ping())
    client.forget(forgotten)  # its reply is skipped when it comes
    assert isinstance(client.call(p.Ping()), p.Pong)
    client.call(p.Step("w-overlap", frees=["o1"]))


def test_copy_on_write_copy_comes_back_to_the_worker(client: KVClient) -> None:
    register(client, "w-cow")
    client.call(p.Step("w-cow", admits=[p.AdmitItem("c1", list(range(2000, 2020)))]))
    reply = client.call(
        p.Step("w-cow", forks=[p.ForkItem("c1", ["c1.1"])], appends=[p.AppendItem("c1", [7], 20)])
    )
    [grown] = reply.appended
    position, src, dst = grown.copies[0]
    assert position == 1 and src == reply.forked[0].block_ids[1] and dst != src
    client.call(p.Step("w-cow", frees=["c1", "c1.1"]))


def test_step_errors_are_per_item(client: KVClient) -> None:
    reg = register(client, "w-err")
    reply = client.call(
        p.Step(
            "w-err",
            admits=[p.AdmitItem("e1", []), p.AdmitItem("e2", [1, 2])],
            appends=[p.AppendItem("ghost", [1], 0)],
        )
    )
    assert [(e.req_id, e.op, e.code) for e in reply.errors] == [  # appends run before admits
        ("ghost", "append", "unknown_request"),
        ("e1", "admit", "bad_argument"),
    ]
    assert [a.req_id for a in reply.admitted] == ["e2"]
    huge = client.call(p.Step("w-err", admits=[p.AdmitItem("e3", [1] * 10_000_000)]))
    assert huge.errors[0].code == "too_large" and "at most" in huge.errors[0].message
    big = client.call(
        p.Step("w-err", admits=[p.AdmitItem("e4", [1] * 16 * (reg.num_gpu_blocks // 2))])
    )
    assert big.errors == [] and big.admitted[0].req_id == "e4"
    too_big = [2] * 16 * (reg.num_gpu_blocks // 2 + 1)
    full = client.call(p.Step("w-err", admits=[p.AdmitItem("e5", too_big)]))
    assert full.errors[0].code == "no_space" and "watermark" in full.errors[0].message
    client.call(p.Step("w-err", frees=["e4"]))
    client.call(p.Step("w-err", frees=["e2"]))


def test_bad_frames_get_error_replies_and_the_daemon_keeps_serving(daemon: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon)
    cases = {
        b"\xc1 not msgpack": "bad_message",
        msgspec.msgpack.encode([p.PROTOCOL_VERSION, 5, ["NoSuchMessage"]]): "bad_message",
        msgspec.msgpack.encode([p.PROTOCOL_VERSION, 6, ["Heartbeat", 12]]): "bad_message",
        msgspec.msgpack.encode({"hello": "world"}): "bad_message",
        p.encode(p.Call(p.PROTOCOL_VERSION + 1, 8, p.Ping())): "version",
        p.encode(p.Call(p.PROTOCOL_VERSION, 9, p.Step("never-registered"))): "unknown_worker",
    }
    for frame, code in cases.items():
        sock.send(frame)
        assert sock.poll(5000), f"no reply to {frame!r}"
        reply = p.decode_reply(sock.recv())
        assert isinstance(reply.body, p.Error) and reply.body.code == code, (frame, reply)
    sock.send_multipart([b"two", b"frames"])
    assert sock.poll(5000)
    body = p.decode_reply(sock.recv()).body
    assert isinstance(body, p.Error) and body.code == "bad_message"
    sock.close()
    with KVClient(daemon) as client:
        assert isinstance(client.call(p.Ping()), p.Pong)


def test_without_a_token_configured_any_token_is_accepted(daemon: str) -> None:
    for token in ("", "anything"):
        with KVClient(daemon, token=token) as client:
            assert isinstance(client.call(p.Ping()), p.Pong)


def test_the_socket_and_the_pool_file_are_private(daemon: str, client: KVClient) -> None:
    path = daemon.removeprefix("ipc://")
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    pool = register(client, "w-private").pool.shm_path
    assert stat.S_IMODE(os.stat(pool).st_mode) == 0o600
    client.call(p.Unregister("w-private"))


def test_dead_worker_requests_are_kept_for_grace_then_reclaimed(client: KVClient) -> None:
    register(client, "w-dies")
    client.call(p.Step("w-dies", admits=[p.AdmitItem("d1", list(range(3000, 3050)))]))
    client.call(p.Step("w-dies", appends=[p.AppendItem("d1", [1], 50)]))
    # w-dies goes silent; within the lease + grace another worker adopts d1 (with one token
    # fewer than the kvstore has: it never reached the output stream).
    time.sleep(1.6)
    register(client, "w-heir")
    rows = {r.req_id: r for r in client.call(p.GetStats()).requests}
    assert rows["d1"].orphaned
    reply = client.call(
        p.Step("w-heir", admits=[p.AdmitItem("d1", list(range(3000, 3050)), adopt=True)])
    )
    # all 50 were computed, but the last one is always recomputed: its logits are needed
    assert reply.admitted[0].num_computed == 49 and not reply.errors
    client.call(p.Step("w-heir", admits=[p.AdmitItem("d2", list(range(4000, 4020)))]))
    # w-heir goes silent too: after lease (1 s) + grace (1 s) both requests are reclaimed.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = client.call(p.GetStats())
        if not any(r.req_id in ("d1", "d2") for r in stats.requests):
            break
        time.sleep(0.3)
    assert not any(r.req_id in ("d1", "d2") for r in stats.requests)
    assert stats.gpu.used == 0


def test_stats_and_cache_reset(client: KVClient) -> None:
    register(client, "w-stats")
    prompt = list(range(5000, 5064))
    client.call(p.Step("w-stats", admits=[p.AdmitItem("s1", prompt)]))
    client.call(p.Step("w-stats", appends=[p.AppendItem("s1", [1], 64)]))
    client.call(p.Step("w-stats", admits=[p.AdmitItem("s2", prompt)]))
    stats = client.call(p.GetStats(5))
    assert isinstance(stats, p.Stats)
    # s1: 65 tokens in 5 blocks; s2 shares 3, owns its 4th (recomputed) and its lookahead block
    assert stats.gpu.used == 5 + 2
    assert stats.top_prefixes[0].tokens == 48 and stats.top_prefixes[0].hits == 1
    assert stats.calibration is not None and stats.calibration.samples
    assert {r.req_id for r in stats.requests} >= {"s1", "s2"}
    [row] = [w for w in stats.workers if w.worker_id == "w-stats"]
    assert (row.device, row.pid, row.requests) == ("cpu", 1, 2)
    assert row.prefill_profile == [(16, 0.001), (256, 0.01)]
    with pytest.raises(KVStoreError, match="unknown_worker"):
        client.call(p.Heartbeat("nobody"))
    client.call(p.Step("w-stats", frees=["s1", "s2"]))
    reset = client.call(p.ResetCache())
    assert isinstance(reset, p.CacheReset) and reset.blocks >= 4  # earlier tests' blocks too
    assert client.call(p.GetStats()).gpu.cached == 0
    reply = client.call(p.Step("w-stats", admits=[p.AdmitItem("s3", prompt)]))
    assert reply.admitted[0].num_cached_tokens == 0
    client.call(p.Step("w-stats", frees=["s3"]))


def test_unregister_orphans_at_once_and_heartbeat_renews(client: KVClient) -> None:
    register(client, "w-leaves")
    assert isinstance(client.call(p.Heartbeat("w-leaves")), p.Ack)
    reply = client.call(p.Step("w-leaves", admits=[p.AdmitItem("u1", list(range(6000, 6010)))]))
    blocks = reply.admitted[0].block_ids
    client.call(p.Unregister("w-leaves"))
    rows = {r.req_id: r for r in client.call(p.GetStats()).requests}
    assert rows["u1"].orphaned and rows["u1"].worker == "w-leaves"
    with pytest.raises(KVStoreError, match="unknown_worker"):
        client.call(p.Heartbeat("w-leaves"))
    register(client, "w-takes")
    item = p.AdmitItem("u1", list(range(6000, 6010)), adopt=True)
    reply = client.call(p.Step("w-takes", admits=[item]))
    assert not reply.errors and reply.admitted[0].block_ids == blocks  # the same blocks, kept
    rows = {r.req_id: r for r in client.call(p.GetStats()).requests}
    assert rows["u1"].worker == "w-takes" and not rows["u1"].orphaned
    client.call(p.Step("w-takes", frees=["u1"]))


def test_token_batch_takes_the_fast_path_and_falls_back_per_item(client: KVClient) -> None:
    register(client, "w-tok")
    admits = [
        p.AdmitItem("t1", list(range(7000, 7020))),
        p.AdmitItem("t2", list(range(8000, 8029))),
    ]
    client.call(p.Step("w-tok", admits=admits))
    client.call(p.Step("w-tok", appends=[p.AppendItem("t1", [1], 20), p.AppendItem("t2", [1], 29)]))
    # t1 (21 tokens) stays in its blocks; t2's 31st token leaves its second lookahead slot past
    # its two blocks: a third; t3 does not exist.
    batch = p.TokenBatch(["t1", "t2", "t3"], [2, 2, 2], [21, 30, 0])
    reply = client.call(p.Step("w-tok", tokens=batch))
    assert [(g.req_id, len(g.new_block_ids)) for g in reply.appended] == [("t2", 1)]
    assert [(e.req_id, e.code) for e in reply.errors] == [("t3", "unknown_request")]
    rows = {r.req_id: r for r in client.call(p.GetStats()).requests}
    assert (rows["t1"].tokens, rows["t1"].num_computed) == (22, 21)
    assert (rows["t2"].tokens, rows["t2"].gpu_blocks) == (31, 3)
    bad = client.call(p.Step("w-tok", tokens=p.TokenBatch(["t1"], [1, 2], [22])))
    assert bad.errors[0].code == "bad_argument" and "differ in length" in bad.errors[0].message
    client.call(p.Step("w-tok", frees=["t1", "t2"]))


def test_recompute_decision_gets_the_cost_the_worker_reports(client: KVClient) -> None:
    # A worker whose prefill is nearly free: the cost model picks recompute over swap.
    client.call(p.Register("w-cost", [(16, 1e-9), (256, 1e-8)], "cpu", 2))
    client.call(p.Step("w-cost", admits=[p.AdmitItem("k1", list(range(9000, 9040)))]))
    client.call(p.Step("w-cost", appends=[p.AppendItem("k1", [1], 40)]))
    reply = client.call(p.Step("w-cost", preempts=["k1"]))
    assert reply.preempted == [("k1", "recompute")]
    reply = client.call(p.Step("w-cost", resumes=["k1"]))
    assert reply.resumed[0].num_computed == 32  # two full blocks come back as prefix hits
    reply = client.call(
        p.Step("w-cost", costs=[p.CostReport("k1", 0.125), p.CostReport("nobody", 1.0)])
    )
    assert [(e.req_id, e.op, e.code) for e in reply.errors] == [
        ("nobody", "cost", "unknown_request")
    ]
    [decision] = [d for d in client.call(p.GetStats()).decisions if d.req_id == "k1"]
    assert (decision.mode, decision.reason) == ("recompute", "recompute is cheaper")
    recompute_s, swap_s = decision.predicted_recompute_s, decision.predicted_swap_s
    assert recompute_s is not None and swap_s is not None
    assert decision.actual_s == 0.125 and recompute_s < swap_s
    client.call(p.Step("w-cost", frees=["k1"]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-memory", "lots"], "expected GiB"),
        (["--swap-memory", "-2"], "must not be negative"),
        (["--kv-memory", "0.0000001GiB"], "holds no block"),
        (["--demote-at-eviction-ms", "-1"], "--demote-at-eviction-ms -1.0: at least 0"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(flags: list[str], message: str) -> None:
    endpoint = f"ipc:///tmp/pagedserve-test-{uuid.uuid4().hex[:8]}.sock"  # not the default one
    cmd = [sys.executable, "-m", "pagedserve.cli", "kvstore", "--device", "cpu", *flags]
    done = subprocess.run(
        [*cmd, "--endpoint", endpoint], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
    assert not os.path.exists(endpoint.removeprefix("ipc://"))  # bound first, removed on exit
