"""A Llama/Qwen2/Qwen3/Mistral decoder in plain torch, parameter-for-parameter compatible with HF.

Parameter names are Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so an HF
checkpoint loads with a plain `load_state_dict`, and `state_dict()` is the unit the learner
publishes and the engine applies. Numerics follow HF's reference code (RMSNorm in float32,
RoPE with rotate-half, cos/sin computed in float32) so logits agree to fp32 rounding.

Two forward paths share the weights:
- `forward(input_ids, attention_mask)` for training and for reference checks: causal over the
  whole sequence, no cache;
- `forward_cached(...)` for the engine: each row writes its new keys/values into its own slot of
  a `KVCache` at its own positions and attends over that slot's valid prefix, so prefill
  (one row, many tokens) and batched decode (many rows, one token each) are the same code.

The family differences live in three places: `Rotary` (Llama 3.x's rescaled frequencies),
`Attention` (Qwen3's per-head q/k RMSNorm) and `attention_window` (Mistral's sliding window, one
mask rule both forwards apply).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.engine.config import ModelConfig, RopeScaling
from slipstream.engine.kernels import WeightCache, project
from slipstream.engine.kv_cache import KVCache, SlotSelection
from slipstream.engine.moe import MoeBlock, last_routes, moe_blocks, routes_per_token
from slipstream.engine.mtp import build_mtp


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Rotary(nn.Module):
    """RoPE tables on demand: cos/sin for arbitrary per-row positions.

    The inverse frequencies are recomputed per call in float32 (a few dozen values) rather than
    kept as a buffer, so casting the model to bf16 never degrades them.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling

    def inv_freq(self, device: torch.device) -> Tensor:
        """The head_dim / 2 inverse frequencies (float32), rescaled when the config says so."""
        idx = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.theta ** (idx / self.head_dim))
        return inv_freq if self.scaling is None else _llama3_scaled(inv_freq, self.scaling)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin of shape [B, T, head_dim] for integer positions [B, T]."""
        inv_freq = self.inv_freq(positions.device)
        freqs = positions.to(torch.float32)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_scaled(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    """Llama 3.x's frequencies: wavelengths longer than original/low_freq_factor are slowed by
    `factor`, shorter than original/high_freq_factor kept, and the band between interpolated."""
    wavelen = 2 * torch.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    between = (1 - smooth) * scaled / s.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, between, scaled)


def attention_window(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Which keys each query may see: causal (k <= q), and within the last `window` positions
    (q - k < window) when `window` > 0. Broadcasts over whatever shapes the positions have."""
    seen = k_pos <= q_pos
    if window > 0:
        seen = seen & (k_pos > q_pos - window)
    return seen


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, T, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    """Grouped-query self-attention with HF projection names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.dim_per_head
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def _qkv(
        self, x: Tensor, cos: Tensor, sin: Tensor, kernel: WeightCache | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q = project(self.q_proj, x, kernel).view(b, t, self.n_heads, self.head_dim)
        k = project(self.k_proj, x, kernel).view(b, t, self.n_kv, self.head_dim)
        v = project(self.v_proj, x, kernel).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_cached(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        layer: int,
        cache: KVCache,
        slots: SlotSelection,
        mask: Tensor,
        span: int,
        flat: Tensor,
        kernel: WeightCache | None = None,
    ) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin, kernel)
        cache.write(layer, flat, k, v)
        keys, values = cache.read(layer, slots, span)  # [B, kv, span, D]
        if kernel is not None and kernel.upcast:
            # fp32 attention on the bf16 values (see kernels.py), rounded back once.
            out = F.scaled_dot_product_attention(
                q.float(), keys.float(), values.float(), attn_mask=mask, enable_gqa=True
            ).to(q.dtype)
        elif t == 1 and x.device.type == "cpu" and q.dtype != torch.float32:
            out = self._decode_attention(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return project(self.o_proj, out.transpose(1, 2).reshape(b, t, -1), kernel)

    def _decode_attention(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """One query per row as two small matmuls with the query heads grouped per kv head.

        For bf16 on CPU, torch's flash-attention kernel costs ~1.7 ms per call at one query
        (batch 16, span 120, SmolLM2's 9/3 heads: measured) against ~0.3 ms for this; the
        softmax runs in fp32 as the kernel's does.
        """
        b, _, _, d = q.shape
        grouped = q.reshape(b, self.n_kv, self.n_heads // self.n_kv, d)  # [B, kv, group, D]
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * d**-0.5  # [B, kv, group, span]
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(b, self.n_heads, 1, d)


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, kernel: WeightCache | None = None) -> Tensor:
        gate = project(self.gate_proj, x, kernel)
        return project(self.down_proj, F.silu(gate) * project(self.up_proj, x, kernel), kernel)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP (dense, or mixture-of-experts when the config has experts) with residuals."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp: nn.Module = MoeBlock(cfg, MLP) if cfg.num_experts else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_cached(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        index: int,
        cache: KVCache,
        slots: SlotSelection,
        mask: Tensor,
        span: int,
        flat: Tensor,
        kernel: WeightCache | None = None,
    ) -> Tensor:
        attn = self.self_attn.forward_cached(
            self.input_layernorm(h), cos, sin, index, cache, slots, mask, span, flat, kernel
        )
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h), kernel)


class DecoderModel(nn.Module):
    """The `model.` prefix of HF's CausalLM: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # nn.Embedding's own init on the meta device goes through torch's Python reference ops,
        # whose first use costs seconds of imports; pass the storage and init it only if real.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        if not weight.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling)


class CausalLM(nn.Module):
    """Decoder + lm_head; `model(input_ids, attention_mask)` returns logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Multi-token-prediction modules (`mtp.py`), part of the state_dict when the config has them.
        self.mtp = build_mtp(cfg)
        self.tie_weights()

    def materialize(self, device: str | torch.device, dtype: torch.dtype) -> None:
        """Give a meta-device model real, uninitialised storage (then fill it by init or copy).

        `nn.Module.to_empty` does the same through torch's Python reference ops, whose first use
        imports sympy (over a second); plain `torch.empty` per parameter does not.
        """
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    real = torch.empty(p.shape, dtype=dtype, device=device)
                    module._parameters[name] = nn.Parameter(real, requires_grad=p.requires_grad)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embedding if the config says so (again after materialising, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.model.layers]

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """HF-style init (normal(0, std) for matrices, zeros for biases, ones for norms)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=generator)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits [B, T, V]. `attention_mask` [B, T] (1 = token, 0 = pad) may pad on either side."""
        return self.lm_head(self.hidden_states(input_ids, attention_mask))

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The final-norm hidden states [B, T, H] that `forward` turns into logits with `lm_head`.

        A caller that needs the logits of a few positions only (the learner: the completion's,
        not the prompt's) applies `lm_head` to those, saving its matmul and the vocab-wide
        log-softmax everywhere else (a fifth of a small model's FLOPs per position).
        """
        h = self.model.embed_tokens(input_ids)
        b, t = input_ids.shape
        mask: Tensor | None = None
        window = self.config.sliding_window
        index = torch.arange(t, device=input_ids.device)
        if attention_mask is None:
            positions = index.expand(b, t)
            if window:  # by index: a row's real tokens are contiguous, so index distance = position distance
                mask = attention_window(index[:, None], index[None, :], window)[None, None]
        else:
            valid = attention_mask.to(torch.bool)
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            causal = attention_window(index[:, None], index[None, :], window)
            # The diagonal keeps fully padded query rows finite; their outputs are ignored anyway.
            eye = torch.eye(t, dtype=torch.bool, device=input_ids.device)
            mask = ((causal[None] & valid[:, None, :]) | eye[None])[:, None]
        cos, sin = self.model.rotary(positions, h.dtype)
        for layer in self.decoder_layers:
            h = layer(h, cos, sin, mask)
        return self.model.norm(h)

    def forward_cached(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: list[int],
        last: Tensor | None = None,
        *,
        kernel: WeightCache | None = None,
    ) -> Tensor:
        """Logits [B, T, V] for new tokens [B, T] at `positions` [B, T], row b in cache slot `slots[b]`.

        Positions of a row must be consecutive and its slot must already hold keys for every
        earlier position; the new keys/values are written into the cache as a side effect. With
        `last` [B] (an index into T per row) only those positions go through the final norm and
        lm_head, and the logits are [B, V]: a prefill needs one row of logits, not T (the lm_head
        is a fifth of a small model's FLOPs). Rows may be right-padded: a padded token's
        position is past its row's real ones, so no real query attends to it, and its cache rows
        are overwritten by the row's next tokens. `kernel` picks the matmul kernel and holds the
        weight copies it needs (`kernels.py`): fp32 copies that run a bf16 model's matmuls in fp32
        (the same products, on CPUs where torch's bf16 GEMM is slow), or MKL-packed fp32 weights.
        """
        return project(
            self.lm_head, self.hidden_cached(input_ids, positions, cache, slots, last, kernel=kernel), kernel
        )

    def hidden_cached(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: list[int],
        last: Tensor | None = None,
        *,
        kernel: WeightCache | None = None,
    ) -> Tensor:
        """`forward_cached` short of the lm_head: the final-norm hidden states [B, T, H] (or [B, H]
        with `last`), for a caller that also needs them (speculative decoding drafts from them)."""
        sel = cache.select(slots)
        span = int(positions.max()) + 1
        if span > cache.max_seq_len:
            raise ValueError(f"position {span - 1} is past the cache's max_seq_len {cache.max_seq_len}")
        flat = cache.flat_index(sel, positions)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, h.dtype)
        # Row b's query at position p sees its own slot's keys 0..p; later cache rows are stale.
        # Built once per forward: every layer attends over the same span.
        keys = torch.arange(span, device=h.device)[None, None, None, :]
        mask = attention_window(positions[:, None, :, None], keys, self.config.sliding_window)
        for i, layer in enumerate(self.decoder_layers):
            h = layer.forward_cached(h, cos, sin, i, cache, sel, mask, span, flat, kernel)
        if cache.routes is not None:  # a MoE model: each token's experts go beside its keys (moe.py)
            cache.write_routes(sel, positions, last_routes(moe_blocks(self)))
        if last is not None:
            h = h[torch.arange(h.shape[0], device=h.device), last]
        return self.model.norm(h)

    def new_cache(self, slots: int, max_seq_len: int) -> KVCache:
        """An empty KV cache on this model's device and dtype."""
        p = self.lm_head.weight
        cfg = self.config
        return KVCache(
            layers=cfg.num_hidden_layers,
            slots=slots,
            max_seq_len=max_seq_len,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.dim_per_head,
            dtype=p.dtype,
            device=p.device,
            route_width=routes_per_token(cfg),
        )


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
