"""Load causal LMs and tokenizers, build random CPU models, attach LoRA through PEFT.

Every model is loaded with ``from_pretrained(path_or_hub_id)``. A ``random_init`` model (the
``tiny-*`` files under conf/model) is first built once into a cache folder -- random weights from
its architecture numbers plus a byte-level BPE tokenizer trained on the shipped data -- and then
loaded from there like any checkpoint, so a hub id works unchanged wherever a hub is reachable.

    python -c "from rlhf.models import random_model_dir; ..."   # no command of its own
"""

from __future__ import annotations

import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlhf.config import (
    STEPS,
    Config,
    ConfigError,
    LoraConfig,
    role_models,
)
from rlhf.models.files import (
    BOS,
    BUILD_VERSION,
    DTYPES,
    EOS,
    GGUF_VERSION,
    PAD,
    PEFT_DEFAULT,
    TOKENIZER_CORPUS,
    build_random_model,
    cache_entry_complete,
    cache_root,
    check_gguf,
    checkpoint_path,
    gguf_config,
    gguf_location,
    gguf_model_dir,
    gguf_tokenizer,
    random_model_dir,
    resolve_path,
    train_tokenizer,
)
from rlhf.models.sizes import (
    ModelSizes,
    lora_targets,
    model_sizes,
    read_config,
    sizes_from_config,
)


def load_tokenizer(path: str, trust_remote_code: bool = False, gguf_file: str | None = None):
    """The tokenizer of a checkpoint folder or hub id, or of a GGUF file (read from its metadata, without
    converting its weights), set up as every step uses it."""
    if gguf := gguf_location(path, gguf_file):
        tokenizer = gguf_tokenizer(gguf)
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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:  # from the mask, so a left-padded row scores as it would unpadded
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

__all__ = [
    "BOS", "BUILD_VERSION", "DTYPES", "EOS", "GGUF_VERSION", "ModelSizes", "PACKED_ROWS_MODEL_TYPES", "PAD",
    "PEFT_DEFAULT", "RewardModel", "SDPA_FP32_ON_CPU", "TOKENIZER_CORPUS", "apply_lora",
    "build_random_model", "cache_entry_complete", "cache_root", "check_gguf", "check_packed_rows",
    "checkpoint_path", "gguf_config", "gguf_location", "gguf_model_dir", "half_attention_in_fp32",
    "is_lora_param", "load_causal_lm", "load_reward_model", "load_tokenizer", "lora_targets", "model_sizes",
    "ppo_role_problems", "random_model_dir", "read_config", "resolve_path", "sequence_classifier",
    "sizes_from_config", "tokenizer_mismatch", "train_tokenizer", "turn_end_token",
]
