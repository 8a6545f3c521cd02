"""The framework on one GPU: SFT throughput and MFU of a random OPT-1.3B-shaped model, and a PPO step
broken into phases with a 1.3B actor and a 350M critic (DeepSpeed-Chat's step-3 pairing), in bf16.

Each phase is one call of this script, so each gets a fresh process (clean peak-memory figures, no
engine left over from the phase before); ``bench/gpu.sh`` runs them in order and writes the summary:

    bash bench/gpu.sh                  # one GPU: under 10 min (phase limits) on an H200
    bash bench/gpu.sh zero=2           # extra Hydra overrides go to the SFT and PPO runs
    bash bench/gpu.sh --tiny           # the same script at toy size on CPU (a smoke test, ~25 s)
    python bench/gpu_bench.py sft --out runs/bench-gpu [--tiny] [overrides]   # one phase

Phases: ``matmul`` (the chip's bf16 matrix rate, measured, so MFU can be read against what the chip
really does and not only against its datasheet), ``sft`` and ``ppo`` (the real runners through
``rlhf.launch.run``: engine factory, DeepSpeed, metrics.jsonl; warm-up steps excluded from every
figure; ``sft_micro4x`` is ``sft`` at 4x the micro batch), ``decode`` (the rollout's decode loop alone, default against the static step recorded as
a CUDA graph, beside the memory bus's floor), ``ppo_graph`` (``ppo`` with
``step.decode_graph=true``), ``report`` (summary.json and summary.md from the phases' JSON files).

The models are random (``random_init``): OPT architecture numbers with the framework's byte-level
BPE tokenizer trained on the shipped data. The tokenizer has few real tokens, but the embedding
and output layers are built at the full 50272-row vocabulary, so every matmul has the real shape.
Rows are random letters cut to exact token counts (no padding): SFT rows of 512 tokens, PPO
prompts of 256 tokens with 256 sampled answer tokens (eos suppressed), as in DeepSpeed-Chat's
OPT-1.3B scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import string
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OPT_VOCAB = 50272
SETTINGS = {
    "gpu": {
        "actor": {"name": "random-opt-1.3b", "num_layers": 24, "hidden_size": 2048, "num_heads": 32,
                  "ffn_size": 8192, "vocab_size": OPT_VOCAB, "max_positions": 2048},
        "critic": {"name": "random-opt-350m", "num_layers": 24, "hidden_size": 1024, "num_heads": 16,
                   "ffn_size": 4096, "vocab_size": OPT_VOCAB, "max_positions": 2048},
        # Llama 3.2 1B's shape (its config.json): grouped-query attention, 8 key/value heads for 32
        # query heads, so its KV cache is a quarter of an OPT-1.3B's per token; a tied 128256-row head.
        "gqa": {"name": "random-llama-3.2-1b", "family": "llama", "num_layers": 16, "hidden_size": 2048,
                "num_heads": 32, "num_kv_heads": 8, "ffn_size": 8192, "vocab_size": 128256, "max_positions": 2048,
                "tied_embeddings": True},
        "matmul": {"n": 8192, "dtype": "bf16"},
        # 5 warm-up steps (cuBLAS handles, allocator growth) then 4 logged windows of 5.
        "sft": {"seq": 512, "micro": 16, "log_every": 5, "warmup_windows": 1, "windows": 4},
        "ppo": {"prompt": 256, "answer": 256, "rollouts": 64, "micro": 16, "warmup": 2, "measured": 4},
        # ZeRO-3's steps are slower: one warm-up and two measured fit the phase's limit (docs/benchmarks.md).
        "ppo_zero3": {"warmup": 1, "measured": 2},
        # The PPO phase's rollout alone: 64 rows of 256 + 256 tokens, each way timed twice after a warm-up.
        "decode": {"prompt": 256, "answer": 256, "rows": 64, "repeats": 2, "copy_mb": 4096},
    },
    # Toy sizes for a CPU smoke test of the script itself; its figures mean nothing.
    "tiny": {
        "actor": {"name": "bench-tiny-actor", "num_layers": 2, "hidden_size": 128, "num_heads": 4,
                  "ffn_size": 512, "vocab_size": 512, "max_positions": 256},
        "critic": {"name": "bench-tiny-critic", "num_layers": 2, "hidden_size": 64, "num_heads": 4,
                   "ffn_size": 256, "vocab_size": 512, "max_positions": 256},
        "gqa": {"name": "bench-tiny-gqa", "family": "llama", "num_layers": 2, "hidden_size": 128, "num_heads": 4,
                "num_kv_heads": 2, "ffn_size": 512, "vocab_size": 512, "max_positions": 256, "tied_embeddings": True},
        "matmul": {"n": 256, "dtype": "fp32"},
        "sft": {"seq": 64, "micro": 4, "log_every": 2, "warmup_windows": 1, "windows": 2},
        "ppo": {"prompt": 16, "answer": 16, "rollouts": 4, "micro": 2, "warmup": 1, "measured": 2},
        "ppo_zero3": {"warmup": 1, "measured": 2},
        "decode": {"prompt": 16, "answer": 16, "rows": 4, "repeats": 1, "copy_mb": 16},
    },
}
# The decode phase samples at PPO's default temperature (conf/step/ppo.yaml).
DECODE_TEMPERATURE = 0.7
# Dense bf16 tensor-core peaks from the vendors' datasheets (SXM parts), in TFLOP/s.
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}
# Memory bandwidth from the same datasheets, GB/s (H100 SXM 3.35 TB/s; A100 80GB SXM 2.04 TB/s).
DATASHEET_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def model_overrides(spec: dict) -> list[str]:
    # tiny-opt (tiny-llama) is the random-init OPT (LLaMA) file; the numbers below replace its toy shape.
    family = spec.get("family", "opt")
    return [f"model=tiny-{family}", *(f"model.{k}={v}" for k, v in spec.items() if k != "family")]


def hardware_overrides(tiny: bool) -> list[str]:
    """A one-GPU bf16 preset named and sized after the GPU it runs on (the memory pre-flight reads
    the size); the tiny run uses the CPU preset as the tests do."""
    if tiny:
        return ["hardware=cpu"]
    import torch

    props = torch.cuda.get_device_properties(0)
    slug = props.name.lower().replace("nvidia ", "").replace(" ", "-")
    return ["hardware=h100-80g", f"hardware.name={slug}",
            f"hardware.memory_per_device_gb={props.total_memory // 2**30}"]


def datasheet_peak(table: dict = DATASHEET_BF16_TFLOPS) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in table.items() if k in name), None)


def exact_text(tokenizer, n_tokens: int, rng: random.Random, special: bool) -> str:
    """Random letters whose tokenization is exactly ``n_tokens`` long (bos included when
    ``special``): cut the ids, decode, and keep the text only if it encodes back to that length."""
    while True:
        words = " ".join(rng.choice(string.ascii_lowercase) for _ in range(2 * n_tokens))
        ids = tokenizer(f" {words}", add_special_tokens=special).input_ids[:n_tokens]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if len(tokenizer(text, add_special_tokens=special).input_ids) == n_tokens:
            return text


def write_rows(folder: Path, rows: list[dict], n_eval: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows), ("eval", rows[:n_eval])):
        with open(folder / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)


def build_model(spec: dict) -> tuple[str, float]:
    """The random model's folder (built into $RLHF_CACHE on first use) and the seconds it took."""
    from rlhf import models
    from rlhf.config import compose_config, to_schema

    t0 = time.perf_counter()
    path = models.resolve_path(to_schema(compose_config(model_overrides(spec))).model)
    return path, time.perf_counter() - t0


def common_overrides(out: Path, phase: str, tiny: bool, data: Path, split: str) -> list[str]:
    return [*hardware_overrides(tiny), f"data.sources=[{{path: {data}}}]", f"data.split='{split}'",
            "logging.progress_bar=false", "step.save_model=false", "resume=never", f"run_dir={out / phase}"]


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


# ------------------------------------------------------------------------------------ phases
def phase_matmul(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """Mean rate of ten square products after three warm-ups, timed with device events."""
    import torch

    n, dtype = settings["matmul"]["n"], settings["matmul"]["dtype"]
    device = "cpu" if tiny else "cuda"
    a = torch.randn(n, n, device=device, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    reps = 10
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        seconds = time.perf_counter() - t0
    tflops = 2 * n**3 * reps / seconds / 1e12
    return {"n": n, "dtype": dtype, "tflops": round(tflops, 3)}


def phase_sft(settings: dict, out: Path, tiny: bool, extra: list[str], name: str = "sft", micro_scale: int = 1) -> dict:
    from rlhf import models
    from rlhf.config import compose_config
    from rlhf.launch import run

    s = {**settings["sft"], "micro": settings["sft"]["micro"] * micro_scale}
    path, build_s = build_model(settings["actor"])
    tokenizer = models.load_tokenizer(path)
    steps = s["log_every"] * (s["warmup_windows"] + s["windows"])
    rng = random.Random(0)
    # Half prompt (bos included), half answer (eos included): every row exactly seq tokens.
    half = s["seq"] // 2
    rows = [{"prompt": exact_text(tokenizer, half, rng, True), "chosen": exact_text(tokenizer, half - 1, rng, False),
             "rejected": " a"} for _ in range(s["micro"] * (steps + 1))]
    write_rows(out / f"data-{name}", rows, s["micro"])
    overrides = [*model_overrides(settings["actor"]), "step=sft", *common_overrides(out, name, tiny, out / f"data-{name}",
                                                                                   "1,0,0"),
                 f"step.max_seq_len={s['seq']}", f"step.micro_batch_size_per_device={s['micro']}",
                 f"step.eval_micro_batch_size_per_device={s['micro']}", "step.loss_on=all",
                 f"step.max_steps={steps}", f"step.log_every_steps={s['log_every']}", "step.eval_every_steps=0",
                 # The last warm-up step, outside every measured window (the profiler slows its step).
                 f"logging.profile_step={s['log_every'] * s['warmup_windows']}", *extra]
    cfg = compose_config(overrides)
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    logged = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
    windows = [r for r in logged if "tflops" in r]
    measured = windows[s["warmup_windows"]:]
    result = {"model": settings["actor"]["name"], "seq_len": s["seq"], "micro_batch": s["micro"],
              "zero_stage": cfg.zero.stage, "precision": cfg.hardware.precision,
              "measured_steps": s["log_every"] * len(measured), "warmup_steps": s["log_every"] * s["warmup_windows"],
              "model_build_s": round(build_s, 1), "run_wall_s": round(wall, 1)}
    for key in ("tokens_per_s", "samples_per_s", "tflops", "latency_s"):
        result[key] = round(median_of(measured, key), 4)
    result["tflops_windows"] = [round(r["tflops"], 2) for r in measured]
    result["memory_gb"] = round(max(r["memory_gb"] for r in measured), 2)
    result["params_m"] = round(param_count(path) / 1e6, 1)
    result["profile"] = step_profile(out / name)
    return result


def phase_ppo(settings: dict, out: Path, tiny: bool, extra: list[str], name: str = "ppo") -> dict:
    from rlhf import models
    from rlhf.config import compose_config, to_schema
    from rlhf.launch import run
    from rlhf.preflight import memory

    s = ppo_settings(settings, name)
    actor, actor_build_s = build_model(settings["actor"])
    critic, critic_build_s = build_model(settings["critic"])
    tokenizer = models.load_tokenizer(actor)
    steps = s["warmup"] + s["measured"]
    rng = random.Random(1)
    rows = [{"prompt": exact_text(tokenizer, s["prompt"], rng, True), "chosen": " a", "rejected": " b"}
            for _ in range(s["rollouts"] * (steps + 1))]
    write_rows(out / f"data-{name}", rows, s["rollouts"])
    overrides = [*model_overrides(settings["actor"]), "step=ppo", *common_overrides(out, name, tiny, out / f"data-{name}",
                                                                                   "0,0,1"),
                 f"actor.path={actor}", f"critic.path={critic}", f"reward.path={critic}",
                 f"step.rollout_batch_size_per_device={s['rollouts']}", f"step.micro_batch_size_per_device={s['micro']}",
                 f"step.max_prompt_len={s['prompt']}", f"step.max_new_tokens={s['answer']}",
                 f"step.min_new_tokens={s['answer']}", f"step.max_steps={steps}", "step.eval_prompts=0",
                 "step.eval_every_steps=0", "step.log_every_steps=1", f"logging.profile_step={s['warmup']}", *extra]
    cfg = compose_config(overrides)
    schema = to_schema(cfg)
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    result = ppo_figures(out / name, s["warmup"], s["measured"])
    result.update(actor=settings["actor"]["name"], critic_and_reward=settings["critic"]["name"],
                  rollouts=s["rollouts"], micro_batch=s["micro"], prompt_tokens=s["prompt"],
                  zero_stage=schema.zero.stage, precision=schema.hardware.precision,
                  old_logprobs=schema.step.old_logprobs, decode_graph=schema.step.decode_graph,
                  # ZeRO-3's way to generate (rlhf.preflight.memory.generation_gathering): 1 whole, t > 1 slices, 0 layer by layer.
                  generation_gathering=memory.generation_gathering(schema),
                  model_build_s=round(actor_build_s + critic_build_s, 1), run_wall_s=round(wall, 1),
                  actor_params_m=round(param_count(actor) / 1e6, 1), critic_params_m=round(param_count(critic) / 1e6, 1),
                  profile=step_profile(out / name))
    return result


def ppo_settings(settings: dict, name: str) -> dict:
    """The PPO phase ``name``'s shapes and step counts: the ``ppo`` entry with the phase's own entry
    (``ppo_zero3``'s fewer steps) over it."""
    return {**settings["ppo"], **settings.get(name, {})}


def step_profile(run_dir: Path) -> dict:
    """The run's profiled step (logging.profile_step, rlhf.observe.profiling): wall, busy and idle ms, device
    time by kernel kind, the costliest kernels."""
    path = run_dir / "profile" / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def ppo_figures(run_dir: Path, warmup: int, planned: int) -> dict:
    """A PPO run's step figures from its metrics.jsonl: medians of the steps after ``warmup`` (of every
    step logged where no more came; ``partial``: fewer than ``warmup`` + ``planned`` steps were logged,
    the run was stopped at its time limit), each phase of the step, and
    ``rollout/logprob_diff``: how far the log-probs PPO's ratio divides by (the sampler's with
    step.old_logprobs=rollout, a scoring forward's with recompute) are from a training forward's."""
    logged = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"step_s"' in line]
    if not logged:
        raise RuntimeError(f"{run_dir}: no PPO step was logged")
    measured = logged[warmup:] or logged
    med = {k: median_of(measured, k) for k in ("generate_s", "experience_s", "train_s", "other_s", "step_s",
                                                 "samples_per_s", "tflops", "answer_len", "rollout/logprob_diff")}
    rollouts = round(measured[0]["samples_per_s"] * measured[0]["step_s"])  # every rank's, per step
    return {"answer_tokens": med["answer_len"], "warmup_steps": len(logged) - len(measured),
            "measured_steps": len(measured), "partial": len(logged) < warmup + planned,
            **{k: round(v, 4) for k, v in med.items() if k not in ("answer_len", "rollout/logprob_diff")},
            "logprob_diff": med["rollout/logprob_diff"],
            # experience_s includes generation; the scoring forwards are the rest of it.
            "scoring_s": round(med["experience_s"] - med["generate_s"], 4),
            "generated_tokens_per_s": round(rollouts * med["answer_len"] / med["generate_s"], 1),
            "step_s_each": [round(r["step_s"], 3) for r in measured],
            "memory_gb": round(max(r["memory_gb"] for r in measured), 2)}


def phase_decode(settings: dict, out: Path, tiny: bool, extra: list[str], spec_key: str = "actor") -> dict:
    """The rollout's decode loop alone on the PPO phase's actor and shapes (eos suppressed, every row
    decodes ``answer`` tokens), in ms per decoding step: the default loop, the static step
    (``rlhf.generation.decode``'s ``static``: one CUDA graph per attention span, replayed per token) and the
    same static step attending over the whole cache from the first token (STATIC_SPAN = 0), beside
    the floor the memory bus sets: a decoding step must read every weight and the KV cache up to its
    position once, so at the mean position (prompt + answer / 2) the floor is those bytes over the
    bandwidth, both the measured one (a large device-to-device copy: read + written bytes / time)
    and the datasheet's. The KV cache's width comes from the model's own config (key/value heads x
    head width: a grouped-query model's cache is a fraction of its hidden width). ``breakdown``:
    where a static step's time goes (``decode_breakdown``)."""
    import torch

    from rlhf import models
    from rlhf.generation import decode as decode_module
    from rlhf.generation.decode import decode
    from rlhf.preflight.forecast import static_attended

    s, spec = settings["decode"], settings[spec_key]
    path, _ = build_model(spec)
    tokenizer = models.load_tokenizer(path)
    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    model = models.load_causal_lm(path, tokenizer, dtype).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tokenizer), (s["rows"], s["prompt"]), generator=gen).to(device)
    mask = torch.ones_like(ids)

    def run(static: bool, span: int = decode_module.STATIC_SPAN):
        spans, decode_module.STATIC_SPAN = decode_module.STATIC_SPAN, span
        try:
            return decode(model, ids, mask, s["answer"], tokenizer.eos_token_id, tokenizer.pad_token_id,
                          do_sample=True, temperature=DECODE_TEMPERATURE, min_new_tokens=s["answer"],
                          with_logprobs=True, static=static)
        finally:
            decode_module.STATIC_SPAN = spans

    config = model.config
    result = {"model": spec["name"], "family": config.model_type, "rows": s["rows"], "prompt_tokens": s["prompt"],
              "answer_tokens": s["answer"], "precision": "fp32" if tiny else "bf16",
              "static_span": decode_module.STATIC_SPAN}
    variants = {"default": lambda: run(False), "static_graph": lambda: run(True),
                "static_graph_whole_cache": lambda: run(True, 0)}
    for name, fn in variants.items():
        fn()  # warm-up: kernels chosen, allocator grown (and, static, the graphs recorded once)
        seconds = min(timed(fn, device) for _ in range(s["repeats"]))
        result[f"{name}_ms_per_token"] = round(1e3 * seconds / s["answer"], 3)
        result[f"{name}_tokens_per_s"] = round(s["rows"] * s["answer"] / seconds, 1)
    torch.manual_seed(0)
    a = run(False)
    torch.manual_seed(0)
    b = run(True)
    # Same seed, same tokens in exact arithmetic; in bf16 the two loops round differently, and one
    # flipped draw changes the rest of its row. So the check that matters is the one PPO relies on:
    # each loop's log-probs against one plain forward of the model over its own tokens (PPO's ratio
    # divides by them).
    result["same_tokens"] = bool(torch.equal(a[0], b[0]))
    differs = (a[0] != b[0]).float()
    first = torch.where(differs.any(1), differs.argmax(1), torch.full_like(differs[:, 0], a[0].shape[1]))
    result["median_first_differing_token"] = float(first.float().median())
    for name, (tokens, logprobs) in (("default", a), ("static_graph", b)):
        gap = (logprobs - forward_logprobs(model, ids, mask, tokens, DECODE_TEMPERATURE, tokenizer.eos_token_id,
                                           s["answer"])).abs()
        result[f"{name}_logprob_vs_forward_max"] = float(gap.max())
        result[f"{name}_logprob_vs_forward_mean"] = float(gap.mean())

    # Bytes one decoding step reads: the weights, and keys + values of every layer up to the position.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    mean_position = s["prompt"] + s["answer"] / 2
    step_bytes = weight_bytes + s["rows"] * mean_position * kv_bytes_per_token
    # What the static step reads: its spans' positions, on average over the answer.
    static_bytes = weight_bytes + s["rows"] * static_attended(s["prompt"], s["answer"]) * kv_bytes_per_token
    src = torch.empty(s["copy_mb"] * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = min(timed(lambda: dst.copy_(src), device) for _ in range(5))
    measured_gbs = 2 * src.numel() / copy_s / 1e9
    sheet = datasheet_peak(DATASHEET_GBS)
    result.update(params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1), kv_heads=kv_heads,
                  heads=config.num_attention_heads, weight_gb=round(weight_bytes / 1e9, 3),
                  kv_gb_at_mean=round((step_bytes - weight_bytes) / 1e9, 3),
                  kv_gb_static_reads=round((static_bytes - weight_bytes) / 1e9, 3),
                  measured_copy_gbs=round(measured_gbs, 1), datasheet_gbs=sheet,
                  floor_ms_measured=round(1e3 * step_bytes / (measured_gbs * 1e9), 3),
                  static_reads_ms_measured=round(1e3 * static_bytes / (measured_gbs * 1e9), 3))
    if sheet:
        result["floor_ms_datasheet"] = round(1e3 * step_bytes / (sheet * 1e9), 3)
    for name in variants:
        result[f"{name}_over_floor"] = round(result[f"{name}_ms_per_token"] / result["floor_ms_measured"], 2)
    result["breakdown"] = decode_breakdown(model, ids, mask, s["answer"], tokenizer.eos_token_id, device)
    return result


def timed(fn, device: str) -> float:
    """Seconds ``fn()`` takes, the device's queue drained before and after."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_breakdown(model, ids, mask, answer: int, eos_id: int, device: str) -> dict:
    """Where a static decoding step's time goes, in ms per token: ``forward`` (the step's span graphs
    replayed ``answer`` times with no sampling between; eagerly on CPU), ``graph_recording`` (what the
    decode's first pass pays over that for its warm-up and captures), ``sampler`` (decode's own
    per-token draw and log-prob, ``rlhf.generation.decode.sample_token``, ``answer`` times on fixed logits); and
    the forward's device time by kernel kind (``rlhf.observe.profiling.KERNEL_KINDS``) with the costliest kernels, from the
    profiler over a few eager steps (a replayed graph hides its kernels from the profiler). The
    whole loop's time minus forward and sampler is what neither explains: host gaps, bookkeeping."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rlhf.generation.decode import _own_forward, _StaticSteps, sample_token
    from rlhf.generation.sampling import Sampling
    from rlhf.losses import token_logprobs
    from rlhf.observe.profiling import device_times

    own = _own_forward(model, ids.shape[1] + answer)
    if own is None:
        return {"skipped": f"{type(model).__name__} has no static decode step"}
    steps = _StaticSteps(own, ids, mask, answer)
    with torch.no_grad():
        logits = steps(None)
        tok = logits.argmax(-1)

        def feed():
            for _ in range(answer):
                steps(tok)

        def rewind():
            steps.at.fill_(steps.prompt)
            steps.fed = 0
            steps.valid[..., steps.prompt:] = False

        first = timed(feed, device)  # records each span's graph on the way
        rewind()
        forward = timed(feed, device)
        sampling = Sampling(max_new_tokens=answer, min_new_tokens=answer, do_sample=True,
                            temperature=DECODE_TEMPERATURE)
        eos = torch.tensor([eos_id], device=logits.device)

        def sample():
            for t in range(answer):
                drawn, scaled = sample_token(logits, t, sampling, eos, True)
                token_logprobs(scaled, drawn)

        sample()
        sampler = timed(sample, device)
        rewind()
        eager = 8
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(eager):
                steps.feed(tok)
                steps.token()
            if device == "cuda":
                torch.cuda.synchronize()
    kernels = device_times(prof, per=eager)
    return {"forward_ms_per_token": round(1e3 * forward / answer, 3),
            "graph_recording_ms_per_token": round(1e3 * (first - forward) / answer, 3),
            "sampler_ms_per_token": round(1e3 * sampler / answer, 3),
            "eager_forward_kernels": kernels["kernels"], "eager_forward_ms_by_kind": kernels["by_kind_ms"],
            "eager_forward_top": kernels["top_ms"]}


def forward_logprobs(model, ids, mask, tokens, temperature: float, eos_id: int, min_new: int):
    """Log-probabilities of ``tokens`` after ``ids`` from one forward of the whole sequence, under the
    distribution decode samples from (PPO's ``token_logprobs`` at the temperature), eos left out of
    the first ``min_new``."""
    import torch

    from rlhf.losses import token_logprobs

    full = torch.cat([ids, tokens], dim=1)
    with torch.no_grad():
        logits = model(full, attention_mask=torch.cat([mask, torch.ones_like(tokens)], dim=1)).logits
    logits = logits[:, ids.shape[1] - 1:-1].float()
    logits[:, :min_new, eos_id] = float("-inf")
    return token_logprobs(logits, tokens, temperature)


def param_count(path: str) -> int:
    """Parameters of the causal LM in ``path`` (tied embeddings counted once), built on the meta
    device: no memory, no weights read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def phase_report(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    import torch

    phases = {p: json.loads((out / f"{p}.json").read_text()) for p in PHASES if (out / f"{p}.json").exists()}
    failed = sorted(p.stem for p in out.glob("*.failed"))
    for name in failed:  # a PPO phase stopped at its limit still has the steps it logged
        if name in PPO_PHASES and (out / name / "metrics.jsonl").exists():
            s = ppo_settings(settings, name)
            try:
                phases[name] = ppo_figures(out / name, s["warmup"], s["measured"])
            except RuntimeError:
                continue
    peak = datasheet_peak()
    env = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "datasheet_bf16_tflops": peak, "commit": git_commit()}
    try:
        import deepspeed
        import transformers

        env.update(deepspeed=deepspeed.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    for sft in (phases[p] for p in ("sft", "sft_micro4x") if p in phases):
        if peak:
            sft["mfu_datasheet"] = round(sft["tflops"] / peak, 4)
        if phases.get("matmul", {}).get("tflops"):
            sft["fraction_of_measured_matmul"] = round(sft["tflops"] / phases["matmul"]["tflops"], 4)
    summary = {"setting": "tiny (CPU smoke test; figures mean nothing)" if tiny else "gpu", "env": env,
               **phases, "failed_phases": failed, "overrides": extra}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


def git_commit() -> str | None:
    """The working tree's commit, '+' where it has changes: the figures' provenance."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def markdown(summary: dict) -> str:
    env = summary["env"]
    lines = [f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), deepspeed {env.get('deepspeed')}, "
             f"transformers {env.get('transformers')}, commit {env.get('commit')}, {env['date']}", ""]
    if m := summary.get("matmul"):
        lines.append(f"- matmul {m['n']}^3 {m['dtype']}: {m['tflops']} TFLOP/s measured"
                     + (f" (datasheet {env['datasheet_bf16_tflops']})" if env["datasheet_bf16_tflops"] else ""))
    for s in (summary[p] for p in ("sft", "sft_micro4x") if p in summary):
        mfu = f", MFU {s['mfu_datasheet']:.1%} of datasheet" if "mfu_datasheet" in s else ""
        frac = f", {s['fraction_of_measured_matmul']:.1%} of measured matmul" if "fraction_of_measured_matmul" in s else ""
        lines.append(f"- SFT {s['model']} ({s['params_m']}M parameters), {s['micro_batch']} x {s['seq_len']} tokens, ZeRO-{s['zero_stage']}, "
                     f"{s['precision']}: {s['tokens_per_s']:.0f} tokens/s, {s['tflops']:.1f} TFLOP/s{mfu}{frac}; "
                     f"{s['latency_s']:.3f} s/step, peak {s['memory_gb']} GB (median of {s['measured_steps']} steps "
                     f"after {s['warmup_steps']} warm-up)")
        lines += profile_lines(s)
    for d in (summary[p] for p in ("decode", "decode_gqa") if p in summary):
        lines.append(
            f"- decode {d['model']} ({d['family']}, {d['params_m']}M, {d['heads']} heads / {d['kv_heads']} KV heads), "
            f"{d['rows']} rows of {d['prompt_tokens']} + {d['answer_tokens']} tokens, {d['precision']}: default loop "
            f"{d['default_ms_per_token']} ms/token ({d['default_over_floor']}x the bandwidth floor); static step as "
            f"graphs over spans of {d['static_span']} positions {d['static_graph_ms_per_token']} ms/token "
            f"({d['static_graph_over_floor']}x), over the whole cache {d['static_graph_whole_cache_ms_per_token']} "
            f"ms/token ({d['static_graph_whole_cache_over_floor']}x); floor {d['floor_ms_measured']} ms (weights "
            f"{d['weight_gb']} GB + KV cache {d['kv_gb_at_mean']} GB at the mean position over the measured "
            f"{d['measured_copy_gbs']} GB/s" + (f"; {d['floor_ms_datasheet']} ms at the datasheet's "
                                               f"{d['datasheet_gbs']:.0f} GB/s" if d.get("floor_ms_datasheet") else "")
            + f"; the spans read {d['kv_gb_static_reads']} GB of cache, {d['static_reads_ms_measured']} ms); same "
            f"tokens: {d['same_tokens']} (rows agree up to token {d['median_first_differing_token']:.0f}, median); "
            f"log-probs against one forward over the same tokens: default within "
            f"{d['default_logprob_vs_forward_max']:.1e} (mean {d['default_logprob_vs_forward_mean']:.1e}), static "
            f"within {d['static_graph_logprob_vs_forward_max']:.1e} (mean {d['static_graph_logprob_vs_forward_mean']:.1e})")
        if "forward_ms_per_token" in (b := d.get("breakdown", {})):
            kinds = ", ".join(f"{k} {v}" for k, v in b["eager_forward_ms_by_kind"].items())
            lines.append(f"  - where a static step goes, ms per token: forward {b['forward_ms_per_token']}, sampler "
                         f"and log-prob {b['sampler_ms_per_token']}, graph recording {b['graph_recording_ms_per_token']};"
                         f" the eager forward: {b['eager_forward_kernels']:.0f} kernels, device time by kind: {kinds}")
    for key, label in (("ppo", "PPO"), ("ppo_graph", "PPO, step.decode_graph=true"),
                       ("ppo_fast", "PPO, step.decode_graph=true step.old_logprobs=rollout"),
                       ("ppo_zero3", "PPO, ZeRO-3")):
        if p := summary.get(key):
            about = (f"actor {p['actor']} ({p['actor_params_m']}M), critic and reward {p['critic_and_reward']} "
                     f"({p['critic_params_m']}M), {p['rollouts']} rollouts of {p['prompt_tokens']} + "
                     f"{p['answer_tokens']:.0f} tokens, micro batch {p['micro_batch']}, ZeRO-{p['zero_stage']}, "
                     f"{p['precision']}, old log-probs {p['old_logprobs']}: " if "actor" in p else
                     "stopped at its time limit, from the steps it logged: ")
            lines.append(f"- {label}: {about}step {p['step_s']:.2f} s = generate "
                         f"{p['generate_s']:.2f} + scoring {p['scoring_s']:.2f} + train {p['train_s']:.2f} + other "
                         f"{p['other_s']:.2f}; {p['generated_tokens_per_s']:.0f} generated tokens/s, "
                         f"{p['samples_per_s']:.2f} samples/s, {p['tflops']:.1f} TFLOP/s, peak {p['memory_gb']} GB; "
                         f"rollout/logprob_diff {p['logprob_diff']:.1e} (median of {p['measured_steps']} steps after "
                         f"{p['warmup_steps']} warm-up{', partial' if p['partial'] else ''})")
            lines += profile_lines(p)
    if summary["failed_phases"]:
        lines.append(f"- failed: {', '.join(summary['failed_phases'])} (see the log)")
    return "\n".join(lines) + "\n"


def profile_lines(phase: dict) -> list[str]:
    """The phase's profiled step (``step_profile``) as one sub-line, or none."""
    if not (prof := phase.get("profile")):
        return []
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in prof["by_kind_ms"].items())
    return [f"  - profiled step {prof['step']} (a warm-up step, slowed by the profiler): {prof['wall_ms']:.0f} ms, "
            f"the device busy {prof['busy_ms']:.0f} ms in {prof['kernels']:.0f} kernels ({kinds}), idle "
            f"{prof['idle_ms']:.0f} ms"]


def phase_sft_micro4x(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """The SFT phase at 4x its micro batch (64 x 512 tokens on the GPU): the MFU that memory left
    unused at 16 rows buys (16 rows peaked at 31 GB of the H200's 141)."""
    return phase_sft(settings, out, tiny, extra, "sft_micro4x", 4)


def phase_ppo_graph(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """The PPO phase with its rollouts through the static decode step recorded as a CUDA graph."""
    return phase_ppo(settings, out, tiny, ["step.decode_graph=true", *extra], "ppo_graph")


def phase_ppo_fast(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """``ppo_graph`` with PPO's old log-probs taken from the sampler (step.old_logprobs=rollout), not
    from a scoring forward of the actor: one 1.3B forward over every rollout less per step, at the
    price ``logprob_diff`` shows (bf16's auto setting recomputes them: the decode step and a full
    forward round differently)."""
    return phase_ppo(settings, out, tiny, ["step.decode_graph=true", "step.old_logprobs=rollout", *extra], "ppo_fast")


def phase_ppo_zero3(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """The PPO phase under ZeRO-3 (every engine partitioned; on one GPU the actor generates gathered
    whole: tensor-parallel slices need a group of ranks), one warm-up and two measured steps; its
    figures from whatever steps were logged if it meets its time limit (``report``)."""
    return phase_ppo(settings, out, tiny, [*extra, "zero=3"], "ppo_zero3")


def phase_decode_gqa(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """The decode phase on a grouped-query model of Llama 3.2 1B's shape, against its own floor."""
    return phase_decode(settings, out, tiny, extra, "gqa")


PHASES = {"matmul": phase_matmul, "sft": phase_sft, "sft_micro4x": phase_sft_micro4x, "decode": phase_decode,
          "decode_gqa": phase_decode_gqa, "ppo": phase_ppo, "ppo_graph": phase_ppo_graph, "ppo_fast": phase_ppo_fast,
          "ppo_zero3": phase_ppo_zero3, "report": phase_report}
# The PPO phases: a report reads the steps logged by one that met its time limit.
PPO_PHASES = ("ppo", "ppo_graph", "ppo_fast", "ppo_zero3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=sorted(PHASES))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-gpu")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU: a smoke test of this script")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for the SFT and PPO runs")
    args = ap.parse_intermixed_args()  # overrides may follow --out (bench/gpu.sh passes them last)
    # No hub: the models are built locally and the data is written here.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = PHASES[args.phase](SETTINGS["tiny" if args.tiny else "gpu"], out, args.tiny, args.overrides)
    if args.phase != "report":
        (out / f"{args.phase}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps({"phase": args.phase, **result}), flush=True)


if __name__ == "__main__":
    main()
