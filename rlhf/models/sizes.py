"""A model's sizes from its own config.json or GGUF metadata (parameter counts from a meta-device
build), or from a conf/model file's numbers offline: what the pre-flight and the forecast read.

    python -m pytest tests/test_sizes.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
)

from rlhf.config import (
    RANDOM_FAMILIES,
    ConfigError,
    ModelConfig,
)
from rlhf.models.files import (
    PEFT_DEFAULT,
    _random_config,
    gguf_config,
    gguf_location,
)


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
        from rlhf.preflight.probes import hub_unreachable

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
