"""Multi-token-prediction (MTP) modules: cheap guesses at the tokens after the next one.

A model with `mtp_depth = D` carries D small modules next to its decoder, as `mtp.0` ...
`mtp.{D-1}` in its state_dict (so they travel with every weight version the learner publishes,
and a worker's draft and main model always stay at the same version). Module k (1-based) chains
on module k-1, as DeepSeek-V3's sequential MTP does:

    x_k = eh_proj([hnorm(x_{k-1}); enorm(embed(token_{t+k}))])       x_0 = the main model's hidden at t
    x_k = x_k + SwiGLU(ffn_norm(x_k))
    logits_k = lm_head(out_norm(x_k))        (the main model's own lm_head, shared)

so module k, given the main model's hidden state at position t and the tokens t+1 .. t+k, predicts
token t+k+1. There is no attention inside a module, hence no cache to keep: a draft needs only the
hidden state of the last verified position and the tokens since. The modules are trained by
self-distillation from the main head (`mtp_distill.py`) and used to draft tokens for speculative
decoding (`speculative.py`). The layer names avoid the LoRA target suffixes (`q_proj`,
`gate_proj`, ...), so attaching adapters leaves the modules as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.engine.config import ModelConfig
from slipstream.engine.kernels import WeightCache, project


class MTPModule(nn.Module):
    """One draft depth: the previous depth's hidden state and the next token's embedding in, a hidden state out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.hnorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.enorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.ffn_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.w_gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.w_up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.out_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, hidden: Tensor, token_embeds: Tensor, kernel: WeightCache | None = None) -> Tensor:
        """The next depth's hidden state [..., H] from `hidden` [..., H] and `token_embeds` [..., H]."""
        x = project(self.eh_proj, torch.cat((self.hnorm(hidden), self.enorm(token_embeds)), dim=-1), kernel)
        y = self.ffn_norm(x)
        gate = project(self.w_gate, y, kernel)
        return x + project(self.w_down, F.silu(gate) * project(self.w_up, y, kernel), kernel)

    def head_input(self, x: Tensor) -> Tensor:
        """What the shared lm_head turns into this depth's logits."""
        return self.out_norm(x)


def build_mtp(cfg: ModelConfig) -> nn.ModuleList | None:
    """The `mtp` modules a model of `cfg` carries (None when `cfg.mtp_depth` is 0)."""
    if cfg.mtp_depth == 0:
        return None
    return nn.ModuleList(MTPModule(cfg) for _ in range(cfg.mtp_depth))


def modules_of(mtp: nn.Module | None) -> list[MTPModule]:
    """A model's MTP modules in depth order (its `mtp` attribute; empty when it has none)."""
    if mtp is None:
        return []
    return [m for m in mtp.children() if isinstance(m, MTPModule)]
