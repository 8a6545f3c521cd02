"""The config groups' schemas: model, hardware, ZeRO, optimizer, LoRA, roles, launch, logging,
checkpoints -- one dataclass per group, with its checks in ``__post_init__`` (data: rlhf.config.data).

    python -c "from rlhf.config import HardwareConfig"   # used through rlhf.config; no command of its own
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from omegaconf import MISSING

from rlhf.config.checks import PROJECT_ROOT, _choice, _positive
from rlhf.config.data import DataConfig, SourceConfig, looks_local  # noqa: F401 - the data group
from rlhf.errors import ConfigError

# --------------------------------------------------------------------------------------- model
# Families whose random models we build (rlhf.models._random_config); any other family is a
# transformers model_type, read from a checkpoint's config.json.
RANDOM_FAMILIES = ("opt", "llama", "qwen2")
# The numbers that stand in for config.json where it cannot be read (a dry-run with no hub).
SIZE_KEYS = ("num_layers", "hidden_size", "num_heads", "ffn_size", "vocab_size", "max_positions")
# A random model's family and numbers where its file leaves them unset: a LLaMA small enough to train
# on one CPU core in minutes (conf/model/tiny-llama.yaml). A checkpoint's are never defaulted.
RANDOM_DEFAULTS = {"family": "llama", "num_layers": 2, "hidden_size": 128, "num_heads": 4, "ffn_size": 512,
                   "vocab_size": 512, "max_positions": 256}


def known_family(family: str) -> bool:
    """Whether transformers' AutoConfig knows this model_type (its registry is read only for a family
    outside RANDOM_FAMILIES: importing it costs seconds)."""
    if family in RANDOM_FAMILIES:
        return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return family in CONFIG_MAPPING_NAMES


@dataclass
class ModelConfig:
    # Short name used in run-directory names and tables.
    name: str = MISSING
    # Hub id or local folder handed to from_pretrained; empty for a random model (cache folder).
    # Its config.json gives every size the pre-flight, the forecast and the runners use.
    path: str = ""
    # A GGUF file inside the folder model.path (a model.path ending in .gguf names the file itself):
    # read through transformers' GGUF support and converted once into a cached Hugging Face folder.
    gguf_file: str | None = None
    # Architecture family (a transformers model_type). config.json's model_type wins where it can be
    # read; here it picks the config class of random models (opt, llama) and of the offline fallback.
    family: str | None = None
    # Build a random model (and a tokenizer trained on the shipped data) instead of downloading.
    random_init: bool = False
    # Architecture numbers: they size random models (unset: RANDOM_DEFAULTS), and stand in for
    # config.json only in a dry-run that cannot read it (no hub); null where config.json is the only source.
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    # Key/value heads (grouped-query attention); null: as many as num_heads.
    num_kv_heads: int | None = None
    ffn_size: int | None = None
    vocab_size: int | None = None
    max_positions: int | None = None
    # The output head shares the input embedding (config.json's tie_word_embeddings), for the offline
    # fallback of a family whose default differs; null: the family's default.
    tied_embeddings: bool | None = None
    # Seed of the random weights and of nothing else (the run seed drives training).
    init_seed: int = 0
    # Execute model code shipped with a hub checkpoint; off unless you trust the repository.
    trust_remote_code: bool = False
    # Override every dropout probability in the model config; null keeps the checkpoint's own.
    dropout: float | None = None

    @property
    def has_sizes(self) -> bool:
        """Whether this file's numbers can stand in for config.json (all of them and the family set)."""
        return self.family is not None and all(getattr(self, k) is not None for k in SIZE_KEYS)

    def __post_init__(self) -> None:
        if self.family is not None and not known_family(self.family):
            raise ConfigError(f"model.family={self.family!r} is not a model_type transformers' AutoConfig knows; "
                              "give the checkpoint's own (its config.json's model_type), or leave it null")
        if not self.random_init and not self.path:
            raise ConfigError(f"model.path is empty for model {self.name!r}: give a hub id or a "
                              "local folder, or set model.random_init=true")
        if self.random_init and not self.path:
            for key, value in RANDOM_DEFAULTS.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
            _choice("model.family", self.family, RANDOM_FAMILIES)
        for key in (*SIZE_KEYS, "num_kv_heads"):
            if getattr(self, key) is not None:
                _positive(f"model.{key}", getattr(self, key))
        if self.hidden_size and self.num_heads and self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"model.num_heads={self.num_heads}")
        if self.num_kv_heads and self.num_heads and self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads={self.num_heads} is not divisible by "
                              f"model.num_kv_heads={self.num_kv_heads} (each key/value head serves a group)")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")


# ------------------------------------------------------------------------------------ hardware
@dataclass
class HardwareConfig:
    # Preset name, shown in dry-runs and tables.
    name: str = MISSING
    # Device kind of one rank.
    accelerator: str = "cpu"
    # Machines taking part in the run.
    nodes: int = 1
    # Ranks per machine (GPUs, or CPU processes on the cpu preset).
    devices_per_node: int = 1
    # Memory of one device in GiB, for the memory pre-flight.
    memory_per_device_gb: float = 16.0
    # Training precision; fp32 is the only one CPU kernels run everywhere.
    precision: str = "fp32"
    # torch intra-op threads per rank; 0 keeps torch's default. On a loaded 2-core machine
    # 2 threads ran 11x slower than 1, so the cpu preset pins 1.
    torch_threads: int = 1
    # Collective backend: gloo on CPU, nccl on NVIDIA GPUs.
    dist_backend: str = "gloo"
    # For the time and cost forecast (rlhf/preflight/forecast/), datasheet figures of one device: dense
    # matrix-product peak at hardware.precision in TFLOP/s (0 on CPU: measured at start-up), memory
    # bandwidth in GB/s, collective bandwidth to the other devices of its node per direction in GB/s,
    # and the network bandwidth of a whole node in GB/s.
    peak_tflops: float = 0.0
    memory_bandwidth_gbs: float = 0.0
    intra_node_gbs: float = 0.0
    inter_node_gbs: float = 0.0
    # Price of one device-hour in USD; 0: the forecast gives time only.
    price_per_device_hour: float = 0.0
    # For ZeRO offload in the forecast: the host link of one device per direction in GB/s (PCIe), and
    # the memory bandwidth of a node's host in GB/s (CPU-Adam streams the optimizer states); 0: unknown,
    # the forecast leaves offload out and says so.
    host_link_gbs: float = 0.0
    host_memory_gbs: float = 0.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def __post_init__(self) -> None:
        _choice("hardware.accelerator", self.accelerator, ("cpu", "cuda"))
        _choice("hardware.precision", self.precision, ("fp32", "fp16", "bf16"))
        _choice("hardware.dist_backend", self.dist_backend, ("gloo", "nccl"))
        _positive("hardware.nodes", self.nodes)
        _positive("hardware.devices_per_node", self.devices_per_node)
        _positive("hardware.memory_per_device_gb", self.memory_per_device_gb)
        _positive("hardware.torch_threads", self.torch_threads, allow_zero=True)
        for key in ("peak_tflops", "memory_bandwidth_gbs", "intra_node_gbs", "inter_node_gbs", "price_per_device_hour"):
            _positive(f"hardware.{key}", getattr(self, key), allow_zero=True)
        if self.accelerator == "cpu" and self.precision == "fp16":
            raise ConfigError("hardware.precision=fp16 is not supported on hardware.accelerator=cpu "
                              "(DeepSpeed's CPU accelerator has no fp16 kernels); use fp32 or bf16")


# ---------------------------------------------------------------------------------------- zero
@dataclass
class OffloadConfig:
    # Where the state lives between uses: none, cpu or nvme.
    device: str = "none"
    # Page-locked host memory: faster copies, but it is taken from the host for the whole run.
    pin_memory: bool = False


@dataclass
class ZeroConfig:
    # ZeRO stage: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters partitioned.
    stage: int = 0
    # Optimizer-state offload (stage >= 1); moves the optimizer to DeepSpeedCPUAdam.
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    # Parameter offload (stage 3 only).
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    # Overlap gradient reduction with the backward pass.
    overlap_comm: bool = False
    # Copy gradients into one contiguous buffer to avoid fragmentation.
    contiguous_gradients: bool = True
    # Elements per gradient-reduction bucket.
    reduce_bucket_size: int = 500_000_000
    # Stage 3: parameters below this many elements stay unpartitioned.
    stage3_param_persistence_threshold: int = 10_000
    # Stage 3: elements prefetched ahead of use.
    stage3_prefetch_bucket_size: int = 30_000_000
    # Stage 3: most parameters held gathered at once, per rank.
    stage3_max_live_parameters: int = 30_000_000
    # Stage 3: DeepSpeed's memory-efficient linear (its default, on). It replaces
    # torch.nn.functional.linear for the whole process with an autograd Function whose saved weight
    # does not keep the gathered copy alive, so each layer's weights are freed after its forward;
    # off, every linear holds its gathered weight until the backward (the whole model's weights at
    # once: small models only). Its per-call overhead cost ZeRO-3 rollouts ~25% per token on 2 CPU
    # ranks, so rollouts gathered whole use torch's own linear either way (rlhf.generation.rollout).
    memory_efficient_linear: bool = True

    def __post_init__(self) -> None:
        _choice("zero.stage", self.stage, (0, 1, 2, 3))
        _choice("zero.offload_optimizer.device", self.offload_optimizer.device, ("none", "cpu", "nvme"))
        _choice("zero.offload_param.device", self.offload_param.device, ("none", "cpu", "nvme"))
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ConfigError("zero.offload_optimizer needs zero.stage >= 1 (it offloads ZeRO-partitioned state)")
        if self.offload_param.device != "none" and self.stage != 3:
            raise ConfigError("zero.offload_param needs zero.stage=3 (only stage 3 partitions parameters)")


# --------------------------------------------------------------------------------------- optim
@dataclass
class OptimConfig:
    # Peak learning rate.
    lr: float = 1e-3
    # Decoupled weight decay (AdamW); biases and norm weights are never decayed.
    weight_decay: float = 0.0
    # Adam betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Adam epsilon.
    eps: float = 1e-8
    # Learning-rate schedule after warmup: cosine, linear or constant.
    scheduler: str = "cosine"
    # Linear warmup, in optimizer steps.
    warmup_steps: int = 0
    # Clip the global gradient norm to this value; 0 turns clipping off.
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _choice("optim.scheduler", self.scheduler, ("cosine", "linear", "constant"))
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")


# ---------------------------------------------------------------------------------------- lora
@dataclass
class LoraConfig:
    # LoRA rank; 0 trains the full model.
    rank: int = 0
    # LoRA scaling numerator (the update is scaled by alpha / rank).
    alpha: float = 16.0
    # Dropout on the LoRA branch input (SFT and reward; off where a step disables dropout: PPO, and DPO /
    # SimPO with step.disable_dropout).
    dropout: float = 0.0
    # Modules that get adapters: names or suffixes, ["all-linear"] (PEFT's every linear but the head), or
    # ["peft-default"] (the family's defaults from PEFT's own mapping; refused where PEFT has none).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # Train only the adapters (DeepSpeed-Chat's --only_optimize_lora); false also trains the base.
    only_optimize_lora: bool = True
    # Learning rate of the adapters; null uses optim.lr. DeepSpeed-Chat uses a separate, higher one.
    lr: float | None = None
    # Merge adapters into the base weights when saving, so the output is a plain HF model.
    merge_on_save: bool = True

    def __post_init__(self) -> None:
        _positive("lora.rank", self.rank, allow_zero=True)
        _positive("lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if self.rank and not self.target_modules:
            raise ConfigError("lora.target_modules is empty while lora.rank > 0")
        if self.lr is not None:
            _positive("lora.lr", self.lr)


@dataclass
class RoleConfig:
    # Checkpoint folder or hub id this role starts from; empty: the chain's output, else the model group.
    path: str = ""
    # A conf/model file describing this role's architecture, for the memory pre-flight (e.g. opt-350m
    # for DeepSpeed-Chat's critic); empty: the same as the model group.
    model: str = ""
    # actor only: start PPO or a preference method from the model group's random weights on purpose
    # (a smoke test); false refuses such a start, which no trained policy comes from.
    random_init: bool = False

    def __post_init__(self) -> None:
        if self.model and not (PROJECT_ROOT / "conf" / "model" / f"{self.model}.yaml").exists():
            options = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "model").glob("*.yaml"))
            raise ConfigError(f"<role>.model={self.model!r} (actor, critic or reward) is not a file in conf/model; choose one of "
                              f"{', '.join(options)}")


# --------------------------------------------------------------------------- parallelism
@dataclass
class ParallelConfig:
    # Ranks that share each sequence (DeepSpeed Ulysses sequence parallelism): each runs 1/N of
    # every sequence's tokens and attends over the whole sequence with 1/N of the heads, so
    # activation memory per rank falls N-fold; the world's ranks form world/N data-parallel groups.
    # 1: off.
    sequence: int = 1

    def __post_init__(self) -> None:
        _positive("parallel.sequence", self.sequence)


# --------------------------------------------------------------------------- launch & logging
@dataclass
class LaunchConfig:
    # Print the DeepSpeed config, batch arithmetic, launch command and memory table; train nothing.
    dry_run: bool = False
    # Run even when the memory pre-flight says the run does not fit.
    force: bool = False
    # DeepSpeed hostfile ("host slots=N" per line); needed for more than one node.
    hostfile: str = ""
    # Address and port of rank 0 for multi-node runs; empty address: the launcher's default.
    master_addr: str = ""
    master_port: int = 29500
    # Which node this command starts, for clusters without ssh between nodes: run the same command on
    # every node with its own launch.node_rank (0 .. hardware.nodes-1) and launch.master_addr set to
    # node 0's address; -1: one command starts every node over ssh (the hostfile's hosts).
    node_rank: int = -1
    # Minutes a rank waits in a collective (all-reduce, barrier) for the others before it fails: a
    # hung rank (a stalled machine, a dead network link) stops the job after this long instead of
    # holding every GPU. Long enough for rank 0 alone to write a large model while the others wait.
    collective_timeout_min: float = 30.0
    # Train rows of the data blend for the time forecast where the data is on a hub (local files are
    # counted); 0: unknown, the forecast is per step.
    forecast_rows: int = 0

    def __post_init__(self) -> None:
        _positive("launch.forecast_rows", self.forecast_rows, allow_zero=True)
        if self.hostfile and not os.path.exists(os.path.expanduser(self.hostfile)):
            raise ConfigError(f"launch.hostfile={self.hostfile!r} does not exist")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"launch.master_port={self.master_port} is not a port number")
        if self.node_rank < -1:
            raise ConfigError(f"launch.node_rank={self.node_rank}: -1 (every node over ssh) or a node's index")
        if self.node_rank >= 0 and not self.master_addr:
            raise ConfigError(f"launch.node_rank={self.node_rank} needs launch.master_addr: node 0's address, the "
                              "same on every node")
        if not self.collective_timeout_min > 0:
            raise ConfigError(f"launch.collective_timeout_min={self.collective_timeout_min} must be above 0")


@dataclass
class LoggingConfig:
    # Show progress bars on rank 0.
    progress_bar: bool = True
    # Log to Weights & Biases as well as metrics.jsonl.
    wandb: bool = False
    # online, offline or disabled; empty: W&B's own settings (WANDB_MODE, `wandb online/offline`)
    # where a credential exists (WANDB_API_KEY, `wandb login`), offline where none does.
    wandb_mode: str = ""
    # Weights & Biases project.
    wandb_project: str = "rlhf"
    # Weights & Biases group: one per sweep, so its runs compare side by side; empty: none.
    wandb_group: str = ""
    # Also write TensorBoard event files into RUN_DIR/tensorboard.
    tensorboard: bool = False
    # Profile this optimizer step (PPO: PPO step) with torch.profiler (rlhf.observe.profiling); 0: off.
    profile_step: int = 0

    def __post_init__(self) -> None:
        _positive("logging.profile_step", self.profile_step, allow_zero=True)
        if self.wandb_mode not in ("", "online", "offline", "disabled"):
            raise ConfigError(f"logging.wandb_mode={self.wandb_mode!r}: online, offline, disabled, or empty for W&B's "
                              "own settings")


@dataclass
class CheckpointConfig:
    # Save every this many optimizer steps (PPO: PPO steps), and always at the end of each epoch; 0: epochs only.
    every_steps: int = 0
    # Checkpoints kept (the newest).
    keep_last: int = 2

    def __post_init__(self) -> None:
        _positive("checkpoint.every_steps", self.every_steps, allow_zero=True)
        _positive("checkpoint.keep_last", self.keep_last)
