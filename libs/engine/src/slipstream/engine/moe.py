"""A mixture-of-experts feed-forward block, its load-balancing loss, and router replay.

`MoeBlock` replaces the dense SwiGLU MLP of a decoder layer when `ModelConfig.num_experts > 0`:
a linear router (`mlp.gate`, [num_experts, hidden]) scores every token, a softmax in float32
gives the router probabilities, the `num_experts_per_tok` most likely experts are chosen and
their probabilities renormalised to sum to one (Mixtral's top-k-then-softmax, written as
softmax-then-renormalise: the same weights). Each expert is the dense layer's SwiGLU MLP, named
`mlp.experts.<e>.{gate,up,down}_proj` (Qwen-MoE's names), so LoRA targets and the weight codec
see ordinary linear layers.

Routes are the experts each token was sent to, per layer, as small integers: the engine's cached
forward writes them into the KV cache beside the keys and values (`KVCache.routes`), so prompt
sharing, sessions and prefix copies carry them exactly as they carry keys; a finished request
returns them packed (uint8, [token, layer, k]) for the episode record.

Router replay: `force_routes(model, routes)` makes every MoE block of `model` use the given
experts instead of its own top-k for the duration of a forward (a route of −1 means "choose
yourself"). The mixing weights are still the router's probabilities at those experts,
renormalised, so the router keeps its gradient; only the discrete choice is replayed. A learner
that recomputes log-probs in another precision or batch shape than the sampler can then land on
the other side of a near-tie between two experts and compute a different function than the one
that sampled; replay removes that source of train–inference mismatch.

`load_balancing_loss` is the Switch Transformer auxiliary loss, E · Σ_e f_e · P_e, with f_e the
share of the top-k slots given to expert e and P_e its mean router probability over the same
tokens. It is 1.0 when routing is uniform in both, and grows as load concentrates; HF's
Mixtral implementation sums over the k slots instead of averaging, which is k times this.

The blocks keep what their last forward routed (`last_routes`, `last_probs`) for the cache and
the loss to read; nothing else is stateful.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from slipstream.engine.config import ModelConfig
from slipstream.engine.kernels import WeightCache, project

ROUTE_DTYPE = torch.uint8
"""Routes travel as one byte per (token, layer, k): up to 256 experts (ModelConfig checks)."""


class MoeBlock(nn.Module):
    """Router + `num_experts` SwiGLU experts; each token goes to its top-k experts."""

    def __init__(self, cfg: ModelConfig, expert: Callable[[ModelConfig], nn.Module]) -> None:
        super().__init__()
        if cfg.num_experts < 1:
            raise ValueError(f"MoeBlock needs num_experts >= 1, got {cfg.num_experts}")
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(expert(cfg) for _ in range(cfg.num_experts))
        # Router replay: [B, T, k] expert ids to use (−1: own choice), set by `force_routes`.
        self.forced: Tensor | None = None
        # What the last forward routed: [B, T, k] ids and [B, T, E] float32 probabilities.
        self.last_routes: Tensor | None = None
        self.last_probs: Tensor | None = None

    def forward(self, x: Tensor, kernel: WeightCache | None = None) -> Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs = project(self.gate, flat, kernel).float().softmax(dim=-1)  # [N, E]
        routes = probs.topk(self.top_k, dim=-1).indices
        if self.forced is not None:
            if tuple(self.forced.shape) != (b, t, self.top_k):
                raise ValueError(
                    f"forced routes have shape {tuple(self.forced.shape)}, the forward needs {(b, t, self.top_k)}"
                )
            forced = self.forced.reshape(-1, self.top_k).to(routes.device)
            routes = torch.where(forced >= 0, forced, routes)
        weights = probs.gather(1, routes)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        # Experts in a fixed order, each over its tokens in row order: the sum does not depend on
        # the order of a token's k choices, so a replayed route computes what the recorded one did.
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(routes == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            y = expert(flat.index_select(0, rows), kernel)
            out.index_add_(0, rows, y * weights[rows, slot, None])
        self.last_routes = routes.view(b, t, self.top_k)
        self.last_probs = probs.view(b, t, self.num_experts)
        return out.view(b, t, h)


def moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The MoE blocks of `model` in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoeBlock)]


def routes_per_token(cfg: ModelConfig) -> int:
    """Route entries per token: layers × k for a MoE config, 0 for a dense one."""
    return cfg.num_hidden_layers * cfg.num_experts_per_tok if cfg.num_experts else 0


def last_routes(blocks: list[MoeBlock]) -> Tensor:
    """The last forward's routes of every block, [B, T, layers × k] in layer-major order."""
    parts = [blk.last_routes for blk in blocks]
    if any(p is None for p in parts):
        raise RuntimeError("a MoE block has not run a forward yet")
    return torch.cat([p for p in parts if p is not None], dim=-1)


@contextlib.contextmanager
def force_routes(model: nn.Module, routes: Tensor | None) -> Iterator[None]:
    """Within the block, every MoE block of `model` uses `routes` [B, T, layers × k] (−1: own choice).

    `routes` None (nothing recorded) leaves the model routing on its own. Raises ValueError when
    the width is not layers × k of the model.
    """
    blocks = moe_blocks(model)
    if routes is None or not blocks:
        yield
        return
    k = blocks[0].top_k
    if routes.dim() != 3 or routes.shape[-1] != len(blocks) * k:
        raise ValueError(
            f"routes have shape {tuple(routes.shape)}; this model needs [B, T, {len(blocks) * k}] "
            f"({len(blocks)} MoE layers x top-{k})"
        )
    top = int(routes.max()) if routes.numel() else -1
    if top >= blocks[0].num_experts:
        raise ValueError(f"a route names expert {top}; this model has {blocks[0].num_experts} experts per layer")
    try:
        for i, blk in enumerate(blocks):
            blk.forced = routes[..., i * k : (i + 1) * k]
        yield
    finally:
        for blk in blocks:
            blk.forced = None


def load_balancing_loss(probs: Tensor, routes: Tensor, num_experts: int, mask: Tensor | None = None) -> Tensor:
    """Switch-style auxiliary loss E · Σ_e f_e · P_e over the tokens where `mask` is true.

    `probs` [..., E] router probabilities, `routes` [..., k] chosen experts, `mask` [...] (None:
    every token). f_e = share of the k·N slots routed to e (no gradient), P_e = mean probability of
    e (carries the gradient to the router). Returns a 0-dim float32 tensor; 0 with no tokens.
    """
    p = probs.reshape(-1, num_experts).float()
    r = routes.reshape(p.shape[0], -1)
    if mask is not None:
        keep = mask.reshape(-1).to(torch.bool)
        p, r = p[keep], r[keep]
    if p.shape[0] == 0:
        return probs.new_zeros((), dtype=torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=p.device)
    counts.index_add_(0, r.reshape(-1), torch.ones(r.numel(), dtype=torch.float32, device=p.device))
    share = counts / r.numel()
    return num_experts * (share * p.mean(dim=0)).sum()


def aux_loss(model: nn.Module, mask: Tensor | None = None) -> Tensor | None:
    """The mean over MoE layers of `load_balancing_loss` for the model's last forward (None: dense)."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    losses = []
    for blk in blocks:
        if blk.last_probs is None or blk.last_routes is None:
            raise RuntimeError("aux_loss before the MoE blocks ran a forward")
        losses.append(load_balancing_loss(blk.last_probs, blk.last_routes, blk.num_experts, mask))
    return torch.stack(losses).mean()


def pack_routes(routes: Tensor) -> bytes:
    """Routes [tokens, width] (ids < 256) as uint8 bytes, token-major: the episode record's form."""
    return bytes(routes.to(device="cpu", dtype=ROUTE_DTYPE).contiguous().numpy().tobytes())


def unpack_routes(data: bytes, width: int) -> Tensor:
    """Bytes from `pack_routes` back to an int64 tensor [tokens, width]."""
    if width < 1 or len(data) % width:
        raise ValueError(f"{len(data)} route bytes are not a whole number of tokens of width {width}")
    if not data:
        return torch.zeros((0, width), dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=ROUTE_DTYPE).to(torch.int64).view(-1, width)
