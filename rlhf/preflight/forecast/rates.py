"""The forecast's rates and unit costs: the efficiency constants, what one device achieves (measured
on CPU by short probes), FLOPs of a forward and a training pass, ZeRO's collectives, offload and
decoding. How they combine into a step's forecast: rlhf/preflight/forecast/__init__.py.

    python -m pytest tests/test_forecast.py
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field

from rlhf.config import Config, ModelConfig
from rlhf.preflight.memory import bytes_per_param, exchanged_bytes, kv_width, param_counts, sizes, table_bytes

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


def alltoall_s(cfg: Config, seqs: int, seq_slice: float, rates: Rates) -> float:
    """Sequence parallelism's exchanges in one optimizer step of a trained model: around each layer's
    attention, this rank's queries, keys and values go out and the attention output comes back
    (each sending (N - 1) / N of its slice), in the forward and again in the backward, and once more
    where gradient checkpointing recomputes the forward; over the node's link where a group of N
    consecutive ranks fits in a node, else the slowest link."""
    n = cfg.parallel.sequence
    if n <= 1:
        return 0.0
    passes = 3 if cfg.step.gradient_checkpointing else 2
    link = rates.node_link or rates.link if n <= cfg.hardware.devices_per_node else rates.link
    size = exchanged_bytes(cfg.model, seqs, seq_slice, cfg.hardware.precision)
    return sizes(cfg.model).num_layers * passes * size * (n - 1) / n / link


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

    ``shards`` > 1: each device holds a tensor-parallel slice (rlhf.generation.shards) and its group of
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
    each token's position + 1 rounded up to a multiple of rlhf.generation.decode.STATIC_SPAN, at most prompt +
    answer (with no spans, always the whole cache)."""
    from rlhf.generation.decode import static_span

    length = prompt + answer
    if answer <= 0:
        return float(length)
    return sum(static_span(prompt + t + 1, length) for t in range(answer)) / answer
