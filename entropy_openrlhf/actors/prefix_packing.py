"""Shared-prefix packing: each prompt once per group in the training-side forwards (old log-probs, the policy's
forward and backward, the reference), with every response seeing the prompt and itself, never its siblings.

In a GRPO batch the n responses of a prompt sit in consecutive rows, and a plain batch recomputes the prompt n
times; on the demo's shape (prompts of ~360 tokens, answers of ~28) that is about 95% of the tokens. Packing puts
the consecutive rows that share a prompt into one row: the prompt once, then its responses one after another.
Position ids restart at the prompt's length for every response, so each response token has the position it has in
its own sequence. The idea is Prefix Grouper (arXiv 2506.05433).

Attention is "split" rather than one dense mask per row: the prompt attends causally to itself, then all responses
of the row, padded to the longest, attend in one call to the prompt's keys and values plus their own (an
R x (P + R) mask each). A dense (P + sum R)^2 mask would make the CPU kernel compute every masked block: on a
long-response shape it was slower than no packing at all. The split attention is the function `split_attention`,
registered with transformers' `AttentionInterface` as "prefix_split"; the layout reaches it as a keyword argument
of the model's forward, which transformers passes down to every attention call. Transformers builds no mask for an
implementation it has no mask function for, so none is built here; the layout is the mask. A model set to
"prefix_split" must always get a layout: `PackedBatch` with groups of one is the plain batch.

On GPUs the same function runs through torch's SDPA with boolean masks. It replaces whatever attention the model
was loaded with, which also avoids a trap of `flash_attention_2`: given restarting position ids at batch size 1,
transformers would treat sibling responses as one packed causal sequence without an error.

Log-probs. A response's first token is predicted at the prompt's last position, which all responses of the row
share; each later token at the position of the token before it. `PackedBatch.source` holds, for every response
token, its (row, position) in the packed batch, so results are gathered from the packed logits and scattered into
the per-response grid of forward.py: losses, entropies and selection see exactly the tensors they saw before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "prefix_split"
MODES = ("auto", "on", "off")


@dataclass
class RowLayout:
    """One packed row: the prompt at [0, prompt_len), then responses at [start, start + length) each."""

    prompt_len: int
    starts: list[int]
    lengths: list[int]


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (G, L), right-padded
    position_ids: torch.Tensor  # (G, L)
    rows: list[RowLayout]
    # for each response token in the per-response grid's row-major order of valid cells: its packed (row, position)
    source_row: torch.Tensor  # (N,)
    source_pos: torch.Tensor  # (N,)

    def to(self, device) -> PackedBatch:
        return PackedBatch(
            self.input_ids.to(device), self.position_ids.to(device), self.rows,
            self.source_row.to(device), self.source_pos.to(device),
        )  # fmt: skip

    def narrowed(self, mask: torch.Tensor, kept: torch.Tensor) -> PackedBatch:
        """The same layout with sources only for the grid cells `kept` (B, L) keeps of those `mask` (B, L), the
        grid's mask these sources were made for, marks: the forwards read one source per valid cell of the mask."""
        keep = kept.bool()[mask.bool()].to(self.source_row.device)
        return PackedBatch(self.input_ids, self.position_ids, self.rows, self.source_row[keep], self.source_pos[keep])


def group_runs(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Indices of consecutive rows with identical prompts, in order: [[0, 1, 2, 3], [4, 5], ...]."""
    runs: list[list[int]] = []
    for i, prompt in enumerate(prompt_ids):
        if runs and prompt_ids[runs[-1][0]] == prompt:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, share: bool = True) -> PackedBatch:
    """The packed batch of these sequences. `share=False` keeps one response per row (groups of one)."""
    runs = group_runs(prompt_ids) if share else [[i] for i in range(len(prompt_ids))]
    rows, ids_rows, pos_rows = [], [], []
    where: dict[int, tuple[int, int, int]] = {}  # sequence -> (row, prompt_len, start)
    for g, run in enumerate(runs):
        prompt = list(prompt_ids[run[0]])
        ids, pos = list(prompt), list(range(len(prompt)))
        starts, lengths = [], []
        for i in run:
            response = list(response_ids[i])
            where[i] = (g, len(prompt), len(ids))
            starts.append(len(ids))
            lengths.append(len(response))
            ids += response
            pos += range(len(prompt), len(prompt) + len(response))
        rows.append(RowLayout(len(prompt), starts, lengths))
        ids_rows.append(ids)
        pos_rows.append(pos)
    width = max(len(r) for r in ids_rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for g, (ids, pos) in enumerate(zip(ids_rows, pos_rows)):
        input_ids[g, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        position_ids[g, : len(pos)] = torch.tensor(pos, dtype=torch.long)
    src_row, src_pos = [], []
    for i in range(len(prompt_ids)):  # the grid's row-major order: sequence by sequence, token by token
        g, p, start = where[i]
        for j in range(len(response_ids[i])):
            src_row.append(g)
            src_pos.append(p - 1 if j == 0 else start + j - 1)  # the position whose output predicts token j
    return PackedBatch(input_ids, position_ids, rows, torch.tensor(src_row), torch.tensor(src_pos))


def estimated_cost(batch: PackedBatch, hidden: int, ffn: int) -> float:
    """Rough multiply-adds of one layer's forward over the packed batch: projections and MLP per token, attention
    per query-key pair (the prompt's full square: the CPU kernel computes masked blocks too)."""
    per_token = 4 * hidden * hidden + 3 * hidden * ffn
    tokens = scores = 0
    for row in batch.rows:
        tokens += row.prompt_len + sum(row.lengths)
        longest = max(row.lengths, default=0)
        scores += row.prompt_len**2 + len(row.lengths) * longest * (row.prompt_len + longest)
    return tokens * per_token + 2 * scores * hidden


def choose_packing(mode: str, prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
                   hidden: int, ffn: int) -> PackedBatch:  # fmt: skip
    """`--train.shared_prefix`: on packs every run of equal prompts; off keeps one response per row; auto packs when
    the estimate says it costs less than the plain layout."""
    if mode not in MODES:
        raise ValueError(f"shared_prefix {mode!r}: auto | on | off")
    if mode == "off":
        return pack(prompt_ids, response_ids, pad_id, share=False)
    shared = pack(prompt_ids, response_ids, pad_id, share=True)
    if mode == "on" or len(shared.rows) == len(prompt_ids):  # nothing shared: the same layout either way
        return shared
    plain = pack(prompt_ids, response_ids, pad_id, share=False)
    return shared if estimated_cost(shared, hidden, ffn) < estimated_cost(plain, hidden, ffn) else plain


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # grouped-query attention: query head h reads key/value head h // groups (transformers' repeat_kv), so each
    # key/value head is repeated in place, [k0, k0, k1, k1], not tiled, [k0, k1, k0, k1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _refuse_unimplemented(module: torch.nn.Module, dropout: float, rows: list[RowLayout], kwargs: dict) -> None:
    """Raise on an attention setting the split attention would otherwise drop without a word. Transformers passes
    a model's attention options as keyword arguments; the ones below change the result, and none is computed here."""
    fix = "set --train.shared_prefix off for this model"
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{ATTENTION_NAME}: attention logit soft-capping (softcap) is not implemented; {fix}")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{ATTENTION_NAME}: attention sinks (s_aux) are not implemented; {fix}")
    window = kwargs.get("sliding_window")
    if window is not None:
        # a window that covers every whole sequence masks nothing (transformers keeps keys with q - k < window)
        longest = max(row.prompt_len + max(row.lengths, default=0) for row in rows)
        if longest > window:
            raise NotImplementedError(
                f"{ATTENTION_NAME}: a sliding window of {window} tokens is not implemented and this batch has a "
                f"sequence of {longest}; {fix}"
            )
    if dropout and module.training:
        # dropout itself would run, but a packed prompt is computed once for its whole group, so every response
        # would share one dropout draw of the prompt where the plain batch draws one per sequence
        raise NotImplementedError(
            f"{ATTENTION_NAME}: attention dropout ({dropout}) in training is not implemented (the responses of a "
            f"group would share the prompt's dropout draw); {fix}, or load the model with attention_dropout=0"
        )


def split_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    prefix_layout: list[RowLayout] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over packed rows (transformers' attention-function signature: query (G, H, L, D), key and value
    (G, H_kv, L, D); returns (G, L, H, D)). Positions past a row's content get zeros. Settings it does not compute
    (soft-capping, sinks, a sliding window shorter than a sequence, dropout in training) raise NotImplementedError."""
    if prefix_layout is None:
        raise RuntimeError(
            f"the model's attention is {ATTENTION_NAME!r}, which needs the packed layout (prefix_layout=...): "
            "call it through entropy_openrlhf.actors.forward"
        )
    _refuse_unimplemented(module, dropout, prefix_layout, kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    out = query.new_zeros(query.shape)
    for g, row in enumerate(prefix_layout):
        P, n = row.prompt_len, len(row.lengths)
        q, k, v = query[g], key[g], value[g]  # (H, L, D)
        out[g, :, :P] = F.scaled_dot_product_attention(q[:, :P], k[:, :P], v[:, :P], is_causal=True, scale=scaling)
        if n == 0:
            continue
        R = max(row.lengths)
        H, _, D = q.shape
        # responses padded to R: queries (n, H, R, D), keys/values (n, H, P + R, D) = the prompt's, then their own
        rq = q.new_zeros(n, H, R, D)
        own_k, own_v = k.new_zeros(n, H, R, D), v.new_zeros(n, H, R, D)
        for i, (s, length) in enumerate(zip(row.starts, row.lengths)):
            rq[i, :, :length] = q[:, s : s + length]
            own_k[i, :, :length] = k[:, s : s + length]
            own_v[i, :, :length] = v[:, s : s + length]
        rk = torch.cat([k[:, :P].expand(n, H, P, D), own_k], dim=2)
        rv = torch.cat([v[:, :P].expand(n, H, P, D), own_v], dim=2)
        lengths = torch.tensor(row.lengths, device=q.device)
        qi = torch.arange(R, device=q.device)
        own = (qi[None, :] <= qi[:, None])[None] & (qi[None, None, :] < lengths[:, None, None])  # causal, unpadded
        mask = torch.cat([torch.ones(n, R, P, dtype=torch.bool, device=q.device), own], dim=2)[:, None]
        res = F.scaled_dot_product_attention(rq, rk, rv, attn_mask=mask, scale=scaling)
        for i, (s, length) in enumerate(zip(row.starts, row.lengths)):
            out[g, :, s : s + length] = res[i, :, :length]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make "prefix_split" a transformers attention implementation (idempotent; per process)."""
    AttentionInterface.register(ATTENTION_NAME, split_attention)
