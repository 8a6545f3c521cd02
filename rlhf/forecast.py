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
import statistics
import time
from dataclasses import dataclass, field

from rlhf.config import STEPS, Config, ModelConfig, ppo_updates_per_step, role_models, step_roles
from rlhf.memory import bytes_per_param, generation_gathering, kv_width, param_counts, sizes, table_bytes
from rlhf.probes import extensions_root

# Achieved fraction of the datasheet peak in training and scoring matrix products, at the micro
# batches the presets use (how it was set: docs/design-notes.md, "The forecast's constants").
MATMUL_EFFICIENCY = 0.334
# Achieved fraction of memory bandwidth when a decoding step streams weights and KV cache (STREAM-
# like copies reach 80-90% on HBM; a decode step's many small reads less).
BANDWIDTH_EFFICIENCY = 0.7
# Seconds per layer and decoding step that neither FLOPs nor bytes explain: kernel launches and the
# Python of an eager decode loop (docs/design-notes.md). On CPU it is measured (probe_cpu).
DECODE_LAYER_OVERHEAD_S = 3.0e-4
# Achieved fraction of link bandwidth in ZeRO's all-gathers and reduce-scatters (NCCL's bus
# bandwidth on NVLink and InfiniBand runs at 70-85% of the link rate).
COMM_EFFICIENCY = 0.7
# Bytes of host memory DeepSpeed's CPU-Adam moves per parameter and optimizer step under ZeRO's
# optimizer offload: the gradient's fp32 copy written on arrival (4); fp32 weight, gradient, momentum
# and variance read (16); weight, momentum and variance written (12); the 16-bit weight for the
# device written (2). It streams at the host's memory bandwidth (BANDWIDTH_EFFICIENCY of it), which
# a node's ranks share.
CPU_ADAM_BYTES = 34


@dataclass
class Rates:
    """What one device achieves: FLOP/s in matrix products, bytes/s from memory, bytes/s over the
    link a collective is limited by, and the fixed cost of a decoding step per layer."""

    flops: float
    memory: float
    link: float
    layer_overhead_s: float
    # Per layer and micro batch of training: forward and backward ops dispatched one after the other
    # (on a GPU they queue asynchronously behind training-sized work: 0).
    train_layer_overhead_s: float = 0.0
    # CPU: (precision, threads) for probing a model's training micro batch (overheads_s).
    probe: tuple[str, int] | None = None
    measured: str = ""  # how the FLOP rate was found, when it was measured rather than read
    # ZeRO offload: bytes/s over one device's host link (PCIe) and of its share of the host's memory
    # bandwidth; inf where the preset does not say (offload then costs nothing here, and a note says so).
    host_link: float = float("inf")
    host_memory: float = float("inf")
    # bytes/s between devices of one node (a tensor-parallel generation group's all-reduces); None: link.
    node_link: float | None = None


@dataclass
class StepForecast:
    """One step's forecast: its phases in seconds (the whole step), how many devices, and the price."""

    step: str
    work: str
    steps: int
    phases: dict[str, float]
    devices: int
    price_per_device_hour: float
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def device_hours(self) -> float:
        return self.seconds * self.devices / 3600

    @property
    def cost(self) -> float | None:
        return self.device_hours * self.price_per_device_hour if self.price_per_device_hour else None

    def as_dict(self) -> dict:
        return {"step": self.step, "work": self.work, "optimizer_or_ppo_steps": self.steps,
                "phases_s": {k: round(v, 3) for k, v in self.phases.items()}, "seconds": round(self.seconds, 3),
                "device_hours": round(self.device_hours, 4), "cost_usd": None if self.cost is None else round(self.cost, 2),
                "notes": self.notes}


# ----------------------------------------------------------------------------------- FLOPs
def matmul_params(m: ModelConfig, lm_head: bool) -> int:
    """Parameters that take part in a matrix product per token: every layer's, plus the output
    projection over the vocabulary for a language model (a scalar head is negligible). Embedding
    lookups and position tables cost no FLOPs."""
    s = sizes(m)
    return s.layer_params + (s.head_params if lm_head else 0)


def forward_flops(m: ModelConfig, tokens: float, context: float, lm_head: bool) -> float:
    """FLOPs of a forward pass over ``tokens`` tokens that attend to ``context`` tokens on average."""
    s = sizes(m)
    return tokens * (2 * matmul_params(m, lm_head) + 2 * s.num_layers * context * s.num_heads * s.head_dim)


def train_flops(m: ModelConfig, tokens: float, seq: float, lm_head: bool, checkpointing: bool, lora: bool) -> float:
    """Forward + backward (+ the forward again under gradient checkpointing) over ``tokens`` tokens
    of sequences of ``seq`` (causal attention: each token attends to seq / 2 on average). LoRA's
    frozen weights need no weight gradients: 2 forward-equivalents instead of 3 (adapters are tiny)."""
    passes = (2 if lora else 3) + (1 if checkpointing else 0)
    return passes * forward_flops(m, tokens, seq / 2, lm_head)


# ---------------------------------------------------------------------------- collectives
def collective_s(size_bytes: float, world: int, rates: Rates) -> float:
    """An all-gather or reduce-scatter of a ``size_bytes`` tensor: each device sends and receives
    (world - 1) / world of it over its slowest link (ring algorithms)."""
    return 0.0 if world <= 1 else size_bytes * (world - 1) / world / rates.link


def zero_comm_s(stage: int, params: int, trainable: int, micro_batches: int, world: int, precision: str,
                rates: Rates) -> float:
    """Communication of one optimizer step of a trained model under ZeRO ``stage``: stage 3 gathers
    the parameters for every micro batch's forward and backward and reduce-scatters its gradients;
    stages 1-2 reduce-scatter gradients per micro batch and all-gather the updated parameters once;
    stage 0 all-reduces the gradients once (a reduce-scatter and an all-gather)."""
    weights, grads = params * bytes_per_param(precision), trainable * bytes_per_param(precision)
    if stage == 3:
        return micro_batches * (2 * collective_s(weights, world, rates) + collective_s(grads, world, rates))
    if stage in (1, 2):
        return micro_batches * collective_s(grads, world, rates) + collective_s(weights, world, rates)
    return 2 * collective_s(grads, world, rates)


# ---------------------------------------------------------------------------------- rates
def hardware_rates(cfg: Config) -> Rates:
    """Achieved rates of one device of the preset; on CPU the FLOP rate is measured (probe_cpu)."""
    hw = cfg.hardware
    if hw.nodes > 1 and hw.inter_node_gbs:
        link = min(hw.intra_node_gbs or hw.inter_node_gbs, hw.inter_node_gbs / hw.devices_per_node)
    else:
        link = hw.intra_node_gbs
    link_bps = link * 1e9 * COMM_EFFICIENCY if link else float("inf")
    if hw.accelerator == "cpu":
        flops, layer_s, how = probe_cpu(sizes(cfg.model).hidden_size, hw.precision, hw.torch_threads)
        rates = Rates(flops, float("inf"), link_bps, layer_s, train_layer_overhead_s=3 * layer_s, measured=how,
                      probe=(hw.precision, hw.torch_threads))
        if measured := probe_cpu_training(cfg.model, *rates.probe, flops):
            rates.measured += (f"; a training micro batch of the model spends {measured[0] * 1e3:.1f} ms beyond its "
                               f"FLOPs, a forward {measured[1] * 1e3:.1f} ms")
        return rates
    if not hw.peak_tflops:
        raise ValueError(f"hardware={hw.name} has no hardware.peak_tflops: the forecast needs the device's peak")
    memory = hw.memory_bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY if hw.memory_bandwidth_gbs else float("inf")
    host_link = hw.host_link_gbs * 1e9 * BANDWIDTH_EFFICIENCY if hw.host_link_gbs else float("inf")
    host_memory = (hw.host_memory_gbs * 1e9 * BANDWIDTH_EFFICIENCY / hw.devices_per_node if hw.host_memory_gbs
                   else float("inf"))
    node = hw.intra_node_gbs * 1e9 * COMM_EFFICIENCY if hw.intra_node_gbs else float("inf")
    return Rates(hw.peak_tflops * 1e12 * MATMUL_EFFICIENCY, memory, link_bps, DECODE_LAYER_OVERHEAD_S,
                 host_link=host_link, host_memory=host_memory, node_link=node)


def offload_s(cfg: Config, params: int, trainable: int, micro_batches: int, rates: Rates, notes: list[str]) -> float:
    """What ZeRO offload adds to one optimizer step of a model trained on GPUs: with the optimizer
    offloaded, each rank's share of the gradients goes to the host and of the updated 16-bit weights
    comes back over its host link, and CPU-Adam streams its share of the optimizer states
    (CPU_ADAM_BYTES per parameter) at its share of the host's memory bandwidth; with the parameters
    offloaded (stage 3), each micro batch's forward and backward fetch the rank's share of the
    weights from the host. Not overlapped with compute (an upper estimate where DeepSpeed overlaps)."""
    zero, hw, world = cfg.zero, cfg.hardware, cfg.world_size
    if hw.accelerator != "cuda" or zero.stage == 0:
        return 0.0
    width = bytes_per_param(hw.precision)
    seconds = 0.0
    if zero.offload_optimizer.device == "cpu":
        share = trainable / world
        seconds += 2 * share * width / rates.host_link + share * CPU_ADAM_BYTES / rates.host_memory
        if rates.host_memory == float("inf"):
            _note(notes, f"optimizer offload: no hardware.host_memory_gbs for hardware={hw.name}, so CPU-Adam's time "
                         "is not in the forecast")
    if zero.stage == 3 and zero.offload_param.device == "cpu":
        seconds += micro_batches * 2 * params / world * width / rates.host_link
    if "nvme" in (zero.offload_optimizer.device, zero.offload_param.device):
        _note(notes, "NVMe offload is not in the forecast")
    if (zero.offload_optimizer.device == "cpu" or zero.offload_param.device == "cpu") and rates.host_link == float("inf"):
        _note(notes, f"offload: no hardware.host_link_gbs for hardware={hw.name}, so host transfers are not in the "
                     "forecast")
    return seconds


def _note(notes: list[str], line: str) -> None:
    if line not in notes:
        notes.append(line)


_PROBED: dict[tuple, tuple[float, float, str]] = {}
# Token rows of the probe's matrix product: a training micro batch's (16 x 64 tokens).
PROBE_ROWS = 1024


def probe_cpu(width: int, precision: str, threads: int) -> tuple[float, float, str]:
    """This CPU's rates for a model of this width, the median of 5 repeats, cached per process: FLOP/s
    in the matrix products a training step runs (1,024 token rows times a width x 4*width weight, as
    the feed-forward layers: a micro batch of 16 x 64 tokens), and the seconds one decoder layer takes
    for a single token (the ops of a layer at one row: there the cost is dispatching ops, not
    arithmetic)."""
    import torch
    import torch.nn.functional as F

    key = (width, precision, threads)
    if key not in _PROBED:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)

        def best(fn, repeats: int) -> float:  # the median of 5: a run meets typical timings, not its fastest
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                times.append((time.perf_counter() - t0) / repeats)
            return statistics.median(times)

        try:
            a, b = torch.randn(PROBE_ROWS, width, dtype=dtype), torch.randn(width, 4 * width, dtype=dtype)
            rate = 2 * PROBE_ROWS * width * 4 * width / best(lambda: a @ b, 10)
            x, w, up, down = (torch.randn(1, 1, width, dtype=dtype), torch.randn(width, width, dtype=dtype),
                              torch.randn(width, 4 * width, dtype=dtype), torch.randn(4 * width, width, dtype=dtype))
            cache = torch.randn(1, 32, width, dtype=dtype)

            def layer():
                h = F.layer_norm(x, (width,))
                q, k, v = h @ w, h @ w, h @ w
                keys, values = torch.cat([cache, k], 1), torch.cat([cache, v], 1)
                h = x + torch.softmax(q @ keys.transpose(1, 2), -1) @ values @ w
                return h + F.gelu(F.layer_norm(h, (width,)) @ up) @ down

            layer_s = best(layer, 20)
        finally:
            torch.set_num_threads(before)
        _PROBED[key] = (rate, layer_s, f"measured {rate / 1e9:.1f} GFLOP/s and {layer_s * 1e6:.0f} us per layer and "
                                       f"token ({precision}, {threads or 'default'} thread(s), width {width})")
    return _PROBED[key]


_TRAIN_PROBED: dict[tuple, tuple[float, float] | None] = {}
# The training probe's micro batch (rows x tokens) and the largest model it builds; above it, the
# per-layer cost of the single-token probe stands in (3x it: the backward dispatches twice the ops).
TRAIN_PROBE_SHAPE = (16, 32)
TRAIN_PROBE_MAX_PARAMS = 50e6


def overheads_s(m: ModelConfig, rates: Rates) -> tuple[float, float]:
    """Seconds a training micro batch, and a scoring forward without gradients, of model ``m`` spend
    beyond their FLOPs: on CPU measured on the architecture itself where it is small enough
    (probe_cpu_training); else per layer from the rates, a third of it for a forward (0 on GPUs,
    where the ops queue behind the work)."""
    if rates.probe and (measured := probe_cpu_training(m, *rates.probe, rates.flops)) is not None:
        return measured
    per_micro = sizes(m).num_layers * rates.train_layer_overhead_s
    return per_micro, per_micro / 3


def probe_cpu_training(m: ModelConfig, precision: str, threads: int, flops: float) -> tuple[float, float] | None:
    """What a training micro batch of this architecture costs on this CPU beyond its FLOPs: a random
    copy of the model runs forward, backward and the engine's fused AdamW step on TRAIN_PROBE_SHAPE
    tokens (the median of seven after a warm-up), minus its FLOPs at ``flops``; and a forward alone
    without gradients, minus its FLOPs. At the sizes trained on CPU that remainder is most of a step:
    dispatching the forward's and backward's ops one by one (norms, rotations, gated MLPs: far more
    than the single-token probe's toy layer) and the optimizer's pass. Returns (training micro batch,
    scoring forward) overheads in seconds, cached per process; None where the model is too large to
    probe."""
    s = sizes(m)
    key = (s.config.to_json_string(use_diff=False), precision, threads)
    if key in _TRAIN_PROBED:
        return _TRAIN_PROBED[key]
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.models import _DROPOUT_KEYS

    if s.params > TRAIN_PROBE_MAX_PARAMS:
        _TRAIN_PROBED[key] = None
        return None
    config = copy.deepcopy(s.config)  # the model's own config, without dropout (a step is timed, not trained)
    for k in _DROPOUT_KEYS:
        if hasattr(config, k):
            setattr(config, k, 0.0)
    rows, tokens = TRAIN_PROBE_SHAPE
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        ids = torch.randint(3, s.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0))
        model = AutoModelForCausalLM.from_config(config).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)  # the engine's optimizer
        trains, forwards = [], []
        for i in range(8):  # the first is a warm-up: first-call allocations and kernel choices
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
            if i:
                trains.append(t1 - t0)
                forwards.append(time.perf_counter() - t1)
    finally:
        torch.set_num_threads(before)
    # Medians: a run of hundreds of steps meets the typical step, not the fastest of seven (the
    # fastest forecast make run's PPO at 0.58-0.76 of its time).
    train, forward = statistics.median(trains), statistics.median(forwards)
    _TRAIN_PROBED[key] = (max(train - train_flops(m, rows * tokens, tokens, True, False, False) / flops, 0.0),
                          max(forward - forward_flops(m, rows * tokens, tokens / 2, True) / flops, 0.0))
    return _TRAIN_PROBED[key]


# ----------------------------------------------------------------------------- generation
def generation_s(m: ModelConfig, seqs: int, chunk: int, prompt: int, answer: int, precision: str,
                 rates: Rates, static: bool = False, graph: bool = False, shards: int = 1) -> float:
    """Answers to ``seqs`` prompts, ``chunk`` at a time, on one device holding the whole model:
    prefill is one forward over the prompts; each decoding step reads the weights and the KV cache
    (at its mean length) once for the chunk, or computes, whichever is slower, plus the per-layer cost.

    ``static`` (step.decode_graph): every step attends over the cache up to the end of its span
    (``static_attended``), and where it is replayed as a CUDA graph (``graph``) the host dispatches
    nothing per layer, so the per-layer cost is gone.

    ``shards`` > 1: each device holds a tensor-parallel slice (rlhf.shards) and its group of
    ``shards`` devices decodes all their chunks together. Per device the FLOPs and KV cache are
    those of its own chunk, the layers' weights read are 1/shards (the embedding and head whole),
    and every layer adds two all-reduces of the group's activations within the node."""
    if seqs <= 0:
        return 0.0
    chunk = min(chunk, seqs)
    width = bytes_per_param(precision)
    prefill = forward_flops(m, seqs * prompt, prompt / 2, True) / rates.flops
    attended = static_attended(prompt, answer) if static else prompt + answer / 2
    s = sizes(m)
    kv_bytes = 2 * s.num_layers * chunk * attended * kv_width(m) * width
    weights, reduce = param_counts(m)[0] * width, 0.0
    if shards > 1:
        tables = table_bytes(m, precision)
        weights = (weights - tables) / shards + tables
        # A ring all-reduce sends and receives 2 (t - 1) / t of the tensor: the group's rows x hidden.
        per_row = 2 * s.num_layers * 2 * (shards - 1) * s.hidden_size * width / (rates.node_link or rates.link)
        prefill += per_row * seqs * prompt
        reduce = per_row * chunk
    read = (weights + kv_bytes) / rates.memory
    math = forward_flops(m, chunk, attended, True) / rates.flops
    overhead = 0.0 if graph else s.num_layers * rates.layer_overhead_s
    return prefill + -(-seqs // chunk) * answer * (max(read, math) + overhead + reduce)


def static_attended(prompt: int, answer: int) -> float:
    """The cache positions the static decode step attends over, on average over the answer's tokens:
    each token's position + 1 rounded up to a multiple of rlhf.decode.STATIC_SPAN, at most prompt +
    answer (with no spans, always the whole cache)."""
    from rlhf.decode import static_span

    length = prompt + answer
    if answer <= 0:
        return float(length)
    return sum(static_span(prompt + t + 1, length) for t in range(answer)) / answer


# ----------------------------------------------------------------------------------- work
def step_rows(cfg: Config, rows: int = 0) -> tuple[int, str]:
    """Train rows of the step's part of the data: ``rows`` (the blend's train rows) or
    launch.forecast_rows where given, else counted in the local sources, else the hub datasets'
    published rows (rlhf.data.adapters.PUBLISHED_ROWS); 0 where none is known."""
    from rlhf.config import looks_local
    from rlhf.data.adapters import PUBLISHED_ROWS

    part = cfg.data.split_fractions[STEPS[cfg.step.name].split_index]
    total = rows or cfg.launch.forecast_rows
    how = "given"
    if not total:
        hub = [(s.path, s.train_split) for s in cfg.data.sources if not looks_local(s.path)]
        if hub and all(key in PUBLISHED_ROWS for key in hub) and len(hub) == len(cfg.data.sources):
            total, how = sum(PUBLISHED_ROWS[key] for key in hub), "published (the dataset cards)"
        elif hub:
            return 0, "hub data: set launch.forecast_rows to the blend's train rows"
        else:
            # Read as the run reads them (split and blended, max_train_samples applied), once per dry-run.
            train = len(step_data(cfg)[0])
            return train, f"counted: {train:,} train rows in this step's part ({part:.0%}) of the data"
    if cfg.data.max_train_samples > 0:
        total = min(total, int(cfg.data.max_train_samples / part))
    return int(total * part), f"{how}: {total:,} train rows x {part:.0%} for this step"


_READ: dict[tuple, tuple] = {}


def step_data(cfg: Config, tokenizer=None) -> tuple:
    """The step's train and eval rows (rlhf.data.blend.load_step_data, conversations rendered by the
    run's tokenizer where it is local), read once per data config and step: the row count, the
    lengths and the rule check share one read."""
    from rlhf.data.blend import DataReport, load_step_data

    key = (repr(cfg.data), cfg.step.name)
    if key not in _READ:
        _READ[key] = load_step_data(cfg.data, cfg.step.name, DataReport(), tokenizer or data_tokenizer(cfg))
    return _READ[key]


def data_tokenizer(cfg: Config):
    """The run's tokenizer where the data and the model are local (a chain's not yet trained tiny model:
    its random base model's, built locally in seconds); None otherwise (a real model's is not guessed)."""
    import dataclasses
    import os

    from rlhf.config import looks_local

    path = cfg.actor.path or cfg.model.path
    if not all(looks_local(s.path) for s in cfg.data.sources) or (path and not looks_local(path)):
        return None
    from rlhf import models

    gguf_file = None if cfg.actor.path else cfg.model.gguf_file
    if models.gguf_location(path, gguf_file):  # the GGUF's own tokenizer, from its metadata
        return models.load_tokenizer(path, gguf_file=gguf_file)
    if path and not os.path.exists(os.path.expanduser(path)):
        if param_counts(cfg.model)[0] > 50e6:
            return None
        path = models.resolve_path(dataclasses.replace(cfg.model, path="", random_init=True))
    elif path and os.path.isdir(folder := os.path.expanduser(path)) and not any(
            f.startswith(("tokenizer", "vocab", "spiece")) for f in os.listdir(folder)):
        return None  # a folder holding only config.json: AutoTokenizer would make an empty tokenizer of it
    return models.load_tokenizer(path or models.resolve_path(cfg.model))


def padded_lengths(cfg: Config, micro: int, pairs: bool) -> tuple[float, float] | None:
    """Mean padded length of a micro batch, in tokens, as the collators pad (to the longest row of the
    batch; a pair's two answers together): (prompt + answer, prompt) over up to 512 train rows of
    local data, tokenized by the run's tokenizer; None where the data or the tokenizer is not local
    (then max_seq_len, or max_prompt_len, stands for every row, as DeepSpeed-Chat pads)."""
    tokenizer = data_tokenizer(cfg)
    if tokenizer is None:
        return None
    rows = step_data(cfg, tokenizer)[0]
    rows = rows.select(range(min(512, len(rows))))
    prompts = [len(tokenizer(r["prompt"]).input_ids) for r in rows]
    answers = [max(len(tokenizer(r["chosen"]).input_ids), len(tokenizer(r["rejected"]).input_ids) if pairs else 0) + 1
               for r in rows]
    full = [p + a for p, a in zip(prompts, answers, strict=True)]
    chunks = [range(i, min(i + micro, len(rows))) for i in range(0, len(rows), micro)]
    return (sum(max(full[j] for j in c) for c in chunks) / len(chunks),
            sum(max(prompts[j] for j in c) for c in chunks) / len(chunks))


def rule_scores_data(cfg: Config) -> bool:
    """Whether a rule scores the data's prompts: data.rule, or the shipped tasks' rule where it parses
    local data's first eval prompts. PPO's start check and the reward model's pairs from the policy's
    own answers run only then."""
    if cfg.data.rule:
        return True
    from rlhf.config import looks_local

    if not all(looks_local(s.path) for s in cfg.data.sources):
        return False
    from rlhf.rewards import task_rule

    return task_rule(None, step_data(cfg)[1]["prompt"][:64]) is not None


def _critic_model(cfg: Config) -> ModelConfig:
    return role_models(cfg)[1]


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
    drawn = min(getattr(step, "policy_pairs_prompts", 0), part_rows) * getattr(step, "policy_pairs_answers", 0)
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
    compute = train_flops(cfg.model, seqs * seq, seq, trained.lm_head, step.gradient_checkpointing, lora)
    if spec.has_role("reference"):  # the reference's forward over the same pairs
        compute += forward_flops(cfg.model, seqs * seq, seq / 2, True)
    comm = zero_comm_s(cfg.zero.stage, total + lora_params, trainable, step.gradient_accumulation_steps, world,
                       hw.precision, rates)
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
    if getattr(step, "stop_at_accuracy", None) is not None or getattr(step, "early_stop_patience", 0):
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
    if getattr(step, "eval_accuracy_prompts", 0):
        per_rank = -(-step.eval_accuracy_prompts // world)
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
    if lengths := lengths or padded_lengths(cfg, batch, False):  # prompts left-padded to the batch's longest
        prompt = min(prompt, round(lengths[1]))
        notes.append(f"{prompt} prompt tokens: {source} "
                     f"(step.max_prompt_len={step.max_prompt_len})")
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
    if step.early_stop_patience:
        notes.append(READINESS_NOTE)
    return StepForecast("ppo", work, steps, phases, world, hw.price_per_device_hour, notes)


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
    # ZeRO-3's layerwise gathering, rlhf.decode._own_forward, nor in tensor-parallel slices, which
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
    has_critic = any(r.name == "critic" for r in step_roles(cfg))
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
    has_reward = any(r.name == "reward" for r in step_roles(cfg))
    evals = 2 + (steps // step.eval_every_steps if step.eval_every_steps else 0)
    per_rank = -(-step.eval_prompts // world)
    greedy = generation_s(actor, per_rank, step.eval_micro_batch_size_per_device, prompt, answer, precision, rates,
                          shards=shards)
    if has_reward:
        greedy += forward_flops(critic, per_rank * seq, seq / 2, False) / rates.flops
    check = 0.0
    if has_reward and rule_scores_data(cfg):
        from rlhf.readiness import POLICY_CHECK_SAMPLES

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
