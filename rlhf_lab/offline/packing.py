"""``algorithm.packing``: a step's demonstrations packed into rows of ``algorithm.packing_length`` tokens.

Each demonstration is one document: prompt, response and EOS, tokenized as unpacked rows are
(:class:`rlhf_lab.offline.batch.Collator`). Documents go first-fit, in batch order, into rows of at most
``packing_length`` tokens (each into the first row with room for it, else a new row); rows are then
right-padded to the fullest row's length. A step is still ``trainer.prompts_per_step`` demonstrations:
packing removes padding, not data (``sft/packing_efficiency``: the share of the batch's token slots that hold
a token), and ``trainer.micro_batch_size`` counts packed rows.

No document sees another. Position ids restart at 0 at each document, and attention is block-diagonal
causal: a 4-D mask [R, 1, W, W] in which token i attends to token j iff both are in the same document and
j ≤ i (transformers takes a 4-D mask as it is: boolean for ``sdpa``, added to the scores for ``eager``; the
padding of a row is a block of its own, so no query attends to nothing). Each document's response tokens
carry the loss exactly as unpacked; the first token of a document has no context in it and carries none.
So a packed batch's per-token log-probs and loss equal the unpacked batch's (to float precision). The offline
loop's updater (:class:`rlhf_lab.offline.loop.OfflineUpdater`) runs packed rows through :func:`packed_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.runtime import distributed
from rlhf_lab.scoring.logprobs import scale_logits


@dataclass(frozen=True)
class PackedRows(Rollout):
    """Packed documents in the rollout layout with a prompt width of 1: ``response_ids`` are every token after
    a row's first, and ``response_mask`` [R, W−1] marks the response tokens of the row's documents."""

    position_ids: Tensor | None = None  # [R, W] 0, 1, … within each document (and within the padding)
    document_ids: Tensor | None = None  # [R, W] 1, 2, … the token's document within its row; 0 on padding

    @property
    def documents(self) -> int:
        return int(self.document_ids.amax(dim=-1).sum())

    def select(self, rows: Tensor) -> PackedRows:
        """A sub-batch of the given rows (as :meth:`Rollout.select`)."""
        base = Rollout(**{f.name: getattr(self, f.name) for f in fields(Rollout)}).select(rows)
        return PackedRows(**vars(base), position_ids=self.position_ids[rows], document_ids=self.document_ids[rows])


def resolve_length(packing_length: int | None, data_cfg: Any) -> int:
    """Tokens per packed row; null: the longest unpacked row, ``data.max_prompt_tokens + max_response_tokens``."""
    return packing_length or data_cfg.max_prompt_tokens + data_cfg.max_response_tokens


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Document indices per row: each document, in order, joins the first row with room for it, else opens a
    new one. ``[5, 3, 4, 2, 6]`` into rows of 8: ``[[0, 1], [2, 3], [4]]``."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"document {index} has {length} tokens, more than a row's {capacity}")
        row = next((r for r, free in enumerate(room) if length <= free), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= length
    return rows


def pack_documents(documents: list[tuple[list[int], list[int]]], capacity: int, pad_token_id: int) -> PackedRows:
    """Rows of (prompt ids, response ids) documents, first-fit into rows of ``capacity`` tokens."""
    lengths = [len(prompt) + len(response) for prompt, response in documents]
    layout = first_fit(lengths, capacity)
    width = max([2, *(sum(lengths[d] for d in row) for row in layout)])
    input_ids = torch.full((len(layout), width), pad_token_id, dtype=torch.long)
    document_ids = torch.zeros_like(input_ids)
    position_ids = torch.zeros_like(input_ids)
    is_response = torch.zeros(len(layout), width)
    for row, indices in enumerate(layout):
        start = 0
        for number, index in enumerate(indices, 1):
            prompt, response = documents[index]
            end = start + len(prompt) + len(response)
            input_ids[row, start:end] = torch.tensor(prompt + response, dtype=torch.long)
            document_ids[row, start:end] = number
            position_ids[row, start:end] = torch.arange(end - start)
            is_response[row, start + len(prompt) : end] = 1.0
            start = end
        position_ids[row, start:] = torch.arange(width - start)
    is_response[position_ids == 0] = 0.0  # a document's first token is predicted from another's: no loss
    response_mask = is_response[:, 1:]
    zeros = torch.zeros_like(response_mask)
    return PackedRows(
        input_ids=input_ids,
        attention_mask=(document_ids > 0).long(),
        response_mask=response_mask,
        prompt_width=1,
        group_size=1,
        logprobs=zeros,
        entropy=zeros.clone(),
        position_ids=position_ids,
        document_ids=document_ids,
    )


def block_causal_mask(document_ids: Tensor) -> Tensor:
    """[R, W] document ids -> [R, 1, W, W] bool: query i may attend to key j iff same document and j ≤ i."""
    width = document_ids.shape[-1]
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=document_ids.device).tril()
    return (same_document & causal)[:, None]


def packed_logits(model: nn.Module, batch: PackedRows, temperature: float) -> Tensor:
    """Temperature-scaled logits at every position but a row's last, each predicting the next token: [R, W−1, V]."""
    mask = block_causal_mask(batch.document_ids)
    if getattr(distributed.unwrap(model).config, "_attn_implementation", None) == "eager":  # adds the mask
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    output = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids, use_cache=False)
    return scale_logits(output.logits[:, :-1], temperature)
