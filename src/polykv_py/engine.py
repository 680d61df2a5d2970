"""In-process shared-prefix engine: N agents over one base context pay for it once.

The prefix is decoded once into sequence 0 and shared into the agents' sequences
1..N with ``seq_cp`` (with unified KV this only adds sequence ids to the prefix's
cells). The agents' suffixes are then decoded together and all agents generate in one
batch per step until each stops (max tokens, end of generation, or a stop string).

Token lists: an agent's prompt is ``prefix_tokens + suffix_tokens``. For text inputs
``tokenization="joint"`` (the default) tokenizes every ``prefix + suffix`` as a whole
and shares the longest common leading run of tokens (at most the prefix's own token
count), so an agent's prompt is exactly the tokenization of its full text; see
``docs/memory-api.md`` for the BPE boundary trap this avoids. ``"separate"`` tokenizes
prefix and suffixes apart and concatenates the tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from .engine_types import (
    GenerationParams,
    Tokenization,
    context_params_for,
    find_stop,
    needed_cells,
    split_joint,
)
from .errors import ContextFullError, SequenceError, TokenError
from .llama.batch import Batch
from .llama.context import Context
from .llama.params import ContextParams
from .llama.sampler import Sampler
from .results import AgentTimings, EngineAgentResult, EngineMode, EngineRunResult, StopReason

if TYPE_CHECKING:
    import os
    from types import TracebackType

    from .llama.model import Model

log = logging.getLogger(__name__)

PREFIX_SEQ = 0

__all__ = [
    "PREFIX_SEQ",
    "AgentTimings",
    "EngineAgentResult",
    "EngineRunResult",
    "GenerationParams",
    "SharedPrefixEngine",
    "context_params_for",
]


class _Clock:
    """Phase timings that leave out time spent measuring (KV cell counts)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.skipped = 0.0
        self.laps: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 - self.skipped

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now

    def excluded(self, fn: Callable[[], int]) -> int:
        t = time.perf_counter()
        try:
            return fn()
        finally:
            d = time.perf_counter() - t
            self.skipped += d
            self.last += d


@dataclass
class _Agent:
    index: int
    seq_id: int
    prompt: list[int]
    suffix: list[int]
    sampler: Sampler
    next_pos: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: StopReason | None = None
    finishing: bool = False  # its last token still has to be decoded
    processed: int = 0
    timings: AgentTimings = field(default_factory=AgentTimings)


class SharedPrefixEngine:
    """Runs N agents over one prefix in one :class:`Context` it owns.

    Sequence 0 holds the prefix; agents use sequences 1..N, so the context needs
    ``n_seq_max >= N + 1`` (see :meth:`context_params` to size one).
    """

    def __init__(self, model: Model, params: ContextParams | None = None, **overrides: Any) -> None:
        self.model = model
        self.ctx = Context(model, params, **overrides)
        self._prefix: list[int] | None = None  # tokens held by PREFIX_SEQ

    # -- ownership ------------------------------------------------------------------
    def close(self) -> None:
        self.ctx.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @property
    def max_agents(self) -> int:
        return self.ctx.n_seq_max - 1

    @property
    def mode(self) -> EngineMode:
        """``"shared"`` with unified KV (no copy), ``"copied"`` without (whole-sequence copies)."""
        return "shared" if self.ctx.kv_unified else "copied"

    context_params = staticmethod(context_params_for)

    # -- inputs ---------------------------------------------------------------------
    def tokenize_inputs(
        self,
        prefix: str | Sequence[int],
        suffixes: Sequence[str | Sequence[int]],
        tokenization: Tokenization = "joint",
    ) -> tuple[list[int], list[list[int]]]:
        """Turn the inputs into ``(prefix_tokens, [suffix_tokens, ...])``, validated."""
        vocab = self.model.vocab
        if isinstance(suffixes, (str, bytes)) or not len(suffixes):
            raise ValueError("suffixes must be a non-empty list (one entry per agent)")
        if tokenization not in ("joint", "separate"):
            raise ValueError(f"tokenization must be 'joint' or 'separate', not {tokenization!r}")
        texts = [s for s in suffixes if isinstance(s, str)]
        if isinstance(prefix, str) and tokenization == "joint" and len(texts) == len(suffixes):
            pre, sufs = split_joint(vocab.tokenize(prefix), [vocab.tokenize(prefix + s) for s in texts])
        else:
            pre = vocab.tokenize(prefix) if isinstance(prefix, str) else vocab.check_tokens(prefix)
            sufs = [
                vocab.tokenize(s, add_special=False) if isinstance(s, str) else vocab.check_tokens(s) for s in suffixes
            ]
        if not pre:
            raise TokenError("the prefix has no tokens")
        for i, s in enumerate(sufs):
            if not s:
                raise TokenError(
                    f"agent {i} has no suffix tokens: every agent needs at least one token after the prefix"
                )
        return pre, sufs

    def _check_room(self, n_prefix: int, sufs: list[list[int]], max_tokens: int, share: bool) -> None:
        ctx = self.ctx
        n = len(sufs)
        if n > self.max_agents:
            raise SequenceError(
                f"{n} agents need {n + 1} sequences (one for the prefix), this context has n_seq_max={ctx.n_seq_max}"
            )
        longest = n_prefix + max(len(s) for s in sufs) + max_tokens
        if longest > ctx.n_ctx_seq:
            raise ContextFullError(f"an agent needs {longest} positions, a sequence holds at most {ctx.n_ctx_seq}")
        if ctx.kv_unified:
            cells = needed_cells(n_prefix, [len(s) for s in sufs], max_tokens, share=share, kv_unified=True)
            if cells > ctx.n_ctx:
                raise ContextFullError(
                    f"this run needs up to {cells} KV cells, the context has {ctx.n_ctx} "
                    "(see SharedPrefixEngine.context_params)"
                )

    # -- prefix ---------------------------------------------------------------------
    @property
    def prefix_tokens(self) -> list[int] | None:
        """Tokens held in the prefix sequence, or None."""
        return None if self._prefix is None else list(self._prefix)

    def reset(self) -> None:
        """Clear the whole KV memory (prefix included)."""
        self.ctx.memory.clear()
        self._prefix = None

    def set_prefix(self, tokens: Sequence[int]) -> bool:
        """Make sequence 0 hold ``tokens``; returns True if it already did (nothing decoded)."""
        toks = self.model.vocab.check_tokens(tokens)
        mem = self.ctx.memory
        if (
            self._prefix == toks
            and mem.seq_pos_range(PREFIX_SEQ) == (0, len(toks) - 1)
            and mem.exact_len(PREFIX_SEQ) >= len(toks)
        ):
            return True  # (the checks catch a prefix sequence edited, shifted or loaded behind the engine's back)
        for s in range(self.ctx.n_seq_max):
            mem.seq_rm(s)
        self._prefix = None
        self.ctx.decode_tokens(toks, seq_id=PREFIX_SEQ, pos0=0, logits_last=False)
        self._prefix = toks
        return False

    def save_prefix(self, path: str | os.PathLike[str]) -> Path:
        """Save the prefix sequence to a verified prefix file (:meth:`Context.save_prefix`)."""
        if self._prefix is None:
            raise SequenceError("no prefix to save: run or set_prefix first")
        return self.ctx.save_prefix(path, PREFIX_SEQ, self._prefix)

    def load_prefix(self, path: str | os.PathLike[str], expected_tokens: Sequence[int] | None = None) -> list[int]:
        """Load a prefix file into sequence 0 (refuses another model or token list)."""
        for s in range(self.ctx.n_seq_max):
            self.ctx.memory.seq_rm(s)
        self._prefix = None
        toks = self.ctx.load_prefix(path, PREFIX_SEQ, expected_tokens)
        self._prefix = toks
        return toks

    # -- running --------------------------------------------------------------------
    def run(
        self,
        prefix: str | Sequence[int],
        suffixes: Sequence[str | Sequence[int]],
        params: GenerationParams | None = None,
        *,
        share: bool = True,
        tokenization: Tokenization = "joint",
        measure_kv: bool = False,
    ) -> EngineRunResult:
        """Run one agent per suffix. ``share=False`` is the baseline: every agent decodes the
        whole prompt into its own sequence (memory is cleared first)."""
        gp = params or GenerationParams()
        pre, sufs = self.tokenize_inputs(prefix, suffixes, tokenization)
        self._check_room(len(pre), sufs, gp.max_tokens, share)
        ctx, mem = self.ctx, self.ctx.memory
        kv: dict[str, int] | None = {} if measure_kv else None
        clock = _Clock()
        start_tokens = ctx.tokens_decoded
        reused = False
        if share:
            for s in range(1, ctx.n_seq_max):
                mem.seq_rm(s)
            reused = self.set_prefix(pre)
        else:
            self.reset()
        clock.lap("prefix_s")
        if kv is not None:
            kv["after_prefix"] = clock.excluded(mem.cells_in_use)
        agents = []
        for i, suf in enumerate(sufs):
            seq = i + 1
            if share:
                mem.seq_cp(PREFIX_SEQ, seq)
                inputs, pos0 = suf, len(pre)
            else:
                inputs, pos0 = pre + suf, 0
            agents.append(_Agent(i, seq, pre + suf, inputs, Sampler(gp.sampling.with_seed(gp.sampling.seed + i)), pos0))
        clock.lap("share_s")
        try:
            if kv is not None and ctx.kv_unified:  # without unified KV the copy is pending until a decode
                kv["after_share"] = clock.excluded(mem.cells_in_use)
            self._decode_prompts(agents, gp, clock)
            clock.lap("suffix_s")
            if kv is not None:
                kv["after_suffixes"] = clock.excluded(mem.cells_in_use)
            self._generate(agents, gp, clock)
            clock.lap("generate_s")
            if kv is not None:
                kv["final"] = clock.excluded(mem.cells_in_use)
        finally:
            for a in agents:
                a.sampler.close()
        mode: EngineMode = self.mode if share else "unshared"
        return EngineRunResult(
            mode=mode,
            agents=[self._result(a) for a in agents],
            prefix_tokens=pre,
            prefix_reused=reused,
            tokens_processed=ctx.tokens_decoded - start_tokens,
            timings={**clock.laps, "wall_s": clock.elapsed()},
            kv_cells=kv,
        )

    def run_alone(
        self,
        prompt_tokens: Sequence[int],
        params: GenerationParams | None = None,
        *,
        agent_index: int = 0,
        split_at: int | None = None,
    ) -> EngineAgentResult:
        """One agent from scratch: clear the memory, decode ``prompt_tokens`` into sequence 0, generate.

        ``split_at=k`` decodes the first ``k`` tokens and the rest in separate calls (as a
        shared run does with prefix and suffix); by default the prompt goes in one pass
        (chunked only by ``n_batch``).
        """
        gp = params or GenerationParams()
        toks = self.model.vocab.check_tokens(prompt_tokens)
        if not toks:
            raise TokenError("no prompt tokens")
        if split_at is not None and not 0 < split_at < len(toks):
            raise ValueError(f"split_at must be in [1, {len(toks) - 1}], not {split_at}")
        if len(toks) + gp.max_tokens > self.ctx.n_ctx_seq:
            raise ContextFullError(f"{len(toks)} + {gp.max_tokens} tokens exceed a sequence's {self.ctx.n_ctx_seq}")
        self.reset()
        clock = _Clock()
        sampler = Sampler(gp.sampling.with_seed(gp.sampling.seed + agent_index))
        try:
            if split_at is not None:
                self.ctx.decode_tokens(toks[:split_at], seq_id=0, pos0=0, logits_last=False)
            k = split_at or 0
            agent = _Agent(agent_index, 0, toks, toks[k:], sampler, k, processed=k)
            self._decode_prompts([agent], gp, clock)
            self._generate([agent], gp, clock)
        finally:
            sampler.close()
        return self._result(agent)

    # -- internals ------------------------------------------------------------------
    def _decode_prompts(self, agents: list[_Agent], gp: GenerationParams, clock: _Clock) -> None:
        """Decode every agent's pending input tokens together (chunks of n_batch), sampling each
        agent's first token right after the decode that carried its last input token."""
        work = [(a, k) for a in agents for k in range(len(a.suffix))]
        ctx = self.ctx
        with Batch(min(len(work), ctx.n_batch)) as batch:
            for off in range(0, len(work), ctx.n_batch):
                chunk = work[off : off + ctx.n_batch]
                batch.clear()
                last_idx: dict[int, int] = {}
                for a, k in chunk:
                    is_last = k == len(a.suffix) - 1
                    idx = batch.add(a.suffix[k], a.next_pos + k, a.seq_id, is_last)
                    if is_last:
                        last_idx[a.index] = idx
                t = time.perf_counter()
                ctx.decode(batch)
                dt = time.perf_counter() - t
                touched = {a.index for a, _ in chunk}
                for a in agents:
                    if a.index in touched:
                        a.timings.suffix_s += dt
                        a.processed += sum(1 for b, _ in chunk if b is a)
                    if a.index in last_idx:
                        a.next_pos += len(a.suffix)
                        self._take(a, a.sampler.sample(ctx, last_idx[a.index]), gp, clock)

    def _generate(self, agents: list[_Agent], gp: GenerationParams, clock: _Clock) -> None:
        ctx = self.ctx
        with Batch(max(1, len(agents))) as batch:
            while True:
                active = [a for a in agents if a.stop_reason is None or a.finishing]
                if not active:
                    return
                batch.clear()
                idx = {}
                for a in active:
                    idx[a.index] = batch.add(a.tokens[-1], a.next_pos, a.seq_id, not a.finishing)
                ctx.decode(batch)
                for a in active:
                    a.next_pos += 1
                    a.processed += 1
                    if a.finishing:
                        a.finishing = False
                        a.timings.total_s = clock.elapsed()
                    else:
                        self._take(a, a.sampler.sample(ctx, idx[a.index]), gp, clock)

    def _take(self, a: _Agent, token: int, gp: GenerationParams, clock: _Clock) -> None:
        """Record a sampled token and decide whether the agent goes on."""
        now = clock.elapsed()
        if not a.tokens and a.stop_reason is None:
            a.timings.first_token_s = now
        vocab = self.model.vocab
        if not gp.ignore_eos and vocab.is_eog(token):
            a.stop_reason = "eos"
            a.timings.total_s = now
            a.text = vocab.detokenize(a.tokens)
            return
        a.tokens.append(token)
        a.text = vocab.detokenize(a.tokens)
        cut = find_stop(a.text, gp.stop)
        if cut >= 0:
            a.text = a.text[:cut]
            a.stop_reason, a.finishing = "stop", True
        elif len(a.tokens) >= gp.max_tokens:
            a.stop_reason, a.finishing = "length", True

    @staticmethod
    def _result(a: _Agent) -> EngineAgentResult:
        return EngineAgentResult(
            index=a.index,
            seq_id=a.seq_id,
            prompt_tokens=a.prompt,
            suffix_tokens=a.suffix,
            tokens=a.tokens,
            text=a.text,
            stop_reason=a.stop_reason or "length",
            tokens_processed=a.processed,
            timings=a.timings,
        )
