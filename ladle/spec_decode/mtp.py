"""Drafting with the checkpoint's multi-token prediction layer (DeepSeek V3's MTP, `"method": "mtp"`).

The MTP layer at position p joins the target's final hidden state there with the embedding of the token
after it and guesses the token after that. The target keeps every token's final hidden state by cache slot
(DeepseekV3ForCausalLM.keep_hidden), so when a sequence drafts, the MTP layer first catches up on the
positions the target computed since it last drafted (a prompt chunk's worth on its first draft), in one
forward for all sequences; its last row gives the first draft. Each further draft feeds the MTP layer its own
output and the draft before, one position per forward, as vLLM's DeepSeek MTP does.

The MTP layer has a latent cache of its own, laid out as the target's (the same block tables and slots).
Only the positions computed from the target's hidden states stay valid: those the drafts wrote are
recomputed on the next catch-up.
"""

from __future__ import annotations

import torch

from ladle.engine.request import Sequence
from ladle.model.attention import AttentionMetadata, KVCache, PrefillSpan, padded_block_tables
from ladle.model.mla_attention import MLAPagedAttention


class MTPDrafter:
    def __init__(self, model: object, num_blocks: int, block_size: int, dtype: torch.dtype):
        """model: the target (its mtp layer and hidden states); the pool's num_blocks of block_size."""
        if getattr(model, "mtp", None) is None:
            raise ValueError('speculative method "mtp" drafts with the checkpoint\'s multi-token prediction layer '
                             "(DeepSeek V3's num_nextn_predict_layers, weights model.layers.{num_hidden_layers}.*): "
                             "this model has none")
        m = model.cfg.mla
        self.model, self.block_size = model, block_size
        self.cache = KVCache(1, num_blocks, block_size, 1, m.kv_lora_rank + m.qk_rope_head_dim, dtype=dtype,
                             device=model.embed.device, layer_shapes=(m.cache_shape,))
        self.attention = MLAPagedAttention(self.cache, m.kv_lora_rank, m.qk_rope_head_dim, model.scale)
        model.keep_hidden(num_blocks, block_size)
        self._done: dict[int, int] = {}  # seq_id -> MTP positions computed from the target's hidden states

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.model.embed.device)

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] greedy drafts after each sequence, whose last token the target has not computed yet
        (positions up to num_tokens - 1 + rooms[i] must have blocks)."""
        if not seqs:
            return []
        tokens, hidden = self._catch_up(seqs)
        drafts = [[t] for t in tokens]
        for step in range(1, max(rooms)):
            active = [i for i, room in enumerate(rooms) if step < room]
            positions = [seqs[i].num_tokens - 2 + step for i in active]
            slots = [self._slot(seqs[i], p) for i, p in zip(active, positions)]
            meta = AttentionMetadata(slot_mapping=self._tensor(slots))
            meta.num_decodes = len(active)
            meta.decode_block_tables = padded_block_tables([seqs[i].block_table for i in active])
            meta.decode_context_lens = torch.tensor(positions) + 1
            out = self.model.mtp_forward(self._tensor([drafts[i][-1] for i in active]), self._tensor(positions),
                                         hidden[active], meta, self.attention)
            chosen = self.model.mtp_logits(out).argmax(dim=-1).tolist()
            hidden = hidden.clone()
            hidden[active] = out
            for i, token in zip(active, chosen):
                drafts[i].append(token)
        return drafts

    def _catch_up(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor]:
        """The MTP layer over each sequence's positions from where it last stopped to num_tokens - 2 (the
        target's last computed one), from the target's hidden states: each one's first draft and the MTP
        output at that position [len(seqs), hidden]."""
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64))
        tokens, positions, slots, last_rows = [], [], [], []
        for seq in seqs:
            end = seq.num_tokens - 1  # MTP positions [0, end) read the target's states
            start = min(self._done.get(seq.seq_id, 0), end - 1)
            span = range(start, end)
            tokens += seq.token_ids[start + 1 : end + 1]
            positions += span
            slots += [self._slot(seq, p) for p in span]
            table = torch.tensor(seq.block_table[: -(-end // self.block_size)], dtype=torch.int64)
            meta.prefills.append(PrefillSpan(len(slots) - len(span), len(slots), end, table))
            last_rows.append(len(slots) - 1)
            self._done[seq.seq_id] = end
        meta.slot_mapping = self._tensor(slots)
        previous = self.model.hidden_cache.index_select(0, meta.slot_mapping)
        out = self.model.mtp_forward(self._tensor(tokens), self._tensor(positions), previous, meta, self.attention)
        last = out[self._tensor(last_rows)]
        return self.model.mtp_logits(last).argmax(dim=-1).tolist(), last

    def forget_all_but(self, seq_ids: set[int]) -> None:
        """Drop what is known of sequences no longer running (a preempted one catches up from scratch)."""
        self._done = {s: n for s, n in self._done.items() if s in seq_ids}
