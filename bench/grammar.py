"""Structured-output grammar engines, xgrammar against llguidance, on the CPU of this host.

    .venv/bin/python bench/grammar.py [--schemas 50] [--batch 128] [--steps 200] [--threads N]

Byte-level Llama-3-size vocabulary (``bench.byte_vocab``), random bounded JSON Schemas
(``pagedserve.json_schemas``). Per engine: schema -> matcher -> first mask (new schemas, seen ones,
json_object); per step, the bitmask of B matchers (each its own schema, driven along a valid
compact instance + EOS; every mask must allow the next token) filled serially and by the batch
API; applying it to [B, vocab] fp32 CPU logits; checks (regex, choice, JSON details).
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar
from transformers import AutoTokenizer, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.byte_vocab import byte_level_tokenizer
from pagedserve.json_schemas import random_schema, schema_instance

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # json_object mode


class Xgrammar:
    def __init__(self, tok: PreTrainedTokenizerBase, vocab_size: int, threads: int) -> None:
        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.matcher = xgrammar.GrammarMatcher
        self.done = lambda m: bool(m.is_terminated())  # EOS accepted (is_completed(): before)
        self.apply = xgrammar.apply_token_bitmask_inplace

    def grammar(self, kind: str, arg: Any) -> Any:  # kind: schema, json, regex or choice
        if kind == "json":  # any JSON value, as vLLM does: {"type": "object"} ignores separators
            return self.compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self.compiler.compile_regex(arg)
        if kind == "choice":  # EBNF string literals
            return self.compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps, arg)))
        text = json.dumps(arg).replace(', "multipleOf": 0.5', "")  # ignored, with a warning each
        return self.compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor, parallel: bool) -> None:
        if parallel:
            return self.batch.batch_fill_next_token_bitmask(list(matchers), bitmask)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matchers: Sequence[Any], tokens: list[int], parallel: bool) -> list[bool]:
        if parallel:
            return xgrammar.BatchGrammarMatcher.batch_accept_token(list(matchers), tokens)
        return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]


class Llguidance:
    def __init__(self, tok: PreTrainedTokenizerBase, vocab_size: int, threads: int) -> None:
        self.vocab_size = vocab_size
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)  # type: ignore[arg-type]
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.matcher = lambda grammar: llguidance.LLMatcher(self.tok, grammar, log_level=0)
        self.done = lambda m: bool(m.is_stopped() and not m.is_error())  # before EOS too, if final
        self.apply = llguidance.torch.apply_token_bitmask_inplace  # torch.compile'd

    def grammar(self, kind: str, arg: Any) -> Any:  # a grammar string; LLMatcher compiles it
        g = llguidance.LLMatcher
        if kind == "regex":
            return g.grammar_from_regex(arg)
        if kind == "choice":  # Lark string literals
            return g.grammar_from_lark("start: " + " | ".join(map(json.dumps, arg)))
        defaults: Any = {"whitespace_flexible": False}  # a JsonCompileOptions TypedDict
        return g.grammar_from_json_schema(ANY_OBJECT if kind == "json" else arg, defaults=defaults)

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor, parallel: bool) -> None:
        if parallel:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            return llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)
        for i, m in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, matchers: Sequence[Any], tokens: list[int], parallel: bool) -> list[bool]:
        if parallel:
            pairs = list(zip(matchers, tokens, strict=True))
            return llguidance.torch.consume_token_par(self.executor, pairs)
        return [m.consume_token(t) for m, t in zip(matchers, tokens, strict=True)]


Engine = Xgrammar | Llguidance


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:  # (ms, fn(*args))
    start = time.perf_counter()
    result = fn(*args)
    return (time.perf_counter() - start) * 1e3, result


def stats(ms: list[float]) -> str:
    s = sorted(ms)
    return f"{s[len(s) // 2]:.2f} / {s[min(len(s) - 1, len(s) * 99 // 100)]:.2f}"


def allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def compile_times(e: Engine, schemas: list[Any], kind: str = "schema") -> dict[str, list[float]]:
    """Schema -> matcher and -> first mask, new and seen before (ms, one entry per schema)."""
    out: dict[str, list[float]] = {k: [] for k in ("new", "new_mask", "seen", "seen_mask")}
    bitmask = xgrammar.allocate_token_bitmask(1, e.vocab_size)
    new = lambda s: e.matcher(e.grammar(kind, s))  # noqa: E731
    # seen: xgrammar's compiler cache hits; llguidance has none, a kept matcher is copied
    seen = lambda m, s: m.deep_copy() if isinstance(e, Llguidance) else new(s)  # noqa: E731
    for schema in schemas:
        m = None
        for key in ("new", "seen"):
            ms, m = timed(new, schema) if m is None else timed(seen, m, schema)
            out[key].append(ms)
            out[key + "_mask"].append(ms + timed(e.fill, [m], bitmask, False)[0])
    return out


def drive(
    e: Engine, tok: PreTrainedTokenizerBase, schemas: list[Any], steps: int, parallel: bool
) -> tuple[list[float], list[float], torch.Tensor]:
    """Per-step fill and accept times (ms) of one matcher per schema, and the last bitmask."""
    eos, batch, name = int(tok.eos_token_id), len(schemas), type(e).__name__
    rngs = [random.Random(i) for i in range(batch)]  # the same instances for every run

    def tokens(i: int) -> list[int]:
        text = json.dumps(schema_instance(rngs[i], schemas[i]), separators=(",", ":"))
        return [*tok.encode(text, add_special_tokens=False), eos]

    matchers = [e.matcher(e.grammar("schema", s)) for s in schemas]
    todo, pos = [tokens(i) for i in range(batch)], [0] * batch
    bitmask, fills, accepts = xgrammar.allocate_token_bitmask(batch, e.vocab_size), [], []
    for _ in range(steps):
        fills.append(timed(e.fill, matchers, bitmask, parallel)[0])
        nxt = [todo[i][p] for i, p in enumerate(pos)]
        for i, p in enumerate(pos):
            assert allows(bitmask, i, nxt[i]), (name, "disallowed", p, tok.decode(todo[i]))
            assert p > 0 or not allows(bitmask, i, eos), (name, "EOS allowed at the start")
        ms, ok = timed(e.accept, matchers, nxt, parallel)
        accepts.append(ms)
        assert all(ok), (name, "rejected", [i for i, a in enumerate(ok) if not a])
        for i in range(batch):
            pos[i] += 1
            if pos[i] == len(todo[i]):
                assert e.done(matchers[i]), (name, "not terminated after EOS")
                matchers[i].reset()
                todo[i], pos[i] = tokens(i), 0
    return fills, accepts, bitmask


def apply_times(e: Engine, base: torch.Tensor, bitmask: torch.Tensor, reps: int) -> list[float]:
    """The first and ``reps`` more applications of ``bitmask`` to ``base`` (ms); checks them."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    want = base.masked_fill(bits.flatten(1)[:, : base.shape[1]] == 0, -torch.inf)
    logits = base.clone()
    times = [timed(e.apply, logits, bitmask)[0] for _ in range(reps + 1)]
    assert torch.equal(logits, want), type(e).__name__
    return times


STR8: dict[str, Any] = {"type": "string", "maxLength": 8}
CHECKS: list[tuple[str, str, Any, str, bool]] = [  # (what, grammar kind, arg, text, valid)
    ("json_object: nested object", "json", None, '{"a":[1,{"b":null}]}', True),
    ("json_object: top-level array", "json", None, "[1]", False),
    ('schema {"type":"object"}: {"a":1,"b":2}', "schema", ANY_OBJECT, '{"a":1,"b":2}', True),
    (r"regex \d{3}-[a-z]+: 123-abc", "regex", r"\d{3}-[a-z]+", "123-abc", True),
    (r"regex \d{3}-[a-z]+: 12-abc", "regex", r"\d{3}-[a-z]+", "12-abc", False),
    ("choice yes|no|maybe: maybe", "choice", ["yes", "no", "maybe"], "maybe", True),
    ('string maxLength 8: "a\\"b"', "schema", STR8, '"a\\"b"', True),
    ("string maxLength 8: raw \\x01", "schema", STR8, '"\x01"', False),
    ('string: "\\u00e9"', "schema", {"type": "string"}, '"\\u00e9"', True),
    ("string: BOS token <s> inside", "schema", {"type": "string"}, '"<s>"', False),
    ("number max 10: 1.1234567", "schema", {"type": "number", "maximum": 10}, "1.1234567", True),
    ("number multipleOf 0.25: 8.5", "schema", {"type": "number", "multipleOf": 0.25}, "8.5", True),
]


def check(e: Engine, tok: PreTrainedTokenizerBase, kind: str, arg: Any, text: str) -> bool:
    m = e.matcher(e.grammar(kind, arg))
    ids = [*tok.encode(text, add_special_tokens=False), int(tok.eos_token_id)]
    return all(e.accept([m], [t], False)[0] for t in ids) and e.done(m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    a = p.add_argument
    a("--schemas", type=int, default=50, help="random schemas whose compile is timed (50)")
    a("--batch", type=int, default=128, help="B: sequences, one matcher each, per step (128)")
    a("--steps", type=int, default=200, help="steps timed per fill mode: serial, batch API (200)")
    a("--vocab-size", type=int, default=128256, help="tokenizer and logits vocabulary (128256)")
    a("--threads", type=int, default=os.cpu_count(), help="threads of each engine (all CPUs)")
    a("--seed", type=int, default=0, help="seed of the random schemas (0)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:  # through the files, as a server loads one
        byte_level_tokenizer(args.vocab_size).save_pretrained(d)
        tok = AutoTokenizer.from_pretrained(d)
    rng, warmup = random.Random(args.seed), random_schema(random.Random(-1))
    schemas = [random_schema(rng) for _ in range(max(args.schemas, args.batch))]
    base = torch.randn(args.batch, args.vocab_size)
    rows: defaultdict[str, list[str]] = defaultdict(list)
    head = f"vocab {args.vocab_size}, threads {args.threads}, torch {torch.get_num_threads()}"
    for make in (Xgrammar, Llguidance):
        ms, e = timed(make, tok, args.vocab_size, args.threads)
        rows[head].append(f"{make.__name__} {version(make.__name__)}")
        rows["tokenizer info (ms)"].append(f"{ms:.0f}")
        cold, obj = compile_times(e, [warmup]), compile_times(e, [None], "json")
        rows["first schema in process -> 1st mask (ms)"].append(f"{cold['new_mask'][0]:.1f}")
        rows["json_object -> 1st mask (ms)"].append(f"{obj['new_mask'][0]:.1f}")
        c = compile_times(e, schemas[: args.schemas])
        for key, what in (("new", "new schema"), ("seen", "seen schema")):
            rows[f"{what} -> matcher p50/p99 (ms, N={args.schemas})"].append(stats(c[key]))
            rows[f"{what} -> 1st mask p50/p99 (ms)"].append(stats(c[key + "_mask"]))
        for parallel in (False, True):
            fills, accepts, bitmask = drive(e, tok, schemas[: args.batch], args.steps, parallel)
            mode = f"batch API {args.threads} thr" if parallel else "serial"
            rows[f"fill B={args.batch} {mode} p50/p99 (ms)"].append(stats(fills))
            rows[f"accept B={args.batch} {mode} p50/p99 (ms)"].append(stats(accepts))
        times = apply_times(e, base, bitmask, 20)
        rows["apply: first call (ms)"].append(f"{times[0]:.1f}")
        rows[f"apply [{args.batch},{args.vocab_size}] fp32 p50/p99 (ms)"].append(stats(times[1:]))
        for what, kind, arg, text, valid in CHECKS:
            got = check(e, tok, kind, arg, text)
            verdict = ("accepts" if got else "rejects") + ("" if got == valid else " (WRONG)")
            rows[f"{what} ({'valid' if valid else 'invalid'})"].append(verdict)
    for label, cells in rows.items():
        print(f"{label:48}{cells[0]:>19}  {cells[1]:>19}")


if __name__ == "__main__":
    main()
