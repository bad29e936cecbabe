"""The order of a Step's parts, first-come-first-served placement and re-registration, against
the real daemon process over its socket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore import protocol as p
from kvstore.client import KVClient
from tests.conftest import start_kvstore, stop_process

BLOCK = 16


@pytest.fixture(scope="module")
def client() -> Iterator[KVClient]:
    # tiny, fp32: 8 KiB blocks; 0.0005 GiB = 65 blocks, watermark 1% = 0 blocks
    process, endpoint = start_kvstore("--kv-memory", "0.0005GiB", "--swap-memory", "0")
    with KVClient(endpoint, timeout_s=10) as c:
        yield c
    stop_process(process)


def register(client: KVClient, worker: str) -> p.Registered:
    reply = client.call(p.Register(worker, [(16, 0.001)], "cpu", 1))
    assert isinstance(reply, p.Registered)
    return reply


def step(client: KVClient, body: p.Step) -> p.StepReply:
    reply = client.call(body)
    assert isinstance(reply, p.StepReply)
    return reply


def used(client: KVClient) -> int:
    stats = client.call(p.GetStats(0))
    assert isinstance(stats, p.Stats)
    return stats.gpu.used


def test_a_final_registers_the_blocks_of_a_sequence_freed_in_the_same_step(
    client: KVClient,
) -> None:
    """A request that ends on the token its prompt drew never reported its prompt computed:
    its final progress, applied before the free, puts the prompt's full blocks in the index."""
    register(client, "w-final")
    prompt = list(range(500, 540))  # 2 full blocks and a partial one
    step(client, p.Step("w-final", admits=[p.AdmitItem("done", prompt)]))
    final = p.AppendItem("done", [], 40)
    reply = step(client, p.Step("w-final", frees=["done", "gone"], finals=[final]))
    assert [(e.req_id, e.op) for e in reply.errors] == [("gone", "free")]
    hit = step(client, p.Step("w-final", admits=[p.AdmitItem("again", prompt)])).admitted
    assert [(a.req_id, a.num_cached_tokens) for a in hit] == [("again", 32)]
    step(client, p.Step("w-final", frees=["again"]))


def test_a_fork_and_a_free_of_the_same_sequence_in_one_step(client: KVClient) -> None:
    """Forks come before frees: a child forked and freed in one step, and a parent freed in
    the step that forks its children (the children go on, alone on the prompt's blocks)."""
    register(client, "w-order")
    prompt = list(range(40))  # 3 blocks, the last one partial
    admitted = step(client, p.Step("w-order", admits=[p.AdmitItem("a", prompt)])).admitted
    assert [a.req_id for a in admitted] == ["a"]
    reply = step(
        client,
        p.Step("w-order", forks=[p.ForkItem("a", ["a#1", "a#2"])], frees=["a#1", "a"]),
    )
    assert reply.errors == []
    assert [f.req_id for f in reply.forked] == ["a#1", "a#2"]
    assert used(client) == 3  # a#2 holds the 3 blocks alone
    grown = step(client, p.Step("w-order", appends=[p.AppendItem("a#2", [7], 40)]))
    assert grown.errors == [] and grown.appended == []  # nobody shares its last block now
    step(client, p.Step("w-order", frees=["a#2"]))
    assert used(client) == 0


def test_placements_are_first_come_first_served(client: KVClient) -> None:
    """Once a placement is refused for space, nothing behind it in the step is placed: a large
    request at the head is not starved by small ones (it is placed once space frees up)."""
    reg = register(client, "w-fifo")
    assert reg.admission_limit_blocks == reg.num_gpu_blocks == 65
    filler = step(client, p.Step("w-fifo", admits=[p.AdmitItem("fill", [1] * BLOCK * 40)]))
    assert filler.errors == []
    big, small = p.AdmitItem("big", [2] * BLOCK * 30), p.AdmitItem("small", [3] * BLOCK)
    reply = step(client, p.Step("w-fifo", admits=[big, small]))
    assert [(e.req_id, e.code) for e in reply.errors] == [
        ("big", "no_space"),
        ("small", "no_space"),
    ]
    assert "earlier request" in reply.errors[1].message
    reply = step(client, p.Step("w-fifo", frees=["fill"], admits=[big, small]))
    assert reply.errors == [] and [a.req_id for a in reply.admitted] == ["big", "small"]
    too_large = p.AdmitItem("too-large", [4] * BLOCK * 66)
    reply = step(client, p.Step("w-fifo", frees=["big", "small"], admits=[too_large, small]))
    assert [(e.req_id, e.code) for e in reply.errors] == [("too-large", "too_large")]
    assert [a.req_id for a in reply.admitted] == ["small"]  # too large never blocks the rest
    step(client, p.Step("w-fifo", frees=["small"]))
    assert used(client) == 0


def test_registering_again_orphans_the_previous_registrations_requests(
    client: KVClient,
) -> None:
    """A worker that registers again (restarted under the same id, or after losing track of
    the daemon) finds its old requests orphaned, and adopts them without recomputing."""
    register(client, "w-again")
    step(client, p.Step("w-again", admits=[p.AdmitItem("kept", list(range(33)))]))
    step(client, p.Step("w-again", appends=[p.AppendItem("kept", [5], 33)]))
    register(client, "w-again")
    stats = client.call(p.GetStats(0))
    assert isinstance(stats, p.Stats)
    assert [(r.req_id, r.orphaned) for r in stats.requests if r.worker == "w-again"] == [
        ("kept", True)
    ]
    reply = step(
        client, p.Step("w-again", admits=[p.AdmitItem("kept", [*range(33), 5], adopt=True)])
    )
    assert reply.errors == [] and reply.admitted[0].num_computed == 33  # only the last token
    step(client, p.Step("w-again", frees=["kept"]))
    assert used(client) == 0
