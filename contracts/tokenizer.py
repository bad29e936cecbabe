"""Tokenizers: the byte tokenizer of ``tiny`` or a local checkpoint's own.

Imports no torch itself (``AutoTokenizer``, for a checkpoint directory, does).

One implementation for every process: compute workers (``compute.model.models``) and the gateway
load tokenizers through ``load_tokenizer``. The byte tokenizer is a real ``PreTrainedTokenizerFast``
(byte-level pre-tokenizer, a BPE model with 256 byte symbols and no merges): ids 0-255 are the
bytes, 256 BOS ``<s>``, 257 EOS ``</s>``, 258 PAD ``<pad>``, matching
``contracts.model_config.tiny_config()``. It saves and loads back with ``save_pretrained`` /
``AutoTokenizer.from_pretrained``, so a saved tiny model is a checkpoint like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from contracts.checkpoints import TINY, resolve_model

__all__ = ["BOS", "EOS", "PAD", "byte_tokenizer", "load_tokenizer", "output_decoder"]

BOS, EOS, PAD = 256, 257, 258


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


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``model``: ``tiny``, a local checkpoint directory, or what
    ``contracts.checkpoints.resolve_model`` makes one of (``smollm2``, a GGUF file); nothing is
    downloaded. Raises FileNotFoundError for anything else."""
    path = resolve_model(model)
    if path == TINY:
        return byte_tokenizer()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model {model!r} is neither 'tiny' nor a local directory")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def output_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[Sequence[int]], str]:
    """Token ids -> output text, special tokens (BOS, PAD, ...) left out as vLLM does by default.

    A fast tokenizer that does no clean-up decodes through its Rust backend directly: the same
    text as ``tokenizer.decode(ids, skip_special_tokens=True)`` (which adds only Python argument
    handling around that call), at a fifth of the cost; the engine decodes twice per token.
    """
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and not tokenizer.clean_up_tokenization_spaces
    ):
        backend = tokenizer.backend_tokenizer

        def fast(token_ids: Sequence[int]) -> str:
            return str(backend.decode(list(token_ids), skip_special_tokens=True))

        return fast

    def slow(token_ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=True))

    return slow
