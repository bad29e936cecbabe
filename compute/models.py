"""Model loading for compute workers: ``tiny`` (random weights, byte tokenizer) or a local HF
checkpoint directory. Every model is loaded with the paged attention function
(``attn_implementation="paged"``, see ``compute.attention``).

The byte tokenizer is a real ``PreTrainedTokenizerFast`` (byte-level pre-tokenizer, a BPE model
with 256 byte symbols and no merges): ids 0-255 are the bytes, 256 BOS ``<s>``, 257 EOS ``</s>``,
258 PAD ``<pad>``, matching ``pagedserve.model_config.tiny_config()``. It saves and loads back with
``save_pretrained`` / ``AutoTokenizer.from_pretrained``, so a saved tiny model is a checkpoint
like any other.
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
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from compute.attention import ATTN_NAME
from pagedserve.model_config import TINY, tiny_config

__all__ = ["FAMILIES", "TINY_SEED", "byte_tokenizer", "load_model", "tiny_family_config"]

log = logging.getLogger("pagedserve.compute")

TINY_SEED = 0
BOS, EOS, PAD = 256, 257, 258
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what tokenizers' ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer of ``tiny``: token id = byte value; encoding prepends BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab |= {"<s>": BOS, "</s>": EOS, "<pad>": PAD}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


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


def _torch_dtype(dtype: str, config: Any) -> torch.dtype:
    if dtype == "auto":
        text = getattr(config, "get_text_config", lambda: config)()
        dtype = str(getattr(text, "dtype", None) or "float32").removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    model: str, dtype: str, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads ``model`` (``tiny`` or a local checkpoint directory) in eval mode on ``device`` with
    paged attention. ``dtype``: ``auto`` (the config's, fp32 if none) or float32/float16/bfloat16.
    Nothing is downloaded (``local_files_only=True``)."""
    started = time.perf_counter()
    if model == TINY:
        config = tiny_config()
        torch_dtype = _torch_dtype(dtype, config)
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
        torch_dtype = _torch_dtype(dtype, config)
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
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    log.info("moving model to %s", device)
    net = net.to(device).eval()
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
