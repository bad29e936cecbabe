"""Tensor parallelism on two GPUs (``-m gpu``, skipped with fewer than two): rank processes over
NCCL (``compute.parallel.group.join_group``), each loading its shards of a tiny safetensors
checkpoint, rank 0 driving the real ``KVCacheManager`` (``GreedyDriver``) and rank 1 following
its plans, with CUDA graphs of decode and mixed steps captured on both ranks (their all-reduces
inside the graphs).

Every sharded family in bf16 with the fused forwards (what the worker runs; the Triton kernels
take half precision only, so greedy equality with fp32 ``generate`` is tested on CPU over gloo,
``test_tensor_parallel.py``): teacher-forced logits as accurate as transformers' own bf16 SDPA
forward of the whole model on one GPU (``check_as_accurate_as_sdpa``).
"""

from __future__ import annotations

import faulthandler
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from compute.model.attention import ATTN_NAME
from compute.model.models import fuse_on_cuda, tiny_family_config
from compute.model.runner import ModelRunner
from compute.parallel.group import free_port, join_group, leave_group
from compute.parallel.sharding import SHARDED_FAMILIES, load_sharded
from tests.compute.driver import GreedyDriver, Seq, garbage_pool
from tests.compute.test_gpu import check_as_accurate_as_sdpa

BLOCKS, BLOCK_SIZE, GRAPH_BATCH, GRAPH_TOKENS, TOKEN_BUDGET = 512, 16, 16, 128, 160


def requests() -> list[tuple[list[int], int]]:
    """Prompts (one of 300 tokens, the others 1-69) and their new tokens: with a budget of 160
    tokens per step, some steps mix prompt chunks and decodes within 128 tokens (mixed graphs),
    some do not fit them (eager), and the last ones decode only (decode graphs)."""
    gen = torch.Generator().manual_seed(13)
    sizes = [300 if i == 5 else int(torch.randint(1, 70, (1,), generator=gen)) for i in range(14)]
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in sizes]
    return [(prompt, 4 + i) for i, prompt in enumerate(prompts)]


def checkpoint(family: str, directory: Path) -> Path:
    config = tiny_family_config(family)
    config.head_dim, config.max_position_embeddings = 64, 1024
    torch.manual_seed(SHARDED_FAMILIES.index(family))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def run_rank(rank: int, size: int, port: int, dirs: list[str], dtype: str, out: str) -> None:
    """One rank on GPU ``rank``: serves ``requests()`` on each checkpoint of ``dirs`` (rank 0)
    or follows (the others); writes what it saw."""
    faulthandler.dump_traceback_later(300, exit=True)  # a hung collective: its stacks, then out
    device = f"cuda:{rank}"
    group = join_group(rank, size, f"tcp://127.0.0.1:{port}", device, 120.0, "auto")
    try:
        results: dict[str, Any] = {"one_shot": group.one_shot is not None}
        for directory in dirs:
            torch_dtype = getattr(torch, dtype)
            model: Any = load_sharded(Path(directory), group, torch_dtype, device, ATTN_NAME)
            fuse_on_cuda(model)  # bf16: the fused forwards, as the worker loads shards
            if rank:
                pool = garbage_pool(model, BLOCKS, BLOCK_SIZE, group)
                runner = ModelRunner(
                    model, pool, BLOCK_SIZE, GRAPH_BATCH, GRAPH_TOKENS, group=group
                )
                runner.follow()
            else:
                driver = GreedyDriver(model, BLOCKS, BLOCK_SIZE, TOKEN_BUDGET, GRAPH_BATCH,
                                      GRAPH_TOKENS, group=group)  # fmt: skip
                runner = driver.runner
                try:
                    serve(driver)
                finally:
                    runner.stop_followers()
                seqs = driver.seqs.values()
                results[directory] = {
                    "outputs": [s.output for s in seqs],
                    "logits": [torch.stack(s.sampled_logits).tolist() for s in seqs],
                }
            assert runner.graphs is not None and runner.mixed is not None
            replays = [runner.graphs.replays, runner.mixed.replays]
            results.setdefault(directory, {})["replays"] = replays
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        leave_group()


def serve(driver: GreedyDriver) -> None:
    """Admits ``requests()`` one step apart (two pairs in the same step), then runs them out."""
    for i, (prompt, new) in enumerate(requests()):
        driver.admit(f"r{i}", prompt, new)
        if i not in (2, 8):
            driver.step()
    driver.run()


def two_ranks(dirs: list[Path], dtype: str, out: Path) -> list[dict[str, Any]]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    mp.spawn(run_rank, (2, free_port(), [str(d) for d in dirs], dtype, str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.gpu
def test_two_gpus_of_every_family_are_as_accurate_as_sdpa(tmp_path: Path) -> None:
    dirs = [checkpoint(f, tmp_path / f) for f in SHARDED_FAMILIES]
    ranks = two_ranks(dirs, "bfloat16", tmp_path)
    assert ranks[0]["one_shot"] and ranks[1]["one_shot"]  # small all-reduces over NVLink
    for directory in dirs:
        got = ranks[0][str(directory)]
        # both ranks replayed the same graphs, decode-only and mixed
        assert got["replays"] == ranks[1][str(directory)]["replays"], directory.name
        assert min(got["replays"]) > 0, (directory.name, got["replays"])
        # loaded as the worker loads a checkpoint: bf16 weights, fp32 rotary frequencies
        # (``.to(bfloat16)`` would round those too, and the positions of the long prompt with)
        whole: Any = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, attn_implementation=ATTN_NAME
        )
        whole = whole.to("cuda:0").eval()
        seqs = []
        for i, ((prompt, _), output, logits) in enumerate(
            zip(requests(), got["outputs"], got["logits"], strict=True)
        ):
            seq = Seq(f"r{i}", [*prompt, *output], len(prompt), len(output), [], 0, 0)
            seq.sampled_logits = list(torch.tensor(logits))
            seqs.append(seq)
        check_as_accurate_as_sdpa(seqs, whole)


def sum_both_ways(rank: int, port: int, out: str) -> None:
    """Sums of rank-dependent tensors (fp32 and bf16, 1 to 2,048 rows of 4,096) by the one-shot
    all-reduce, eager and replayed from a CUDA graph, set against NCCL's."""
    device = f"cuda:{rank}"
    group = join_group(rank, 2, f"tcp://127.0.0.1:{port}", device, 120.0, "auto")
    one_shot = group.one_shot
    assert one_shot is not None
    checked = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 3, 256, 2048):
            gen = torch.Generator(device).manual_seed(rows + rank)
            x = torch.randn(rows, 4096, device=device, dtype=dtype, generator=gen)
            assert one_shot.fits(x) == (rows * 4096 * x.element_size() <= 4 << 20)
            if not one_shot.fits(x):
                continue
            expected = x.clone()
            torch.distributed.all_reduce(expected)
            eager = one_shot(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = one_shot(x)
            x.mul_(2)  # the replay reads the new values
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(eager, expected), (dtype, rows)
            assert torch.equal(captured, expected * 2), (dtype, rows)
            checked.append(f"{dtype} {rows}")
    Path(out, f"sums{rank}.json").write_text(json.dumps(checked))
    leave_group()


@pytest.mark.gpu
def test_the_one_shot_all_reduce_sums_as_nccl_does(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    mp.spawn(sum_both_ways, (free_port(), str(tmp_path)), nprocs=2)
    checked = json.loads((tmp_path / "sums0.json").read_text())
    assert len(checked) == 6, checked  # 2,048 rows are over 4 MiB: NCCL's
