"""Host cost of the engine step on a CPU, with a model so small its forward costs little.

Runs the real stack (embedded Redis, a kvstore daemon with a shared-memory pool, ``Engine``)
with ``tiny``'s byte tokenizer and a 1-layer, 32-wide Llama, ``--requests`` greedy requests at
once (prompts 64-256 bytes, ``--max-tokens`` each, ignore_eos), and prints the engine's phase
timeline per step and, with ``--profile``, the functions that cost the most host time
(cProfile). What it shows is the per-token host work the GPU would wait for.

    python bench/host_profile.py [--requests 128] [--max-tokens 128] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="print the top functions")
    parser.add_argument("--sort", default="tottime", help="--profile's order (a pstats key)")
    parser.add_argument("--top", default="25", help="--profile's rows, or a regex of names")
    args = parser.parse_args()

    import redis

    import compute.model.attention  # noqa: F401  (registers the "paged" attention function)
    from bench.serve import serve_jobs, stack_on
    from compute.batch.scheduler import SchedulerConfig
    from compute.loop.engine import Engine
    from contracts.heap import tune_gc_for_serving
    from contracts.tokenizer import BOS, EOS, PAD, byte_tokenizer
    from kvstore.client import KVClient

    config = LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=4096, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    torch.manual_seed(0)
    rng = random.Random(0)
    jobs = [
        ([rng.randrange(32, 127) for _ in range(rng.randint(64, 256))], args.max_tokens)
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
        flags = ["--device", "cpu", "--dtype", "float32", "--kv-memory", "0.25"]
        with stack_on(model_dir, flags) as (endpoint, url), KVClient(endpoint) as kv:
            engine = Engine(
                "host-profile", model, byte_tokenizer(), kv, redis.Redis.from_url(url),
                SchedulerConfig(args.requests, 8192), [(1, 0.0), (1024, 0.001)],
            )  # fmt: skip
            serve_jobs(engine, url, jobs[:4], "warmup")
            tune_gc_for_serving()  # as the worker does once it serves
            profiler = cProfile.Profile() if args.profile else None
            if profiler:
                profiler.enable()
            result = serve_jobs(engine, url, jobs, "run")
            if profiler:
                profiler.disable()
    steps = result["steps"]
    print(f"{result['tokens']} tokens in {result['seconds']:.2f} s, {steps} steps, "
          f"{1e3 * result['seconds'] / steps:.2f} ms per step")  # fmt: skip
    for phase, seconds in result["phases"].items():
        print(f"  {phase:>10}: {1e3 * seconds / steps:6.2f} ms per step")
    if profiler:
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(
            int(args.top) if args.top.isdigit() else args.top
        )


if __name__ == "__main__":
    main()
