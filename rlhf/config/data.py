"""The data group's schema: a blend of sources (local folders, files or hub ids), its split over the
steps and its rule for bad rows.

    python -c "from rlhf.config import DataConfig"   # used through rlhf.config; no command of its own
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from omegaconf import MISSING

from rlhf.config.checks import _choice, _positive
from rlhf.errors import ConfigError


@dataclass
class SourceConfig:
    # Local folder or json/jsonl/parquet file (loaded with datasets.load_dataset), or a hub id.
    path: str = MISSING
    # Relative sampling weight of this source in the blend.
    weight: float = 1.0
    # Split of the source used for training, and the one used for evaluation.
    train_split: str = "train"
    eval_split: str = "eval"
    # Row adapter from rlhf.data.adapters.ADAPTERS (DeepSpeed-Chat's datasets by hub id); empty: chosen
    # by the path when it is a known hub id.
    adapter: str = ""
    # Column mapping for other tables: {prompt: <column>, chosen: <column>, rejected: <column>}.
    columns: dict[str, str] = field(default_factory=dict)


def looks_local(path: str) -> bool:
    """Paths we must find on disk; anything else ("org/name") is handed to the hub as an id. A hub id
    has at most one slash, so runs/e2e/.../model is a folder (relative to the working directory)."""
    return (path.startswith(("/", "./", "../", "~")) or os.path.exists(path) or path.count("/") >= 2
            or bool(re.search(r"\.(json|jsonl|parquet|csv|gguf)$", path)))


@dataclass
class DataConfig:
    # Blend name, shown in run directories and tables.
    name: str = MISSING
    # Sources of the blend, each with a weight.
    sources: list[SourceConfig] = field(default_factory=list)
    # DeepSpeed-Chat's per-step split of each source's train rows: SFT, reward, PPO parts.
    split: str = "2,4,4"
    # Seed of the split and of blend sampling (kept apart from the run seed so that runs with
    # different training seeds see the same data).
    seed: int = 1234
    # Cap on training rows after blending; -1 keeps all.
    max_train_samples: int = -1
    # Cap on evaluation rows; -1 keeps all.
    max_eval_samples: int = 512
    # Rows that cannot be used (empty, too long, chosen == rejected): drop (or skip: the same) and count
    # them in data_report.json, or error naming the source, row and column.
    on_bad_row: str = "drop"
    # Unsupervised text for PPO's ptx loss (a "text" column, or columns: {text: <column>}); empty: the
    # blend's SFT part (prompt + chosen).
    ptx_sources: list[SourceConfig] = field(default_factory=list)
    # PPO prompts longer than step.max_prompt_len: drop and count (DeepSpeed-Chat's rule), or keep their
    # last tokens (truncate_left: the end of a conversation matters most).
    long_prompts: str = "drop"
    # The task's rule, scoring (prompt, answer) -> float: held-out accuracy of SFT and PPO, the truth
    # PPO's rollouts are checked against, and PPO's reward with step.reward_fn=rule. A name from
    # rlhf.rewards.REWARD_FNS or your own 'package.module:function'; null: the shipped tasks' rule
    # where it parses every prompt, else none.
    rule: str | None = None
    # auto: prompts and answers through the tokenizer's chat template where it has one (DeepSpeed-Chat's
    # " Human: ... Assistant:" turns parsed into messages); none: that text as it is, for any model.
    chat_template: str = "auto"

    @property
    def split_fractions(self) -> list[float]:
        parts = [float(x) for x in self.split.split(",")]
        return [p / sum(parts) for p in parts]

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError(f"data.sources is empty in blend {self.name!r}")
        from rlhf.data.adapters import ADAPTERS

        for i, src in enumerate(self.sources):
            _positive(f"data.sources[{i}].weight", src.weight)
            if src.adapter:
                _choice(f"data.sources[{i}].adapter", src.adapter, tuple(ADAPTERS))
            if src.columns and not {"prompt", "chosen"} <= set(src.columns) <= {"prompt", "chosen", "rejected"}:
                raise ConfigError(f"data.sources[{i}].columns={dict(src.columns)} must map prompt and chosen "
                                  "(and optionally rejected) to the table's column names")
            path = os.path.expanduser(src.path)
            if looks_local(src.path) and not os.path.exists(path):
                raise ConfigError(f"data.sources[{i}].path={src.path!r} does not exist")
        if self.rule:
            from rlhf.rewards import resolve

            resolve(self.rule, "data.rule")  # a bad reference fails now, naming what could not be imported
        for i, src in enumerate(self.ptx_sources):
            if looks_local(src.path) and not os.path.exists(os.path.expanduser(src.path)):
                raise ConfigError(f"data.ptx_sources[{i}].path={src.path!r} does not exist")
        try:
            parts = [float(x) for x in self.split.split(",")]
        except ValueError:
            raise ConfigError(f"data.split={self.split!r} must be comma-separated numbers like '2,4,4'") from None
        if len(parts) != 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
            raise ConfigError(f"data.split={self.split!r} must be three non-negative numbers (SFT, reward, "
                              "PPO) with a positive sum")
        _choice("data.on_bad_row", self.on_bad_row, ("drop", "skip", "error"))
        _choice("data.long_prompts", self.long_prompts, ("drop", "truncate_left"))
        _choice("data.chat_template", self.chat_template, ("auto", "none"))


# ------------------------------------------------------------------------------------- roles
