"""The grammar engine behind structured outputs: llguidance.

Why llguidance (measured in benchmarks/NOTES.md, entry 40): it compiles a JSON schema in about
a millisecond, lazily (the token trie is walked per step, not turned into a whole-vocabulary
automaton up front as outlines-core does), takes JSON schema, regex, Lark and GBNF, bounds its
own work per compile and per step (``LLParserLimits``), has no runtime dependencies, and is the
engine behind llama.cpp's and vLLM's ``guidance`` backend.

``grammar_source`` turns a request's ``StructuredOutputsParams`` into llguidance's grammar text;
``check_grammar`` says why one does not compile (a 400 at the boundary); ``GrammarCompiler``
compiles off the caller's thread, keeps one compiled matcher per distinct constraint and hands
each sequence a copy of it.

llguidance recurses over a grammar's rules and a schema's ``$ref`` chains: on a thread's usual
8 MiB stack a chain of about 3,000 Lark rules or 2,000 references overflows it and kills the
process. Every llguidance call that reads a request's constraint therefore runs on a thread of
its own with a deep stack (:func:`deep_stack_executor`), and the constraint's size is bounded
before (``LimitsConfig.max_grammar_chars``), so the depth it can reach stays far below that
stack's. llguidance releases the GIL while it works, so these threads never stall the server's
event loop.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import llguidance.hf
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from transformers import PreTrainedTokenizerBase

from pagellm.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Bounds on one grammar's compile and on each step's mask (llguidance's own "fuel" units): a
# hostile schema is refused with llguidance's message instead of stalling a step.
_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_grammar_size=500_000, verbose_errors=False)
_CACHE_SIZE = 256
# The stack of the threads that run llguidance: measured, 256 MiB takes a chain of 100,000 Lark
# rules (2 MB of grammar text), while the size bound keeps requests far below that. Only the
# pages a deep grammar touches are ever mapped.
GRAMMAR_STACK_BYTES = 256 << 20
_stack_size_lock = threading.Lock()
_checker_lock = threading.Lock()
_checker: ThreadPoolExecutor | None = None
# A Rust panic llguidance caught: "panic: ..." / "panicked at src/x.rs:1:2:", then a backtrace.
_PANIC = re.compile(r"panicked at|panic\b:?|\S+\.rs(?::\d+)*:?", re.IGNORECASE)
_BACKTRACE = re.compile(r"(?im)^\s*(?:stack )?backtrace|^\s*note: run with|^\s*0:\s")


def parser_limits() -> LLParserLimits:
    return LLParserLimits(**_LIMITS)


def deep_stack_executor(name: str) -> ThreadPoolExecutor:
    """A one-thread pool whose thread has a ``GRAMMAR_STACK_BYTES`` stack.

    ``threading.stack_size`` applies to threads started after it is set, so the pool's thread is
    started here, under a lock, and the process's default is put back at once.
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    with _stack_size_lock:
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            pool.submit(lambda: None).result()
        except RuntimeError:  # no room to map such a stack (a strict overcommit policy)
            logger.warning("a %d MiB thread stack could not be mapped: %s checks grammars on a default stack",
                           GRAMMAR_STACK_BYTES >> 20, name)  # fmt: skip
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        finally:
            threading.stack_size(previous)
    return pool


def _checker_pool() -> ThreadPoolExecutor:
    """The pool ``check_grammar`` runs on, started at its first use (shared by every caller)."""
    global _checker
    with _checker_lock:
        if _checker is None:
            _checker = deep_stack_executor("pagellm-grammar-check")
        return _checker


def plain_error(error: str) -> str:
    """llguidance's error text fit for a client: a Rust panic it caught (its source location and
    backtrace) becomes a plain sentence; anything else is kept as it is."""
    text = error.strip()
    if not _PANIC.search(text):
        return text
    head = _BACKTRACE.split(text)[0]
    reason = " ".join(_PANIC.sub(" ", head).split()).strip(" :")[:200]
    detail = f" ({reason})" if reason else ""
    return f"the grammar engine cannot handle this constraint{detail}: it is likely too large or too deeply nested"


def _json_options(params: StructuredOutputsParams) -> dict[str, object]:
    """Bounded whitespace unless the request says otherwise (see ``StructuredOutputsParams``)."""
    if params.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# A reasoning model's thinking before the constrained answer (``StructuredOutputsParams.thinking``):
# free text up to the first </think> (a lazy rule: the shortest), any newlines, then the answer
# (the request's own grammar, ``@answer``). The tags are text: Qwen3's and DeepSeek-R1's are
# tokens of their own whose text is the tag, which llguidance matches as text.
_THINKING_GRAMMARS = {
    "optional": 'start: think NL @answer | think @answer | @answer\nthink[lazy]: "<think>" /(?s:.*)/ "</think>"\n'
                'NL: /\\n+/\n',
    "open": 'start: think NL @answer | think @answer\nthink[lazy]: /(?s:.*)/ "</think>"\nNL: /\\n+/\n',
}  # fmt: skip


def grammar_source(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for ``params`` (after the thinking, where it says so);
    ValueError when it cannot even be read."""
    source = _answer_source(params)
    if params.thinking is None:
        return source
    answer = _as_grammar(source)
    answer["name"] = "answer"
    return json.dumps({"grammars": [{"name": "thinking", "lark_grammar": _THINKING_GRAMMARS[params.thinking]}, answer]})


def _as_grammar(source: str) -> dict[str, object]:
    """One grammar of llguidance's JSON form from what ``_answer_source`` gave (that form with
    one grammar, or Lark text)."""
    if source.lstrip().startswith("{"):
        (grammar,) = json.loads(source)["grammars"]
        return dict(grammar)
    return {"lark_grammar": source}


def _answer_source(params: StructuredOutputsParams) -> str:
    """The grammar of the constraint itself."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            # The request's options override any "x-guidance" block a schema carries.
            return LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(params))  # type: ignore[arg-type]
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        return llguidance.grammar_from("grammar", params.grammar or "")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{kind}: {exc}") from None


def check_grammar(params: StructuredOutputsParams, timeout_s: float | None = None) -> None:
    """ValueError naming what is wrong when the constraint does not compile (within the limits),
    or when the check takes longer than ``timeout_s``. Runs on the deep-stack checker thread
    (see the module docstring); the caller waits for it."""
    future = _checker_pool().submit(_validate, params)
    try:
        error = future.result(timeout=timeout_s)
    except FutureTimeout:
        future.cancel()  # still queued behind another check: it never runs
        raise ValueError(
            f"structured_outputs.{params.kind} took longer than {timeout_s:g} s to check: make it smaller"
        ) from None
    if error:
        raise ValueError(f"structured_outputs.{params.kind} does not compile: {plain_error(error)}")


def _validate(params: StructuredOutputsParams) -> str:
    """llguidance's complaint about the constraint (empty: none)."""
    return LLMatcher.validate_grammar(grammar_source(params), None, limits=parser_limits()) or ""


def llguidance_tokenizer(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None
) -> LLTokenizer:
    """The vocabulary as llguidance sees it: ``vocab_size`` is the logits' width (the model's,
    which may exceed the tokenizer's), EOS the token a finished grammar allows."""
    if eos_token_id is None:
        raise ValueError("structured outputs need a model with an end-of-sequence token; this one has none")
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)


class GrammarCompiler:
    """Compiles constraints on one background thread, once each (LRU cache by ``cache_key``).

    ``submit`` returns at once; the future gives a fresh matcher (a copy of the compiled one) or
    raises ValueError naming why the constraint does not compile. The vocabulary is prepared on
    that thread too, at the first compile (about a second for 49k tokens), so neither the
    engine's start nor its step loop waits for it.
    """

    def __init__(self, make_tokenizer: Callable[[], LLTokenizer]) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: LLTokenizer | None = None  # only the compile thread touches it
        self._pool = deep_stack_executor("pagellm-grammar")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Future[LLMatcher]:
        key = params.cache_key()
        with self._lock:
            prototype = self._compiled.get(key)
            if prototype is not None:
                self._compiled.move_to_end(key)
                done: Future[LLMatcher] = Future()
                done.set_result(prototype.deep_copy())
                return done
        return self._pool.submit(self._compile, key, params)

    def _compile(self, key: str, params: StructuredOutputsParams) -> LLMatcher:
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
        matcher = LLMatcher(self._tokenizer, grammar_source(params), limits=parser_limits(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {plain_error(matcher.get_error())}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher.deep_copy()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
