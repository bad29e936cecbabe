"""End-to-end serving throughput on a GPU: kvstore (CUDA IPC pool) + engine + Redis, no HTTP.

A Llama-3.2-1B-shaped random-weight bf16 model serves 128 requests (prompts uniform 64-1024
tokens, outputs uniform 32-512, ignore_eos, seed 0): all submitted at once to Redis, served by
the engine until every output stream is final. Baseline in the same run: transformers `generate`
with static batches of 32 (left padding, each batch runs to its longest output; only the
requested tokens count).

    python bench/serve.py [--requests 128] [--max-num-seqs 128] [--skip-baseline]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import redis.asyncio
from transformers import AutoModelForCausalLM, LlamaConfig

import compute.attention  # noqa: F401  (registers the "paged" attention function)
from compute.engine import Engine
from compute.models import byte_tokenizer
from compute.profile import measure_prefill
from compute.scheduler import SchedulerConfig
from gateway import queue
from kvstore import protocol as p
from kvstore.client import KVClient
from pagedserve.cli import spawn_kvstore
from pagedserve.redis_server import EmbeddedRedis


def llama_1b_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(128000) for _ in range(rng.randint(64, 1024))], rng.randint(32, 512))
        for _ in range(n)
    ]


def build_model(config: LlamaConfig, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    return model.cuda().eval()


def serve(
    model: torch.nn.Module, model_dir: str, jobs: list[tuple[list[int], int]], seqs: int
) -> dict:
    server = EmbeddedRedis.start()
    endpoint = f"ipc:///tmp/pagedserve-bench-{uuid.uuid4().hex[:8]}.sock"
    kvstore = spawn_kvstore(
        endpoint,
        [
            "--model",
            model_dir,
            "--dtype",
            "bfloat16",
            "--device",
            "cuda",
            "--kv-memory",
            "40",
            "--log-level",
            "WARNING",
        ],
        300,
    )
    try:
        r = redis.Redis.from_url(server.url)
        profile = measure_prefill(model, 16, (128, 1024), repeats=2)
        with KVClient(endpoint) as kv:
            engine = Engine(
                "bench", model, byte_tokenizer(), kv, r, SchedulerConfig(seqs, 8192), profile
            )
            run(engine, r, server.url, jobs[:4], "warmup")  # compiles the kernels
            kv.call(p.ResetCache())  # the timed run must not hit the warm-up's prompts
            result = run(engine, r, server.url, jobs, "run")
            result["stats"] = kv.call(p.GetStats(0))
        return result
    finally:
        kvstore.send_signal(2)
        kvstore.wait(60)
        server.stop()


def run(engine: Engine, r: redis.Redis, url: str, jobs: list, tag: str) -> dict:
    params = [queue.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in jobs]
    records = [
        queue.RequestRecord(f"{tag}-{i}", prompt, pp, "bench", time.time())
        for i, ((prompt, _), pp) in enumerate(zip(jobs, params, strict=True))
    ]

    async def submit() -> None:
        client = redis.asyncio.Redis.from_url(url)
        for record in records:
            await queue.submit(client, record)
        await client.aclose()

    start = time.perf_counter()
    asyncio.run(submit())
    steps = 0
    while True:
        engine.step()
        steps += 1
        if not engine.active and steps % 8 == 0:
            streamed = [queue.read_streamed(r, rec.req_id) for rec in records]
            if all(s.final for s in streamed):
                break
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(s.sequences[0].token_ids) for s in streamed)
    assert tokens == sum(m for _, m in jobs), "lost tokens"
    return {"seconds": seconds, "tokens": tokens, "steps": steps}


def static_baseline(model: torch.nn.Module, jobs: list, batch: int = 32) -> dict:
    model.generation_config.pad_token_id = 0
    useful, start = 0, time.perf_counter()
    for lo in range(0, len(jobs), batch):
        part = jobs[lo : lo + batch]
        width = max(len(prompt) for prompt, _ in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for i, (prompt, _) in enumerate(part):  # left padding
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        new = max(m for _, m in part)
        model.generate(
            input_ids=ids.cuda(),
            attention_mask=mask.cuda(),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
        useful += sum(m for _, m in part)
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "tokens": useful}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    config = llama_1b_config()
    jobs = workload(args.requests)
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)  # the kvstore reads the geometry from it
        model = build_model(config, "paged")
        ours = serve(model, model_dir, jobs, args.max_num_seqs)
    del model
    torch.cuda.empty_cache()
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(f"# {' '.join(sys.argv)}; {args.requests} requests, {ours['tokens']} output tokens")
    print("| system | seconds | output tok/s | ratio |")
    print("|---|---|---|---|")
    ours_tps = ours["tokens"] / ours["seconds"]
    if not args.skip_baseline:
        base = static_baseline(build_model(config, "sdpa"), jobs)
        base_tps = base["tokens"] / base["seconds"]
        print(
            f"| transformers generate, static batches of 32 (sdpa) | {base['seconds']:.1f} | "
            f"{base_tps:.0f} | 1.00 |"
        )
    ratio = f"{ours_tps / base_tps:.2f}" if not args.skip_baseline else "-"
    print(
        f"| pagedserve engine + kvstore + Redis ({ours['steps']} steps) | {ours['seconds']:.1f} | "
        f"{ours_tps:.0f} | {ratio} |"
    )
    stats = ours["stats"]
    print(f"# preemptions {stats.preemptions}, prefix hit tokens {stats.prefix_hit_tokens}")


if __name__ == "__main__":
    main()
