"""A LoRA adapter for the default model, written with the ``gguf`` package (there is none to download).

A rank-4 LoRA on every layer's K and V projections (it changes the KV cells themselves), small random
weights (seed 7): the LoRA tests of the pool and of the slot choice, the provenance oracle and its soak
benchmark load it. Needs the test extra (``gguf``, which brings numpy).
"""

from __future__ import annotations

from pathlib import Path

N_LAYER, N_EMBD, KV_DIM, RANK = 30, 576, 192, 4  # SmolLM2-135M: 3 KV heads of 64


def write_adapter(path: Path) -> Path:
    """Write the adapter to ``path`` (a ``.gguf``) and return it."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(RANK))
    for layer in range(N_LAYER):
        for proj in ("attn_k", "attn_v"):
            # ggml shapes: A is [n_embd, r], B is [r, kv_dim]; numpy's are the reverse
            w.add_tensor(
                f"blk.{layer}.{proj}.weight.lora_a", (rng.standard_normal((RANK, N_EMBD)) * 0.05).astype(np.float32)
            )
            w.add_tensor(
                f"blk.{layer}.{proj}.weight.lora_b", (rng.standard_normal((KV_DIM, RANK)) * 0.05).astype(np.float32)
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
