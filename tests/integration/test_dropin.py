"""Drop-in sharing, server side (patch 0074): automatic P, ``--pool-auto``, isolation, default-off.

Raw HTTP (httpx) against the patched server, so the contract is checked as the wire shows it:
``shared_prefix.requested`` null and ``"auto"`` when the server chose P or the pool,
``salt_mismatch`` without length information, a 400 for a non-reserved ``shared_pool_slot``
and for requests the scheduler could never place, ``/props.polykv``, and a ``/metrics`` text
that is upstream's until a request opts in.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_py.client import Client
from polykv_py.errors import ServerError
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import NO_HOST_CACHE, UNIFIED_KV, pool_slot_args, slots_args
from polykv_py.tokens import common_prefix_len

pytestmark = pytest.mark.integration

MIN_TOKENS = 32
GREEDY: dict[str, Any] = {"temperature": 0, "cache_prompt": True, "n_predict": 2}


def post(url: str, path: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout, trust_env=False)


def tokenize(url: str, text: str) -> list[int]:
    with Client(url) as c:
        return c.prompt_tokens(text)


def base_text(seed: int, n_lines: int = 30) -> str:
    """A base context of a few hundred tokens whose first tokens differ per seed."""
    return "\n".join(
        f"Record {seed}-{i}: the archive lists item {i * 7 + seed} under shelf {i % 13}." for i in range(n_lines)
    )


def prime(url: str, base: str, slot: int = 0, **extra: Any) -> None:
    with Client(url) as c:
        c.prime(base, slot, **extra)


def complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    r = post(url, "/completion", {"prompt": prompt, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return dict(r.json())


def erase_workers(url: str) -> None:
    """Erase the unreserved slots 1 and 2, so the next request has no own cache to reuse (upstream's
    similarity-based slot reuse does not look at cache_salt)."""
    with Client(url) as c:
        for slot in (1, 2):
            c.erase_slot(slot)


def start(bin_: Path, model: Path, logs: Path, name: str, args: list[str]) -> LlamaServer:
    return LlamaServer(bin_, model, args, log_dir=logs, name=name).start()


@pytest.fixture(scope="module")
def auto_server(patched_server_bin: Path, model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``-np 3 --pool-slots 0 --pool-auto --pool-auto-min-tokens 32``, unified KV, no host cache."""
    args = [
        UNIFIED_KV,
        *slots_args(3, 8192),
        *NO_HOST_CACHE,
        "--slots",
        "--slot-save-path",
        str(tmp_path_factory.mktemp("slot-files")),
        *pool_slot_args([0]),
        "--pool-auto",
        "--pool-auto-min-tokens",
        str(MIN_TOKENS),
    ]
    with start(patched_server_bin, model_path, tmp_path_factory.mktemp("auto"), "dropin-auto", args) as srv:
        yield srv.url


# ----------------------------------------------------------------- step 1: automatic P
def test_auto_p_is_the_true_common_prefix(auto_server: str) -> None:
    url = auto_server
    base = base_text(11)
    prime(url, base)
    prompt = base + "\nQuestion: which shelf holds item 18? Answer:"
    p = common_prefix_len(tokenize(url, base), tokenize(url, prompt))
    out = complete(url, prompt, shared_pool_slot=0)
    sp = out["shared_prefix"]
    assert sp["requested"] is None and sp["auto"] == "prefix", sp
    assert sp["status"] == "hit" and sp["shared"] == p > 200, (sp, p)
    assert out["timings"]["prompt_n"] == len(tokenize(url, prompt)) - p


def test_given_p_stays_an_assertion(auto_server: str) -> None:
    url = auto_server
    base = base_text(12)
    pool = base + "\nQuestion: which item is on shelf 4? Answer:"
    prime(url, pool)
    prompt = base + "\nQuestion: which shelf holds item 19? Answer:"
    p = common_prefix_len(tokenize(url, pool), tokenize(url, prompt))
    sp = complete(url, prompt, shared_pool_slot=0, shared_prefix_n_tokens=p + 3)["shared_prefix"]
    assert sp["status"] == "mismatch" and sp["common"] == p and sp["requested"] == p + 3 and "auto" not in sp, sp


def test_auto_p_on_the_whole_prompt_leaves_one_token(auto_server: str) -> None:
    url = auto_server
    base = base_text(13)
    prime(url, base)
    n = len(tokenize(url, base))
    sp = complete(url, base, shared_pool_slot=0)["shared_prefix"]
    assert sp["status"] == "hit" and sp["shared"] == n - 1, (sp, n)


# ----------------------------------------------------------------- step 2: automatic pool
def test_auto_pool_hit_without_any_field(auto_server: str) -> None:
    url = auto_server
    base = base_text(21)
    prime(url, base)
    prompt = base + "\nQuestion: which shelf holds item 28? Answer:"
    p = common_prefix_len(tokenize(url, base), tokenize(url, prompt))
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    sp = out["shared_prefix"]
    assert sp["auto"] == "pool" and sp["pool_slot"] == 0 and sp["status"] == "hit" and sp["requested"] is None, sp
    assert sp["shared"] == p
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == p
    metrics = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    m = re.search(r"^llamacpp:polykv_share_auto_total (\S+)$", metrics, re.M)
    assert m and float(m.group(1)) >= 1, metrics


def test_auto_pool_respects_min_tokens(auto_server: str) -> None:
    url = auto_server
    base = base_text(22)
    prime(url, base)
    toks = tokenize(url, base)
    # a prompt that starts with fewer than MIN_TOKENS of the pool's tokens (its first record)
    prompt = base.split("\n", 1)[0] + "\nAnd now something else entirely: name a colour, then count to ten."
    assert 8 < common_prefix_len(toks, tokenize(url, prompt)) < MIN_TOKENS
    out = complete(url, prompt)
    assert "shared_prefix" not in out, out["shared_prefix"]


# ----------------------------------------------------------------- step 3: isolation and salt
def test_only_reserved_slots_are_sources(auto_server: str) -> None:
    r = post(auto_server, "/completion", {"prompt": "hello", "n_predict": 1, "shared_pool_slot": 1})
    assert r.status_code == 400 and "Field 'shared_pool_slot'" in r.text and "not a pool slot" in r.text, r.text


@pytest.mark.parametrize("salt", ["", "x" * 257, 5, True])
def test_bad_cache_salt_is_400(auto_server: str, salt: Any) -> None:
    r = post(auto_server, "/completion", {"prompt": "hello", "n_predict": 1, "cache_salt": salt})
    assert r.status_code == 400 and "cache_salt" in r.text, r.text


def test_salt(auto_server: str) -> None:
    url = auto_server
    base = base_text(31)
    prime(url, base, cache_salt="tenant-a")
    q = "\nQuestion: which shelf holds item {}? Answer:"
    p = common_prefix_len(tokenize(url, base), tokenize(url, base + q.format(1)))
    # another salt, or none: refused with no length information
    for extra in ({"cache_salt": "tenant-b"}, {}):
        erase_workers(url)
        sp = complete(url, base + q.format(2), shared_pool_slot=0, shared_prefix_n_tokens=p, **extra)["shared_prefix"]
        assert sp["status"] == "salt_mismatch" and sp["shared"] == 0 and "common" not in sp, sp
    # automatic pool choice never picks a pool of another salt (nor an unsalted request's)
    erase_workers(url)
    assert "shared_prefix" not in complete(url, base + q.format(3), cache_salt="tenant-b")
    erase_workers(url)
    assert "shared_prefix" not in complete(url, base + q.format(4))
    # the same salt shares, explicitly and automatically
    erase_workers(url)
    sp = complete(url, base + q.format(5), shared_pool_slot=0, cache_salt="tenant-a")["shared_prefix"]
    assert sp["status"] == "hit" and sp["shared"] == p, sp
    erase_workers(url)
    sp = complete(url, base + q.format(6), cache_salt="tenant-a")["shared_prefix"]
    assert sp["status"] == "hit" and sp["auto"] == "pool" and sp["shared"] == p, sp


def test_reprime_under_another_salt_recomputes(auto_server: str) -> None:
    url = auto_server
    base = base_text(32)
    prime(url, base, cache_salt="tenant-a")
    # the same prompt pinned under another salt: the pool's cells are recomputed and labelled tenant-c
    r = post(url, "/completion", {"prompt": base, "id_slot": 0, "n_predict": 0, "cache_salt": "tenant-c"})
    assert r.status_code == 200 and r.json()["timings"]["prompt_n"] == len(tokenize(url, base)), r.text
    prompt = base + "\nQuestion: which shelf holds item 3? Answer:"
    erase_workers(url)
    assert (
        complete(url, prompt, shared_pool_slot=0, cache_salt="tenant-a")["shared_prefix"]["status"] == "salt_mismatch"
    )
    erase_workers(url)
    assert complete(url, prompt, shared_pool_slot=0, cache_salt="tenant-c")["shared_prefix"]["status"] == "hit"


# ----------------------------------------------------------------- step 4: /props, prompt arrays
def test_props_polykv_object(auto_server: str) -> None:
    props = httpx.get(auto_server + "/props", timeout=30, trust_env=False).json()
    files = props["polykv"].pop("pool_files")  # what a pool file must match here (patch 0075)
    assert files["format"] == 3 and set(files) == {"format", "model", "kv", "settings"} and files["settings"] == {}
    assert props["polykv"] == {
        "pool_slots": [0],
        "pool_auto": True,
        "pool_auto_min_tokens": MIN_TOKENS,
        "share_any": False,
    }


def test_prompt_array_reports_one_shared_prefix_per_choice(auto_server: str) -> None:
    url = auto_server
    base = base_text(41)
    prime(url, base)
    prompts = [base + "\nQuestion: which shelf holds item 1? Answer:", base + "\nQuestion: name item 2. Answer:"]
    r = post(url, "/v1/completions", {"prompt": prompts, "max_tokens": 2, "temperature": 0, "shared_pool_slot": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 2 and "shared_prefix" not in out
    for choice in out["choices"]:
        assert choice["shared_prefix"]["pool_slot"] == 0 and choice["shared_prefix"]["status"] in ("hit", "own_cache")
    # /completion: one result object per prompt, each with its own
    r = post(url, "/completion", {"prompt": prompts, **GREEDY, "shared_pool_slot": 0})
    assert r.status_code == 200 and [x["shared_prefix"]["pool_slot"] for x in r.json()] == [0, 0], r.text


# ----------------------------------------------------------------- step 4: default off
def metric_names(text: str) -> list[str]:
    return sorted(
        {re.split(r"[ {]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    )


def test_metrics_without_pool_option_are_upstreams(
    patched_server_bin: Path, upstream_server_bin: Path, model_path: Path, tmp_path: Path
) -> None:
    args = [*slots_args(2, 2048), *NO_HOST_CACHE]
    with (
        start(patched_server_bin, model_path, tmp_path, "dropin-plain", args) as pat,
        LlamaServer(
            upstream_server_bin, model_path, args, kind="upstream", log_dir=tmp_path, name="dropin-ref"
        ).start() as ref,
    ):
        texts = []
        for url in (pat.url, ref.url):
            complete(url, "Name a colour.")
            texts.append(httpx.get(url + "/metrics", timeout=30, trust_env=False).text)
        assert metric_names(texts[0]) == metric_names(texts[1])
        assert "polykv" not in texts[0]
        assert "polykv" not in httpx.get(pat.url + "/props", timeout=30, trust_env=False).json()
        # a request that opts in turns the counters on
        complete(pat.url, "Name a colour.", shared_pool_slot=1, shared_prefix_n_tokens=2)
        assert (
            "llamacpp:polykv_share_requests_total 1"
            in httpx.get(pat.url + "/metrics", timeout=30, trust_env=False).text
        )


# ----------------------------------------------------------------- step 5: nothing waits forever
def test_unschedulable_requests_answer_400_at_once(patched_server_bin: Path, model_path: Path, tmp_path: Path) -> None:
    args = [UNIFIED_KV, *slots_args(2, 2048), *NO_HOST_CACHE, *pool_slot_args([0])]
    with start(patched_server_bin, model_path, tmp_path, "dropin-hang", args) as srv:
        t0 = time.monotonic()
        r = post(srv.url, "/completion", {"prompt": "Name a colour.", "n_predict": 2, "n": 2}, timeout=20)
        assert r.status_code == 400 and "n_cmpl" in r.text and "unreserved" in r.text, r.text
        r = post(
            srv.url, "/completion", {"prompt": "Name a colour.", "n_predict": 2, "shared_pool_slot": 1}, timeout=20
        )
        assert r.status_code == 400 and "shared_pool_slot" in r.text, r.text
        assert time.monotonic() - t0 < 10
        # nothing was queued: the next request is served
        assert complete(srv.url, "Name a colour.")["content"] is not None
        r = post(srv.url, "/v1/completions", {"prompt": "Name a colour.", "max_tokens": 2, "n": 1}, timeout=60)
        assert r.status_code == 200, r.text


def test_pool_auto_without_pool_slots_refuses_to_start(
    patched_server_bin: Path, model_path: Path, tmp_path: Path
) -> None:
    srv = LlamaServer(
        patched_server_bin, model_path, [*slots_args(2, 2048), "--pool-auto"], log_dir=tmp_path, name="dropin-bad"
    )
    with pytest.raises(ServerError):
        srv.start(timeout=120)
    srv.stop()
    assert "--pool-auto needs --pool-slots" in srv.log_path.read_text(errors="replace")
