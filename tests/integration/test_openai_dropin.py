"""The patched server as a drop-in OpenAI endpoint, through the official ``openai`` package.

The server is started as ``polykv serve --pool DOC --pool-chat DOC`` starts it (presets.serve_server: reserved
pools, ``--pool-auto``; pools primed by polykv_py.serve.prime_pools), small: 2 agent slots, 4,096 cells, 2
threads, a ~250-token document. Sync and async clients, chat and completions, streamed and not:

- a plain request (no pool field) shares the pool that starts like its prompt (``shared_prefix.auto ==
  "pool"``), ``usage.prompt_tokens_details.cached_tokens`` is the shared count, and the answer (text and
  log-probabilities) is byte-identical to the reference server answering the same request from its own
  cache after the same priming requests (the same split at P, the same KV cell layout: both servers are
  reset and primed alike before every comparison, and P is the pool's whole prompt);
- ``extra_body={"shared_pool_slot": s}`` without P: the server computes P (``requested`` null,
  ``auto == "prefix"``); a slot that is not a reserved pool is refused with HTTP 400;
- a pool primed with a ``cache_salt`` is shared only by requests with the same salt.

Before each comparison both servers are emptied and primed alike with the one pool the request shares (so
their KV cells are laid out alike); the comparisons come first in the module, so both servers start every
reset from the same history.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from polykv_py.client import Client, PoolFeatures
from polykv_py.data import sample_document
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import reference_server, serve_server
from polykv_py.serve import PoolSpec, prime_pools

pytestmark = pytest.mark.integration

AGENT_SLOTS = 2
N_POOLS = 3  # slot 0: the document as text, 1: as a chat system message, 2: left for the salt test
CTX = 4096
MAX_TOKENS = 10
#: The shared document: whole lines, ending in a newline (its tokens are a prefix of DOC + QUESTION's).
DOC = "\n".join(sample_document().splitlines()[:14]).rstrip("\n") + "\n"
QUESTION = "Question: what does Lanternfish replace?\nAnswer:"
CHAT = [{"role": "system", "content": DOC}, {"role": "user", "content": "What does Lanternfish replace?"}]
POOLS = [PoolSpec(0, DOC, "text", "doc"), PoolSpec(1, DOC, "chat", "doc (chat)")]
#: The pool each endpoint's plain requests share.
POOL_OF = {"completions": 0, "chat": 1}


@dataclass(frozen=True)
class Case:
    api: str  # "chat" or "completions"
    stream: bool
    use_async: bool

    def __str__(self) -> str:
        return f"{'async' if self.use_async else 'sync'}-{self.api}-{'stream' if self.stream else 'whole'}"


#: Each of sync/async, chat/completions and streamed/whole twice, each api with both of the others.
CASES = [Case("completions", False, False), Case("chat", True, False), Case("completions", True, True),
         Case("chat", False, True)]  # fmt: skip


@dataclass
class Answer:
    """What the comparison needs from one OpenAI response (streamed or not)."""

    text: str
    logprobs: list[Any]
    finish_reason: str | None
    shared_prefix: dict[str, Any] | None
    prompt_tokens: int | None
    cached_tokens: int | None

    def same_output(self) -> tuple[str, list[Any], str | None]:
        return self.text, self.logprobs, self.finish_reason


def _extra(obj: Any, name: str) -> Any:
    """A field the openai types do not declare (llama-server's own), from ``model_extra``."""
    return (obj.model_extra or {}).get(name)


def _cached(usage: Any) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return getattr(details, "cached_tokens", None) if details is not None else None


def request_args(case: Case, extra_body: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {"model": "polykv", "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": extra_body}
    if case.api == "chat":
        args.update(messages=CHAT, logprobs=True, top_logprobs=3)
    else:
        args.update(prompt=DOC + QUESTION, logprobs=3)
    if case.stream:
        args.update(stream=True, stream_options={"include_usage": True})
    return args


def fold(case: Case, parts: list[Any]) -> Answer:
    """One Answer from a whole response (``parts`` of one) or from a stream's chunks."""
    text, logprobs, finish, sp, usage = [], [], None, None, None
    for part in parts:
        for choice in part.choices:
            text.append((choice.delta.content or "") if case.stream and case.api == "chat" else
                        (choice.message.content or "") if case.api == "chat" else choice.text)  # fmt: skip
            if choice.logprobs is not None:
                logprobs.append(choice.logprobs.model_dump())
            finish = choice.finish_reason or finish
        sp = _extra(part, "shared_prefix") or sp
        usage = part.usage or usage
    return Answer("".join(text), logprobs, finish, sp, getattr(usage, "prompt_tokens", None), _cached(usage))


def ask(server: LlamaServer, case: Case, extra_body: dict[str, Any] | None = None) -> Answer:
    """Send the case's request with the official client (sync or async) and fold its answer."""
    args = request_args(case, extra_body or {})
    url = f"{server.url}/v1"
    if not case.use_async:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        with client:
            api = client.chat.completions if case.api == "chat" else client.completions
            resp = api.create(**args)
            return fold(case, list(resp) if case.stream else [resp])

    async def main() -> Answer:
        aclient = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        async with aclient:
            api = aclient.chat.completions if case.api == "chat" else aclient.completions
            resp = await api.create(**args)
            return fold(case, [c async for c in resp] if case.stream else [resp])

    return asyncio.run(main())


def reset(server: LlamaServer, api: str) -> None:
    """Empty every slot and prime the pool ``api``'s requests share: the same KV state on either server."""
    client = server.client
    for slot in range(int(client.props()["total_slots"])):
        client.erase_slot(slot)
    prime_pools(client, [POOLS[POOL_OF[api]]])


def erase_agent_slots(server: LlamaServer) -> None:
    for slot in range(N_POOLS, N_POOLS + AGENT_SLOTS):
        server.client.erase_slot(slot)


def pool_p(client: Client, api: str) -> int:
    """P of this module's request over its pool: the pool's whole prompt (asserted)."""
    pool = POOLS[POOL_OF[api]].prompt(client)
    full = DOC + QUESTION if api == "completions" else client.apply_template(CHAT)
    pool_tokens, tokens = client.prompt_tokens(pool), client.prompt_tokens(full)
    assert tokens[: len(pool_tokens)] == pool_tokens, "the pool's tokens must be a prefix of the request's"
    return len(pool_tokens)


@pytest.fixture(scope="module")
def patched(patched_server_bin: Path, model_path: Path, logs: Path) -> Iterator[LlamaServer]:
    # upstream's decode attention (polykv serve's default is --shared-decode): these answers are compared with the
    # reference byte for byte, which only the sharing itself promises (test_shared_decode.py covers the other path)
    srv = serve_server(N_POOLS, agent_slots=AGENT_SLOTS, ctx=CTX, threads=2, slot_actions=True, shared_decode=False,
                       binary=patched_server_bin, model=model_path, log_dir=logs, name="dropin")  # fmt: skip
    with srv:
        prime_pools(srv.client, POOLS)  # as polykv serve does before it says "ready"
        yield srv


@pytest.fixture(scope="module")
def reference(upstream_server_bin: Path, model_path: Path, logs: Path) -> Iterator[LlamaServer]:
    srv = reference_server(n_slots=N_POOLS + AGENT_SLOTS, ctx=CTX, threads=2, binary=upstream_server_bin,
                           model=model_path, log_dir=logs, name="dropin-reference")  # fmt: skip
    with srv:
        yield srv


# ------------------------------------------------------------------------------ byte-identical to the reference


@pytest.mark.parametrize("case", CASES, ids=str)
def test_plain_request_shares_a_pool_and_answers_like_the_reference(
    patched: LlamaServer, reference: LlamaServer, case: Case
) -> None:
    p = pool_p(patched.client, case.api)
    reset(patched, case.api)
    got = ask(patched, case)
    assert got.shared_prefix == {"pool_slot": POOL_OF[case.api], "requested": None, "shared": p, "status": "hit",
                                 "auto": "pool"}  # fmt: skip
    assert got.cached_tokens == p
    assert got.text

    reset(reference, case.api)
    ref = ask(reference, case, {"id_slot": POOL_OF[case.api]})  # the reference's own cache after the same priming
    assert ref.shared_prefix is None and ref.cached_tokens == p and ref.prompt_tokens == got.prompt_tokens
    assert got.same_output() == ref.same_output()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_shared_pool_slot_without_p_lets_the_server_compute_it(
    patched: LlamaServer, reference: LlamaServer, api: str
) -> None:
    case = Case(api, stream=False, use_async=False)
    p = pool_p(patched.client, api)
    reset(patched, case.api)
    got = ask(patched, case, {"shared_pool_slot": POOL_OF[api]})
    assert got.shared_prefix == {"pool_slot": POOL_OF[api], "requested": None, "shared": p, "status": "hit",
                                 "auto": "prefix"}  # fmt: skip
    assert got.cached_tokens == p

    reset(reference, case.api)
    ref = ask(reference, case, {"id_slot": POOL_OF[api]})
    assert got.same_output() == ref.same_output()


# ------------------------------------------------------------------------------ the pools' contract


def test_props_announce_the_pools(patched: LlamaServer) -> None:
    features = Client(patched.url).pool_features()
    files = features.pool_files
    assert files is not None and files["format"] == 3 and files["kv"]["n_stream"] == 1  # patch 0075
    assert dataclasses.replace(features, pool_files=None) == PoolFeatures(
        pool_slots=(0, 1, 2), pool_auto=True, pool_auto_min_tokens=64, server_prefix=True, share_any=True
    )


def test_shared_pool_slot_must_name_a_reserved_pool(patched: LlamaServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(patched, Case("completions", False, False), {"shared_pool_slot": N_POOLS})  # an agent slot
    assert info.value.status_code == 400


def test_a_salted_pool_is_shared_only_with_its_salt(patched: LlamaServer) -> None:
    salted = PoolSpec(2, "Team A notes.\n" + DOC, "text", "salted")
    prime_pools(patched.client, [salted], salt="team-a")
    prompt = salted.text + QUESTION

    def plain(salt: str | None, **extra: Any) -> Answer:
        erase_agent_slots(patched)  # no agent slot's own cache in the way
        body = {**extra, **({"cache_salt": salt} if salt is not None else {})}
        case = Case("completions", False, False)
        args = {**request_args(case, body), "prompt": prompt}
        with openai.OpenAI(base_url=f"{patched.url}/v1", api_key="unused", max_retries=0) as client:
            return fold(case, [client.completions.create(**args)])

    same = plain("team-a")
    assert same.shared_prefix is not None and same.shared_prefix["status"] == "hit"
    assert same.shared_prefix["pool_slot"] == 2 and same.shared_prefix["auto"] == "pool"
    assert same.cached_tokens == same.shared_prefix["shared"] > 64
    for other in ("team-b", None):  # another salt, or none: the salted pool is invisible
        got = plain(other)
        assert got.shared_prefix is None and got.cached_tokens == 0, (other, got.shared_prefix)
    named = plain("team-b", shared_pool_slot=2)  # naming it does not help
    assert named.shared_prefix is not None and named.shared_prefix["status"] == "salt_mismatch"
    assert named.shared_prefix["shared"] == 0 and named.cached_tokens == 0
