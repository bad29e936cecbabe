"""Tensor parallelism through the whole stack on CPU: a kvstore with ``--tensor-parallel-size 2``
(each pool split by KV heads into two ``/dev/shm`` rank pools), a worker group of two processes
over gloo (``pagedserve compute --tensor-parallel-size 2`` starts rank 1 itself), a gateway; tiny
fp32 checkpoints of every family the project serves. Over HTTP, greedy completions are identical
to transformers' ``generate`` on the whole model, token for token, and their logprobs match its
``log_softmax``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from compute.model.models import FAMILIES, tiny_family_config
from contracts import queue_worker
from contracts.tokenizer import byte_tokenizer
from pagedserve.redis_server import free_port
from tests.compute.driver import generate_greedy, paged_model
from tests.conftest import banner_of
from tests.pagedserve.test_up import NONE, start_up, submit, wait_final
from tests.stack import Stack, complete_greedy, running_stack

# 9 and 41 tokens; ids 130-258 are rank 1's share of the vocabulary (its embedding rows)
PROMPTS = [[1, 72, 101, 108, 108, 111, 44, 32, 119], [1, *range(40, 60), *range(200, 220)]]
MAX_TOKENS = 12
DB = 12


def family_checkpoint(family: str, directory: Path) -> Path:
    paged_model(tiny_family_config(family), seed=3).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def expected(
    checkpoint: Path, prompt: list[int], max_tokens: int = MAX_TOKENS
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for ``prompt`` and each one's log-probability."""
    ref: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokens = generate_greedy(ref, prompt, max_tokens)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    return tokens, [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def served_as_transformers(url: str, checkpoint: Path, prompt: list[int]) -> str:
    """Completes ``prompt`` greedily over HTTP and checks the text and the logprobs against
    transformers'; returns the pool that served it."""
    answer = complete_greedy(url, prompt, str(checkpoint))
    tokens, logprobs = expected(checkpoint, prompt)
    choice = answer["choices"][0]
    assert choice["text"] == byte_tokenizer().decode(tokens, skip_special_tokens=True)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4), prompt
    pool: str = answer["pool"]
    return pool


def tp_stack(
    redis_url: str, logs: Path, checkpoint: Path, *gateway_flags: str, pools: int = 1
) -> contextlib.AbstractContextManager[Stack]:
    """The CPU test stack of ``checkpoint`` with ``--tensor-parallel-size 2`` for the kvstore
    and the workers."""
    tp = ["--tensor-parallel-size", "2"]
    return running_stack(
        redis_url,
        logs,
        DB,
        "0.01GiB",
        *gateway_flags,
        model=str(checkpoint),
        kvstore_flags=tp,
        compute_flags=tp,
        pools=pools,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_serve_greedy_completions_as_transformers_does(
    family: str, redis_url: str, tmp_path: Path
) -> None:
    checkpoint = family_checkpoint(family, tmp_path / family)
    with tp_stack(redis_url, tmp_path, checkpoint) as stack:
        for prompt in PROMPTS:
            served_as_transformers(stack.url, checkpoint, prompt)
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "rank 1 of 2" in log and "rank 0 of 2" in log  # both ranks loaded their shards


def pids_of(argument: bytes, parent: int | None = None) -> list[int]:
    """The pids of running processes with ``argument`` on their command line (children of
    ``parent`` only, if given)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if argument in cmdline and parent in (None, ppid):
                pids.append(int(entry.name))
    return pids


def rank_pids() -> list[int]:
    """The pids of running ``compute.loop.rank`` processes (ranks 1 and up of a group)."""
    return pids_of(b"compute.loop.rank")


def streaming_group(
    tmp_path: Path, req_id: str
) -> tuple[subprocess.Popen[str], redis.Redis, Path, list[int], int]:
    """``pagedserve up --tensor-parallel-size 2`` of a tiny Llama checkpoint, with request
    ``req_id`` submitted and 10 of its tokens streamed: ``up``'s process, its Redis, the
    checkpoint, the prompt and ``max_tokens``."""
    checkpoint = family_checkpoint("llama", tmp_path / "llama")
    prompt, max_tokens = [1, *range(60, 100)], 150
    up = start_up(free_port(), tmp_path / "redis", checkpoint, "--tensor-parallel-size", "2")
    try:
        banner = banner_of(up, 180)
        redis_url = banner.split("redis ")[1].split(",")[0]
        r = redis.Redis.from_url(redis_url)
        submit(redis_url, req_id, max_tokens=max_tokens, prompt=prompt)
        deadline = time.monotonic() + 90
        while len(queue_worker.read_streamed(r, req_id).sequences.get(0, NONE).token_ids) < 10:
            assert time.monotonic() < deadline, "the group never streamed"
            time.sleep(0.05)
    except BaseException:
        up.send_signal(signal.SIGINT)
        up.wait(120)
        raise
    return up, r, checkpoint, prompt, max_tokens


@pytest.mark.parametrize("rank", [1, 0])
def test_sigkill_of_a_rank_mid_stream_restarts_the_group_and_the_stream_completes(
    rank: int, tmp_path: Path
) -> None:
    """``pagedserve up --tensor-parallel-size 2``: a rank gets SIGKILL while a request streams.
    Rank 1: rank 0 sees its process exit and exits too; rank 0 (the worker): rank 1 gets SIGKILL
    with it (its parent-death signal). ``up`` restarts the worker, which starts a new rank 1, and
    the restarted group takes its request back: the output is transformers'."""
    up, r, checkpoint, prompt, max_tokens = streaming_group(tmp_path, "tp-kill")
    try:
        [rank_1] = rank_pids()
        rank_0 = int(Path(f"/proc/{rank_1}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(rank_1 if rank else rank_0, signal.SIGKILL)
        gone = time.monotonic() + 10
        while rank_1 in rank_pids() or Path(f"/proc/{rank_0}/cmdline").exists():
            assert time.monotonic() < gone, "the other rank outlived the killed one"
            time.sleep(0.05)
        output = wait_final(r, "tp-kill", timeout_s=180)
        streamed = output.sequences[0].token_ids
        tokens, _ = expected(checkpoint, prompt, max_tokens)
        assert streamed == tokens
        assert rank_pids() and rank_1 not in rank_pids()  # a new rank 1 serves
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(120)
    log = up.stdout.read()  # type: ignore[union-attr]
    exits = [line for line in log.splitlines() if "exited with" in line]
    assert exits and "restarting" in exits[0], log[-3000:]  # the worker went down and came back
    print("\n".join(exits))


def test_the_kvstore_killed_mid_stream_the_group_maps_its_new_pools_and_completes(
    tmp_path: Path,
) -> None:
    """``pagedserve up --tensor-parallel-size 2``: the kvstore gets SIGKILL while a request
    streams. ``up`` restarts it with new rank pools; rank 0 registers again and sends rank 1 the
    new pools (a ``map`` plan), so the group lives on (the same rank 1 process) and recomputes
    the request: the output is transformers'."""
    up, r, checkpoint, prompt, max_tokens = streaming_group(tmp_path, "tp-kv")
    try:
        [rank_1] = rank_pids()
        [kvstore] = pids_of(b"kvstore", parent=up.pid)
        os.kill(kvstore, signal.SIGKILL)
        output = wait_final(r, "tp-kv", timeout_s=180)
        tokens, _ = expected(checkpoint, prompt, max_tokens)
        assert output.sequences[0].token_ids == tokens
        assert rank_pids() == [rank_1]  # the same group, over the new pools
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(120)
    log = up.stdout.read()  # type: ignore[union-attr]
    again = log.find("the kvstore's pool is new: mapping it again")  # after the banner's lines
    assert again >= 0 and "rank 1 mapped its pool" in log[again:], log[-3000:]


def test_two_pools_of_two_ranks_each_serve_as_transformers_does(
    redis_url: str, tmp_path: Path
) -> None:
    """Data parallel x tensor parallel on CPU: ``--data-parallel-size 2 --tensor-parallel-size
    2``, four rank processes in two groups over gloo, four rank pools; requests dealt to the two
    pools in turn come back as transformers' on each."""
    checkpoint = family_checkpoint("qwen2", tmp_path / "qwen2")
    with tp_stack(redis_url, tmp_path, checkpoint, "--routing", "round_robin", pools=2) as stack:
        served = {served_as_transformers(stack.url, checkpoint, p) for p in [*PROMPTS, *PROMPTS]}
    assert served == {"0", "1"}
    for pool in (0, 1):
        log = (tmp_path / f"worker-{pool}.log").read_text(errors="replace")
        assert "rank 1 mapped its pool" in log, log[-2000:]
