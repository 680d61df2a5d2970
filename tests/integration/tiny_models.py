"""Tiny random-weight GGUF models of families no pinned model covers, written with the ``gguf`` package.

The weights are random (fixed seed), so the text is noise; what the tests check is how the server's memory
behaves, which depends on the architecture, not on the weights. The tokenizer and chat template are the
default model's (copied from its GGUF), so prompts tokenize as in every other test.

Writers: :func:`write_mamba` (recurrent memory), :func:`write_lfm2` (hybrid: short-convolution recurrent layers
and attention layers), :func:`write_qwen3` (GQA with QK-norm, one unified KV cache) and :func:`write_gpt_oss`
(attention sinks, alternating sliding-window and full layers, a small mixture of experts).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

#: The recurrent model's shape: 2 Mamba layers, n_embd 64 (d_inner must be 2 * n_embd), 16 states, conv 4.
MAMBA_SHAPE = {"n_layer": 2, "n_embd": 64, "d_state": 16, "d_conv": 4, "dt_rank": 4}

#: The hybrid model's shape: 4 LFM2 layers, short-convolution (recurrent) on even layers and attention with QK-norm
#: on odd ones (head_count_kv 0 marks a recurrent layer); head size n_embd / n_head = 32 (the shared-decode kernel
#: takes multiples of 32); conv kernel (L cache) 3.
LFM2_SHAPE = {"n_layer": 4, "n_embd": 64, "n_head": 2, "n_head_kv": 1, "n_ff": 128, "l_cache": 3}

#: The Qwen3 model's shape: 2 layers, GQA 4 query / 2 KV heads of size 32 (so n_head * head_dim = 128 != n_embd).
QWEN3_SHAPE = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "head_dim": 32, "n_ff": 128}

#: The gpt-oss model's shape: 4 layers, sliding-window (window 128) on even layers and full attention on odd ones
#: (the loader's default pattern 2), GQA 4 / 2 heads of size 32 with per-head sinks, 4 experts (2 used) of size 64.
GPT_OSS_SHAPE = {
    "n_layer": 4,
    "n_embd": 64,
    "n_head": 4,
    "n_head_kv": 2,
    "head_dim": 32,
    "n_swa": 128,
    "n_expert": 4,
    "n_expert_used": 2,
    "n_ff_exp": 64,
}


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


def _writer(
    path: Path, arch: gguf.MODEL_ARCH, name: str, tokenizer_from: Path, *, n_layer: int, n_embd: int
) -> gguf.GGUFWriter:
    """A writer for ``arch`` with the keys every tiny model has: name, sizes, F32 weights, the tokenizer."""
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"polykv tiny {name} (random weights)")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer(tokenizer_from, w)
    return w


def _n_vocab(tokenizer_from: Path) -> int:
    return len(gguf.GGUFReader(tokenizer_from).fields["tokenizer.ggml.tokens"].data)


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _random(seed: int) -> Callable[..., np.ndarray]:
    """``rand(*shape, scale=0.02)``: F32 normal weights from a generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return rand


def _embedding(rand: Callable[..., np.ndarray], n_vocab: int, n_embd: int) -> np.ndarray:
    """F16 token embeddings (or output projection) of unit scale: the logits of a normalized state spread with a
    standard deviation of about sqrt(n_embd) = 8, so the top tokens are nats apart and greedy answers are stable
    under rounding (at 0.02 the distribution was near uniform, a top-5 list held ties only)."""
    return rand(n_vocab, n_embd, scale=1.0).astype(np.float16)


def _add_ffn(w: gguf.GGUFWriter, b: str, rand: Callable[..., np.ndarray], n_embd: int, n_ff: int) -> None:
    """Block ``b``'s SwiGLU feed-forward and its RMS norm."""
    w.add_tensor(f"{b}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor(f"{b}.ffn_gate.weight", rand(n_ff, n_embd))
    w.add_tensor(f"{b}.ffn_up.weight", rand(n_ff, n_embd))
    w.add_tensor(f"{b}.ffn_down.weight", rand(n_embd, n_ff))


def _add_qk_norm_attention(
    w: gguf.GGUFWriter, b: str, rand: Callable[..., np.ndarray], n_embd: int, n_head: int, n_head_kv: int, head_dim: int
) -> None:
    """Block ``b``'s GQA attention with an RMS norm on Q and K per head (Qwen3, LFM2's attention layers)."""
    w.add_tensor(f"{b}.attn_q.weight", rand(n_head * head_dim, n_embd))
    w.add_tensor(f"{b}.attn_k.weight", rand(n_head_kv * head_dim, n_embd))
    w.add_tensor(f"{b}.attn_v.weight", rand(n_head_kv * head_dim, n_embd))
    w.add_tensor(f"{b}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
    w.add_tensor(f"{b}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
    w.add_tensor(f"{b}.attn_output.weight", rand(n_embd, n_head * head_dim))


def write_mamba(path: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """A 2-layer Mamba (recurrent memory: one state per sequence) with random weights; about 6.5 MB."""
    s = MAMBA_SHAPE
    n_embd, d_inner, d_state, d_conv, dt_rank = s["n_embd"], 2 * s["n_embd"], s["d_state"], s["d_conv"], s["dt_rank"]
    n_vocab = _n_vocab(tokenizer_from)
    rand = _random(seed)

    w = _writer(path, gguf.MODEL_ARCH.MAMBA, "mamba", tokenizer_from, n_layer=s["n_layer"], n_embd=n_embd)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)

    # numpy shapes are ggml's {ne0, ne1} reversed
    w.add_tensor("token_embd.weight", _embedding(rand, n_vocab, n_embd))
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
    return _finish(w, path)


def write_lfm2(path: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """A 4-layer LFM2 (hybrid: shortconv layers 0, 2, attention 1, 3), random weights; 6.9 MB, 8.7 MB file."""
    s = LFM2_SHAPE
    n_layer, n_embd, n_head, n_ff, l_cache = s["n_layer"], s["n_embd"], s["n_head"], s["n_ff"], s["l_cache"]
    head_dim = n_embd // n_head  # the loader sizes wq and wo as n_embd x n_embd
    n_head_kv = [0 if i % 2 == 0 else s["n_head_kv"] for i in range(n_layer)]
    n_vocab = _n_vocab(tokenizer_from)
    rand = _random(seed)

    w = _writer(path, gguf.MODEL_ARCH.LFM2, "lfm2", tokenizer_from, n_layer=n_layer, n_embd=n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(1000000.0)
    w.add_shortconv_l_cache(l_cache)
    w.add_layer_norm_rms_eps(1e-5)

    # numpy shapes are ggml's {ne0, ne1} reversed; the output is tied to token_embd
    w.add_tensor("token_embd.weight", _embedding(rand, n_vocab, n_embd))
    w.add_tensor("token_embd_norm.weight", np.ones(n_embd, dtype=np.float32))  # LFM2's name for the output norm
    for i in range(n_layer):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if n_head_kv[i] == 0:
            w.add_tensor(f"{b}.shortconv.conv.weight", rand(n_embd, l_cache, scale=0.2))
            w.add_tensor(f"{b}.shortconv.in_proj.weight", rand(3 * n_embd, n_embd))
            w.add_tensor(f"{b}.shortconv.out_proj.weight", rand(n_embd, n_embd))
        else:
            _add_qk_norm_attention(w, b, rand, n_embd, n_head, n_head_kv[i], head_dim)
        _add_ffn(w, b, rand, n_embd, n_ff)
    return _finish(w, path)


def write_qwen3(path: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """A 2-layer Qwen3 (GQA 4/2 heads of 32, QK-norm), random weights; 6.7 MB, 8.5 MB file."""
    s = QWEN3_SHAPE
    n_layer, n_embd, n_head, n_head_kv, head_dim = s["n_layer"], s["n_embd"], s["n_head"], s["n_head_kv"], s["head_dim"]
    n_ff = s["n_ff"]
    n_vocab = _n_vocab(tokenizer_from)
    rand = _random(seed)

    w = _writer(path, gguf.MODEL_ARCH.QWEN3, "qwen3", tokenizer_from, n_layer=n_layer, n_embd=n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)  # rope dimension count defaults to the key length
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)

    # numpy shapes are ggml's {ne0, ne1} reversed; the output is tied to token_embd
    w.add_tensor("token_embd.weight", _embedding(rand, n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        _add_qk_norm_attention(w, b, rand, n_embd, n_head, n_head_kv, head_dim)
        _add_ffn(w, b, rand, n_embd, n_ff)
    return _finish(w, path)


def write_gpt_oss(path: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """A 4-layer gpt-oss (SWA 128 on layers 0, 2, sinks, 4 experts / 2 used), random weights; 13.8 MB, 15.6 MB file."""
    s = GPT_OSS_SHAPE
    n_layer, n_embd, n_head, n_head_kv, head_dim = s["n_layer"], s["n_embd"], s["n_head"], s["n_head_kv"], s["head_dim"]
    n_expert, n_ff_exp = s["n_expert"], s["n_ff_exp"]
    n_vocab = _n_vocab(tokenizer_from)
    rand = _random(seed)

    w = _writer(path, gguf.MODEL_ARCH.GPT_OSS, "gpt-oss", tokenizer_from, n_layer=n_layer, n_embd=n_embd)
    w.add_feed_forward_length(n_ff_exp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)  # n_rot defaults to the key length; q is n_head * n_rot wide
    w.add_value_length(head_dim)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    # required; no sliding_window_pattern key, so the loader's pattern 2 applies: layer il is SWA iff il % 2 == 0
    w.add_sliding_window(s["n_swa"])
    w.add_expert_count(n_expert)
    w.add_expert_used_count(s["n_expert_used"])
    w.add_expert_feed_forward_length(n_ff_exp)  # required

    # numpy shapes are ggml's {ne0, ne1, ne2} reversed; gpt-oss requires its own output.weight (no tying)
    w.add_tensor("token_embd.weight", _embedding(rand, n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", _embedding(rand, n_vocab, n_embd))
    for i in range(n_layer):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"{b}.attn_q.weight", rand(n_head * head_dim, n_embd))
        w.add_tensor(f"{b}.attn_q.bias", rand(n_head * head_dim))
        w.add_tensor(f"{b}.attn_k.weight", rand(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"{b}.attn_k.bias", rand(n_head_kv * head_dim))
        w.add_tensor(f"{b}.attn_v.weight", rand(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"{b}.attn_v.bias", rand(n_head_kv * head_dim))
        w.add_tensor(f"{b}.attn_output.weight", rand(n_embd, n_head * head_dim))
        w.add_tensor(f"{b}.attn_output.bias", rand(n_embd))
        w.add_tensor(f"{b}.attn_sinks.weight", rand(n_head, scale=0.5))  # one sink logit per query head
        w.add_tensor(f"{b}.post_attention_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_gate_inp.weight", rand(n_expert, n_embd))
        w.add_tensor(f"{b}.ffn_gate_inp.bias", rand(n_expert))
        w.add_tensor(f"{b}.ffn_gate_exps.weight", rand(n_expert, n_ff_exp, n_embd))
        w.add_tensor(f"{b}.ffn_gate_exps.bias", rand(n_expert, n_ff_exp))
        w.add_tensor(f"{b}.ffn_up_exps.weight", rand(n_expert, n_ff_exp, n_embd))
        w.add_tensor(f"{b}.ffn_up_exps.bias", rand(n_expert, n_ff_exp))
        w.add_tensor(f"{b}.ffn_down_exps.weight", rand(n_expert, n_embd, n_ff_exp))
        w.add_tensor(f"{b}.ffn_down_exps.bias", rand(n_expert, n_embd))
    return _finish(w, path)
