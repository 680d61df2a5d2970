"""Tiny random-weight GGUF models of families no pinned model covers, written with the ``gguf`` package.

The weights are random (fixed seed), so the text is noise; what the tests check is how the server's memory
behaves, which depends on the architecture, not on the weights. The tokenizer and chat template are the
default model's (copied from its GGUF), so prompts tokenize as in every other test.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

#: The recurrent model's shape: 2 Mamba layers, n_embd 64 (d_inner must be 2 * n_embd), 16 states, conv 4.
MAMBA_SHAPE = {"n_layer": 2, "n_embd": 64, "d_state": 16, "d_conv": 4, "dt_rank": 4}


def _copy_tokenizer(src: Path, w: gguf.GGUFWriter) -> None:
    r = gguf.GGUFReader(src)
    for key, add in (
        ("tokenizer.ggml.model", w.add_tokenizer_model),
        ("tokenizer.ggml.pre", w.add_tokenizer_pre),
        ("tokenizer.ggml.tokens", w.add_token_list),
        ("tokenizer.ggml.token_type", w.add_token_types),
        ("tokenizer.ggml.merges", w.add_token_merges),
        ("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
        ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
        ("tokenizer.ggml.unknown_token_id", w.add_unk_token_id),
        ("tokenizer.ggml.padding_token_id", w.add_pad_token_id),
        ("tokenizer.ggml.add_bos_token", w.add_add_bos_token),
        ("tokenizer.ggml.add_space_prefix", w.add_add_space_prefix),
        ("tokenizer.chat_template", w.add_chat_template),
    ):
        add(r.fields[key].contents())


def write_mamba(path: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """A 2-layer Mamba (recurrent memory: one state per sequence) with random weights; about 6.5 MB."""
    s = MAMBA_SHAPE
    n_embd, d_inner, d_state, d_conv, dt_rank = s["n_embd"], 2 * s["n_embd"], s["d_state"], s["d_conv"], s["dt_rank"]
    n_vocab = len(gguf.GGUFReader(tokenizer_from).fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MAMBA]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("polykv tiny mamba (random weights)")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(s["n_layer"])
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer(tokenizer_from, w)

    # numpy shapes are ggml's {ne0, ne1} reversed
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(s["n_layer"]):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"{b}.ssm_in.weight", rand(2 * d_inner, n_embd))
        w.add_tensor(f"{b}.ssm_conv1d.weight", rand(d_inner, d_conv, scale=0.2))
        w.add_tensor(f"{b}.ssm_conv1d.bias", rand(d_inner))
        w.add_tensor(f"{b}.ssm_x.weight", rand(dt_rank + 2 * d_state, d_inner))
        w.add_tensor(f"{b}.ssm_dt.weight", rand(d_inner, dt_rank, scale=0.2))
        w.add_tensor(f"{b}.ssm_dt.bias", rand(d_inner))
        w.add_tensor(f"{b}.ssm_a", -np.exp(rand(d_inner, d_state, scale=0.5)))  # A = -exp(A_log) < 0
        w.add_tensor(f"{b}.ssm_d", np.ones(d_inner, dtype=np.float32))
        w.add_tensor(f"{b}.ssm_out.weight", rand(n_embd, d_inner))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
