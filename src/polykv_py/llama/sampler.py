"""Sampler chains: greedy, or seeded temperature / top-k / top-p."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._ffi import lib
from ._check import check_ptr
from ._owned import OwnedPointer
from .params import SamplingParams

if TYPE_CHECKING:
    from .context import Context


class Sampler(OwnedPointer):
    """An owned ``llama_sampler`` chain built from :class:`SamplingParams`."""

    _what = "sampler"

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

    def sample(self, ctx: Context, idx: int) -> int:
        """Pick (and accept) a token from output ``idx`` of the context's last decode."""
        ctx.check_output(idx)
        return int(lib.llama_sampler_sample(self.ptr, ctx.ptr, idx))

    def accept(self, token: int) -> None:
        lib.llama_sampler_accept(self.ptr, token)

    def reset(self) -> None:
        lib.llama_sampler_reset(self.ptr)

    def _free(self, ptr: Any) -> None:
        lib.llama_sampler_free(ptr)
