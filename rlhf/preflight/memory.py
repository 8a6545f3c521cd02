"""Per-device memory pre-flight: model states, activations, KV cache and frozen models, per role.

Model-state accounting follows DeepSpeed's own estimators
(``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``) for mixed
precision: per trainable parameter 2 bytes of 16-bit weights plus 18 bytes on the optimizer side
(16-bit and 32-bit gradients, 32-bit master weights, Adam's two moments), partitioned by stage;
ZeRO-3 also holds the largest module gathered (4 bytes per parameter). Activations follow Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): 34*s*b*h bytes per
layer in 16-bit -- their 5*a*s^2*b term for attention scores is left out because transformers'
default SDPA attention never materializes the score matrix -- or the layer inputs only (2*s*b*h)
under checkpointing; a language-model head adds b*s*V*(2 + 4) bytes of logits (scalar-head reward
models and critics have none). Generation's KV cache is 2 * layers * batch * length * KV heads *
head size * bytes (grouped-query attention keeps fewer key/value heads than query heads).
Every size comes from the model's config.json (rlhf.models.model_sizes), parameter counts from a
meta-device build of it; a model's conf/model numbers stand in only where no config.json can be read.
Under ZeRO-3 the generating model (PPO's actor, SFT's model) is either gathered whole for a
generate call -- its full 16/32-bit weights resident beside its shard -- or gathered layer by
layer as in training, or gathered into tensor-parallel slices over a node's ranks;
``generation_gathering`` picks one, for the pre-flight and the runners alike.

    python launch.py experiment=opt-13b_8xa100-40g step=ppo launch.dry_run=true   # prints the table
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.config import STEPS, Config, ModelConfig, role_models, step_roles
from rlhf.errors import ConfigError

GIB = 2**30
# Headroom for the CUDA context, allocator fragmentation and communication buffers.
USABLE_FRACTION = 0.9


def sizes(m: ModelConfig):
    """The model's sizes (rlhf.models.model_sizes): its config.json, or its conf/model numbers offline."""
    from rlhf.models import model_sizes  # torch and transformers: loaded where a model is sized

    return model_sizes(m)


def param_counts(m: ModelConfig, lora_rank: int = 0, lora_targets=("all-linear",)) -> tuple[int, int, int]:
    """(total, largest module, LoRA) parameter counts: exact, from a meta-device build of the model's
    config. The largest module is DeepSpeed's largest_layer_params (ZeRO-3 gathers one module's own
    parameters at a time)."""
    s = sizes(m)
    return s.params, s.largest_module, s.lora_params(lora_rank, lora_targets)


@dataclass
class RoleMemory:
    role: str
    params: int
    trainable: bool
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache


def model_states(total: int, largest: int, trainable: int, stage: int, world: int, precision: str,
                 offload_optimizer: bool, offload_params: bool) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on one device for one trainable model."""
    half = precision in ("fp16", "bf16")
    w_bytes = 2 if half else 4
    # Optimizer side per trainable parameter: mixed precision 2 (16-bit grads) + 4 (32-bit grads)
    # + 4 (master weights) + 8 (Adam); fp32: 4 (grads) + 8 (Adam).
    # Under ZeRO-3 the 16-bit gradients are reduce-scattered as they are produced, so only the
    # 32-bit partition stays (DeepSpeed's 18 bytes at stage 3 = 2 weights + 16 optimizer side).
    grad_bytes = (4 if stage == 3 else 6) if half else 4
    opt_bytes = 12 if half else 8
    weights = w_bytes * total
    grads = grad_bytes * trainable
    opt = opt_bytes * trainable
    if stage >= 1:
        opt /= world
    if stage >= 2:
        grads /= world
    if stage == 3:
        weights = w_bytes * total / world + 4 * largest  # the gathered working set
    if offload_optimizer:  # ZeRO-Offload: gradients and optimizer states live in host memory
        grads = opt = 0.0
    if offload_params and stage == 3:
        weights = 4 * largest
    return weights, grads, opt


def activation_bytes(m: ModelConfig, batch: int, seq: int, checkpointing: bool, precision: str,
                     lm_head: bool = True) -> float:
    s = sizes(m)
    h, n, v = s.hidden_size, s.num_layers, s.vocab_size
    scale = 1 if precision in ("fp16", "bf16") else 2
    per_layer_full = 34 * seq * batch * h
    if checkpointing:
        layers = n * 2 * seq * batch * h + per_layer_full  # saved inputs + one layer recomputed at a time
    else:
        layers = n * per_layer_full
    logits = batch * seq * v * (2 + 4) if lm_head else 0
    return scale * layers + logits


def exchanged_bytes(m: ModelConfig, batch: int, seq: int, precision: str) -> float:
    """What sequence parallelism exchanges around one layer's attention: this rank's queries, keys,
    values and attention output over its ``seq`` tokens. Its buffers (one layer at a time) hold a sent
    and a received copy."""
    s = sizes(m)
    return (2 * s.num_heads * s.head_dim + 2 * kv_width(m)) * batch * seq * bytes_per_param(precision)


def bytes_per_param(precision: str) -> int:
    """Bytes of one weight at the training precision (16-bit or fp32)."""
    return 2 if precision in ("fp16", "bf16") else 4


def kv_width(m: ModelConfig) -> int:
    """Numbers one token keeps per layer for each of key and value: its key/value heads x head size
    (grouped-query attention keeps fewer heads than it queries with; head size from config.json)."""
    s = sizes(m)
    return s.num_kv_heads * s.head_dim


def kv_cache_bytes(m: ModelConfig, batch: int, length: int, precision: str) -> float:
    return 2 * sizes(m).num_layers * batch * length * kv_width(m) * bytes_per_param(precision)


def generating_role(cfg: Config) -> str | None:
    """The role that generates, in a step that does: PPO's rollouts, SFT's and DPO's greedy accuracy eval."""
    spec = STEPS[cfg.step.name]
    if not spec.generates and not cfg.step.greedy_eval_prompts():
        return None
    # The trainable language model of the step: PPO's and DPO's actor, SFT's model.
    return spec.policy.name


def table_bytes(m: ModelConfig, precision: str) -> float:
    """The embedding and the language-model head (one table where tied, as OPT's): what a
    tensor-parallel slice of the model (rlhf.generation.shards) holds whole on every rank."""
    return bytes_per_param(precision) * sizes(m).table_params


def tp_unsupported(m: ModelConfig, t: int) -> str | None:
    """Why ``m`` cannot be split over ``t`` ranks for generation (rlhf.generation.shards), from its sizes."""
    from rlhf.generation.shards import PLANS, unsupported

    s = sizes(m)
    # rlhf.generation.shards keys its plans by the class a checkpoint loads as; a family without one is named.
    family = s.architecture if s.architecture in PLANS else s.family
    return unsupported(family, s.num_heads, s.ffn_size, t, s.num_kv_heads)


def generation_tp_size(cfg: Config) -> int:
    """Ranks per tensor-parallel generation group: step.generation_tp_size, 0 for a node's devices."""
    return cfg.step.generation_tp() or min(cfg.hardware.devices_per_node, cfg.world_size)


def generation_gathering(cfg: Config, critic_model: ModelConfig | None = None) -> int:
    """How a ZeRO-3 generate call holds the generating model: 1, gathered whole (one gather per
    call); t > 1, gathered into tensor-parallel slices over groups of t ranks (rlhf.generation.shards, one
    gather per call, 1/t of the weights per device); 0, layer by layer (ZeRO-3's hooks gather
    every layer again for every token) -- and 0 where nothing is gathered (not ZeRO-3).

    ``step.zero3_generation`` gather / tp / layerwise decide; auto takes the first of gather and tp
    that this pre-flight says fits on one device beside everything else the step holds (tp only
    where the model splits over the group), else layerwise.
    """
    if cfg.zero.stage != 3 or generating_role(cfg) is None:
        return 0
    mode = cfg.step.zero3_mode()[0]
    t, m = generation_tp_size(cfg), role_models(cfg, critic_model)[0]
    if mode == "tp" and (why := tp_unsupported(m, t) or (
            f"{t} ranks per group do not divide the {cfg.world_size} ranks" if cfg.world_size % t else None)):
        raise ConfigError(f"step.zero3_generation=tp with step.generation_tp_size={t}: {why}")
    if mode != "auto":
        return {"gather": 1, "tp": t, "layerwise": 0}[mode]
    ways = [1] + ([t] if t > 1 and not tp_unsupported(m, t) else [])
    budget = cfg.hardware.memory_per_device_gb
    return next((way for way in ways if verdict(estimate(cfg, critic_model, gathering=way), budget)[0]), 0)


def estimate(cfg: Config, critic_model: ModelConfig | None = None,
             gathering: int | None = None) -> list[RoleMemory]:
    """Memory of every role of the run's step on one device; ``gathering`` None: as
    ``generation_gathering`` decides."""
    world, stage, precision = cfg.world_size, cfg.zero.stage, cfg.hardware.precision
    offload_opt = cfg.zero.offload_optimizer.device != "none"
    offload_par = cfg.zero.offload_param.device != "none"
    step = cfg.step
    micro = step.micro_batch_size_per_device
    actor, critic = role_models(cfg, critic_model)

    def trainable_role(name: str, m: ModelConfig, lora: int, batch: int, seq: int, lm_head: bool) -> RoleMemory:
        total, largest, lora_params = param_counts(m, lora, cfg.lora.target_modules)
        trainable = lora_params if lora and cfg.lora.only_optimize_lora else total + lora_params
        r = RoleMemory(name, total + lora_params, True)
        r.weights, r.gradients, r.optimizer = model_states(total + lora_params, largest, trainable, stage, world,
                                                           precision, offload_opt, offload_par)
        r.activations = activation_bytes(m, batch, seq, step.gradient_checkpointing, precision, lm_head)
        if lora:
            r.notes.append(f"LoRA rank {lora}: {trainable / 1e6:.1f}M trainable")
        if stage == 3 and generating_role(cfg) == name:
            way = generation_gathering(cfg, critic_model) if gathering is None else gathering
            if way:
                # The gathered copy (whole, or this rank's tensor-parallel slice: 1/t of the layers'
                # weights, the embedding and head whole; OPT ties them) takes the place of the
                # one-layer working set; the shard stays beside it unless it lives in host memory.
                full = bytes_per_param(precision) * (total + lora_params)
                tables = table_bytes(m, precision)
                held = full if way == 1 else (full - tables) / way + tables
                r.weights = held if offload_par else full / world + held
            mode, has_key = step.zero3_mode()
            key = f" (step.zero3_generation={mode})" if has_key else ""
            how = {0: "layer by layer", 1: "whole model gathered once per call"}.get(
                way, f"gathered once per call into tensor-parallel slices over {way} ranks")
            r.notes.append(f"ZeRO-3 generation: {how}{key}")
        return r

    def frozen_role(name: str, m: ModelConfig, offload: bool) -> RoleMemory:
        total, largest, _ = param_counts(m)
        w_bytes = bytes_per_param(precision)
        r = RoleMemory(name, total, False)
        if offload:
            r.weights, r.notes = 4 * largest, ["parameters in host memory"]
        elif stage == 3:
            r.weights = w_bytes * total / world + 4 * largest
        else:
            r.weights = w_bytes * total
        return r

    if not STEPS[step.name].generates:  # a micro batch of pairs holds both answers of each pair
        batch = STEPS[step.name].seqs_per_row * micro
        sp = cfg.parallel.sequence
        seq = -(-step.max_seq_len // sp)  # this rank's slice of every sequence

        def trained(role) -> RoleMemory:
            m = actor if role.lm_head else cfg.model
            r = trainable_role(role.name, m, cfg.lora.rank, batch, seq, role.lm_head)
            if sp > 1:
                buffers = 2 * exchanged_bytes(m, batch, seq, precision)
                r.activations += buffers
                r.notes.append(f"parallel.sequence={sp}: {seq} of {step.max_seq_len} tokens per rank, all-to-all "
                               f"buffers {buffers / GIB:.2f} GiB")
            return r

        # DPO's reference is counted even when its log-probs are precomputed: it is loaded for that pass.
        return [trained(role) if role.trainable else frozen_role(role.name, actor, step.offloads(role.name))
                for role in step_roles(cfg)]
    seq = step.max_prompt_len + step.max_new_tokens
    out = []
    for role in step_roles(cfg):
        # The actor and its reference are the policy's model; the critic and reward model the critic's.
        m = actor if role.lm_head else critic
        if not role.trainable:
            out.append(frozen_role(role.name, m, step.offloads(role.name)))
            continue
        r = trainable_role(role.name, m, cfg.lora.rank if role.lm_head else 0, micro, seq, role.lm_head)
        if role.name == generating_role(cfg):
            generating = step.generation_batch_size_per_device or step.rollout_batch_size_per_device
            r.kv_cache = kv_cache_bytes(actor, generating, seq, precision)
        out.append(r)
    return out


def verdict(roles: list[RoleMemory | None], memory_gb: float) -> tuple[bool, str]:
    roles = [r for r in roles if r is not None]
    total = sum(r.total for r in roles) / GIB
    budget = memory_gb * USABLE_FRACTION
    fits = total <= budget
    word = "fits" if fits else "does not fit"
    return fits, f"{total:.1f} GiB of {memory_gb:g} GiB per device ({budget:.1f} usable): {word}"


def table(roles: list[RoleMemory | None], memory_gb: float) -> str:
    roles = [r for r in roles if r is not None]
    head = f"{'role':<10}{'params':>10}{'weights':>10}{'grads':>10}{'optim':>10}{'activ':>10}{'kv':>10}{'total':>10}  GiB"
    lines = [head]
    for r in roles:
        cols = [r.weights, r.gradients, r.optimizer, r.activations, r.kv_cache, r.total]
        lines.append(f"{r.role:<10}{r.params / 1e9:>9.2f}B" + "".join(f"{c / GIB:>10.2f}" for c in cols)
                     + (f"  ({'; '.join(r.notes)})" if r.notes else ""))
    lines.append("memory: " + verdict(roles, memory_gb)[1])
    return "\n".join(lines)
