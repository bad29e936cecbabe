"""Small random-weight checkpoints with tokenizers of other kinds than ``tiny``'s byte-level BPE,
for tests that serve them through the whole stack."""

from __future__ import annotations

import string
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from compute.models import tiny_family_config
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


def bpe_tokenizer(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's kind: merges, a byte-level pre-tokenizer and decoder,
    special tokens) trained on this repository's documentation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = Path(__file__).resolve().parent.parent
    corpus = [(root / name).read_text() for name in ("README.md", "docs/architecture.md")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|begin|>", "<|end|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_bpe_checkpoint(directory: Path, seed: int = 43) -> tuple[Path, int, list[int]]:
    """A tiny fp32 Llama-shaped checkpoint whose tokenizer is ``bpe_tokenizer``: the directory,
    the vocabulary size and the special token ids."""
    tokenizer = bpe_tokenizer()
    config = tiny_family_config("llama")
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 2
    paged_model(config, seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, len(tokenizer), [0, 1, 2]
