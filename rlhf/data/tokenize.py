"""Tokenize rows for each step and collate them into padded (or, for SFT, packed) batches.

Prompt and answer are tokenized apart and concatenated, so the answer's first token is known
exactly (no guessing from a joint encoding), and eos is appended as the answer's last token.
Rows that cannot be used -- an empty prompt or answer, or a row longer than ``step.max_seq_len`` --
are dropped and counted in the data report by default, or stop the run with the source, row and
column named when ``data.on_bad_row=error``.

    python -c "from rlhf.data.tokenize import sft_dataset; ..."   # used by the runners
"""

from __future__ import annotations

import torch
from datasets import Dataset

from rlhf.config import DataError
from rlhf.data.blend import DataReport

IGNORE_INDEX = -100


class BadRowError(DataError):
    pass


def _bad(report: DataReport, split: str, on_bad_row: str, row: dict, reason: str, column: str) -> None:
    if on_bad_row == "error":  # "drop" and "skip" both drop and count
        raise BadRowError(f"bad row in {row['source']}, row {row['row'] + 1}, column {column!r}: {reason} "
                          "(set data.on_bad_row=drop to drop and count such rows)")
    report.drop(split, reason)


def _not_text(value, what: str) -> str | None:
    """Why ``value`` cannot be a prompt or answer (None when it can)."""
    if not isinstance(value, str):
        return f"{what} is {'missing' if value is None else f'a {type(value).__name__}, not text'}"
    return None if value.strip() else f"empty {what}"


def sft_dataset(rows: Dataset, tokenizer, max_seq_len: int, loss_on: str, report: DataReport, split: str,
                on_bad_row: str = "drop") -> Dataset:
    """input_ids and labels for next-token loss on the chosen answer (or on all tokens)."""
    input_ids, labels = [], []
    for row in rows:
        prompt, answer = row["prompt"], row["chosen"]
        if why := _not_text(prompt, "prompt"):
            _bad(report, split, on_bad_row, row, why, "prompt")
            continue
        if why := _not_text(answer, "answer"):
            _bad(report, split, on_bad_row, row, why, "chosen")
            continue
        p = tokenizer(prompt).input_ids
        a = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        if len(p) + len(a) > max_seq_len:
            _bad(report, split, on_bad_row, row, f"longer than step.max_seq_len={max_seq_len}", "chosen")
            continue
        input_ids.append(p + a)
        labels.append(([IGNORE_INDEX] * len(p) if loss_on == "answer" else list(p)) + a)
    if not input_ids:
        raise BadRowError(f"no usable {split} rows left after dropping bad ones: {report.dropped.get(split)}")
    return Dataset.from_dict({"input_ids": input_ids, "labels": labels})


class PadCollator:
    """Right-pads input_ids (pad id), attention_mask (0) and labels (ignored) to the batch's longest row."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            mask[i, :n] = 1
            labels[i, :n] = torch.tensor(b["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PackCollator:
    """The micro batch's rows end to end in one row of shape [1, sum of lengths]: no padding and no
    attention_mask (step.packing).

    position_ids restart at 0 at every row: transformers reads the restarts as row boundaries when
    there is no attention_mask and no KV cache, and confines attention to each row (a per-row causal
    mask for sdpa / eager, the varlen kernels for flash attention) -- for the model types in
    rlhf.models.PACKED_ROWS_MODEL_TYPES only. Each row's first label is ignored so that a row's last
    token is not trained to predict the next row's first; a padded batch never uses that label either
    (labels shift by one), so the loss is the padded batch's.
    """

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        ids = [t for b in batch for t in b["input_ids"]]
        positions = [i for b in batch for i in range(len(b["input_ids"]))]
        labels = [t for b in batch for t in (IGNORE_INDEX, *b["labels"][1:])]
        return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions]),
                "labels": torch.tensor([labels])}


def packed_row_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """The lengths of the rows in a PackCollator batch, from where its position_ids restart at 0."""
    starts = (position_ids.flatten() == 0).nonzero().flatten()
    return torch.diff(starts, append=starts.new_tensor([position_ids.numel()]))


def pair_dataset(rows: Dataset, tokenizer, max_seq_len: int, report: DataReport, split: str,
                 on_bad_row: str = "drop") -> Dataset:
    """chosen_ids / rejected_ids (prompt + answer + eos) for the pairwise reward loss.

    Documented rule (data.on_bad_row=drop, the default): a pair whose chosen equals its rejected
    (after trimming white space) teaches nothing and is dropped; so are empty prompts or answers
    and pairs where either side is longer than step.max_seq_len. Each drop is counted by reason
    in data_report.json.
    """
    chosen_ids, rejected_ids, prompt_lens = [], [], []
    for row in rows:
        prompt = row["prompt"]
        if why := _not_text(prompt, "prompt"):
            _bad(report, split, on_bad_row, row, why, "prompt")
            continue
        answers = {}
        for column in ("chosen", "rejected"):
            value = row[column]
            if why := _not_text(value, "answer"):
                _bad(report, split, on_bad_row, row, why, column)
                break
            answers[column] = value
        if len(answers) < 2:
            continue
        if answers["chosen"].strip() == answers["rejected"].strip():
            _bad(report, split, on_bad_row, row, "chosen equals rejected", "rejected")
            continue
        p = tokenizer(prompt).input_ids
        c = p + tokenizer(answers["chosen"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        r = p + tokenizer(answers["rejected"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        if max(len(c), len(r)) > max_seq_len:
            _bad(report, split, on_bad_row, row, f"longer than step.max_seq_len={max_seq_len}",
                 "chosen" if len(c) >= len(r) else "rejected")
            continue
        chosen_ids.append(c)
        rejected_ids.append(r)
        prompt_lens.append(len(p))
    if not chosen_ids:
        raise BadRowError(f"no usable {split} pairs left after dropping bad ones: {report.dropped.get(split)}")
    return Dataset.from_dict({"chosen_ids": chosen_ids, "rejected_ids": rejected_ids, "prompt_len": prompt_lens})


class PairCollator:
    """One batch of 2B rows: the B chosen, then the B rejected, right-padded to a common width so
    that the prompts line up position by position (the divergence loss compares them there).
    ``answer_mask``: also the mask of each row's answer tokens (eos included), for DPO's log-probs."""

    def __init__(self, pad_token_id: int, answer_mask: bool = False):
        self.pad_token_id = pad_token_id
        self.answer_mask = answer_mask

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        seqs = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        out = {"input_ids": ids, "attention_mask": mask}
        if self.answer_mask:
            starts = torch.tensor([b["prompt_len"] for b in batch] * 2).unsqueeze(1)
            out["answer_mask"] = mask * (torch.arange(width).unsqueeze(0) >= starts)
        # Precomputed reference log-probs, and unpaired rows' labels, where present.
        for key in ("ref_chosen", "ref_rejected", "desirable"):
            if key in batch[0]:
                out[key] = torch.tensor([b[key] for b in batch], dtype=torch.float32)
        return out
