"""The four model families in bf16 on the GPU, through the real stack: a kvstore daemon (CUDA IPC
pool), Redis and the worker's engine (Triton kernels, CUDA-graph decodes), against transformers'
SDPA forward of the same weights.

For each family (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm; 8 layers, 16/4
heads, d 128, vocab 32000, random weights) 32 requests (prompts 16-600 tokens, 24 greedy output
tokens each) are served; the logits the engine sampled from at the first 4 output positions of
every request are compared with an fp32 forward of the same weights over the same tokens
(teacher-forced), and so are transformers' own bf16 SDPA logits: the bf16 noise floor the engine
should match. Greedy choices are compared with the fp32 argmax at every output position.

    python bench/families.py [family ...]
"""

from __future__ import annotations

import copy
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
from transformers import AutoModelForCausalLM, PretrainedConfig

import compute.model.attention  # noqa: F401  (registers the "paged" attention function)
from bench.serve import serve_jobs, stack
from compute.batch.scheduler import SchedulerConfig
from compute.loop.engine import Engine
from compute.model.models import FAMILIES, byte_tokenizer, tiny_family_config
from compute.model.runner import Feed, ScheduledChunk
from contracts import queue_worker

CAPTURED_POSITIONS = 4  # output positions whose logits are compared per request


def family_config(family: str) -> PretrainedConfig:
    config: PretrainedConfig = tiny_family_config(family)
    config.update(
        {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "max_position_embeddings": 4096,
        }
    )
    if getattr(config, "layer_types", None) is not None:  # Qwen2/3 list one type per layer
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    return config


def capture_logits(engine: Engine) -> dict[str, dict[int, torch.Tensor]]:
    """Wraps the engine's forward: keeps the logits row of every sampling chunk, by sequence id
    and position of the token it predicts, for each request's first CAPTURED_POSITIONS."""
    captured: dict[str, dict[int, torch.Tensor]] = {}
    runner = engine.runner
    assert runner is not None  # built when the engine registered with the kvstore
    forward = runner.forward

    def recording(batch: Sequence[ScheduledChunk], feed: Feed | None = None) -> torch.Tensor:
        logits = forward(batch, feed)  # [B, vocab]
        by_table = {id(s.block_ids): s for s in engine.requests.sequences()}
        for row, chunk in enumerate(batch):
            seq = by_table[id(chunk.block_ids)]
            end = chunk.start + len(chunk.token_ids)
            last = len(seq.token_ids) + seq.inflight  # a fed chunk's token is in flight
            if end == last and end - seq.num_prompt < CAPTURED_POSITIONS:
                captured.setdefault(seq.seq_id, {})[end] = logits[row].float().cpu()
        return logits

    runner.forward = recording  # type: ignore[method-assign]
    return captured


@torch.inference_mode()
def check_family(family: str) -> dict:
    config = family_config(family)
    torch.manual_seed(FAMILIES.index(family))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged")
    model = model.to("cuda", torch.bfloat16).eval()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    rng = random.Random(FAMILIES.index(family))
    jobs = [([rng.randrange(32000) for _ in range(rng.randint(16, 600))], 24) for _ in range(32)]
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        with stack(model_dir, "8") as (endpoint, url):
            from kvstore.client import KVClient

            with KVClient(endpoint) as kv:
                engine = Engine(
                    "families",
                    model,
                    byte_tokenizer(),
                    kv,
                    redis.Redis.from_url(url),
                    SchedulerConfig(64, 2048),
                    [(16, 0.001), (2048, 0.05)],
                    cuda_graph_max_batch=64,
                )
                captured = capture_logits(engine)
                serve_jobs(engine, url, jobs, "fam")
                outputs = [
                    queue_worker.read_streamed(redis.Redis.from_url(url), f"fam-{i}").sequences[0]
                    for i in range(len(jobs))
                ]
    runner = engine.runner
    assert runner is not None
    ref32 = copy.deepcopy(ref).float()  # the oracle: fp32 weights (the bf16 ones, upcast)
    ours_err, sdpa_err, ours_agree, sdpa_agree, total = [], [], 0, 0, 0
    for i, ((prompt, _), out) in enumerate(zip(jobs, outputs, strict=True)):
        ids = torch.tensor([(prompt + out.token_ids)[:-1]], device="cuda")
        exact = ref32(ids).logits[0].float().cpu()  # [L, V]
        sdpa = ref(ids).logits[0].float().cpu()  # [L, V] transformers' own bf16 path
        for end, got in captured[f"fam-{i}"].items():  # got predicts token `end`
            scale = exact[end - 1].abs().max()
            ours_err.append(float((got - exact[end - 1]).abs().max() / scale))
            sdpa_err.append(float((sdpa[end - 1] - exact[end - 1]).abs().max() / scale))
        best = exact[len(prompt) - 1 :].argmax(-1)  # fp32 greedy choice at each output position
        ours_agree += int((best == torch.tensor(out.token_ids)).sum())
        sdpa_agree += int((best == sdpa[len(prompt) - 1 :].argmax(-1)).sum())
        total += len(out.token_ids)
    return {
        "family": family,
        "rows": len(ours_err),
        "ours_err": (max(ours_err), sum(ours_err) / len(ours_err)),
        "sdpa_err": (max(sdpa_err), sum(sdpa_err) / len(sdpa_err)),
        "ours_agree": ours_agree / total,
        "sdpa_agree": sdpa_agree / total,
        "graph_replays": runner.graphs.replays if runner.graphs else 0,
    }


def main() -> None:
    print(f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} torch {torch.__version__}")
    print("# python bench/families.py; bf16, engine + kvstore (CUDA IPC) + Redis vs SDPA")
    print("| family | rows | ours vs fp32: max / mean rel err | SDPA bf16 vs fp32 | "
          "ours = fp32 argmax | SDPA bf16 = fp32 argmax | graph replays |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for family in sys.argv[1:] or FAMILIES:  # e.g. python bench/families.py llama
        r = check_family(family)
        print(
            f"| {r['family']} | {r['rows']} | {r['ours_err'][0]:.4f} / {r['ours_err'][1]:.4f} "
            f"| {r['sdpa_err'][0]:.4f} / {r['sdpa_err'][1]:.4f} | {r['ours_agree']:.1%} "
            f"| {r['sdpa_agree']:.1%} | {r['graph_replays']} |"
        )


if __name__ == "__main__":
    main()
