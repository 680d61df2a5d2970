"""What a backend other than the CPU must show besides the gate: zero-config sharing answers like the stock server,
and pool files cross between backends.

``scripts/device_check.py`` runs these with every layer offloaded (``--server-args='-ngl 99'``), on CUDA on a lent
GPU and on Vulkan (lavapipe) in CI; the CPU runs them too (there both sides of the pool-file check are the CPU).

- **zero_config**: ``polykv serve``'s recipe (``--share-any``, no pool declared) gets N concurrent chat requests
  with one system message through the official ``openai`` package (plain HTTP to the same endpoint where the
  package is not installed: a lent GPU machine has none; the report names the client); all but one must
  report the system message as cached, and every greedy answer must equal the reference server's (built the
  same way, same flags) under the layout margins of :mod:`polykv_py.harness.compare`.
- **pool_files**: a pool primed on the offloaded backend and saved is restored on the CPU backend of the same
  binary (``-ngl 0 --no-op-offload``: the KV in host memory, computed by the CPU) and the other way round. The
  rule (docs/build.md): a pool file's state is the cache's cells in its type and layout (f16 here), which do
  not depend on where the buffer lives, so its identity names no backend and a restore on another backend is
  accepted; it must be exact: the restored pool, saved again, is the file byte for byte, and it shares (a
  ``hit`` that computes only the suffix). Whether the two backends compute the same bits for the same tokens
  is reported, not required.

``python -m polykv_py.harness.backend_checks --server-args='-ngl 99' --report out.json`` (the servers of
``POLYKV_SERVER_BIN`` / ``POLYKV_UPSTREAM_SERVER_BIN``, else the installed ones); exit status 0 when every check
passes.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..client import Client, Share
from ..data import sample_document
from ..errors import HTTPError
from ..jsontypes import Json
from ..llama_server import LlamaServer
from ..native import ServerKind
from ..prefix_file import read_verified
from ..presets import (
    NO_HOST_CACHE,
    UNIFIED_KV,
    custom_server,
    pool_slot_args,
    reference_server,
    serve_server,
    slots_args,
)
from ..tokens import common_prefix_len
from .compare import compare_chat
from .texts import repeat_to_tokens

log = logging.getLogger(__name__)

POOL = 0
CTX = 8192
#: Every layer, and so the KV, on the CPU backend (the last -ngl on a command line wins), and no batch's matrix
#: products sent to the device either (ggml offloads those of large batches by default), so the CPU computes.
CPU_KV = ("-ngl", "0", "--no-op-offload")


@dataclass
class BackendConfig:
    """The servers' model, flags and sizes."""

    model: Path | None = None
    server_args: list[str] = field(default_factory=list)
    threads: int = 2
    log_dir: Path | None = None
    agents: int = 4
    system_tokens: int = 400
    max_tokens: int = 8


def _text(client: Client, n_tokens: int) -> str:
    return repeat_to_tokens(sample_document(), n_tokens, client.tokenize, client.detokenize)


# ------------------------------------------------------------------------------------------- zero config
def _chat_with(url: str) -> tuple[str, Callable[[list[Json], int], Json]]:
    """(the client's name, a function sending one greedy chat request with top-5 logprobs and returning the
    response as JSON)."""

    def plain(messages: list[Json], max_tokens: int) -> Json:
        body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": max_tokens, "logprobs": True,
                "top_logprobs": 5}  # fmt: skip
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        resp.raise_for_status()
        return resp.json()

    try:
        import openai
    except ImportError:
        return "httpx", plain
    api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    def official(messages: list[Json], max_tokens: int) -> Json:
        resp = api.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens,  # type: ignore[arg-type]
                                           logprobs=True, top_logprobs=5)  # fmt: skip
        return resp.model_dump()

    return f"openai {openai.__version__}", official


def _ask_all(url: str, conversations: list[list[Json]], max_tokens: int) -> tuple[str, list[Json]]:
    name, chat = _chat_with(url)
    with ThreadPoolExecutor(len(conversations)) as ex:
        return name, list(ex.map(lambda m: chat(m, max_tokens), conversations))


def check_zero_config(cfg: BackendConfig) -> Json:
    """N plain chat requests at once over one system message: shared on ``--share-any``, answered as the stock
    server answers them."""
    extra = cfg.server_args  # patched and reference alike
    srv = serve_server(0, agent_slots=cfg.agents, ctx=CTX, threads=cfg.threads, extra_args=extra, model=cfg.model,
                       log_dir=cfg.log_dir, name="zero-config")  # fmt: skip
    ref = reference_server(model=cfg.model, n_slots=cfg.agents, ctx=CTX, threads=cfg.threads, extra_args=extra,
                           log_dir=cfg.log_dir, name="zero-config-reference")  # fmt: skip
    with srv.start(), Client(srv.url) as c:
        system = _text(c, cfg.system_tokens)
        convs: list[list[Json]] = [
            [{"role": "system", "content": system}, {"role": "user", "content": f"Agent {i}: what is point {i}?"}]
            for i in range(cfg.agents)
        ]
        first, second = (c.prompt_tokens(c.apply_template(m)) for m in convs[:2])
        n_system = common_prefix_len(first, second)
        client, ours = _ask_all(srv.url, convs, cfg.max_tokens)
        health = srv.health_state()
    with ref.start():
        _, theirs = _ask_all(ref.url, convs, cfg.max_tokens)
    cached = [int(a["usage"]["prompt_tokens_details"]["cached_tokens"]) for a in ours]
    shared = sum(n >= n_system for n in cached)
    verdicts = [compare_chat(a["choices"][0], b["choices"][0]) for a, b in zip(ours, theirs, strict=True)]
    ok = health == "ok" and shared == cfg.agents - 1 and all(v.ok for v in verdicts)
    summary = (f"{cfg.agents} chat requests at once through {client}: {shared} found the {n_system}-token system "
               f"message cached (cached_tokens {cached}); answers vs the reference server: "
               f"{', '.join(v.verdict for v in verdicts)}")  # fmt: skip
    return {"ok": ok, "summary": summary, "client": client, "n_system": n_system, "cached_tokens": cached,
            "answers": [{"verdict": v.verdict, "detail": v.detail, "ok": v.ok} for v in verdicts],
            "health_after": health}  # fmt: skip


# ------------------------------------------------------------------------------------------- pool files
def _pool_server(cfg: BackendConfig, save: Path, where: Sequence[str], name: str) -> LlamaServer:
    args = [UNIFIED_KV, *slots_args(3, CTX), *NO_HOST_CACHE, "--slots", "--slot-save-path", f"{save}/",
            *pool_slot_args([POOL])]  # fmt: skip
    return custom_server(ServerKind.PATCHED, args, extra_args=[*cfg.server_args, *where], threads=cfg.threads,
                         model=cfg.model, log_dir=cfg.log_dir, name=name)  # fmt: skip


def _shares(c: Client, text: str, question: str, n_pool: int) -> Json:
    """A sharer's request over the pool: a hit that computes only its suffix."""
    res = c.completion(text + question, share=Share(POOL), id_slot=1, temperature=0, n_predict=4, cache_prompt=True)
    n_prompt = len(c.prompt_tokens(text + question))
    sp = res.get("shared_prefix") or {}
    prompt_n = res["timings"]["prompt_n"]
    return {"status": sp.get("status"), "shared": sp.get("shared"), "prompt_n": prompt_n,
            "ok": sp.get("status") == "hit" and prompt_n == n_prompt - n_pool}  # fmt: skip


def _restore_elsewhere(c: Client, save: Path, name: str, tokens: list[int], text: str, question: str) -> Json:
    """Restore ``name``; save it again; the bytes must be the file's, and the pool must share."""
    try:
        res = c.restore_pool(POOL, name, tokens=tokens)
    except HTTPError as exc:
        return {"file": name, "accepted": False, "refusal": exc.server_message, "ok": False}
    again = name.replace(".pkvpool", "-again.pkvpool")
    c.save_pool(POOL, again)
    exact = (save / again).read_bytes() == (save / name).read_bytes()
    share = _shares(c, text, question, len(tokens))
    return {"file": name, "accepted": res.get("n_restored") == len(tokens), "resaved_identical": exact,
            "share": share, "ok": res.get("n_restored") == len(tokens) and exact and share["ok"]}  # fmt: skip


def check_pool_files(cfg: BackendConfig) -> Json:
    """A pool file crosses from the offloaded backend to the CPU's and back, exactly."""
    question = "\nQuestion: what does the first section decide?\nAnswer:"
    with tempfile.TemporaryDirectory(prefix="polykv-pools-") as tmp:
        save = Path(tmp)
        save.chmod(0o700)
        with _pool_server(cfg, save, [], "pool-files-offloaded").start() as srv, Client(srv.url) as c:
            text = _text(c, cfg.system_tokens)
            tokens = c.prompt_tokens(text)
            c.prime(tokens, POOL)
            c.save_pool(POOL, "offloaded.pkvpool")
        with _pool_server(cfg, save, CPU_KV, "pool-files-cpu").start() as srv, Client(srv.url) as c:
            to_cpu = _restore_elsewhere(c, save, "offloaded.pkvpool", tokens, text, question)
            srv.restart()
            c.prime(tokens, POOL)
            c.save_pool(POOL, "cpu.pkvpool")
        with _pool_server(cfg, save, [], "pool-files-offloaded-restore").start() as srv, Client(srv.url) as c:
            to_offloaded = _restore_elsewhere(c, save, "cpu.pkvpool", tokens, text, question)
        same_bits = read_verified(save / "offloaded.pkvpool")[1] == read_verified(save / "cpu.pkvpool")[1]
    ok = to_cpu["ok"] and to_offloaded["ok"]
    summary = (f"a {len(tokens)}-token pool saved offloaded ({' '.join(cfg.server_args) or 'no flags'}) and restored "
               f"on the CPU backend: {_verdict(to_cpu)}; saved on the CPU and restored offloaded: "
               f"{_verdict(to_offloaded)}; both backends computed {'the same' if same_bits else 'different'} KV bits "
               f"for the tokens")  # fmt: skip
    return {"ok": ok, "summary": summary, "n_tokens": len(tokens), "offloaded_to_cpu": to_cpu,
            "cpu_to_offloaded": to_offloaded, "same_kv_bits_on_both_backends": same_bits}  # fmt: skip


def _verdict(r: Json) -> str:
    if not r["accepted"]:
        return f"refused ({r.get('refusal')})"
    share = r["share"]
    return (f"accepted, saved again {'byte-identical' if r['resaved_identical'] else 'DIFFERENT'}, sharer "
            f"{share['status']} computing {share['prompt_n']} tokens")  # fmt: skip


CHECKS: dict[str, Callable[[BackendConfig], Json]] = {"zero_config": check_zero_config, "pool_files": check_pool_files}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="GGUF (default: the pinned default model)")
    ap.add_argument("--server-args", default="", help="added to every server, e.g. '-ngl 99'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-dir", type=Path)
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--report", type=Path, required=True, help="the JSON report")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = [n for n in args.checks.split(",") if n]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        ap.error(f"unknown checks {unknown}; known: {sorted(CHECKS)}")
    cfg = BackendConfig(model=args.model, server_args=shlex.split(args.server_args), threads=args.threads,
                        log_dir=args.log_dir)  # fmt: skip
    checks: dict[str, Json] = {}
    for name in names:
        t0 = time.monotonic()
        try:
            checks[name] = CHECKS[name](cfg)
        except (HTTPError, httpx.HTTPError, RuntimeError, OSError, KeyError) as exc:
            checks[name] = {"ok": False, "summary": f"{type(exc).__name__}: {exc}"}
        checks[name]["wall_s"] = round(time.monotonic() - t0, 1)
        log.info("%s %s: %s", "PASS" if checks[name]["ok"] else "FAIL", name, checks[name]["summary"])
    doc = {"server_args": cfg.server_args, "ok": all(c["ok"] for c in checks.values()), "checks": checks}
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
