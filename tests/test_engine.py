"""The engine factory's DeepSpeed configs, field by field, for every zero file and precision."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, to_schema
from rlhf.engine import ds_config
from tests.conftest import ROOT, compose

ZERO_FILES = sorted(p.stem for p in (ROOT / "conf" / "zero").glob("*.yaml"))
EXPECTED = {  # stage, optimizer offload, parameter offload
    "0": (0, None, None), "1": (1, None, None), "2": (2, None, None), "3": (3, None, None),
    "2-offload": (2, "cpu", None), "3-offload": (3, "cpu", "cpu"),
}


def test_every_zero_file_is_expected():
    assert set(ZERO_FILES) == set(EXPECTED)


@pytest.mark.parametrize("zero", ZERO_FILES)
def test_zero_block_matches_the_file(zero):
    cfg = to_schema(compose([f"zero={zero}"]))
    stage, opt_off, param_off = EXPECTED[zero]
    ds = ds_config(cfg)
    block = ds["zero_optimization"]
    assert block["stage"] == stage
    assert block.get("offload_optimizer", {}).get("device") == opt_off
    assert block.get("offload_param", {}).get("device") == param_off
    assert ds.get("zero_force_ds_cpu_optimizer", False) == (opt_off is not None)
    assert ds["gradient_clipping"] == cfg.optim.grad_clip
    # Frozen roles carry no optimizer offload and no gradient settings; stage 3 alone partitions them.
    frozen = ds_config(cfg, trainable=False)
    assert frozen["zero_optimization"]["stage"] == (3 if stage == 3 else 0)
    assert "offload_optimizer" not in frozen["zero_optimization"]
    assert frozen["zero_optimization"].get("offload_param", {}).get("device") == param_off
    assert "gradient_clipping" not in frozen
    # DeepSpeed's memory-efficient linear: its default, on, wherever stage 3 partitions; off on request.
    assert block.get("memory_efficient_linear") is (True if stage == 3 else None)
    assert frozen["zero_optimization"].get("memory_efficient_linear") is (True if stage == 3 else None)
    off = to_schema(compose([f"zero={zero}", "zero.memory_efficient_linear=false"]))
    for trainable in (True, False):
        assert ds_config(off, trainable)["zero_optimization"].get("memory_efficient_linear") is \
            (False if stage == 3 else None)


@pytest.mark.parametrize("micro,accum,world_nodes,world_devices", [(8, 1, 1, 1), (4, 4, 1, 1), (2, 3, 2, 4)])
def test_batch_arithmetic(micro, accum, world_nodes, world_devices):
    cfg = to_schema(compose([f"step.micro_batch_size_per_device={micro}", f"step.gradient_accumulation_steps={accum}",
                             f"hardware.nodes={world_nodes}", f"hardware.devices_per_node={world_devices}"]))
    ds = ds_config(cfg)
    world = world_nodes * world_devices
    assert ds["train_micro_batch_size_per_gpu"] == micro
    assert ds["gradient_accumulation_steps"] == accum
    assert ds["train_batch_size"] == micro * accum * world == cfg.step.global_batch_size


def test_global_batch_derives_accumulation():
    cfg = to_schema(compose(["step.global_batch_size=64", "step.micro_batch_size_per_device=4",
                             "hardware.devices_per_node=2"]))
    ds = ds_config(cfg)
    assert ds["gradient_accumulation_steps"] == 8
    assert ds["train_batch_size"] == 64


@pytest.mark.parametrize("precision,bf16,fp16", [("fp32", False, False), ("bf16", True, False)])
def test_precision_comes_from_the_preset(precision, bf16, fp16):
    ds = ds_config(to_schema(compose([f"hardware.precision={precision}"])))
    assert ds["bf16"]["enabled"] is bf16
    assert ds["fp16"]["enabled"] is fp16


def test_fp16_allowed_on_cuda_only():
    ds = ds_config(to_schema(compose(["hardware.accelerator=cuda", "hardware.precision=fp16",
                                      "hardware.dist_backend=nccl"])))
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0
    with pytest.raises(ConfigError, match="fp16"):
        to_schema(compose(["hardware.precision=fp16"]))


@pytest.mark.parametrize("zero", ["0", "3"])
def test_frozen_engine_runs_forward_without_gradients(zero):
    import torch

    from rlhf import models
    from rlhf.engine import build_frozen_engine, loading_context
    from rlhf.worker import init_distributed

    cfg = to_schema(compose([f"zero={zero}"]))
    init_distributed(cfg)
    path = models.resolve_path(cfg.model)
    tok = models.load_tokenizer(path)
    reference = models.load_causal_lm(path, tok).eval()
    with loading_context(cfg):
        model = models.load_causal_lm(path, tok)
    engine, ds = build_frozen_engine(model, cfg)
    # No optimizer (under ZeRO-3 DeepSpeed keeps only its parameter-fetching helper in that slot).
    assert not isinstance(engine.optimizer, torch.optim.Optimizer) and "gradient_clipping" not in ds
    assert not any(p.requires_grad for p in engine.module.parameters())
    if zero == "3":  # parameters live partitioned between forward passes
        assert all(hasattr(p, "ds_id") for p in engine.module.parameters())
    ids = torch.tensor([tok(" Human: sort d b a c Assistant:").input_ids])
    with torch.no_grad():
        assert torch.allclose(engine(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)
    if zero == "3":
        # DeepSpeed's memory-efficient linear (on, its default) replaces F.linear for the process;
        # a rollout gathered whole runs torch's own and puts DeepSpeed's back.
        from rlhf.generation.rollout import gathered_whole

        patched = torch.nn.functional.linear
        assert patched is not torch._C._nn.linear
        with gathered_whole(engine), torch.no_grad():
            assert torch.nn.functional.linear is torch._C._nn.linear
            assert torch.allclose(engine.module(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)
        assert torch.nn.functional.linear is patched


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_rank_at_stage_0_skips_the_identity_all_reduce_and_steps_the_same(precision):
    """At one rank and stage 0 the engine skips DeepSpeed's gradient all-reduce: three steps give
    the same weights bit for bit as an engine that runs it (bf16: through DeepSpeed's fp32 master
    weights), and in fp32 the same as torch's fused AdamW with the same clipping."""
    import copy

    import torch

    from rlhf import models
    from rlhf.engine import build_train_engine, param_groups
    from rlhf.worker import init_distributed

    cfg = to_schema(compose([f"hardware.precision={precision}", "optim.grad_clip=0.05", "optim.weight_decay=0.1",
                             "optim.warmup_steps=0", "optim.scheduler=constant"]))
    init_distributed(cfg)
    path = models.resolve_path(cfg.model)
    tok = models.load_tokenizer(path)
    model = models.load_causal_lm(path, tok, models.DTYPES[precision])
    reference, reduced, initial = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    engine, _ = build_train_engine(model, cfg, total_steps=3)
    with_reduce, _ = build_train_engine(reduced, cfg, total_steps=3)
    assert not engine.enable_backward_allreduce
    with_reduce.enable_backward_allreduce = True  # DeepSpeed's own path
    opt = torch.optim.AdamW(param_groups(reference, cfg), betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, fused=True)
    ids = torch.tensor([tok(" Human: sort d b a c Assistant: a b c d").input_ids] * 2)
    for _ in range(3):
        for e in (engine, with_reduce):
            e.backward(e(input_ids=ids, labels=ids).loss)
            e.step()
        reference(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad()
    for (name, p), q, r in zip(engine.module.named_parameters(), with_reduce.module.parameters(),
                               reference.parameters(), strict=True):
        assert torch.equal(p, q), name
        if precision == "fp32":
            assert torch.allclose(p, r, atol=1e-6, rtol=1e-5), name
    assert all(not torch.equal(p, q) for p, q in zip(engine.module.parameters(), initial.parameters(), strict=True)), "it trained"


def test_frozen_offload_keeps_parameters_in_host_memory_at_any_stage():
    for zero in ("0", "2"):
        cfg = to_schema(compose([f"zero={zero}"]))
        block = ds_config(cfg, trainable=False, offload=True)["zero_optimization"]
        assert block["stage"] == 3 and block["offload_param"]["device"] == "cpu"
        assert ds_config(cfg, trainable=False)["zero_optimization"] == {"stage": 0}
