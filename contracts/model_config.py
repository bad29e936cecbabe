"""Model configs: a local Hugging Face directory (a GGUF file or ``smollm2`` resolve to one:
``contracts.checkpoints``), or ``tiny`` (random weights, byte tokenizer).

Torch-free apart from what ``transformers`` imports lazily; the kvstore reads the KV geometry
(layers, KV heads, head dim) from here and compute builds the model from the same config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts.checkpoints import TINY as TINY
from contracts.checkpoints import resolve_model

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVGeometry:
    """What the KV pool needs to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block: K and V of ``block_size`` tokens in every layer."""
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * self.itemsize


def tiny_config() -> Any:
    """A small random-weight Llama config (byte vocabulary: 256 bytes + BOS/EOS/PAD)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )


def load_config(model: str) -> Any:
    """The transformers config of ``model``: ``tiny``, a local checkpoint directory, or what
    ``contracts.checkpoints.resolve_model`` makes one of (``smollm2``, a GGUF file)."""
    path = resolve_model(model)
    if path == TINY:
        return tiny_config()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def resolve_dtype(config: Any, dtype: str, device: str) -> str:
    """The model and KV dtype for ``dtype`` (a name or 'auto') on ``device``: 'auto' takes the
    config's (float32 if none), except that float32 becomes bfloat16 on CUDA, where the Triton
    kernels take half precision only. The kvstore and the workers both resolve through here, so
    their pools agree."""
    if dtype != "auto":
        return dtype
    text = getattr(config, "get_text_config", lambda: config)()
    dtype = str(getattr(text, "dtype", None) or "float32").removeprefix("torch.")
    return "bfloat16" if dtype == "float32" and device.startswith("cuda") else dtype


def heads_per_rank(num_heads: int, size: int) -> int:
    """The heads each rank of a tensor-parallel group of ``size`` holds: an equal share, or, with
    fewer heads than ranks (GQA's KV heads), one head that ``size / num_heads`` ranks share
    (replicated, as vLLM does)."""
    if num_heads >= size:
        if num_heads % size:
            raise ValueError(f"{num_heads} heads do not split over {size} ranks")
        return num_heads // size
    if size % num_heads:
        raise ValueError(f"{size} ranks do not share {num_heads} heads evenly")
    return 1


def kv_geometry(config: Any, dtype: str, tensor_parallel_size: int = 1) -> KVGeometry:
    """KV geometry from a transformers config; ``dtype`` 'auto' takes the config's own. With
    ``tensor_parallel_size`` > 1: one rank's (its KV heads, ``heads_per_rank``)."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if dtype == "auto":
        dtype = str(getattr(text, "dtype", None) or "float32").removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return KVGeometry(
        num_layers=text.num_hidden_layers,
        num_kv_heads=heads_per_rank(
            getattr(text, "num_key_value_heads", None) or heads, tensor_parallel_size
        ),
        head_dim=head_dim,
        dtype=dtype,
    )


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when there is a GPU, else ``cpu``; anything else as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
