"""The forecast's amount of work: the step's rows (counted in local data or published), the data's
padded lengths under the run's tokenizer, and whether a rule scores it.

    python -m pytest tests/test_forecast.py
"""

from __future__ import annotations

from rlhf.config import STEPS, Config, ModelConfig, role_models
from rlhf.preflight.memory import param_counts


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


def long_prompts(cfg: Config, read: int = 512) -> tuple[int, int, int] | None:
    """Of up to ``read`` distinct train prompts of the step's part of local data, as the run tokenizes
    them (rlhf.generation.rollout.prompt_dataset: chat template, bos): how many are longer than
    step.max_prompt_len, how many were read, and the longest's length. None where the data or the
    tokenizer is not local."""
    tokenizer = data_tokenizer(cfg)
    if tokenizer is None:
        return None
    prompts = list(dict.fromkeys(p for p in step_data(cfg, tokenizer)[0]["prompt"] if isinstance(p, str) and p.strip()))
    lengths = [len(tokenizer(p).input_ids) for p in prompts[:read]]
    if not lengths:
        return None
    return sum(n > cfg.step.max_prompt_len for n in lengths), len(lengths), max(lengths)


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
