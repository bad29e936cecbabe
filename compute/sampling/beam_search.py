"""Beam-search scoring of a compute worker: one request's beam bookkeeping. Torch only.

* ``BeamSearch``: Hugging Face's length penalty and early stopping rules; each step says which
  parent every new beam comes from (``BeamStep``) so the worker can fork/free blocks in the
  kvstore. Finished beams are kept as ``Hypothesis``.
* ``top_continuations``: the k best (beam, token) continuations of a step.

The engine's side (the beams' sequences in the scheduler, their logits, forks and frees) is
``compute.batch.beams.BeamGroup``; it computes the log-softmax this module's ``step`` takes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["BeamSearch", "BeamStep", "EarlyStopping", "Hypothesis", "top_continuations"]

EarlyStopping = bool | Literal["never"]


def top_continuations(
    sums: torch.Tensor, logprobs: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k best (beam, token) continuations by ``sums[beam] + logprobs[beam, token]``.

    sums: [beams] fp32; logprobs: [beams, vocab] (log-softmax). Returns (scores [k'] descending,
    parents [k'] int64, tokens [k'] int64), k' = min(k, beams * vocab).
    """
    vocab = logprobs.shape[-1]
    total = (logprobs + sums[:, None]).reshape(-1)  # [beams * vocab]
    scores, flat = total.topk(min(k, total.numel()))  # [k'], [k']
    return scores, flat // vocab, flat % vocab


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # output tokens, the final stop token included
    sum_logprob: float
    score: float  # sum_logprob / len(token_ids) ** length_penalty


@dataclass(frozen=True)
class BeamStep:
    """One step's outcome: live beam i continues previous live beam ``parents[i]`` with
    ``token_ids[i]`` (fork that parent's blocks; free previous beams no one continues). Once
    ``done``, every beam's blocks can be freed: the answer is in ``BeamSearch.best``."""

    parents: list[int]
    token_ids: list[int]
    finished: list[Hypothesis] = field(default_factory=list)  # newly kept hypotheses
    done: bool = False


_Node = tuple[int, "_Node | None"]  # (token, parent node): a beam's tokens as a shared chain


def _tokens(node: _Node | None) -> tuple[int, ...]:
    out: list[int] = []
    while node is not None:
        out.append(node[0])
        node = node[1]
    return tuple(reversed(out))


class BeamSearch:
    """One request's beam search state, Hugging Face's semantics (``generate(num_beams=W)``).

    Each step takes the top ``K = max(2, 1 + #stop ids) * W`` continuations of the live beams;
    those among the first W that end (stop token, or ``max_tokens`` reached) become finished
    hypotheses scored ``sum_logprob / length ** length_penalty`` (the W best are kept); the first W
    that do not end become the next live beams (in score order). Starts with one live beam (the
    prompt). The search is done when every candidate ended, or W hypotheses are finished and:

    * ``early_stopping=True``: immediately;
    * ``"never"`` (default): the best live beam cannot beat the worst finished one, an exact bound
      because sums only decrease: ``best_sum / L**lp <= worst`` with ``L = max_tokens`` when
      ``lp > 0``, else the current length;
    * ``False`` (Hugging Face's default): the same test with the current length for every ``lp``,
      a heuristic when ``lp > 0`` (a longer hypothesis may still have won).
    """

    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        stop_token_ids: Collection[int] = (),
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = "never",
    ) -> None:
        self.width = beam_width
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_generated = 0
        self.sums = torch.zeros(1)  # [live] fp32 logprob sums of the live beams
        self._nodes: list[_Node | None] = [None]
        self.finished: list[Hypothesis] = []  # best first, at most W
        self.done = False

    @property
    def num_live(self) -> int:
        return len(self._nodes)

    def live_tokens(self, beam: int) -> tuple[int, ...]:
        return _tokens(self._nodes[beam])

    def step(self, logprobs: torch.Tensor) -> BeamStep:
        """logprobs: [num_live, vocab] log-softmax of each live beam's next-token logits."""
        if self.done:
            raise RuntimeError("beam search is done")
        if logprobs.shape[0] != self.num_live:
            raise ValueError(f"{logprobs.shape[0]} rows for {self.num_live} live beams")
        k = max(2, 1 + len(self.stop_ids)) * self.width
        scores, parents, tokens = top_continuations(self.sums.to(logprobs), logprobs.float(), k)
        scores, parent_list, token_list = scores.cpu(), parents.tolist(), tokens.tolist()
        length = self.num_generated + 1
        ended = [length >= self.max_tokens or t in self.stop_ids for t in token_list]
        new = self._add_finished(scores, parent_list, token_list, ended, length)
        keep = [i for i, e in enumerate(ended) if not e][: self.width]
        self._nodes = [(token_list[i], self._nodes[parent_list[i]]) for i in keep]
        self.sums = scores[keep]
        self.num_generated = length
        self.done = not keep or self._cannot_improve()
        return BeamStep(
            [parent_list[i] for i in keep], [token_list[i] for i in keep], new, self.done
        )

    def _add_finished(
        self,
        scores: torch.Tensor,
        parents: list[int],
        tokens: list[int],
        ended: list[bool],
        length: int,
    ) -> list[Hypothesis]:
        penalized = (scores / (length**self.length_penalty)).tolist()  # fp32, as HF computes it
        added = [
            Hypothesis(_tokens((tok, self._nodes[parents[i]])), float(scores[i]), penalized[i])
            for i, tok in enumerate(tokens[: self.width])
            if ended[i]
        ]
        merged = sorted(self.finished + added, key=lambda h: h.score, reverse=True)
        self.finished = merged[: self.width]
        return [h for h in added if any(h is f for f in self.finished)]

    def _cannot_improve(self) -> bool:
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        lp = self.length_penalty
        horizon = self.max_tokens if self.early_stopping == "never" and lp > 0 else None
        best_possible = self.sums[:1] / ((horizon or self.num_generated) ** lp)  # [1] fp32
        return float(best_possible) <= self.finished[-1].score

    def best(self, n: int = 1) -> list[Hypothesis]:
        """The n best finished hypotheses, best first."""
        return self.finished[:n]
