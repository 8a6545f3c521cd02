"""Padding-free packing of SFT rows (step.packing): a packed micro batch gives the padded one's loss
and gradients on a model type whose attention stays within each packed row, OPT (whose attention
would cross the rows) is refused before training, and a packed SFT run trains as the padded run does.

    python -m pytest -q tests/test_packing.py
"""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.config import ConfigError, to_schema
from rlhf.data.blend import DataReport, load_step_data
from rlhf.data.tokenize import IGNORE_INDEX, PackCollator, PadCollator, packed_row_lengths, sft_dataset
from rlhf.launch import run
from rlhf.models import PACKED_ROWS_MODEL_TYPES, check_packed_rows, load_causal_lm, load_tokenizer, resolve_path
from rlhf.runners.common import Throughput
from tests.conftest import check_margin, compose, trajectory_overrides


def _model_and_rows(name: str, loss_on: str):
    """The shipped tiny model ``name`` (fp32, no dropout) and shipped SFT rows of the mixed tasks: two of
    each length (answers of 2 to 7 tokens), in the data's order."""
    cfg = to_schema(compose([f"model={name}", "data=synthetic-mix", f"step.loss_on={loss_on}"]))
    path = resolve_path(cfg.model)
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    model = load_causal_lm(path, tok, torch.float32, 0.0).train()
    train_rows, _ = load_step_data(cfg.data, "sft", DataReport())
    ds = sft_dataset(train_rows.select(range(200)), tok, cfg.step.max_seq_len, loss_on, DataReport(), "train")
    lengths = [len(ids) for ids in ds["input_ids"]]
    picked = sorted(i for n in set(lengths) for i in [j for j, m in enumerate(lengths) if m == n][:2])
    rows = [ds[i] for i in picked]
    assert len({len(r["input_ids"]) for r in rows}) >= 2, "rows of different lengths, so padding differs per row"
    return path, model, tok, rows


def _loss_and_grads(model, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_on", ["answer", "all"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_a_packed_batch_gives_the_padded_loss_and_gradients_where_the_model_type_is_supported(name, loss_on):
    """The registry PACKED_ROWS_MODEL_TYPES says which model types keep attention within each packed row;
    this checks it both ways, so an OPT that learns to do so in a later transformers shows up here."""
    path, model, tok, rows = _model_and_rows(name, loss_on)
    padded, packed = PadCollator(tok.pad_token_id)(rows), PackCollator()(rows)
    assert packed["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows)) and "attention_mask" not in packed
    assert packed_row_lengths(packed["position_ids"]).tolist() == [len(r["input_ids"]) for r in rows]
    assert (packed["labels"] != IGNORE_INDEX).sum() == (padded["labels"][:, 1:] != IGNORE_INDEX).sum()

    loss_pad, grads_pad = _loss_and_grads(model, padded)
    loss_pack, grads_pack = _loss_and_grads(model, packed)
    if model.config.model_type in PACKED_ROWS_MODEL_TYPES:
        check_packed_rows(path)
        assert loss_pack == pytest.approx(loss_pad, abs=1e-5)
        assert grads_pack.keys() == grads_pad.keys() and len(grads_pad) == len(list(model.parameters()))
        for key, grad in grads_pad.items():
            torch.testing.assert_close(grads_pack[key], grad, atol=1e-5, rtol=0, msg=key)
    else:
        assert abs(loss_pack - loss_pad) > 1e-4, "attention crosses the packed rows (why this type is refused)"
        with pytest.raises(ConfigError, match=r"step\.packing=true is not supported for OPTForCausalLM"):
            check_packed_rows(path)


def test_throughput_counts_a_packed_batch_as_the_padded_one_without_its_padding():
    rows = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (2, 5, 3)]
    cfg = to_schema(compose([]))
    padded, packed = Throughput(cfg, 1, 1), Throughput(cfg, 1, 1)
    padded.add(PadCollator(0)(rows))
    packed.add(PackCollator()(rows))
    assert padded.tokens == packed.tokens == packed.padded == 10 and padded.padded == 15
    assert packed.seq_len == pytest.approx((4 + 25 + 9) / 10)  # a token attends within its own row


@pytest.mark.trajectory
def test_a_packed_sft_run_trains_as_the_padded_run_does_and_opt_is_refused_before_training(tmp_path, record_property):
    """Same rows per micro batch, same per-batch loss: the logged losses of the two runs agree and fall."""
    base = ["data=synthetic-mix", "step.max_steps=12", "step.log_every_steps=4", "data.max_eval_samples=32",
            "logging.progress_bar=false", "step.save_model=false", *trajectory_overrides()]
    for packing in ("false", "true"):
        run(compose([*base, f"step.packing={packing}", f"run_dir={tmp_path / packing}"]))
    logged = {p: [json.loads(line) for line in open(tmp_path / p / "metrics.jsonl") if '"loss"' in line]
              for p in ("false", "true")}
    losses = {p: [r["loss"] for r in rows] for p, rows in logged.items()}
    assert len(losses["true"]) == 3, losses
    check_margin(record_property, "loss last/first", losses["true"][-1] / losses["true"][0], 0.8, higher=False,
                 strict=True)
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-4), losses
    assert [r["tokens_per_s"] > 0 for r in logged["true"]] == [True] * 3

    assert to_schema(compose(["step.packing=true"])).step.packing is True
    with pytest.raises(ConfigError, match=r"step\.packing=true is not supported for OPTForCausalLM"):
        run(compose([*base, "model=tiny-opt", "step.packing=true", f"run_dir={tmp_path / 'opt'}"]))
    assert not (tmp_path / "opt" / "metrics.jsonl").exists()
