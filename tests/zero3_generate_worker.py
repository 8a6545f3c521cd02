"""One rank of tests/test_zero3_generate.py: ZeRO-3 generation gathered once, layer by layer and in
tensor-parallel slices over both ranks, against the same model unpartitioned (ZeRO-0); and a LoRA
actor's slices (adapters merged) against it gathered whole. Writes what it saw to OUT_DIR/rank<N>.json.

    python -m deepspeed.launcher.runner --num_gpus 2 --no_local_rank --master_port PORT \\
        tests/zero3_generate_worker.py ZERO3.yaml ZERO0.yaml ZERO3_LORA.yaml OUT_DIR
"""

from __future__ import annotations

import importlib
import json
import sys
from collections import Counter
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from rlhf import engine as engine_factory
from rlhf import models
from rlhf.config import load_run_config
from rlhf.generation.rollout import _zero3_offload, gathered_whole, generate, left_pad, position_ids

NEW_TOKENS = 6
# Per rank: lengths and counts differ, so tensor-parallel groups pad both.
PROMPTS = [["sort: d b a c", "sort: x y"], ["sort: q w e r t y", "sort: m", "sort: k j"]]


def count_releases(module: torch.nn.Module, counts: Counter) -> None:
    """Wrap each parameter's ``partition`` so every parameter that is really released (gathered ->
    partitioned) is counted by name, whoever releases it: GatheredParameters' exit calls
    ``params[0].partition(param_list=...)``, ZeRO-3's coordinator ``param.partition()`` per parameter."""
    names = {id(p): n for n, p in module.named_parameters()}

    def wrap(param):
        original = param.partition

        def partition(param_list=None, *args, **kwargs):
            for p in param_list if param_list is not None else [param]:
                if p.ds_status == ZeroParamStatus.AVAILABLE:
                    counts[names[id(p)]] += 1
            return original(param_list, *args, **kwargs)

        param.partition = partition

    for p in module.parameters():
        wrap(p)


def main(zero3_yaml: str, zero0_yaml: str, lora_yaml: str, out_dir: str) -> None:
    # DeepSpeed compiles a shared-memory all-reduce on CPU init (a minute on 2 cores); only its
    # tensor-parallel inference path uses it, never ZeRO, so this check goes without it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (deepspeed.comm.torch is torch)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg3, cfg0, cfg_lora = (load_run_config(f) for f in (zero3_yaml, zero0_yaml, lora_yaml))
    path = models.resolve_path(cfg3.model)
    tokenizer = models.load_tokenizer(path)
    tokenizer.padding_side = "left"
    batch = left_pad([{"input_ids": tokenizer(p).input_ids, "prompt": p} for p in PROMPTS[rank]],
                     tokenizer.pad_token_id)

    def build(cfg, trainable: bool):
        with engine_factory.loading_context(cfg):
            model = models.load_causal_lm(path, tokenizer, engine_factory.model_dtype(cfg), 0.0)
        if trainable:
            return engine_factory.build_train_engine(model, cfg, total_steps=10)[0]
        return engine_factory.build_frozen_engine(model, cfg)[0]

    def gen(engine, gathering: int, logprobs: bool = False):
        # min = max new tokens: exactly NEW_TOKENS forward passes, whatever the random model emits.
        out = generate(engine, batch, tokenizer, NEW_TOKENS, min_new_tokens=NEW_TOKENS, gathering=gathering,
                       with_logprobs=logprobs)
        return [x.tolist() for x in out] if logprobs else out.tolist()

    def lm_batch(engine, response: list[list[int]]) -> dict:
        seq = torch.cat([batch["input_ids"], torch.tensor(response)], 1).to(engine.device)
        attn = torch.cat([batch["attention_mask"], torch.ones(len(response), NEW_TOKENS, dtype=torch.long)], 1)
        attn = attn.to(engine.device)
        labels = seq.masked_fill(attn == 0, -100)
        return {"input_ids": seq, "attention_mask": attn, "position_ids": position_ids(attn), "labels": labels}

    result = {}
    for kind in ("trainable", "frozen"):
        engine3, engine0 = build(cfg3, kind == "trainable"), build(cfg0, kind == "trainable")
        counts: Counter = Counter()
        count_releases(engine3.module, counts)
        seen = {"persistent": sorted(n for n, p in engine3.module.named_parameters() if p.ds_persist),
                "params": [n for n, _ in engine3.module.named_parameters()]}
        for label, gathering in (("gather", 1), ("layerwise", 0), ("gather_again", 1), ("tp", 2)):
            if label == "layerwise":  # a generate that raises must still hand the hooks back
                offload = _zero3_offload(engine3)
                hooks = len(offload.forward_hooks), len(offload.backward_hooks)
                try:
                    with gathered_whole(engine3):
                        raise KeyboardInterrupt
                except KeyboardInterrupt:
                    pass
                seen["hooks_before_after_error"] = [hooks, [len(offload.forward_hooks), len(offload.backward_hooks)]]
            counts.clear()
            seen[f"tokens_{label}"] = gen(engine3, gathering)
            seen[f"releases_{label}"] = dict(counts)
        seen["tokens_zero0"], seen["logprobs_zero0"] = gen(engine0, 1, logprobs=True)
        seen["logprobs_tp"] = gen(engine3, 2, logprobs=True)[1]
        # Straight after a gathered generate: ZeRO-3's hooks must be back for training and forward.
        data = lm_batch(engine3, seen["tokens_gather"])
        losses = {}
        for name, engine in (("zero3", engine3), ("zero0", engine0)):
            if kind == "trainable":
                engine.train()
                loss = engine(**data).loss
                engine.backward(loss)
                engine.step()
                with torch.no_grad():
                    after = engine(**data).loss
                losses[name] = [loss.item(), after.item()]
            else:
                with torch.no_grad():
                    losses[name] = [engine(**data).loss.item()]
        seen["losses"] = losses
        result[kind] = seen
        dist.barrier()
    # A LoRA actor after one update (its B matrices no longer zero): slices with the adapters merged
    # against the whole model gathered, whose PEFT layers add them at run time.
    engine = build(cfg_lora, True)
    data = lm_batch(engine, result["trainable"]["tokens_gather"])
    engine.backward(engine(**data).loss)
    engine.step()
    b = [p for n, p in engine.module.named_parameters() if "lora_B" in n]
    with deepspeed.zero.GatheredParameters(b):
        b_norm = sum(p.float().norm().item() for p in b)
    result["lora"] = {"b_norm": b_norm, "whole": gen(engine, 1, logprobs=True), "tp": gen(engine, 2, logprobs=True)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
