"""Sampler chains: greedy, or seeded temperature / top-k / top-p."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

from .._ffi import ffi, lib
from ..errors import LlamaError
from ._check import check_ptr
from .params import SamplingParams

if TYPE_CHECKING:
    from types import TracebackType

    from .context import Context


class Sampler:
    """An owned ``llama_sampler`` chain built from :class:`SamplingParams`."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params or SamplingParams()
        cp = lib.llama_sampler_chain_default_params()
        cp.no_perf = True
        self._ptr: Any = check_ptr(lib.llama_sampler_chain_init(cp), "llama_sampler_chain_init")
        p = self.params
        if p.greedy:
            self._add(lib.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                self._add(lib.llama_sampler_init_top_k(p.top_k))
            if p.top_p < 1.0:
                self._add(lib.llama_sampler_init_top_p(p.top_p, 1))
            self._add(lib.llama_sampler_init_temp(p.temperature))
            self._add(lib.llama_sampler_init_dist(p.seed))

    def _add(self, smpl: Any) -> None:
        lib.llama_sampler_chain_add(self._ptr, check_ptr(smpl, "creating a sampler"))  # the chain owns it

    @property
    def ptr(self) -> Any:
        if self._ptr == ffi.NULL:
            raise LlamaError("the sampler is closed")
        return self._ptr

    def sample(self, ctx: Context, idx: int) -> int:
        """Pick (and accept) a token from output ``idx`` of the context's last decode."""
        ctx.check_output(idx)
        return int(lib.llama_sampler_sample(self.ptr, ctx.ptr, idx))

    def accept(self, token: int) -> None:
        lib.llama_sampler_accept(self.ptr, token)

    def reset(self) -> None:
        lib.llama_sampler_reset(self.ptr)

    def close(self) -> None:
        if self._ptr != ffi.NULL:
            lib.llama_sampler_free(self._ptr)
            self._ptr = ffi.NULL

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            self.close()
