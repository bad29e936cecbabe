"""``Requests``, the one map of a worker's requests and their sequences, exactly: sequences enter
through it (made by the scheduler), are looked up by id, and leave through ``finish``/``remove``
marked finished for the scheduler's policy."""

from __future__ import annotations

import pytest

from compute.batch.registry import Requests
from compute.batch.scheduler import Scheduler, SchedulerConfig, SeqStatus
from compute.faults import RequestError
from contracts.records import RequestRecord, SamplingParams
from contracts.tokenizer import load_tokenizer, output_decoder


def registry() -> Requests:
    decode = output_decoder(load_tokenizer("tiny"))
    return Requests(Scheduler(SchedulerConfig(), 4), decode, {0}, "w")


def record(req_id: str, n: int = 1) -> RequestRecord:
    return RequestRecord(req_id, [5, 6, 7], SamplingParams(n=n, max_tokens=4), "tiny")


def test_sequences_enter_are_found_and_leave_through_the_one_map() -> None:
    requests = registry()
    active = requests.start("e1", record("a", n=2))
    [root] = requests.sequences()
    assert (root.seq_id, root.max_len, requests.sequence("a")) == ("a", 7, root)
    assert requests.branch("a") == (active, active.branches[0]) and requests.owner("a") is active
    requests.scheduler.placed(root, [0, 1], 0, 3)
    root.token_ids.append(9)  # its first token, sampled
    child = requests.fork_branch(active, 1, 8).seq
    assert [s.seq_id for s in requests.running()] == ["a", "a#1"]
    assert child.token_ids == [5, 6, 7, 8] and child.block_ids == [0, 1]
    with pytest.raises(ValueError, match="already exists"):
        requests.fork_branch(active, 1, 8)
    assert requests.snapshot() == {"a": root, "a#1": child}  # the refused fork left nothing
    requests.finish("a#1")
    assert child.status is SeqStatus.FINISHED and requests.sequence("a#1") is None
    assert requests.remove(active) == ["a"]  # the kvstore holds it: the caller frees it
    assert root.status is SeqStatus.FINISHED and not requests.sequences() and not requests.active


def test_a_request_id_already_served_is_refused_leaving_the_first_alone() -> None:
    requests = registry()
    first = requests.start("e1", record("a"))
    with pytest.raises(RequestError, match="already being served"):
        requests.start("e2", record("a"))
    assert requests.active == {"a": first} and [s.seq_id for s in requests.sequences()] == ["a"]
