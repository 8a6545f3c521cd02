"""Load causal LMs and tokenizers, build random CPU models, attach LoRA through PEFT.

Every model is loaded with ``from_pretrained(path_or_hub_id)``. A ``random_init`` model (the
``tiny-*`` files under conf/model) is first built once into a cache folder -- random weights from
its architecture numbers plus a byte-level BPE tokenizer trained on the shipped data -- and then
loaded from there like any checkpoint, so a hub id works unchanged wherever a hub is reachable.

    python -c "from rlhf.models import random_model_dir; ..."   # no command of its own
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    OPTConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlhf.config import (
    PROJECT_ROOT,
    RANDOM_FAMILIES,
    STEPS,
    Config,
    ConfigError,
    LoraConfig,
    ModelConfig,
    role_models,
)

# Special tokens of the tokenizers we train: pad is distinct from eos so that a mask built from
# pad never hides a real end of answer.
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# The random models' tokenizer learns its merges from the shipped preference tasks only: a task added
# to data/synthetic/ (numbers) would otherwise change every random model's tokenizer and with it every
# shipped figure; byte-level BPE encodes any other text all the same.
TOKENIZER_CORPUS = tuple(f"data/synthetic/{task}/train.jsonl" for task in ("add", "reverse", "sort"))
# Bump when the way random models are built changes, so stale cache entries are not reused.
BUILD_VERSION = 1

# lora.target_modules=[peft-default]: each family's default target modules from PEFT's own mapping.
PEFT_DEFAULT = "peft-default"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf"))


def _corpus_files() -> list[Path]:
    files = sorted(f for pattern in TOKENIZER_CORPUS for f in PROJECT_ROOT.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no tokenizer corpus at {PROJECT_ROOT / TOKENIZER_CORPUS[0]}; "
                                "run `python -m rlhf.data.synthetic --out data/synthetic`")
    return files


def random_model_dir(cfg: ModelConfig) -> Path:
    """Cache folder of a random model, keyed by everything that changes its files."""
    digest = hashlib.sha256()
    spec = {k: getattr(cfg, k) for k in ("family", "num_layers", "hidden_size", "num_heads", "ffn_size",
                                         "vocab_size", "max_positions", "init_seed")}
    if cfg.num_kv_heads not in (None, cfg.num_heads):  # keys of existing entries stay as they were
        spec["num_kv_heads"] = cfg.num_kv_heads
    if cfg.tied_embeddings is not None:
        spec["tied_embeddings"] = cfg.tied_embeddings
    digest.update(json.dumps({"spec": spec, "version": BUILD_VERSION}, sort_keys=True).encode())
    for f in _corpus_files():
        digest.update(f.read_bytes())
    return cache_root() / "random" / f"{cfg.name}-{digest.hexdigest()[:12]}"


def train_tokenizer(vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE on the shipped data: no unknown tokens, and one token per ' x' letter."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for f in _corpus_files():
            with open(f) as fh:
                for line in fh:
                    row = json.loads(line)
                    yield row["prompt"] + row["chosen"]
                    yield row["prompt"] + row["rejected"]

    tok.train_from_iterator(texts(), trainer)
    # Like OPT and LLaMA tokenizers, put bos in front of every encoded text.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=max_length)


def _random_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast):
    """The transformers config of a random model (also the offline stand-in for a checkpoint's
    config.json, rlhf.models.model_sizes): ``tokenizer`` gives the special token ids."""
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    dropout = cfg.dropout or 0.0
    if cfg.family == "opt":
        return OPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, ffn_dim=cfg.ffn_size,
                         max_position_embeddings=cfg.max_positions, word_embed_proj_dim=cfg.hidden_size,
                         dropout=dropout, attention_dropout=dropout, **ids)
    if cfg.family in ("llama", "qwen2"):
        # qwen2 is the stand-in for Qwen2.5 presets in CPU tests: LLaMA's layers with biased q/k/v and
        # (by default) a tied head; llama's head is its own unless model.tied_embeddings=true (Llama 3.2).
        cls, default = (LlamaConfig, {"tie_word_embeddings": False}) if cfg.family == "llama" else (Qwen2Config, {})
        tie = default if cfg.tied_embeddings is None else {"tie_word_embeddings": cfg.tied_embeddings}
        return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                   num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
                   intermediate_size=cfg.ffn_size, max_position_embeddings=cfg.max_positions,
                   attention_dropout=dropout, **ids, **tie)
    raise ValueError(f"model.family={cfg.family!r}: random models are built for opt, llama and qwen2 only")


# A cache entry is usable only when all of these were written; a marker file written last says so.
_ENTRY_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_COMPLETE = ".complete"


def cache_entry_complete(path: Path) -> bool:
    return (path / _COMPLETE).exists() and all((path / f).exists() for f in _ENTRY_FILES)


def build_random_model(cfg: ModelConfig, out: Path) -> Path:
    """Write a random model + tokenizer into ``out``, atomically, and never hand back an incomplete folder.

    Each builder writes into its own temporary folder, checks it, and renames it into place. An
    existing entry that lacks a file (a crashed or interrupted builder) is moved aside and rebuilt.
    Concurrent builders are safe: the loser of the rename keeps the winner's (complete) entry.
    """
    if cache_entry_complete(out):
        return out

    def write(tmp: Path) -> None:
        tokenizer = train_tokenizer(cfg.vocab_size, cfg.max_positions)
        if len(tokenizer) > cfg.vocab_size:
            raise ValueError(f"tokenizer has {len(tokenizer)} tokens > model.vocab_size={cfg.vocab_size}")
        torch.manual_seed(cfg.init_seed)
        model = AutoModelForCausalLM.from_config(_random_config(cfg, tokenizer))
        model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                                   eos_token_id=tokenizer.eos_token_id,
                                                   pad_token_id=tokenizer.pad_token_id)
        # With torch.distributed initialized transformers writes weights on global rank 0 only; the
        # completeness check in _build_entry turns a rank that wrote none into an error, not a broken entry.
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _build_entry(out, write, f"building the random model {cfg.name}")


def _build_entry(out: Path, write, what: str) -> Path:
    """Run ``write`` into a temporary folder beside ``out``, check that it wrote a complete entry, and
    rename it into place; the temporary folder is removed whatever happens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp)
        (tmp / _COMPLETE).write_text("")
        if not cache_entry_complete(tmp):
            missing = [f for f in _ENTRY_FILES if not (tmp / f).exists()]
            raise RuntimeError(f"{what} wrote no {', '.join(missing)} in {tmp}")
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _move_into_place(tmp: Path, out: Path) -> None:
    for _ in range(3):
        try:
            os.rename(tmp, out)
            return
        except OSError:  # `out` exists: another builder won, or an incomplete entry is in the way
            if cache_entry_complete(out):
                return
            stale = out.parent / f".{out.name}-stale-{os.getpid()}"
            try:
                os.rename(out, stale)
            except OSError:
                continue  # someone else moved it aside first; try again
            print(f"[models] rebuilt incomplete cache entry {out}", flush=True)
            shutil.rmtree(stale, ignore_errors=True)
    if not cache_entry_complete(out):
        raise RuntimeError(f"could not put the model folder into {out}; delete that folder and run again")


def resolve_path(cfg: ModelConfig) -> str:
    """The path or hub id to hand to from_pretrained: a random model built on first use, a GGUF file
    converted on first use (gguf_model_dir), else model.path as it is."""
    if gguf := gguf_location(cfg.path, cfg.gguf_file):
        return str(gguf_model_dir(gguf))
    if cfg.path:
        return cfg.path
    return str(build_random_model(cfg, random_model_dir(cfg)))


def checkpoint_path(path: str) -> str:
    """A role's path (actor.path, critic.path, reward.path) for from_pretrained: a GGUF file converted
    on first use, anything else as it is."""
    gguf = gguf_location(path)
    return str(gguf_model_dir(gguf)) if gguf else path


# ------------------------------------------------------------------------------------ GGUF
# A GGUF file (llama.cpp's single-file format) is read through transformers' own GGUF support (the
# `gguf` package): dequantized, then saved once as a Hugging Face folder that every step, the chat CLI
# and PEFT load like any checkpoint; outputs are safetensors folders as always.
GGUF_VERSION = 1  # bump when the conversion changes, so stale cache entries are not reused
# Tensor types stored unquantized, which need no dequantization.
_GGUF_PLAIN = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}


def gguf_location(path: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file ``path`` names: a ``.gguf`` file, or ``gguf_file`` in the folder ``path`` (None when
    neither: a Hugging Face folder or hub id). A named file that is not there is refused."""
    if not path:
        return None
    where = Path(os.path.expanduser(path))
    if gguf_file:
        file = where / gguf_file
    elif where.suffix.lower() == ".gguf":
        file = where
    else:
        return None
    if not file.is_file():
        key = "model.gguf_file" if gguf_file else "model.path"
        raise ConfigError(f"{key}: no GGUF file at {file}" + (f" (the folder holds {', '.join(sorted(g.name for g in where.glob('*.gguf')))})"
                                                             if where.is_dir() and any(where.glob("*.gguf")) else ""))
    return file.resolve()


_GGUF_DIGESTS: dict[tuple, str] = {}


def _gguf_digest(file: Path) -> str:
    """The file's content hash (cached per process by path, size and modification time)."""
    stat = file.stat()
    key = (str(file), stat.st_size, stat.st_mtime_ns)
    if key not in _GGUF_DIGESTS:
        digest = hashlib.sha256()
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
        _GGUF_DIGESTS[key] = digest.hexdigest()
    return _GGUF_DIGESTS[key]


def check_gguf(file: Path) -> None:
    """Refuse, in one line naming both, a GGUF whose architecture or tensor types transformers cannot
    read -- before anything converts."""
    from gguf import GGUFReader
    from gguf.quants import _type_traits
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    reader = GGUFReader(file)
    field_ = reader.fields.get("general.architecture")
    arch = bytes(field_.parts[field_.data[0]]).decode() if field_ else "?"
    kinds = sorted({t.tensor_type.name for t in reader.tensors})
    readable = _GGUF_PLAIN | {t.name for t in _type_traits}
    # transformers maps a few llama.cpp names to its own (qwen2moe -> qwen2_moe); either spelling counts.
    known = {a.replace("_", "") for a in GGUF_SUPPORTED_ARCHITECTURES} | set(GGUF_SUPPORTED_ARCHITECTURES)
    bad_arch = arch not in known and arch.replace("-", "").replace("_", "") not in known
    bad_kinds = [k for k in kinds if k not in readable]
    if bad_arch or bad_kinds:
        import transformers

        raise ConfigError(f"{file}: a GGUF of architecture {arch!r} with tensors in {', '.join(kinds)}: transformers "
                          f"{transformers.__version__} cannot read "
                          + (f"the architecture (it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})" if bad_arch
                             else f"{', '.join(bad_kinds)} (the gguf package dequantizes {', '.join(sorted(readable))})")
                          + "; convert it to a Hugging Face folder with llama.cpp's tools, or use another quantization")


_GGUF_CONFIGS: dict[tuple, object] = {}


def gguf_config(file: Path):
    """The transformers config in a GGUF's metadata, without reading its weights (once per process)."""
    stat = file.stat()
    key = (str(file), stat.st_size, stat.st_mtime_ns)
    if key not in _GGUF_CONFIGS:
        check_gguf(file)
        _GGUF_CONFIGS[key] = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    return _GGUF_CONFIGS[key]


def gguf_model_dir(file: Path) -> Path:
    """A Hugging Face folder converted from a GGUF file (safetensors in fp32, tokenizer with its chat
    template, generation config), cached by the file's content and built in a temporary folder renamed
    into place, as the random models are. Its weights are the GGUF's dequantized values: a run loads
    them in its own precision, the same numbers as dequantizing into that precision directly."""
    out = cache_root() / "gguf" / f"{file.stem}-{_gguf_digest(file)[:12]}-v{GGUF_VERSION}"
    if cache_entry_complete(out):
        return out
    check_gguf(file)
    print(f"[models] converting {file} into {out} (once; later runs load the folder)", flush=True)

    def write(tmp: Path) -> None:
        from transformers import GgufConfig

        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        # Dequantized into plain dense weights (not kept in GGUF blocks, which cannot train or be saved).
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        # Plain weights now: what marks the model as GGUF-quantized would stop save_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(file), "sha256": _gguf_digest(file)}, indent=1))

    return _build_entry(out, write, f"converting {file}")


# ------------------------------------------------------------------------------------ sizes
@dataclass(frozen=True)
class ModelSizes:
    """What the pre-flight, the forecast, the dry-run and the runners know of a model before it loads:
    the numbers of its config.json (through AutoConfig) and exact parameter counts of a ``meta``-device
    build of that config (shapes only, no memory), or the same of its conf/model numbers where no
    config.json can be read (a dry-run without a hub). ``source`` says which."""

    family: str  # config.json's model_type
    architecture: str  # the class AutoModelForCausalLM builds from it, e.g. Qwen2ForCausalLM
    source: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: fewer key/value heads than query heads
    head_dim: int
    ffn_size: int
    gated_mlp: bool
    vocab_size: int
    tied_embeddings: bool
    max_positions: int | None  # None: no position limit in the config (ALiBi, as BLOOM)
    params: int  # every parameter once; a tied head is the embedding's
    largest_module: int  # the most parameters one module holds itself: DeepSpeed's largest_layer_params
    layer_params: int  # the decoder layers' parameters, all layers together
    head_params: int  # the output projection over the vocabulary
    table_params: int  # the input embedding, plus the head where it is not tied
    # (name within its layer, in features, out features) of every linear of every decoder layer:
    # where LoRA adapters go (PEFT's all-linear is all of them).
    layer_linears: tuple[tuple[str, int, int], ...]
    config: object = field(compare=False, repr=False)  # the transformers config it was read from

    @property
    def fallback(self) -> bool:
        return self.source.startswith("conf/model/")

    def lora_params(self, rank: int, targets=("all-linear",)) -> int:
        """Parameters of LoRA adapters of ``rank`` on the layers' linears named by ``targets``
        (names or suffixes, PEFT's matching; all-linear: every one): rank x (in + out) each."""
        targets = lora_targets(self.family, targets)

        def hit(name: str) -> bool:
            return targets == "all-linear" or any(name == t or name.endswith("." + t) for t in targets)

        return sum(rank * (i + o) for name, i, o in self.layer_linears if hit(name)) if rank else 0

    def describe(self) -> str:
        """One line for the dry-run: the numbers and where they came from."""
        kv = f"{self.num_kv_heads} KV" if self.num_kv_heads != self.num_heads else "no GQA"
        count = f"{self.params / 1e9:.3f}B" if self.params >= 1e9 else f"{self.params / 1e6:.1f}M"
        return (f"{count} parameters ({self.architecture}): {self.num_layers} layers, hidden "
                f"{self.hidden_size}, {self.num_heads} heads ({kv}, head size {self.head_dim}), MLP {self.ffn_size}"
                f"{' gated' if self.gated_mlp else ''}, vocabulary {self.vocab_size}"
                f"{' tied' if self.tied_embeddings else ''}, {self.max_positions or 'unlimited'} positions; "
                f"sizes from {self.source}")


def _first(config, *keys):
    return next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)


def _is_linear(module: torch.nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D  # GPT-2's linears, weight stored [in, out]

    return isinstance(module, (torch.nn.Linear, Conv1D))


def _linear_shape(module: torch.nn.Module) -> tuple[int, int]:
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)  # Conv1D


_MEASURED: dict[str, dict] = {}


def _measure(config) -> dict:
    """Counts from a meta-device build of ``config``, cached by its JSON (a 175B build takes a second,
    and a dry-run sizes each model several times)."""
    key = config.to_json_string(use_diff=False)
    if key not in _MEASURED:
        _MEASURED[key] = _build_and_count(config)
    return _MEASURED[key]


def _build_and_count(config) -> dict:
    remote = bool(getattr(config, "auto_map", None))  # a checkpoint's own model code (trust_remote_code)
    with torch.device("meta"):  # parameters get shapes only: no memory, no initialization
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
    text = config.get_text_config()
    layers = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == text.num_hidden_layers),
                 key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no list of {text.num_hidden_layers} decoder layers found")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    linears = tuple((name, *_linear_shape(m)) for i, layer in enumerate(layers)
                    for name, m in layer.named_modules() if _is_linear(m))
    return {
        "architecture": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),  # shared (tied) parameters once
        "largest_module": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        "layer_params": sum(p.numel() for p in layers.parameters()),
        "head_params": head.weight.numel() if head is not None else 0,
        "table_params": embed.weight.numel() + (0 if tied or head is None else head.weight.numel()),
        "tied": tied,
        "linears": linears,
        # A gated MLP (SwiGLU/GeGLU) has a gate projection beside the up projection (gate_proj, or
        # one gate_up_proj); the layers name it.
        "gated": any("gate" in name.rsplit(".", 1)[-1] for name, _, _ in linears[:len(linears) // len(layers)]),
        "down_in": max((i for name, i, o in linears if o == text.hidden_size), default=None),
    }


def sizes_from_config(config, source: str) -> ModelSizes:
    """ModelSizes of a transformers config: its numbers, and counts from a meta-device build."""
    measured = _measure(config)
    text = config.get_text_config()
    heads = text.num_attention_heads
    return ModelSizes(
        family=config.model_type, architecture=measured["architecture"], source=source,
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, num_heads=heads,
        num_kv_heads=_first(text, "num_key_value_heads", "num_kv_heads", "n_head_kv") or heads,
        head_dim=_first(text, "head_dim") or text.hidden_size // heads,
        # The MLP width where the config names it; else (GPT-2's n_inner=None, BLOOM) the input width
        # of the layers' down projection in the build.
        ffn_size=_first(text, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size") or measured["down_in"],
        gated_mlp=measured["gated"], vocab_size=text.vocab_size, tied_embeddings=measured["tied"],
        max_positions=_first(text, "max_position_embeddings"),
        params=measured["params"], largest_module=measured["largest_module"], layer_params=measured["layer_params"],
        head_params=measured["head_params"], table_params=measured["table_params"],
        layer_linears=measured["linears"], config=config)


def _fallback_config(cfg: ModelConfig):
    """A transformers config from a conf/model file's numbers: the random-model builder's for opt,
    llama and qwen2, else the family's config class with the common key names (its attribute_map translates)."""
    import types

    if cfg.family in RANDOM_FAMILIES:
        special = types.SimpleNamespace(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return _random_config(cfg, special)
    return AutoConfig.for_model(cfg.family, num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                num_attention_heads=cfg.num_heads,
                                num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
                                intermediate_size=cfg.ffn_size, vocab_size=cfg.vocab_size,
                                max_position_embeddings=cfg.max_positions,
                                **({} if cfg.tied_embeddings is None else {"tie_word_embeddings": cfg.tied_embeddings}))


_HUB_CONFIGS: dict[tuple[str, bool], tuple] = {}


def read_config(path: str, trust_remote_code: bool = False):
    """(config, None) from ``path``'s config.json through AutoConfig, or (None, why it cannot be read).
    A hub id comes from the Hugging Face cache, else from the hub if it answers; one that cannot be
    reached is answered at once (once per process), not after from_pretrained's retries."""
    from rlhf.config import looks_local

    if path and path.lower().endswith(".gguf"):  # actor.path, critic.path or reward.path naming a GGUF
        try:
            return gguf_config(gguf_location(path)), None
        except ConfigError as err:
            return None, str(err)
    local = looks_local(path)
    if not local and (path, trust_remote_code) in _HUB_CONFIGS:
        return _HUB_CONFIGS[path, trust_remote_code]
    if not local:
        from rlhf.probes import hub_unreachable

        if why := hub_unreachable(path):
            _HUB_CONFIGS[path, trust_remote_code] = None, why
            return None, why
    try:
        found = AutoConfig.from_pretrained(os.path.expanduser(path), trust_remote_code=trust_remote_code), None
    except (OSError, ValueError, KeyError) as err:  # not there, or a model_type this transformers does not know
        found = None, (str(err).strip().splitlines() or [type(err).__name__])[0]
    if not local:
        _HUB_CONFIGS[path, trust_remote_code] = found
    return found


def model_sizes(cfg: ModelConfig) -> ModelSizes:
    """The sizes of ``cfg``'s model: from its ``path``'s config.json; where that cannot be read, from the
    numbers of its conf/model file (the offline fallback; ``source`` says so); a random model's from
    those numbers. A path with neither is refused in one line, before anything loads."""
    if not cfg.path:
        return sizes_from_config(_fallback_config(cfg),
                                 f"conf/model/{cfg.name}.yaml (a random model built from these numbers)")
    if gguf := gguf_location(cfg.path, cfg.gguf_file):
        return sizes_from_config(gguf_config(gguf), f"the GGUF metadata of {gguf}")
    config, why = read_config(cfg.path, cfg.trust_remote_code)
    if config is not None:
        return sizes_from_config(config, f"config.json of {cfg.path}")
    if not cfg.has_sizes:
        raise ConfigError(f"model.path={cfg.path!r}: no config.json readable ({why}), and conf/model/{cfg.name}.yaml "
                          "has no numbers to size it offline (model.family, model.num_layers, model.hidden_size, ...): "
                          "give a folder holding the checkpoint's config.json, or run where the hub is reachable")
    return sizes_from_config(_fallback_config(cfg),
                             f"conf/model/{cfg.name}.yaml (no config.json readable for {cfg.path})")


def load_tokenizer(path: str, trust_remote_code: bool = False, gguf_file: str | None = None):
    """The tokenizer of a checkpoint folder or hub id, or of a GGUF file (read from its metadata, without
    converting its weights), set up as every step uses it."""
    if gguf := gguf_location(path, gguf_file):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    # An answer ends where its chat template closes the turn: where that is one special token other
    # than eos (a base model's template, Qwen's <|im_end|> beside <|endoftext|>), it becomes the eos
    # that tokenization appends to answers and that decoding stops at, so that a model's answers end
    # as its template's turns do (and rules never see a second end marker).
    if (marker := turn_end_token(tokenizer)) is not None:
        tokenizer.eos_token = marker
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # LLaMA ships no pad token, SmolLM2's GGUF pads with eos. Reusing eos would make masks built
        # from pad hide real ends of answers, so add a distinct one (the model's embeddings are
        # resized in load_causal_lm).
        tokenizer.add_special_tokens({"pad_token": PAD})
    return tokenizer


def turn_end_token(tokenizer) -> str | None:
    """The special token that closes an assistant turn in the tokenizer's chat template, where that is
    a single token other than eos; None otherwise (no template, text markers, or eos itself)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    from rlhf.data.adapters import ChatFormat

    try:
        marker = ChatFormat(tokenizer).end_of_turn
    except ValueError:  # a template that refuses a plain user/assistant exchange: nothing to learn from it
        return None
    if not marker or marker == tokenizer.eos_token:
        return None
    return marker if len(tokenizer(marker, add_special_tokens=False).input_ids) == 1 else None


_DROPOUT_KEYS = ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout", "attn_pdrop",
                 "resid_pdrop", "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob")


def tokenizer_mismatch(a, b) -> str | None:
    """Why two tokenizers would not give the same ids for the same text (None when they would).

    PPO feeds the actor's token ids to the critic and reward model; a model trained with another
    vocabulary scores them as noise without any error."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} tokens"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} {getattr(a, name)} vs {getattr(b, name)}"
    if a.get_vocab() != b.get_vocab():
        return "the same size but different vocabularies"
    return None


def _sdpa_fp32_on_cpu(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention, in fp32 where the tensors are half precision on CPU: there
    PyTorch's half-precision fused attention kernel is several times slower than the fp32 one at the
    head sizes of small models, most of all its backward (docs/design-notes.md), and the products
    of half-precision inputs are exact in fp32. The output goes back to the model's dtype, so the
    rest of the forward is unchanged; on any other device this is transformers' SDPA as it is."""
    if query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float16):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                          *args, **kwargs)
    return out.to(query.dtype), weights


# Registered under our own name (transformers' registries are keyed by name); never written to a saved
# config.json, so a saved model loads anywhere with transformers' own default.
SDPA_FP32_ON_CPU = "rlhf_sdpa_fp32_on_cpu"
AttentionInterface.register(SDPA_FP32_ON_CPU, _sdpa_fp32_on_cpu)
AttentionMaskInterface.register(SDPA_FP32_ON_CPU, sdpa_mask)


def half_attention_in_fp32(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """A half-precision model that attends through SDPA attends through ``_sdpa_fp32_on_cpu``."""
    if dtype in (torch.bfloat16, torch.float16) and getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(SDPA_FP32_ON_CPU)


def load_causal_lm(path: str, tokenizer, dtype: torch.dtype = torch.float32, dropout: float | None = None,
                   trust_remote_code: bool = False) -> PreTrainedModel:
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if dropout is not None:
        for key in _DROPOUT_KEYS:
            if hasattr(config, key):
                setattr(config, key, dropout)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    half_attention_in_fp32(model, dtype)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        # Multiple of 8 keeps the embedding GEMMs on fast tensor-core shapes.
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        # transformers' generate (and a saved model's users) stop where our decoding does: at the
        # tokenizer's eos, which may be the template's end of turn (load_tokenizer), and at the model's own.
        own = model.generation_config.eos_token_id
        own = [] if own is None else [own] if isinstance(own, int) else list(own)
        ids = list(dict.fromkeys([tokenizer.eos_token_id, *own]))
        model.generation_config.eos_token_id = ids[0] if len(ids) == 1 else ids
    return model


# Model types that, in the installed transformers, confine attention to each row of a packed batch
# (rlhf.data.tokenize.PackCollator) by reading row starts from its position_ids; tests/test_packing.py
# checks each against padded batches. Not OPT: it takes position_ids for its position embeddings but
# builds its attention mask without them, so packed rows would attend to the rows before them.
PACKED_ROWS_MODEL_TYPES = ("llama",)


def check_packed_rows(path: str, trust_remote_code: bool = False) -> None:
    """Refuse step.packing for a model whose attention would cross packed rows (read from its
    config.json, before any weights load)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if config.model_type not in PACKED_ROWS_MODEL_TYPES:
        name = (config.architectures or [config.model_type])[0]
        raise ConfigError(f"step.packing=true is not supported for {name} (model type {config.model_type!r}, {path}): "
                          "its attention would reach across the packed rows; supported model types: "
                          f"{', '.join(PACKED_ROWS_MODEL_TYPES)}. Set step.packing=false")


class RewardModel(torch.nn.Module):
    """A causal-LM backbone with a scalar head: one score per token (values), pooled by the caller.

    The backbone and head are registered under the attribute names of transformers'
    ``*ForSequenceClassification`` (``<base_model_prefix>`` and ``score``), so this module's state
    dict *is* that class's: ``save_pretrained`` writes a folder that
    ``AutoModelForSequenceClassification.from_pretrained(out, num_labels=1)`` loads and that gives
    the same score at the last real token. The PPO critic is this class too.
    """

    def __init__(self, hf_model: PreTrainedModel):
        super().__init__()
        self.base_model_prefix = hf_model.base_model_prefix
        self.add_module(self.base_model_prefix, hf_model.base_model)
        self.add_module("score", hf_model.score)
        self.config = hf_model.config
        # Held outside the module tree (no duplicate parameters); used for save_pretrained only.
        object.__setattr__(self, "hf_model", hf_model)

    @classmethod
    def from_config(cls, config, dtype: torch.dtype = torch.float32) -> RewardModel:
        return cls(sequence_classifier(config).from_config(config, dtype=dtype))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Positions from the mask, so a left-padded row scores as it would unpadded.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = getattr(self, self.base_model_prefix)(input_ids=input_ids, attention_mask=attention_mask,
                                                       position_ids=position_ids).last_hidden_state
        return self.score(hidden).squeeze(-1).float()

    def save_pretrained(self, out, state_dict=None, **kwargs) -> None:
        self.hf_model.save_pretrained(out, state_dict=state_dict, **kwargs)

    # The engine factory calls these as it would on any transformers model; the backbone is shared
    # with hf_model, so switching them on there switches them on here.
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def enable_input_require_grads(self) -> None:
        self.hf_model.enable_input_require_grads()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.hf_model.is_gradient_checkpointing


def sequence_classifier(config):
    """The class a reward model (or critic) of ``config``'s family is built as: AutoModelForSequenceClassification,
    or, for a family transformers gives none (CodeGen), transformers' own GenericForSequenceClassification
    over the family's backbone (a ``score`` head on its last hidden state, the state dict laid out as
    every built-in *ForSequenceClassification's), registered with AutoModelForSequenceClassification so
    that a saved reward model loads through it in any process that imported rlhf.models."""
    from transformers import AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in AutoModelForSequenceClassification._model_mapping or getattr(config, "auto_map", None):
        return AutoModelForSequenceClassification
    from transformers.modeling_layers import GenericForSequenceClassification

    try:
        causal = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"{config.model_type}: transformers has no causal-LM class for this family, which reward "
                         "models are built on") from None
    # The family's PreTrainedModel (weight init, base_model_prefix: where a causal LM's backbone weights sit).
    family_base = next(b for b in causal.__mro__[1:] if issubclass(b, PreTrainedModel) and b is not PreTrainedModel)
    name = causal.__name__.replace("ForCausalLM", "ForSequenceClassification")
    cls = type(name, (GenericForSequenceClassification, family_base),
               {"base_model_prefix": family_base.base_model_prefix, "__module__": __name__})
    AutoModelForSequenceClassification.register(type(config), cls, exist_ok=True)
    return AutoModelForSequenceClassification


def load_reward_model(path: str, tokenizer, dtype: torch.dtype = torch.float32, dropout: float | None = None,
                      trust_remote_code: bool = False) -> RewardModel:
    """A reward model (or PPO critic) from a reward-model folder or from any causal-LM checkpoint.

    From a causal LM (an SFT output, a hub id) the backbone is loaded and the scalar head starts
    random; from a saved reward model both come back.
    """
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, num_labels=1)
    if dropout is not None:
        for key in _DROPOUT_KEYS:
            if hasattr(config, key):
                setattr(config, key, dropout)
    hf_model = sequence_classifier(config).from_pretrained(path, config=config, dtype=dtype,
                                                           trust_remote_code=trust_remote_code)
    half_attention_in_fp32(hf_model, dtype)
    if len(tokenizer) > hf_model.get_input_embeddings().num_embeddings:
        hf_model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    hf_model.config.pad_token_id = tokenizer.pad_token_id
    return RewardModel(hf_model)


def lora_targets(model_type: str, targets) -> str | list[str]:
    """PEFT's ``target_modules`` for lora.target_modules on a ``model_type`` model: all-linear, the names
    given, or (``peft-default``) the family's default from PEFT's own mapping, so that a family PEFT
    adds is covered without a list of ours; a family PEFT has no default for is refused in one line."""
    targets = list(targets)
    if targets == ["all-linear"]:
        return "all-linear"
    if targets != [PEFT_DEFAULT]:
        return targets
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    if model_type not in PEFT_TARGETS:
        raise ConfigError(f"lora.target_modules=[{PEFT_DEFAULT}]: PEFT has no default LoRA target modules for "
                          f"{model_type} (not in its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING); name them, "
                          "e.g. lora.target_modules=[qkv_proj], or use all-linear")
    return list(PEFT_TARGETS[model_type])


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Wrap ``model`` in PEFT LoRA adapters; a no-op when ``lora.rank`` is 0.

    A reward model's fresh scalar head is trained in full (``modules_to_save``): with adapters
    only, it would stay at its random initialization.
    """
    if cfg.rank == 0:
        return model
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    is_reward = isinstance(model, RewardModel)
    targets = lora_targets(model.config.model_type, cfg.target_modules)
    if is_reward and targets == "all-linear":
        # PEFT's all-linear skips a causal LM's output layer by name; here the head is `score`.
        targets = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                          if isinstance(mod, torch.nn.Linear) and not name.startswith("score")})
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              task_type=None if is_reward else "CAUSAL_LM",
                              modules_to_save=["score"] if is_reward else None)
    # Adapters in the base model's dtype: PEFT's fp32 adapters beside bf16/fp16 weights stop ZeRO-3, whose
    # partitions hold one dtype (the optimizer keeps its own fp32 copy of every trainable weight).
    model = get_peft_model(model, peft_cfg, autocast_adapter_dtype=False)
    if not cfg.only_optimize_lora:
        for p in model.parameters():
            p.requires_grad_(True)
    return model


def is_lora_param(name: str) -> bool:
    return "lora_" in name


def ppo_role_problems(cfg: Config) -> list[str]:
    """What makes a PPO config unrunnable before any model loads: a missing reward model, or roles
    whose sizes (model_sizes: their config.json, else their conf/model numbers) say they
    use another tokenizer than the actor. Used by the dry-run, the launcher and the runner alike."""
    if not STEPS[cfg.step.name].generates:
        return []
    problems = []
    if cfg.step.reward_model_weight > 0 and not (cfg.reward.path or cfg.critic.path):
        problems.append("PPO with step.reward_model_weight > 0 needs critic.path or reward.path (a reward-model "
                        "output), or use step.reward_fn=rule step.reward_model_weight=0")
    actor_model, judge_model = role_models(cfg)
    actor = model_sizes(actor_model)
    uses_judge = cfg.step.reward_model_weight > 0 or cfg.step.builds("critic")
    if uses_judge and judge_model is not cfg.model and judge_model is not actor_model:
        # The architecture the user named (critic.model) is the clearer name; else the checkpoint's path.
        key = next((f"{k}={v}" for k, v in (("critic.model", cfg.critic.model), ("critic.path", cfg.critic.path),
                                             ("reward.path", cfg.reward.path)) if v), "critic")
        other = model_sizes(judge_model)
        if (other.family, other.vocab_size) != (actor.family, actor.vocab_size):
            problems.append(f"{key} ({other.family}, vocabulary {other.vocab_size}) does not share the actor's "
                            f"tokenizer ({actor_model.path or 'model=' + cfg.model.name}: {actor.family}, vocabulary "
                            f"{actor.vocab_size}); PPO feeds the actor's token ids to the critic and reward model")
    return problems
