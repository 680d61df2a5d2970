"""Result types: what a fan-out over a llama-server and a run of the in-process engine return.

Plain dataclasses, no I/O; the fan-out (:mod:`polykv_py.fanout`), the engine
(:mod:`polykv_py.engine`), the harness and the command line all read them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from .jsontypes import Json

#: How a fan-out agent is sent: ``/completion`` with a text prompt, or ``/v1/chat/completions``.
Mode = Literal["completion", "chat"]
#: How the in-process engine gives agents their prefix.
EngineMode = Literal["shared", "copied", "unshared"]
StopReason = Literal["eos", "length", "stop"]

#: Share statuses after which the agent's prefix KV was not recomputed.
REUSED_STATUSES = frozenset({"hit", "copied", "own_cache", "self"})
#: Share statuses that mean the pool no longer holds the base (or holds it shifted, not exact, on a sliding-window
#: model without the window P needs, or on a recurrent one with its state past P): re-prime.
REPRIME_STATUSES = frozenset({"not_resident", "mismatch", "inexact", "swa_window", "recurrent_state"})
#: Status recorded for an agent that was sent without sharing fields.
NOT_SHARED = "not_shared"
#: Status recorded for an agent whose request failed.
ERROR = "error"


# --------------------------------------------------------------------------- fan-out
@dataclass
class PrimeResult:
    """One priming of the pool slot."""

    generation: int
    n_tokens: int
    processed: int  # prompt tokens the server actually computed for it
    wall_s: float
    reason: str
    restored_from: str | None = None  # the pool file it was restored from instead (pool cache)
    restore_ms: float | None = None  # the server's time for the restore
    saved_to: str | None = None  # the pool file it was saved to after priming (pool cache)


@dataclass
class AgentResult:
    """One agent's answer and what it cost."""

    index: int
    name: str
    mode: Mode
    text: str
    status: str  # the server's shared_prefix.status, or "not_shared"
    requested: int  # P sent
    shared: int  # tokens whose KV came from the pool (server's count)
    n_prompt: int  # tokens of the full prompt
    processed: int  # prompt tokens computed for this agent (timings.prompt_n)
    cached: int  # prompt tokens taken from a cache or the pool (timings.cache_n)
    n_generated: int
    ttft_s: float | None  # request sent -> first generated text
    latency_s: float  # request sent -> answer complete
    started_s: float  # since the fan-out began
    finished_s: float
    finish_reason: str | None
    id_slot: int | None
    timings: Json = field(default_factory=dict)
    shared_prefix: Json | None = None
    error: str | None = None  # set (with status "error") when the request failed
    replica: str | None = None  # the replica a gateway sent it to (its URL), None without a gateway
    probs: list[Json] | None = None  # per-token probabilities, when the request asked for them (n_probs)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def prefix_reused(self) -> bool:
        """True when the agent's prefix KV was not recomputed (pool hit or own cache)."""
        return self.status in REUSED_STATUSES


@dataclass
class FanoutResult:
    """Everything a fan-out did."""

    agents: list[AgentResult]
    primes: list[PrimeResult]
    pool_slot: int | None
    pool_tokens: int  # tokens of the templated base held by the pool
    wall_s: float  # priming (if any) + all agents
    shared: bool
    kv_cells_peak: int | None = None
    kv_cells_method: str | None = None

    @property
    def statuses(self) -> dict[str, int]:
        return dict(Counter(a.status for a in self.agents))

    @property
    def prefix_tokens(self) -> int:
        """The largest P any agent was given (0 without sharing)."""
        return max((a.requested for a in self.agents), default=0)

    @property
    def tokens_processed(self) -> int:
        """Prompt tokens the server computed: priming plus every agent."""
        return sum(p.processed for p in self.primes) + sum(a.processed for a in self.agents)

    @property
    def tokens_without_sharing(self) -> int:
        """Prompt tokens a server without any reuse would compute: every agent's whole prompt."""
        return sum(a.n_prompt for a in self.agents)

    @property
    def kv_cells_without_sharing(self) -> int:
        """KV cells needed to keep all agents resident without sharing (their prompts and answers)."""
        return sum(a.n_prompt + a.n_generated for a in self.agents)

    @property
    def kv_cells_with_sharing(self) -> int:
        """The same with the prefix held once: the pool plus every agent's cells beyond its P (a model)."""
        own = sum(a.n_prompt - a.requested + a.n_generated for a in self.agents)
        return (self.pool_tokens if self.shared else 0) + own

    def to_json(self) -> Json:
        """A JSON-ready dict (agents, primes and the summary numbers)."""
        return {
            "shared": self.shared,
            "pool_slot": self.pool_slot,
            "pool_tokens": self.pool_tokens,
            "prefix_tokens": self.prefix_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_processed": self.tokens_processed,
            "tokens_without_sharing": self.tokens_without_sharing,
            "kv_cells_peak": self.kv_cells_peak,
            "kv_cells_method": self.kv_cells_method,
            "kv_cells_with_sharing_model": self.kv_cells_with_sharing,
            "kv_cells_without_sharing_model": self.kv_cells_without_sharing,
            "statuses": self.statuses,
            "primes": [dataclasses.asdict(p) for p in self.primes],
            "agents": [dataclasses.asdict(a) for a in self.agents],
        }


# --------------------------------------------------------------------------- in-process engine
@dataclass
class AgentTimings:
    """Seconds, measured from the start of the run."""

    suffix_s: float = 0.0  # wall time of the decode calls that carried this agent's prompt tokens
    first_token_s: float = 0.0  # until the agent's first token was sampled
    total_s: float = 0.0  # until the agent stopped


@dataclass
class EngineAgentResult:
    """One agent's outcome."""

    index: int
    seq_id: int
    prompt_tokens: list[int]  # everything the agent's sequence was conditioned on (prefix + suffix)
    suffix_tokens: list[int]  # the tokens this agent decoded itself before generating
    tokens: list[int]  # generated tokens (an end-of-generation token is not included)
    text: str  # detokenized tokens, cut before the first stop string
    stop_reason: StopReason
    tokens_processed: int  # tokens this agent itself put through llama_decode
    timings: AgentTimings


@dataclass
class EngineRunResult:
    """A whole run: per-agent results plus totals."""

    mode: EngineMode
    agents: list[EngineAgentResult]
    prefix_tokens: list[int]
    prefix_reused: bool
    tokens_processed: int  # every token put through llama_decode in this run
    timings: dict[str, float]  # prefix_s, share_s, suffix_s, generate_s, wall_s
    kv_cells: dict[str, int] | None = None  # after_prefix, [after_share], after_suffixes, final


def needs_reprime(status: str, *, server_prefix: bool = False) -> bool:
    """True when ``status`` says the pool no longer holds the base. When the server computes P,
    ``no_prefix`` says so too: every agent's prompt starts with the base, so only a pool that
    lost it has nothing in common with the prompt."""
    return status in REPRIME_STATUSES or (server_prefix and status == "no_prefix")
