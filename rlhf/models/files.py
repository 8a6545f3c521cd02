"""A model's folder: random models built once into a cache entry (random weights from a conf/model
file's numbers plus a byte-level BPE tokenizer trained on the shipped data), GGUF files converted
once into a Hugging Face folder, and the path every loader reads.

    python -m pytest tests/test_models.py tests/test_gguf.py
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from rlhf.config import (
    PROJECT_ROOT,
    ConfigError,
    ModelConfig,
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


# What transformers reads from a GGUF's metadata, once per process per file (by path, size and
# modification time): each read parses the whole metadata, seconds for a 49k-token vocabulary, and a
# chain's dry-run asks once per step and check.
_GGUF_CONFIGS: dict[tuple, object] = {}
_GGUF_TOKENIZERS: dict[tuple, object] = {}


def _gguf_key(file: Path) -> tuple:
    stat = file.stat()
    return str(file), stat.st_size, stat.st_mtime_ns


def gguf_config(file: Path):
    """The transformers config in a GGUF's metadata, without reading its weights (once per process)."""
    if (key := _gguf_key(file)) not in _GGUF_CONFIGS:
        check_gguf(file)
        _GGUF_CONFIGS[key] = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    return _GGUF_CONFIGS[key]


def gguf_tokenizer(file: Path):
    """The tokenizer in a GGUF's metadata, as transformers builds it (once per process): a copy of it,
    which the caller may set up as it needs."""
    if (key := _gguf_key(file)) not in _GGUF_TOKENIZERS:
        _GGUF_TOKENIZERS[key] = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    return copy.deepcopy(_GGUF_TOKENIZERS[key])


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
