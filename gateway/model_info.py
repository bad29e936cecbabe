"""What the gateway knows of the served model, read at startup: ``ModelInfo`` (the tokenizer, the
context length, what the model cannot do). A module of its own because ``gateway.prepare`` and
``gateway.limits`` both use it (in ``prepare``, which imports ``limits``, it made a circle)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from contracts.guides import GuidesUnsupported, grammar_tokenizer
from gateway.config import GatewayConfig


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway knows of the served model (no weights). ``max_token_chars``: the
    longest token of the vocabulary, in characters (a text longer than ``context_len`` times it
    cannot fit the context)."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    context_len: int
    vocab_size: int
    created: int
    max_token_chars: int = 64
    # what the model cannot do -> why (a request that needs it gets a 400): "structured_output"
    # when the grammar engine cannot read its tokenizer
    unsupported: dict[str, str] = dataclasses.field(default_factory=dict)
    chat_template: bool = False  # its tokenizer has one (else the plain template)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included (a logprob's token may be EOS)."""
        return str(self.tokenizer.decode(list(ids)))

    @classmethod
    def load(cls, config: GatewayConfig) -> ModelInfo:
        from contracts.model_config import load_config
        from contracts.tokenizer import load_tokenizer

        model_config = load_config(config.model)
        text = getattr(model_config, "get_text_config", lambda: model_config)()
        context = config.max_model_len or int(text.max_position_embeddings)
        tokenizer = load_tokenizer(config.model)
        unsupported = {}
        try:
            grammar_tokenizer(tokenizer, int(text.vocab_size))
        except GuidesUnsupported as err:
            unsupported["structured_output"] = str(err)
        return cls(
            name=config.model_name(),
            tokenizer=tokenizer,
            context_len=context,
            vocab_size=int(text.vocab_size),
            created=int(time.time()),
            max_token_chars=max((len(t) for t in tokenizer.get_vocab()), default=1),
            unsupported=unsupported,
            chat_template=bool(getattr(tokenizer, "chat_template", None)),
        )
