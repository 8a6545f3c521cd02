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
        "matmul": {"n": 8192, "dtype": "bf16"},
        # 5 warm-up steps (cuBLAS handles, allocator growth) then 4 logged windows of 5.
        "sft": {"seq": 512, "micro": 16, "log_every": 5, "warmup_windows": 1, "windows": 4},
        "ppo": {"prompt": 256, "answer": 256, "rollouts": 64, "micro": 16, "warmup": 2, "measured": 4},
        # The PPO phase's rollout alone: 64 rows of 256 + 256 tokens, each way timed twice after a warm-up.
        "decode": {"prompt": 256, "answer": 256, "rows": 64, "repeats": 2, "copy_mb": 4096},
    },
    # Toy sizes for a CPU smoke test of the script itself; its figures mean nothing.
    "tiny": {
        "actor": {"name": "bench-tiny-actor", "num_layers": 2, "hidden_size": 128, "num_heads": 4,
                  "ffn_size": 512, "vocab_size": 512, "max_positions": 256},
        "critic": {"name": "bench-tiny-critic", "num_layers": 2, "hidden_size": 64, "num_heads": 4,
                   "ffn_size": 256, "vocab_size": 512, "max_positions": 256},
        "matmul": {"n": 256, "dtype": "fp32"},
        "sft": {"seq": 64, "micro": 4, "log_every": 2, "warmup_windows": 1, "windows": 2},
        "ppo": {"prompt": 16, "answer": 16, "rollouts": 4, "micro": 2, "warmup": 1, "measured": 2},
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
    # tiny-opt is the random-init OPT file; the numbers below replace its toy shape.
    return ["model=tiny-opt", *(f"model.{k}={v}" for k, v in spec.items())]


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
                 *extra]
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
    return result


def phase_ppo(settings: dict, out: Path, tiny: bool, extra: list[str], name: str = "ppo") -> dict:
    from rlhf import models
    from rlhf.config import compose_config
    from rlhf.launch import run

    s = settings["ppo"]
    actor, actor_build_s = build_model(settings["actor"])
    critic, critic_build_s = build_model(settings["critic"])
    tokenizer = models.load_tokenizer(actor)
    steps = s["warmup"] + s["measured"]
    rng = random.Random(1)
    rows = [{"prompt": exact_text(tokenizer, s["prompt"], rng, True), "chosen": " a", "rejected": " b"}
            for _ in range(s["rollouts"] * (steps + 1))]
    write_rows(out / "data-ppo", rows, s["rollouts"])
    overrides = [*model_overrides(settings["actor"]), "step=ppo", *common_overrides(out, name, tiny, out / "data-ppo",
                                                                                   "0,0,1"),
                 f"actor.path={actor}", f"critic.path={critic}", f"reward.path={critic}",
                 f"step.rollout_batch_size_per_device={s['rollouts']}", f"step.micro_batch_size_per_device={s['micro']}",
                 f"step.max_prompt_len={s['prompt']}", f"step.max_new_tokens={s['answer']}",
                 f"step.min_new_tokens={s['answer']}", f"step.max_steps={steps}", "step.eval_prompts=0",
                 "step.eval_every_steps=0", "step.log_every_steps=1", *extra]
    cfg = compose_config(overrides)
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    logged = [json.loads(line) for line in open(out / name / "metrics.jsonl") if "step_s" in line]
    measured = logged[s["warmup"]:]
    med = {k: median_of(measured, k) for k in ("generate_s", "experience_s", "train_s", "other_s", "step_s",
                                                 "samples_per_s", "tflops")}
    result = {"actor": settings["actor"]["name"], "critic_and_reward": settings["critic"]["name"],
              "rollouts": s["rollouts"], "micro_batch": s["micro"], "prompt_tokens": s["prompt"],
              "answer_tokens": median_of(measured, "answer_len"), "zero_stage": cfg.zero.stage,
              "precision": cfg.hardware.precision, "warmup_steps": s["warmup"], "measured_steps": len(measured),
              "model_build_s": round(actor_build_s + critic_build_s, 1), "run_wall_s": round(wall, 1),
              **{k: round(v, 4) for k, v in med.items()},
              # experience_s includes generation; the four scoring forwards are the rest of it.
              "scoring_s": round(med["experience_s"] - med["generate_s"], 4),
              "generated_tokens_per_s": round(s["rollouts"] * median_of(measured, "answer_len") / med["generate_s"], 1),
              "step_s_each": [round(r["step_s"], 3) for r in measured],
              "memory_gb": round(max(r["memory_gb"] for r in measured), 2),
              "actor_params_m": round(param_count(actor) / 1e6, 1),
              "critic_params_m": round(param_count(critic) / 1e6, 1)}
    return result


def phase_decode(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """The rollout's decode loop alone on the PPO phase's actor and shapes (eos suppressed, every row
    decodes ``answer`` tokens), the default loop against the static step (``rlhf.decode``'s
    ``static``: recorded once as a CUDA graph, replayed per token), in ms per decoding step, beside
    the floor the memory bus sets: a decoding step must read every weight and the KV cache up to its
    position once, so at the mean position (prompt + answer / 2) the floor is those bytes over the
    bandwidth, both the measured one (a large device-to-device copy: read + written bytes / time)
    and the datasheet's."""
    import torch

    from rlhf import models
    from rlhf.decode import decode

    s, spec = settings["decode"], settings["actor"]
    path, _ = build_model(spec)
    tokenizer = models.load_tokenizer(path)
    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    model = models.load_causal_lm(path, tokenizer, dtype).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tokenizer), (s["rows"], s["prompt"]), generator=gen).to(device)
    mask = torch.ones_like(ids)

    def timed(fn) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def run(static: bool):
        return decode(model, ids, mask, s["answer"], tokenizer.eos_token_id, tokenizer.pad_token_id, do_sample=True,
                      temperature=DECODE_TEMPERATURE, min_new_tokens=s["answer"], with_logprobs=True, static=static)

    result = {"model": spec["name"], "rows": s["rows"], "prompt_tokens": s["prompt"], "answer_tokens": s["answer"],
              "precision": "fp32" if tiny else "bf16"}
    for name, static in (("default", False), ("static_graph", True)):
        run(static)  # warm-up: kernels chosen, allocator grown (and, static, one recording)
        seconds = min(timed(lambda static=static: run(static)) for _ in range(s["repeats"]))
        result[f"{name}_ms_per_token"] = round(1e3 * seconds / s["answer"], 3)
        result[f"{name}_tokens_per_s"] = round(s["rows"] * s["answer"] / seconds, 1)
    torch.manual_seed(0)
    a = run(False)
    torch.manual_seed(0)
    b = run(True)
    # Same seed, same tokens in exact arithmetic; in bf16 the two loops round differently (the static
    # step attends over the whole fixed-length cache), and one flipped draw changes the rest of its
    # row. So the check that matters is the one PPO relies on: each loop's log-probs against one plain
    # forward of the model over its own tokens (PPO's ratio divides by them).
    result["same_tokens"] = bool(torch.equal(a[0], b[0]))
    differs = (a[0] != b[0]).float()
    first = torch.where(differs.any(1), differs.argmax(1), torch.full_like(differs[:, 0], a[0].shape[1]))
    result["median_first_differing_token"] = float(first.float().median())
    for name, (tokens, logprobs) in (("default", a), ("static_graph", b)):
        gap = (logprobs - forward_logprobs(model, ids, mask, tokens, DECODE_TEMPERATURE, tokenizer.eos_token_id,
                                               s["answer"])).abs()
        result[f"{name}_logprob_vs_forward_max"] = float(gap.max())
        result[f"{name}_logprob_vs_forward_mean"] = float(gap.mean())

    # Bytes one decoding step reads: the weights, and keys + values of every layer up to the mean position.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes_per_token = 2 * spec["num_layers"] * spec["hidden_size"] * torch.finfo(dtype).bits // 8
    mean_position = s["prompt"] + s["answer"] / 2
    step_bytes = weight_bytes + s["rows"] * mean_position * kv_bytes_per_token
    src = torch.empty(s["copy_mb"] * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = min(timed(lambda: dst.copy_(src)) for _ in range(5))
    measured_gbs = 2 * src.numel() / copy_s / 1e9
    sheet = datasheet_peak(DATASHEET_GBS)
    result.update(weight_gb=round(weight_bytes / 1e9, 3), kv_gb_at_mean=round((step_bytes - weight_bytes) / 1e9, 3),
                  measured_copy_gbs=round(measured_gbs, 1), datasheet_gbs=sheet,
                  floor_ms_measured=round(1e3 * step_bytes / (measured_gbs * 1e9), 3))
    if sheet:
        result["floor_ms_datasheet"] = round(1e3 * step_bytes / (sheet * 1e9), 3)
    for name in ("default", "static_graph"):
        result[f"{name}_over_floor"] = round(result[f"{name}_ms_per_token"] / result["floor_ms_measured"], 2)
    return result


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

    phases = {p: json.loads((out / f"{p}.json").read_text()) for p in ("matmul", "sft", "sft_micro4x", "decode", "ppo", "ppo_graph")
              if (out / f"{p}.json").exists()}
    failed = sorted(p.stem for p in out.glob("*.failed"))
    peak = datasheet_peak()
    env = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "datasheet_bf16_tflops": peak}
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


def markdown(summary: dict) -> str:
    env = summary["env"]
    lines = [f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), deepspeed {env.get('deepspeed')}, "
             f"transformers {env.get('transformers')}, {env['date']}", ""]
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
    if d := summary.get("decode"):
        lines.append(f"- decode {d['model']}, {d['rows']} rows of {d['prompt_tokens']} + {d['answer_tokens']} tokens, "
                     f"{d['precision']}: default loop {d['default_ms_per_token']} ms/token "
                     f"({d['default_over_floor']}x the bandwidth floor), static step recorded as a graph "
                     f"{d['static_graph_ms_per_token']} ms/token ({d['static_graph_over_floor']}x); floor "
                     f"{d['floor_ms_measured']} ms (weights {d['weight_gb']} GB + KV cache {d['kv_gb_at_mean']} GB at "
                     f"the mean position over the measured {d['measured_copy_gbs']} GB/s"
                     + (f"; {d['floor_ms_datasheet']} ms at the datasheet's {d['datasheet_gbs']:.0f} GB/s" if d.get(
                         "floor_ms_datasheet") else "") + f"); same tokens: {d['same_tokens']} (rows agree up to "
                     f"token {d['median_first_differing_token']:.0f}, median); log-probs against one forward over "
                     f"the same tokens: default within {d['default_logprob_vs_forward_max']:.1e} (mean "
                     f"{d['default_logprob_vs_forward_mean']:.1e}), static within "
                     f"{d['static_graph_logprob_vs_forward_max']:.1e} (mean {d['static_graph_logprob_vs_forward_mean']:.1e})")
    for key, label in (("ppo", "PPO"), ("ppo_graph", "PPO, step.decode_graph=true")):
        if p := summary.get(key):
            lines.append(f"- {label}: actor {p['actor']} ({p['actor_params_m']}M), critic and reward {p['critic_and_reward']} "
                         f"({p['critic_params_m']}M), {p['rollouts']} rollouts "
                         f"of {p['prompt_tokens']} + {p['answer_tokens']:.0f} tokens, micro batch {p['micro_batch']}, "
                         f"ZeRO-{p['zero_stage']}, {p['precision']}: step {p['step_s']:.2f} s = generate "
                         f"{p['generate_s']:.2f} + scoring {p['scoring_s']:.2f} + train {p['train_s']:.2f} + other "
                         f"{p['other_s']:.2f}; {p['generated_tokens_per_s']:.0f} generated tokens/s, "
                         f"{p['samples_per_s']:.2f} samples/s, {p['tflops']:.1f} TFLOP/s, peak {p['memory_gb']} GB "
                         f"(median of {p['measured_steps']} steps after {p['warmup_steps']} warm-up)")
    if summary["failed_phases"]:
        lines.append(f"- failed: {', '.join(summary['failed_phases'])} (see the log)")
    return "\n".join(lines) + "\n"


def phase_sft_micro4x(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """The SFT phase at 4x its micro batch (64 x 512 tokens on the GPU): the MFU that memory left
    unused at 16 rows buys (16 rows peaked at 31 GB of the H200's 141)."""
    return phase_sft(settings, out, tiny, extra, "sft_micro4x", 4)


def phase_ppo_graph(settings: dict, out: Path, tiny: bool, extra: list[str]) -> dict:
    """The PPO phase with its rollouts through the static decode step recorded as a CUDA graph."""
    return phase_ppo(settings, out, tiny, ["step.decode_graph=true", *extra], "ppo_graph")


PHASES = {"matmul": phase_matmul, "sft": phase_sft, "sft_micro4x": phase_sft_micro4x, "decode": phase_decode,
          "ppo": phase_ppo,
          "ppo_graph": phase_ppo_graph, "report": phase_report}


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
