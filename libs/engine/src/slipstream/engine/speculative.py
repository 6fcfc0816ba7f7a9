"""Speculative decoding: draft tokens with the model's MTP modules, verify them with one forward.

One `Speculator.step` advances every running row by 1 to k+1 tokens:

1. draft: module j (`mtp.py`) turns the hidden state of the row's last verified position and the
   tokens since into a distribution q_j, and a draft token d_j is drawn from it (the argmax for a
   greedy row), for j = 1..k_row;
2. verify: one forward of the main model over [last token, d_1 .. d_k] at the row's next
   positions gives the main model's distributions p_1 .. p_{k+1} (the one after each fed token);
3. accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (for a greedy row: iff d_j is p_j's
   argmax), stopping at the first rejection; at a rejection draw the replacement from
   norm(max(0, p_j - q_j)), and when all k_row are accepted draw one more token from p_{k+1}.

This is the rejection rule of Leviathan et al. / Chen et al. (2023): every emitted token is
distributed exactly as the main model would have sampled it, whatever q is, and a greedy row emits
exactly the main model's argmax tokens. p and q are both the row's processed distributions
(temperature, top-k, top-p: `sampling.row_logprobs`), and the log-prob recorded for every emitted
token is the main model's, read from p, as `sampling.sample` records it. The tokens are not the
ones a non-speculative engine would draw with the same seed (the random numbers are spent
differently), only identically distributed; a seeded request stays reproducible, since a row's
draft count and draws depend on that row alone.

Rejected drafts need no cache rollback beyond the row's `cache_len`: the verify forward wrote
their keys/values at positions past the accepted ones, every later query masks positions past its
own, and the row's next forward overwrites them. The engine allocates its cache k positions longer
than `max_seq_len`, so a row near the end can still be padded to the batch's verify width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slipstream.engine.kernels import WeightCache, project
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import CausalLM
from slipstream.engine.mtp import modules_of
from slipstream.engine.sampling import draw, process_logits, row_params
from slipstream.engine.sequence import SequenceState


@dataclass
class RowAdvance:
    """What one speculative step made for one row."""

    tokens: list[int]
    """Emitted tokens: the accepted drafts, then the replacement or bonus token."""
    logprobs: list[float]
    """The main model's log-prob of each emitted token."""
    hidden: Tensor
    """The main model's hidden state [H] at the position whose distribution gave the last token."""
    drafted: int
    accepted: int


def draft_limit(seq: SequenceState, k: int, max_seq_len: int) -> int:
    """Drafts worth making for `seq` now: at most k, and no more than the tokens it may still emit
    minus the one the verify step always adds (max_tokens, max_seq_len); 0 without a hidden state."""
    if seq.draft_hidden is None:
        return 0
    left_tokens = seq.request.params.max_tokens - len(seq.completion)
    left_seq = max_seq_len - len(seq.tokens)
    return max(0, min(k, left_tokens - 1, left_seq - 1))


class Speculator:
    """Drafts with a CausalLM's MTP modules and verifies with the model itself (see the module docstring)."""

    def __init__(self, model: CausalLM, k: int) -> None:
        modules = modules_of(model.mtp)
        if k < 1:
            raise ValueError(f"speculative decoding needs k >= 1 draft tokens, got {k}")
        if k > len(modules):
            raise ValueError(
                f"speculative decoding with k={k} draft tokens needs a model with mtp_depth >= {k}; "
                f"this one has mtp_depth {model.config.mtp_depth}"
            )
        self.model = model
        self.k = k
        self.modules = modules[:k]

    def step(
        self, rows: Sequence[SequenceState], cache: KVCache, kernel: WeightCache | None, max_seq_len: int
    ) -> list[RowAdvance]:
        """Draft, verify and accept for every row (each row's `tokens[-1]` not yet in its cache)."""
        model = self.model
        device = model.lm_head.weight.device
        n = len(rows)
        params = [s.request.params for s in rows]
        ks = [draft_limit(s, self.k, max_seq_len) for s in rows]
        kmax = max(ks)
        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=device)
        processing = row_params(params, device)  # built once, for the drafts and the verify
        # Each sampled row's uniforms, from its own stream, in a fixed order: k_row for the drafts,
        # k_row for the accept tests, one for the final token (a greedy row draws none).
        u_draft = torch.zeros(n, max(kmax, 1))
        u_accept = torch.ones(n, max(kmax, 1))
        u_final = torch.zeros(n)
        for b, (seq, k) in enumerate(zip(rows, ks, strict=True)):
            if params[b].temperature == 0.0:
                continue
            u = torch.rand(2 * k + 1, generator=seq.generator)
            u_draft[b, :k] = u[:k]
            u_accept[b, :k] = u[k : 2 * k]
            u_final[b] = u[2 * k]
        u_draft, u_accept, u_final = u_draft.to(device), u_accept.to(device), u_final.to(device)
        last = torch.tensor([s.tokens[-1] for s in rows], dtype=torch.long, device=device)
        drafts, q_lp = self._draft(rows, processing, last, kmax, greedy, u_draft, kernel)

        # Verify: one forward over [last, d_1 .. d_kmax] per row (rows with fewer drafts are padded;
        # their padding sits past their real positions, inside the cache's extra room).
        ids = torch.cat([last[:, None], drafts], dim=1)
        width = ids.shape[1]
        start = torch.tensor([s.cache_len for s in rows], dtype=torch.long, device=device)
        pos = start[:, None] + torch.arange(width, device=device)[None]
        hidden = model.hidden_cached(ids, pos, cache, [s.slot for s in rows], kernel=kernel)  # [n, W, H]
        logits = project(model.lm_head, hidden, kernel)
        per_position = tuple(t.repeat_interleave(width) for t in processing)
        p_lp = process_logits(logits.reshape(n * width, -1), *per_position).view(n, width, -1)

        # Accept the longest prefix of drafts that pass their tests.
        k_row = torch.tensor(ks, dtype=torch.long, device=device)
        rows_idx = torch.arange(n, device=device)
        if kmax:
            p_d = p_lp[:, :kmax].gather(2, drafts[..., None])[..., 0]
            q_d = q_lp.gather(2, drafts[..., None])[..., 0]
            sampled_ok = u_accept[:, :kmax] < (p_d - q_d).exp()
            greedy_ok = drafts == p_lp[:, :kmax].argmax(dim=-1)
            ok = torch.where(greedy[:, None], greedy_ok, sampled_ok)
            ok &= torch.arange(kmax, device=device)[None] < k_row[:, None]
            n_acc = ok.long().cumprod(dim=1).sum(dim=1)
        else:
            n_acc = torch.zeros(n, dtype=torch.long, device=device)
        # The final token: from norm(max(0, p - q)) after a rejection, from p after full acceptance.
        p_fin = p_lp[rows_idx, n_acc]  # [n, V]
        if kmax:
            rejected = n_acc < k_row
            q_fin = q_lp[rows_idx, n_acc.clamp(max=kmax - 1)].exp() * rejected[:, None]
            residual = (p_fin.exp() - q_fin).clamp(min=0.0)
            # p == q to rounding leaves no mass (a rejection there has probability ~0): sample p.
            empty = residual.sum(dim=-1) <= 0
            fin_lp = torch.where(empty[:, None], p_fin, residual.log())
        else:
            fin_lp = p_fin
        final = torch.where(greedy, p_fin.argmax(dim=-1), draw(fin_lp, u_final))

        emitted = torch.cat([drafts, final[:, None]], dim=1)  # [n, kmax + 1]; final placed below
        emitted[rows_idx, n_acc] = final
        emitted_lp = p_lp.gather(2, emitted[..., None])[..., 0]
        keep_hidden = hidden[rows_idx, n_acc]
        out: list[RowAdvance] = []
        counts = n_acc.tolist()
        tokens = emitted.tolist()
        lps = emitted_lp.tolist()
        for b in range(n):
            m = counts[b] + 1
            out.append(
                RowAdvance(
                    tokens=tokens[b][:m],
                    logprobs=lps[b][:m],
                    hidden=keep_hidden[b],
                    drafted=ks[b],
                    accepted=counts[b],
                )
            )
        return out

    def _draft(
        self,
        rows: Sequence[SequenceState],
        processing: tuple[Tensor, Tensor, Tensor],
        last: Tensor,
        kmax: int,
        greedy: Tensor,
        u_draft: Tensor,
        kernel: WeightCache | None,
    ) -> tuple[Tensor, Tensor]:
        """Draft tokens [n, kmax] and the distributions they were drawn from, q [n, kmax, V]."""
        model = self.model
        n = len(rows)
        device = last.device
        vocab = model.config.vocab_size
        drafts = torch.zeros((n, kmax), dtype=torch.long, device=device)
        q_lp = torch.zeros((n, kmax, vocab), dtype=torch.float32, device=device)
        if kmax == 0:
            return drafts, q_lp
        ref = model.lm_head.weight
        h = torch.stack(
            [
                s.draft_hidden
                if s.draft_hidden is not None
                else torch.zeros(ref.shape[1], dtype=ref.dtype, device=device)
                for s in rows
            ]
        )
        embed: nn.Embedding = model.model.embed_tokens
        tok = last
        for j in range(kmax):
            module = self.modules[j]
            h = module(h, embed(tok), kernel)
            lq = process_logits(project(model.lm_head, module.head_input(h), kernel), *processing)
            tok = torch.where(greedy, lq.argmax(dim=-1), draw(lq, u_draft[:, j]))
            drafts[:, j] = tok
            q_lp[:, j] = lq
        return drafts, q_lp
