"""The benchmarks' models and workload: Llama-3.2-1B- and Llama-3.1-8B-shaped random bf16
configs, the 64-1024 / 32-512-token request mix, the model built on the GPU as the worker
builds it, and the checkpoints the servers load (saved with a word-level tokenizer, so prompts of
exact token lengths travel as text). Shared by the benchmarks under ``bench/``."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent

Jobs = list[tuple[list[int], int]]  # (prompt, max_tokens)


def llama_config(**geometry: Any) -> LlamaConfig:
    """A Llama-3 family config: its 128k vocabulary, 32 query / 8 KV heads and rope theta 500k
    unless ``geometry`` says otherwise."""
    defaults: dict[str, Any] = {
        "vocab_size": 128256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    return LlamaConfig(**{**defaults, **geometry})


def llama_1b_config() -> LlamaConfig:
    return llama_config(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def llama_8b_config() -> LlamaConfig:
    return llama_config(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def llama_70b_config() -> LlamaConfig:
    """Llama-3.1-70B's config (its llama3 rope scaling and 128k context included)."""
    return llama_config(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
    )


# Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B (70B: written by ``bench/big_checkpoint.py``)
SHAPES = {"1b": llama_1b_config, "8b": llama_8b_config, "70b": llama_70b_config}


def workload(n: int, seed: int = 0, tokenizer: str = "") -> Jobs:
    """``n`` requests: prompts of 64-1024 tokens, outputs of 32-512. With ``tokenizer`` (a
    checkpoint directory), exactly the chat requests ``pagedserve bench --seed seed`` sends to it
    (``bench/http_serve.py``'s flags), as the token ids the gateway makes of them (chat template
    rendered, then encoded without special tokens), so the engine alone and the HTTP runs serve
    one workload; without, uniform random ids."""
    if not tokenizer:
        rng = random.Random(seed)
        return [
            ([rng.randrange(128000) for _ in range(rng.randint(64, 1024))], rng.randint(32, 512))
            for _ in range(n)
        ]
    from contracts.tokenizer import load_tokenizer
    from pagedserve.bench import tokenizer_of
    from pagedserve.bench_workloads import Lengths, TextMaker, build

    decode, vocab = tokenizer_of(tokenizer)
    groups = build(
        "random",
        n,
        Lengths(64, 1024),
        Lengths(32, 512),
        seed,
        lambda r: TextMaker(r, decode, vocab),
    )
    chat = load_tokenizer(tokenizer)
    jobs = []
    for (turn,) in groups:
        messages = [{"role": "user", "content": turn.text}]
        text = chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        jobs.append((list(chat(str(text), add_special_tokens=False)["input_ids"]), turn.max_tokens))
    return jobs


def build_model(config: LlamaConfig, attn: str, fused: bool = True) -> LlamaForCausalLM:
    """The random bf16 model on CUDA; with paged attention, fused as the worker fuses it
    (``compute.model.fused``) unless ``fused`` is False. Initialized on the GPU (seconds for the 8B
    shape, where the CPU takes minutes)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn, dtype=torch.bfloat16
        )
    model = model.eval()
    if attn == "paged" and fused:
        from compute.model.fused import fuse_layers

        fuse_layers(model)
    return model


# ----------------------------------------------------------------------------- checkpoints
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def checkpoint(directory: Path, shape: str, byte_level: bool = False) -> Path:
    """A random-weight bf16 checkpoint with a word-level tokenizer (``byte_level``: a byte-level
    one of the same vocabulary size, ``bench/byte_vocab.py``, which can spell JSON), built once,
    in a child process, and synced to disk before a server starts: built in this process, it
    left a CUDA context and the caching allocator's copy of the weights (16 GB at 8B) here while
    the servers ran, and the kvstore sizes its pool from the GPU's free memory."""
    if (directory / "config.json").exists():
        return directory
    code = "import sys; from bench.shapes import build_checkpoint as b; b(*sys.argv[1:])"
    flags = [str(directory), shape, "bytes" if byte_level else "words"]
    subprocess.run([sys.executable, "-c", code, *flags], cwd=ROOT, check=True)
    os.sync()
    return directory


def build_checkpoint(directory: str, shape: str, vocab: str) -> None:
    """``checkpoint``'s child: builds and saves it (``vocab``: ``words`` or ``bytes``)."""
    path = Path(directory)
    config = SHAPES[shape]()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 8B: minutes on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    if vocab == "bytes":
        from bench.byte_vocab import byte_level_tokenizer

        tokenizer = byte_level_tokenizer(config.vocab_size)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
    else:
        save_word_level_tokenizer(path, config.vocab_size)


def save_word_level_tokenizer(directory: Path, vocab_size: int) -> None:
    """Saves in ``directory`` a tokenizer whose token ``i`` is the word ``w{i}`` (BOS w128000,
    EOS w128001 as Llama-3's; unknown w0), with a chat template that only joins the messages'
    contents. ``vocab_size`` > 128001."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="w128000", eos_token="w128001", unk_token="w0"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
