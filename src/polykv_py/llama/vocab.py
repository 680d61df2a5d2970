"""Tokenizer, detokenizer, special tokens and chat templates of a loaded model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._ffi import ffi, lib
from ..errors import ModelError, TokenError
from ._check import check_template, read_sized
from ._owned import CGetter

if TYPE_CHECKING:
    from .model import Model

_INT32_MAX = 2**31 - 1


class Vocab:
    """The vocabulary of a :class:`Model`; valid while the model is open."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self.n_tokens: int = int(lib.llama_vocab_n_tokens(self.ptr))

    @property
    def ptr(self) -> Any:
        """The model's ``llama_vocab`` (raises :class:`LlamaError` once the model is closed)."""
        return lib.llama_model_get_vocab(self._model.ptr)

    # -- special tokens -------------------------------------------------------------
    bos = CGetter(lib.llama_vocab_bos, int, "Beginning-of-sequence token.")
    eos = CGetter(lib.llama_vocab_eos, int, "End-of-sequence token.")
    eot = CGetter(lib.llama_vocab_eot, int, "End-of-turn token.")
    nl = CGetter(lib.llama_vocab_nl, int, "Newline token.")
    add_bos = CGetter(lib.llama_vocab_get_add_bos, bool, "Whether tokenizing with add_special adds BOS.")
    add_eos = CGetter(lib.llama_vocab_get_add_eos, bool, "Whether tokenizing with add_special adds EOS.")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ...)."""
        return bool(lib.llama_vocab_is_eog(self.ptr, self.check_token(token)))

    def is_control(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_control(self.ptr, self.check_token(token)))

    def token_text(self, token: int) -> str:
        """The raw vocabulary entry of ``token`` (not detokenized)."""
        return ffi.string(lib.llama_vocab_get_text(self.ptr, self.check_token(token))).decode("utf-8", "replace")

    # -- validation -----------------------------------------------------------------
    def check_token(self, token: int) -> int:
        """Return ``token`` if it is a valid id of this vocabulary, else raise :class:`TokenError`."""
        if isinstance(token, bool) or not isinstance(token, int):
            raise TokenError(f"token ids are ints, not {type(token).__name__}")
        if not 0 <= token < self.n_tokens:
            raise TokenError(f"token id {token} is outside the vocabulary [0, {self.n_tokens})")
        return token

    def check_tokens(self, tokens: Iterable[int]) -> list[int]:
        """Validate every id of ``tokens`` and return them as a list."""
        out = list(tokens)
        n = self.n_tokens
        for t in out:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n:
                self.check_token(t)  # raises with the precise message
        return out

    # -- text <-> tokens ------------------------------------------------------------
    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Tokenize ``text``; ``add_special`` adds BOS/EOS as the model wants them."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if len(data) > _INT32_MAX:
            raise TokenError("text too long to tokenize (more than 2**31 - 1 bytes)")
        vocab = self.ptr

        def fill(buf: Any, cap: int) -> int:
            return int(lib.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special))

        return list(read_sized(fill, len(data) + 8, "llama_tokenize", ctype="llama_token[]"))

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes ``token`` detokenizes to on its own (may be part of a UTF-8 character)."""
        self.check_token(token)
        vocab = self.ptr

        def fill(buf: Any, cap: int) -> int:
            return int(lib.llama_token_to_piece(vocab, token, buf, cap, 0, special))

        return bytes(read_sized(fill, 64, "llama_token_to_piece"))

    def detokenize_bytes(
        self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False
    ) -> bytes:
        toks = self.check_tokens(tokens)
        if not toks:
            return b""
        vocab, arr = self.ptr, ffi.new("llama_token[]", toks)

        def fill(buf: Any, cap: int) -> int:
            return int(lib.llama_detokenize(vocab, arr, len(toks), buf, cap, remove_special, unparse_special))

        return bytes(read_sized(fill, max(64, 8 * len(toks)), "llama_detokenize"))

    def detokenize(self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of ``tokens`` (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD)."""
        raw = self.detokenize_bytes(tokens, remove_special=remove_special, unparse_special=unparse_special)
        return raw.decode("utf-8", errors="replace")

    # -- chat templates -------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_assistant: bool = True,
        template: str | None = None,
    ) -> str:
        """Format ``messages`` (dicts with ``role`` and ``content``) with a built-in chat template.

        ``template`` defaults to the model's own template (GGUF ``tokenizer.chat_template``).
        Only templates libllama recognises are supported (no Jinja engine).
        """
        tmpl = template if template is not None else self._model.chat_template
        if tmpl is None:
            raise ModelError("the model has no chat template; pass template=")
        keep: list[Any] = []
        msgs = ffi.new("llama_chat_message[]", len(messages))
        for i, m in enumerate(messages):
            try:
                role, content = m["role"], m["content"]
            except (KeyError, TypeError) as exc:
                raise ValueError(f"message {i} needs 'role' and 'content' keys") from exc
            r, c = ffi.new("char[]", role.encode()), ffi.new("char[]", content.encode())
            keep += (r, c)
            msgs[i].role, msgs[i].content = r, c
        tmpl_c = ffi.new("char[]", tmpl.encode())

        def fill(buf: Any, cap: int) -> int:  # answers the full length, which may exceed cap
            n = check_template(int(lib.llama_chat_apply_template(tmpl_c, msgs, len(messages), add_assistant, buf, cap)))
            return n if n <= cap else -n

        cap = max(256, 2 * sum(len(m["content"]) + len(m["role"]) for m in messages) + 256)
        return bytes(read_sized(fill, cap, "llama_chat_apply_template")).decode("utf-8", errors="replace")
