"""How long a step takes and what it costs, before it runs: a model a reader can check.

Work: FLOPs from the model's sizes (rlhf.models.model_sizes: its config.json, parameter counts from a
meta-device build): a forward pass costs 2 FLOPs per matrix parameter and token plus 2 * layers *
context * attention width (query heads x head size) for attention (Kaplan et al. 2020);
training 3 forward passes (forward, and backward for activations and for weights), 4 with gradient
checkpointing (the forward again), and LoRA drops the frozen weights' gradients (2 of the 3).
Decoding one token of a batch reads the weights and the KV cache once: the slower of that read at
the device's memory bandwidth and its FLOPs, plus a fixed cost per layer (kernel launches of an
eager decode loop). ZeRO's collectives move the 16-bit parameters or gradients over the slowest
link they cross: within a node (NVLink, PCIe) or the node's network share per device. ZeRO
offload adds the host link's transfers and CPU-Adam's pass over the optimizer states (offload_s).

Rates: per accelerator kind the hardware preset carries the datasheet peak, memory and link
bandwidths and a price per device-hour (conf/hardware/*.yaml, with sources); four efficiency
constants below, shared by every preset, turn peaks into achieved rates. On CPU the matrix-product
rate is measured at start-up (a short probe at the model's width).

Amount: rows of the step's part of the data (counted where the data is local, else
launch.forecast_rows), epochs, batch sizes and lengths; a step stopped early by a readiness rule
takes less (the forecast is its cap).

    python launch.py experiment=opt-13b_8xa100-40g launch.dry_run=true   # a forecast per step
    python bench/forecast.py                                               # against DeepSpeed-Chat's tables
"""

from __future__ import annotations

import copy

from rlhf.config import STEPS, Config, ppo_updates_per_step, role_models, step_roles
from rlhf.preflight.forecast.rates import (
    BANDWIDTH_EFFICIENCY,
    COMM_EFFICIENCY,
    CPU_ADAM_BYTES,
    DECODE_LAYER_OVERHEAD_S,
    MATMUL_EFFICIENCY,
    PROBE_ROWS,
    TRAIN_PROBE_MAX_PARAMS,
    TRAIN_PROBE_SHAPE,
    Rates,
    StepForecast,
    _note,
    alltoall_s,
    collective_s,
    forward_flops,
    generation_s,
    hardware_rates,
    matmul_params,
    offload_s,
    overheads_s,
    probe_cpu,
    probe_cpu_training,
    static_attended,
    train_flops,
    zero_comm_s,
)
from rlhf.preflight.forecast.work import (
    _READ,
    _critic_model,
    data_tokenizer,
    long_prompts,
    padded_lengths,
    rule_scores_data,
    step_data,
    step_rows,
)
from rlhf.preflight.memory import bytes_per_param, generation_gathering, param_counts
from rlhf.preflight.probes import extensions_root


def forecast(cfg: Config, rows: int = 0, part_rows: int = 0, rates: Rates | None = None,
             lengths: tuple[float, float] | None = None) -> StepForecast:
    """The step's forecast on its preset: ``rows`` is the blend's train rows where they are not
    counted, ``part_rows`` the step's own rows (a benchmark's prompts) outright, ``lengths`` a
    benchmark's row lengths in tokens (prompt + answer, prompt) in place of the data's."""
    # The policy is sized as the step loads it (actor.path's checkpoint for PPO and the preference methods).
    sized = copy.copy(cfg)
    sized.model = role_models(cfg)[0]
    try:
        found = _forecast(sized, rows, part_rows, rates, lengths)
    finally:
        _READ.clear()  # the data is read once per forecast, and not held through the run
    if seconds := startup_s(cfg, found.notes):
        found.phases["start-up"] = seconds
    return found


# A launch through the DeepSpeed launcher (several ranks): the launcher and each rank start Python,
# import torch, DeepSpeed and transformers, and meet at the rendezvous (about 20 s on 2 CPU cores).
LAUNCH_S = 20.0
# DeepSpeed compiles an op on the first run of a machine that needs it (the CPU backend's shared-memory
# all-reduce, CPU-Adam): 30-70 s each on 2 cores, with a C++ toolchain.
OP_BUILD_S = 60.0


def startup_s(cfg: Config, notes: list[str]) -> float:
    """What a run spends before its first step beyond loading its models: the launch of its ranks, and
    the DeepSpeed ops it compiles where this machine (a CPU preset: the one the plan runs on) has not
    built them yet. Not per step: a run stopped early still paid it."""
    hw, world = cfg.hardware, cfg.world_size
    ops = [op for op, needed in (("deepspeed_shm_comm", hw.accelerator == "cpu" and world > 1),
                                 ("cpu_adam", cfg.zero.offload_optimizer.device == "cpu")) if needed]
    seconds = LAUNCH_S if world > 1 else 0.0
    if hw.accelerator != "cpu":
        if ops:
            _note(notes, f"start-up: DeepSpeed compiles {', '.join(ops)} on a machine's first run that needs it "
                         f"(about {OP_BUILD_S:.0f} s each): not counted, the target machine's build cache is unknown here")
        return seconds
    root = extensions_root()
    missing = [op for op in ops if not any(root.glob(f"**/{op}.so"))]
    if missing:
        _note(notes, f"start-up: DeepSpeed compiles {', '.join(missing)} on this machine's first run that needs it "
                     f"(about {OP_BUILD_S:.0f} s each; kept in {root})")
    return seconds + OP_BUILD_S * len(missing)


# A step that trains until ready (an accuracy bar, a plateau's patience) runs at most its forecast.
READINESS_NOTE = "a readiness rule may stop it sooner: this is its cap"


def _forecast(cfg: Config, rows: int, part_rows: int, rates: Rates | None,
              lengths: tuple[float, float] | None) -> StepForecast:
    rates = rates or hardware_rates(cfg)
    step, world, hw = cfg.step, cfg.world_size, cfg.hardware
    part_rows, how = (part_rows, "given: the step's rows") if part_rows else step_rows(cfg, rows)
    notes = [how] + ([rates.measured] if rates.measured else [])
    # Only adapters trained: the frozen weights need no weight gradients.
    lora = cfg.lora.rank > 0 and cfg.lora.only_optimize_lora
    spec = STEPS[step.name]
    if spec.generates:
        return _ppo(cfg, part_rows, rates, notes, lengths)
    pairs = spec.seqs_per_row == 2
    if part_rows and spec.rows_per_source_row > 1:
        part_rows *= spec.rows_per_source_row
        notes.append(f"{spec.rows_per_source_row} {spec.rows} rows from each row of the data")
    # Pairs from the policy's own answers (rlhf.runners.reward.policy_pairs): sampled before training,
    # then trained on beside the data's; counted as if every draw were a distinct wrong answer, so
    # the forecast is a cap (duplicates and right answers make no pair).
    prompts, answers = step.policy_pairs()
    drawn = min(prompts, part_rows) * answers
    if drawn and not rule_scores_data(cfg):
        drawn = 0
    if drawn:
        part_rows += drawn
        notes.append(f"up to {drawn:,} pairs from the policy's own answers (step.policy_pairs_prompts)")
    seqs = step.micro_batch_size_per_device * step.gradient_accumulation_steps * (2 if pairs else 1)
    source = "the benchmark's rows" if lengths else "the mean padded micro batch of the data"
    lengths = lengths or padded_lengths(cfg, step.micro_batch_size_per_device, pairs)
    seq = min(step.max_seq_len, lengths[0]) if lengths else step.max_seq_len
    per_epoch = part_rows // step.global_batch_size if part_rows else 1
    steps = per_epoch * step.epochs
    if step.max_steps > 0:
        steps = min(steps, step.max_steps) if part_rows else step.max_steps
    trained = next(r for r in step_roles(cfg) if r.trainable)
    total, _, lora_params = param_counts(cfg.model, cfg.lora.rank, cfg.lora.target_modules)
    trainable = lora_params if lora and cfg.lora.only_optimize_lora else total + lora_params
    # With parallel.sequence=N a rank runs 1/N of every sequence's tokens, each attending over the whole.
    sp = cfg.parallel.sequence
    compute = train_flops(cfg.model, seqs * seq / sp, seq, trained.lm_head, step.gradient_checkpointing, lora)
    if spec.has_role("reference"):  # the reference's forward over the same pairs
        compute += forward_flops(cfg.model, seqs * seq / sp, seq / 2, True)
    exchanges = alltoall_s(cfg, seqs, seq / sp, rates)
    comm = zero_comm_s(cfg.zero.stage, total + lora_params, trainable, step.gradient_accumulation_steps, world,
                       hw.precision, rates) + exchanges
    if sp > 1:
        notes.append(f"parallel.sequence={sp}: {seq / sp:.0f} tokens of each sequence per rank; the all-to-alls "
                     f"around attention take {exchanges:.3g} s per optimizer step")
    dispatch = step.gradient_accumulation_steps * overheads_s(cfg.model, rates)[0]
    phases = {"compute": steps * (compute / rates.flops + dispatch), "communication": steps * comm,
              "evaluation": _supervised_evaluation_s(cfg, steps, rates)}
    if drawn:
        # Up to the longest answer and two tokens more (the padded pair's longer answer stands for it).
        prompt, answer = (lengths[1], lengths[0] - lengths[1] + 2) if lengths else (step.max_seq_len / 2,) * 2
        phases["policy samples"] = generation_s(cfg.model, -(-drawn // world), step.eval_micro_batch_size_per_device,
                                                prompt, answer, hw.precision, rates)
    if offload := offload_s(cfg, total + lora_params, trainable, step.gradient_accumulation_steps, rates, notes):
        phases["offload"] = steps * offload
    work = (f"{part_rows:,} {STEPS[step.name].rows} x {step.epochs} epoch(s) = {steps:,} optimizer steps of "
            f"{step.global_batch_size} x {seq:.0f} tokens" if part_rows else f"{steps:,} optimizer steps (step.max_steps)")
    if lengths:
        notes.append(f"{seq:.0f} tokens: {source} (step.max_seq_len={step.max_seq_len})")
    if not part_rows and step.max_steps <= 0:
        notes.append("no row count: the figures are per optimizer step")
    if step.stops_when_ready():
        notes.append(READINESS_NOTE)
    return StepForecast(step.name, work, steps, phases, world, hw.price_per_device_hour, notes)


def _supervised_evaluation_s(cfg: Config, steps: int, rates: Rates) -> float:
    """Evaluations before training, every eval_every_steps and at each epoch's end: a forward over the
    held-out rows (max_eval_samples; both answers of a pair, and the reference's for DPO), plus greedy
    answers where the step checks accuracy by a rule (the select half at each, the reported half at
    the start and the end)."""
    step, world = cfg.step, cfg.world_size
    evals = 1 + step.epochs + (steps // step.eval_every_steps if step.eval_every_steps else 0)
    rows = -(-(cfg.data.max_eval_samples if cfg.data.max_eval_samples > 0 else 1000) // world)
    spec = STEPS[step.name]
    seqs = rows * spec.seqs_per_row
    forward = forward_flops(cfg.model, seqs * step.max_seq_len, step.max_seq_len / 2, spec.policy.lm_head) / rates.flops
    if spec.has_role("reference"):
        forward *= 2
    greedy = 0.0
    if step.greedy_eval_prompts():
        per_rank = -(-step.greedy_eval_prompts() // world)
        greedy = generation_s(cfg.model, per_rank, step.eval_micro_batch_size_per_device, step.max_seq_len // 2,
                              step.max_new_tokens, cfg.hardware.precision, rates)
    return evals * forward + (evals + 2) * greedy


def _ppo(cfg: Config, part_rows: int, rates: Rates, notes: list[str],
         lengths: tuple[float, float] | None = None) -> StepForecast:
    """PPO step by step: generation (prefill, then each decoding step), the scoring forwards of the
    frozen roles (and the actor's with old_logprobs=recompute), and the updates with their ZeRO
    communication. Rollouts are max_prompt_len + max_new_tokens long (DeepSpeed-Chat's benchmark
    pads prompts and generates fixed-length answers)."""
    step, world, hw = cfg.step, cfg.world_size, cfg.hardware
    batch, prompt, answer = step.rollout_batch_size_per_device, step.max_prompt_len, step.max_new_tokens
    source = "the benchmark's prompts" if lengths else "the mean padded rollout batch of the data"
    # The data's own prompts, where no benchmark's lengths stand for them.
    long = None if lengths else long_prompts(cfg)
    if lengths := lengths or padded_lengths(cfg, batch, False):  # prompts left-padded to the batch's longest
        prompt = min(prompt, round(lengths[1]))
        notes.append(f"{prompt} prompt tokens: {source} "
                     f"(step.max_prompt_len={step.max_prompt_len})")
    if long and long[0]:
        # The run drops them at its start (or cuts them); said here so that nothing is dropped unforeseen.
        n, read, longest = long
        fate = "drops them" if cfg.data.long_prompts == "drop" else "keeps their last tokens (data.long_prompts)"
        notes.append(f"{n} of {read} train prompts read ({n / read:.0%}) are longer than step.max_prompt_len="
                     f"{step.max_prompt_len} tokens: the run {fate}; step.max_prompt_len={-(-longest // 8) * 8} (in a chain "
                     f"pipeline.{step.name}.step.max_prompt_len) keeps every one read whole")
        if cfg.data.long_prompts == "drop":
            part_rows = round(part_rows * (1 - n / read))
    per_step = batch * world
    rollouts = part_rows * step.samples_per_prompt * step.epochs
    steps = rollouts // per_step if part_rows else 1
    if step.max_steps > 0:
        steps = min(steps, step.max_steps) if part_rows else step.max_steps
    generate, chunk, shards = _ppo_generation_s(cfg, prompt, rates, notes)
    scoring = _ppo_scoring_s(cfg, prompt + answer, -(-batch // chunk), rates)
    train, comm, offload = _ppo_updates_s(cfg, prompt + answer, rates, notes)
    phases = {"generation": steps * generate, "scoring": steps * scoring, "updates": steps * train,
              "communication": steps * comm,
              "evaluation": _ppo_evaluation_s(cfg, steps, prompt, chunk, shards, rates)}
    if offload:
        phases["offload"] = steps * offload
    work = (f"{part_rows:,} prompts x {step.samples_per_prompt} sample(s) x {step.epochs} epoch(s) = {steps:,} PPO "
            f"steps of {per_step} rollouts x ({prompt} + {answer}) tokens" if part_rows
            else f"{steps:,} PPO steps (step.max_steps)")
    if not part_rows and step.max_steps <= 0:
        notes.append("no row count: the figures are per PPO step")
    if step.stops_when_ready():
        notes.append(READINESS_NOTE)
    return StepForecast(step.name, work, steps, phases, world, hw.price_per_device_hour, notes)


def _ppo_generation_s(cfg: Config, prompt: int, rates: Rates, notes: list[str]) -> tuple[float, int, int]:
    """One PPO step's generation on a device, with the generate chunk and the tensor-parallel slices
    it runs in. Prefill is one forward over the prompts; each decoding step reads the whole actor
    (gathered once per call under ZeRO-3, or layer by layer for every token) and the KV cache at
    its mean length."""
    step, world, hw = cfg.step, cfg.world_size, cfg.hardware
    batch, answer = step.rollout_batch_size_per_device, step.max_new_tokens
    chunk = step.generation_batch_size_per_device or batch
    calls = -(-batch // chunk)
    gather, gathering = 0.0, 1
    if cfg.zero.stage == 3:
        gathering = generation_gathering(cfg, _critic_model(cfg))
        a_total = param_counts(cfg.model, cfg.lora.rank, cfg.lora.target_modules)[0]
        gather = calls * (1 if gathering else answer) * collective_s(a_total * bytes_per_param(hw.precision), world,
                                                                     rates)
        notes.append("ZeRO-3 generation: " + {0: "the actor gathered layer by layer for every token",
                                              1: "the actor gathered once per call"}.get(
            gathering, f"the actor gathered once per call into tensor-parallel slices over {gathering} ranks"))
    shards = max(gathering, 1)
    # The static step replays as a CUDA graph only where the actor is whole on the device (not under
    # ZeRO-3's layerwise gathering, rlhf.generation.forwards._own_forward, nor in tensor-parallel slices, which
    # decode eagerly) and on a GPU.
    static = step.decode_graph and gathering == 1
    graph = static and hw.accelerator != "cpu"
    generate = generation_s(cfg.model, batch, chunk, prompt, answer, hw.precision, rates, static, graph, shards) + gather
    if graph:
        notes.append("generation replayed as a CUDA graph (step.decode_graph): no per-layer dispatch cost")
    return generate, chunk, shards


def _ppo_scoring_s(cfg: Config, seq: int, calls: int, rates: Rates) -> float:
    """One PPO step's scoring forwards over whole rollouts: reference (the actor's size), critic and
    reward model (the critic's), and the actor itself where old log-probs are recomputed. One
    forward per generate chunk (``calls``) and role; beyond its FLOPs each dispatches its ops (CPU)."""
    step, world, actor = cfg.step, cfg.world_size, cfg.model
    batch, width = step.rollout_batch_size_per_device, bytes_per_param(cfg.hardware.precision)
    roles = {r.name for r in step_roles(cfg)}
    critic = _critic_model(cfg)
    scoring = 0.0
    role_models = {"reference": actor, "critic": critic, "reward": critic}
    for name in ("reference", "critic", "reward"):
        if name in roles:
            scoring += forward_flops(role_models[name], batch * seq, seq / 2, name == "reference") / rates.flops
            scoring += calls * overheads_s(role_models[name], rates)[1]
            if cfg.zero.stage == 3:
                scoring += collective_s(param_counts(role_models[name])[0] * width, world, rates)
    if step.old_logprobs == "recompute":
        scoring += forward_flops(actor, batch * seq, seq / 2, True) / rates.flops + calls * overheads_s(actor, rates)[1]
    return scoring


def _ppo_updates_s(cfg: Config, seq: int, rates: Rates, notes: list[str]) -> tuple[float, float, float]:
    """One PPO step's updates, (training, ZeRO communication, offload) in seconds: every PPO epoch
    trains the actor (and critic) on the step's rollouts."""
    step, world, hw = cfg.step, cfg.world_size, cfg.hardware
    actor, critic, batch = cfg.model, _critic_model(cfg), step.rollout_batch_size_per_device
    has_critic = STEPS[step.name].has_role("critic") and step.builds("critic")
    a_total, _, a_lora = param_counts(actor, cfg.lora.rank, cfg.lora.target_modules)
    c_total, _, _ = param_counts(critic)
    updates = ppo_updates_per_step(cfg)
    lora = cfg.lora.rank > 0 and cfg.lora.only_optimize_lora
    a_trainable = a_lora if lora and cfg.lora.only_optimize_lora else a_total + a_lora
    train = step.ppo_epochs * train_flops(actor, batch * seq, seq, True, step.gradient_checkpointing, lora)
    comm = updates * zero_comm_s(cfg.zero.stage, a_total + a_lora, a_trainable, step.gradient_accumulation_steps,
                                 world, hw.precision, rates)
    offload = updates * offload_s(cfg, a_total + a_lora, a_trainable, step.gradient_accumulation_steps, rates, notes)
    if has_critic:
        train += step.ppo_epochs * train_flops(critic, batch * seq, seq, False, step.gradient_checkpointing, False)
        comm += updates * zero_comm_s(cfg.zero.stage, c_total, c_total, step.gradient_accumulation_steps, world,
                                      hw.precision, rates)
        offload += updates * offload_s(cfg, c_total, c_total, step.gradient_accumulation_steps, rates, notes)
    micro = step.ppo_epochs * -(-batch // step.micro_batch_size_per_device)
    dispatch = micro * (overheads_s(actor, rates)[0] + (overheads_s(critic, rates)[0] if has_critic else 0.0))
    return train / rates.flops + dispatch, comm, offload


def _ppo_evaluation_s(cfg: Config, steps: int, prompt: int, chunk: int, shards: int, rates: Rates) -> float:
    """Greedy answers to the select half at every evaluation (step 0, every eval_every_steps, the
    end) and to the reported half at the start and the end (and at each new best, not counted), each
    scored by the reward model where there is one; and the start check (rlhf.runners.ppo_judge.policy_check):
    sampled answers to the select half, scored by the reward model."""
    step, world, precision = cfg.step, cfg.world_size, cfg.hardware.precision
    actor, critic, answer = cfg.model, _critic_model(cfg), step.max_new_tokens
    seq = prompt + answer
    has_reward = STEPS[step.name].has_role("reward") and step.builds("reward")
    evals = 2 + (steps // step.eval_every_steps if step.eval_every_steps else 0)
    per_rank = -(-step.eval_prompts // world)
    greedy = generation_s(actor, per_rank, step.eval_micro_batch_size_per_device, prompt, answer, precision, rates,
                          shards=shards)
    if has_reward:
        greedy += forward_flops(critic, per_rank * seq, seq / 2, False) / rates.flops
    check = 0.0
    if has_reward and rule_scores_data(cfg):
        from rlhf.chain.readiness import POLICY_CHECK_SAMPLES

        samples = -(-step.eval_prompts * POLICY_CHECK_SAMPLES // world)
        check = generation_s(actor, samples, chunk, prompt, answer, precision, rates, shards=shards) \
            + forward_flops(critic, samples * seq, seq / 2, False) / rates.flops
    return (evals + 2) * greedy + check


_FORECASTS: dict[str, StepForecast | Exception] = {}


def step_forecast(cfg: Config) -> StepForecast:
    """forecast(cfg), computed once per resolved config in a process: a chain's pre-flight, the step's
    own pre-flight and its start all ask for it, and each forecast reads and tokenizes data."""
    import json
    from dataclasses import asdict

    key = json.dumps(asdict(cfg), sort_keys=True, default=str)
    if key not in _FORECASTS:
        try:
            _FORECASTS[key] = forecast(cfg)
        except (ValueError, OSError) as e:
            _FORECASTS[key] = e
    found = _FORECASTS[key]
    if isinstance(found, Exception):
        raise found
    return found


# ---------------------------------------------------------------------------------- text
def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 86400:.2f} days"


def table(f: StepForecast) -> str:
    """The forecast as the dry-run prints it: work, phases, total, device-hours and cost."""
    lines = [f"forecast [{f.step}]: {f.work}"]
    lines += [f"  {name:<14}{duration(s):>12}" for name, s in f.phases.items()]
    money = f", ${f.cost:,.2f} at ${f.price_per_device_hour:g} per device-hour" if f.cost is not None else \
        " (no hardware.price_per_device_hour: time only)"
    lines.append(f"  {'total':<14}{duration(f.seconds):>12}  = {f.device_hours:,.2f} device-hours on {f.devices} "
                 f"device(s){money}")
    lines += [f"  note: {n}" for n in f.notes]
    return "\n".join(lines)

__all__ = [
    "BANDWIDTH_EFFICIENCY", "COMM_EFFICIENCY", "CPU_ADAM_BYTES", "DECODE_LAYER_OVERHEAD_S", "LAUNCH_S",
    "MATMUL_EFFICIENCY", "OP_BUILD_S", "PROBE_ROWS", "READINESS_NOTE", "Rates", "StepForecast",
    "TRAIN_PROBE_MAX_PARAMS", "TRAIN_PROBE_SHAPE", "bytes_per_param", "collective_s", "data_tokenizer",
    "duration", "forecast", "forward_flops", "generation_s", "hardware_rates", "matmul_params", "offload_s",
    "overheads_s", "padded_lengths", "param_counts", "probe_cpu", "probe_cpu_training", "rule_scores_data",
    "startup_s", "static_attended", "step_data", "step_forecast", "step_rows", "table", "train_flops",
    "zero_comm_s",
]
