"""Model loading for compute workers: ``tiny`` (random weights, byte tokenizer) or a local HF
checkpoint directory (``smollm2`` and GGUF files resolve to one: ``contracts.checkpoints``).
Every model is loaded with the paged attention function (``attn_implementation="paged"``, see
``compute.model.attention``); fp16/bf16 models on CUDA also get fused RMSNorm, attention and MLP
forwards (``compute.model.fused``).

Tokenizers (the byte tokenizer of ``tiny``, or the checkpoint's) come from
``contracts.tokenizer``, the one implementation the gateway uses too.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from compute.model.attention import ATTN_NAME
from compute.model.fused import fuse_layers
from compute.parallel.layers import TPGroup
from compute.parallel.sharding import checkpoint_dir, load_sharded
from contracts.checkpoints import resolve_model
from contracts.model_config import TINY, resolve_dtype, tiny_config
from contracts.tokenizer import BOS, EOS, PAD, byte_tokenizer, load_tokenizer

__all__ = [
    "BOS",
    "EOS",
    "FAMILIES",
    "PAD",
    "TINY_SEED",
    "byte_tokenizer",
    "load_model",
    "load_sharded_model",
    "tiny_family_config",
]

log = logging.getLogger("pagedserve.compute")

TINY_SEED = 0
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_family_config(family: str) -> Any:
    """A tiny random-weight config of ``family`` (llama, mistral, qwen2 with q/k/v bias, qwen3 with
    q/k norm) for tests: fp32, 2 layers, 4 query / 2 KV heads, head_dim 16, byte vocabulary."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": 259,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "initializer_range": 0.2,  # larger than the default 0.02: varied greedy outputs
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":  # sliding window larger than any test context: plain causal
        return MistralConfig(**common, sliding_window=4096)
    if family == "qwen2":  # q/k/v projections carry a bias in Qwen2
        return Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":  # per-head RMSNorm on q and k
        return Qwen3Config(**common | {"tie_word_embeddings": True}, use_sliding_window=False)
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def _torch_dtype(config: Any, dtype: str, device: str) -> torch.dtype:
    name = resolve_dtype(config, dtype, device)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_sharded_model(
    model: str, dtype: str, device: str, group: TPGroup
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """This rank's shards of ``model`` (a checkpoint directory: ``compute.parallel.sharding``) in
    eval mode on ``device`` with paged attention, and its tokenizer; ``dtype`` as ``load_model``
    resolves it."""
    started = time.perf_counter()
    path = checkpoint_dir(model)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    torch_dtype = _torch_dtype(config, dtype, device)
    net = load_sharded(path, group, torch_dtype, device, ATTN_NAME)
    fuse_on_cuda(net)
    log.info(
        "rank %d of %d: %s shards ready, %s on %s, %.1f s",
        group.rank,
        group.size,
        config.model_type,
        torch_dtype,
        device,
        time.perf_counter() - started,
    )
    return net, load_tokenizer(model)


def fuse_on_cuda(net: PreTrainedModel) -> None:
    """Fuses the forwards of a half-precision model on CUDA (``compute.model.fused``)."""
    if net.device.type == "cuda" and net.dtype in (torch.float16, torch.bfloat16):
        fused = fuse_layers(net)
        log.info(
            "fused forwards: %d RMSNorm, %d attention, %d MLP and %d decoder-layer modules",
            fused.norms,
            fused.attentions,
            fused.mlps,
            fused.layers,
        )


def load_model(
    model: str, dtype: str, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads ``model`` (``tiny``, a local checkpoint directory, ``smollm2`` or a GGUF file: the
    checkpoint ``resolve_model`` converts it into) in eval mode on ``device`` with paged
    attention. ``dtype``: float32/float16/bfloat16 or ``auto`` (``resolve_dtype``: the config's,
    fp32 if none, bf16 on CUDA instead of fp32). Nothing is downloaded
    (``local_files_only=True``)."""
    started = time.perf_counter()
    model = resolve_model(model)
    if model == TINY:
        config = tiny_config()
        torch_dtype = _torch_dtype(config, dtype, device)
        log.info("building tiny random model (seed %d, %s)", TINY_SEED, torch_dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            net = AutoModelForCausalLM.from_config(
                config, attn_implementation=ATTN_NAME, dtype=torch_dtype
            )
        tokenizer: PreTrainedTokenizerBase = byte_tokenizer()
    else:
        path = Path(model)
        if not path.is_dir():
            raise FileNotFoundError(f"model {model!r} is neither 'tiny' nor a local directory")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        torch_dtype = _torch_dtype(config, dtype, device)
        log.info(
            "loading %s (%s) from %s as %s",
            config.model_type,
            type(config).__name__,
            path,
            torch_dtype,
        )
        net = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype, attn_implementation=ATTN_NAME
        )
        log.info("weights loaded in %.1f s; loading tokenizer", time.perf_counter() - started)
        tokenizer = load_tokenizer(model)
    log.info("moving model to %s", device)
    net = net.to(device).eval()
    fuse_on_cuda(net)
    params = sum(p.numel() for p in net.parameters())
    log.info(
        "model ready: %.1fM parameters, %s on %s, attention %r, %.1f s",
        params / 1e6,
        net.dtype,
        net.device,
        net.config._attn_implementation,
        time.perf_counter() - started,
    )
    return net, tokenizer
