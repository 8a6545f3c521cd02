"""Sources, DeepSpeed-Chat's per-step split, and weighted blends.

A source is a local folder (``{train,eval}.{jsonl,json,parquet}``), a single local file (train rows
only), or a hub dataset id; all go through ``datasets.load_dataset``. Each source's train rows are
shuffled with ``data.seed`` and cut into the SFT / reward / PPO parts of ``data.split`` ("2,4,4"),
so the three steps never train on the same row. A blend then samples from the sources' parts by
weight (with repetition where a weight asks for more rows than a part has).

    python -c "from rlhf.data.blend import load_step_data; ..."   # used by the runners
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from datasets import Dataset, concatenate_datasets, load_dataset

from rlhf.config import STEPS, ConfigError, DataConfig, SourceConfig, looks_local
from rlhf.data.adapters import ADAPTERS, EVAL_SPLITS, HUB_IDS, map_columns, render_conversation

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class DataReport:
    """What happened to the rows: written to the run directory, so nothing is dropped silently."""

    sources: dict[str, dict] = field(default_factory=dict)
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)
    cache: dict = field(default_factory=dict)

    def drop(self, split: str, reason: str, n: int = 1) -> None:
        bucket = self.dropped.setdefault(split, {})
        bucket[reason] = bucket.get(reason, 0) + n

    def as_dict(self) -> dict:
        return {"sources": self.sources, "dropped": self.dropped, "truncated": self.truncated, "cache": self.cache}


def _split_files(folder: Path) -> dict[str, str]:
    files: dict[str, str] = {}
    for f in sorted(folder.iterdir()):
        if f.suffix in FORMATS and f.stem not in files:
            files[f.stem] = str(f)
    return files


COMMON = ("prompt", "chosen", "rejected")


def _adapt(ds: Dataset, src: SourceConfig, key: str, tokenizer=None) -> Dataset:
    """Map a source's own columns to prompt / chosen / rejected, naming the row and column that fail."""
    name = src.adapter or (src.path if src.path in ADAPTERS else "")
    if name:
        fn = ADAPTERS[name]
    elif src.columns:
        fn = map_columns(dict(src.columns))
    elif "messages" in ds.column_names:
        name = "conversation"

        def fn(row: dict) -> dict:
            prompt, chosen = render_conversation(row["messages"], tokenizer)
            rejected = row.get("rejected") or ""
            if isinstance(rejected, list):  # a rejected conversation: its last answer
                rejected = render_conversation(rejected, tokenizer)[1]
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    else:
        missing = [c for c in ("prompt", "chosen") if c not in ds.column_names]
        if missing:
            raise ValueError(f"{key}.path={src.path!r} has no column {missing[0]!r} (columns: {ds.column_names}); "
                             f"set {key}.columns or {key}.adapter")
        if "rejected" not in ds.column_names:
            ds = ds.add_column("rejected", [""] * len(ds))
        return ds.select_columns(list(COMMON))

    def safe(row: dict, idx: int) -> dict:
        try:
            return fn(row)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"{key} ({src.path}), row {idx}: the {name or 'columns'} adapter cannot read it "
                             f"({type(err).__name__}: {err}); columns: {list(row)}") from None

    return ds.map(safe, with_indices=True, remove_columns=ds.column_names)


def _raw(src: SourceConfig, split: str, key: str) -> Dataset:
    path = os.path.expanduser(src.path)
    if not looks_local(src.path):
        return load_dataset(HUB_IDS.get(src.path, src.path), split=split)
    p = Path(path)
    if p.is_dir():
        files = _split_files(p)
        if split not in files:
            raise FileNotFoundError(f"{key}.path={src.path!r} has no '{split}' file "
                                    f"(found: {', '.join(files) or 'none'}; formats {', '.join(FORMATS)})")
        return load_dataset(FORMATS[Path(files[split]).suffix], data_files={split: files[split]}, split=split)
    if p.suffix not in FORMATS:
        raise ValueError(f"{key}.path={src.path!r}: unknown format {p.suffix!r}; use {', '.join(FORMATS)}")
    return load_dataset(FORMATS[p.suffix], data_files={"train": path}, split="train")


def load_text_sources(cfg: DataConfig) -> list[str]:
    """Texts of data.ptx_sources: their `text` column (or columns.text)."""
    texts: list[str] = []
    for i, src in enumerate(cfg.ptx_sources):
        ds = _raw(src, src.train_split, f"data.ptx_sources[{i}]")
        column = src.columns.get("text", "text")
        if column not in ds.column_names:
            raise ValueError(f"data.ptx_sources[{i}].path={src.path!r} has no column {column!r} "
                             f"(columns: {ds.column_names}); set data.ptx_sources[{i}].columns.text")
        texts += [t for t in ds[column] if isinstance(t, str) and t.strip()]
    return texts


def load_source(src: SourceConfig, split: str, index: int, tokenizer=None) -> Dataset:
    """One split of one source in the common columns, with ``source`` and ``row`` columns for error messages."""
    key = f"data.sources[{index}]"
    local_file = looks_local(src.path) and Path(os.path.expanduser(src.path)).is_file()
    if local_file and split != src.train_split:
        raise FileNotFoundError(f"{key}.path={src.path!r} is a single file; it has no '{split}' split. "
                                "Point the source at a folder with train and eval files.")
    if not looks_local(src.path) and split == src.eval_split == "eval" and src.path in EVAL_SPLITS:
        split = EVAL_SPLITS[src.path]  # the dataset's own name for its evaluation split
    ds = _raw(src, split, key)
    ds = _adapt(ds, src, key, tokenizer)
    ds = ds.add_column("row", list(range(len(ds))))
    return ds.add_column("source", [src.path] * len(ds))


def _seed_for(seed: int, path: str) -> int:
    # Per-source seed: adding a source to a blend must not reshuffle the others' splits.
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:4], "little")


def split_part(ds: Dataset, fractions: list[float], part: int, seed: int) -> Dataset:
    """Rows of one step's part; the parts are disjoint and together cover every row."""
    order = np.random.default_rng(seed).permutation(len(ds))
    bounds = np.round(np.cumsum([0.0, *fractions]) * len(ds)).astype(int)
    return ds.select(sorted(order[bounds[part]:bounds[part + 1]].tolist()))


def blend(parts: list[Dataset], weights: list[float], seed: int, total: int | None = None) -> tuple[Dataset, list[int]]:
    """Sample ``total`` rows (default: all rows of all parts) with probabilities proportional to weights."""
    rng = np.random.default_rng(seed)
    total = sum(len(p) for p in parts) if total is None else total
    probs = np.asarray(weights, dtype=float) / sum(weights)
    counts = np.floor(probs * total).astype(int)
    counts[: total - counts.sum()] += 1  # hand out the rounding remainder
    picked = []
    for part, k in zip(parts, counts, strict=True):
        if len(part) == 0 or k == 0:
            continue
        # Without replacement up to the part's size; a weight asking for more repeats whole passes.
        idx = np.concatenate([rng.permutation(len(part)) for _ in range(-(-k // len(part)))])[:k]
        picked.append(part.select(idx.tolist()))
    if not picked:
        raise ValueError("the blend selected no rows: every source's part is empty")
    out = concatenate_datasets(picked)
    return out.shuffle(seed=int(rng.integers(2**31))), counts.tolist()


def load_step_data(cfg: DataConfig, step: str, report: DataReport, tokenizer=None) -> tuple[Dataset, Dataset]:
    """Train rows of ``step``'s part of the blend, and the blend's eval rows (conversations rendered
    with ``tokenizer``'s chat template when it has one)."""
    part = STEPS[step].split_index
    trains, evals = [], []
    for i, src in enumerate(cfg.sources):
        full = load_source(src, src.train_split, i, tokenizer)
        trains.append(split_part(full, cfg.split_fractions, part, _seed_for(cfg.seed, src.path)))
        evals.append(load_source(src, src.eval_split, i, tokenizer))
        report.sources[src.path] = {"train_rows": len(full), f"{step}_part_rows": len(trains[-1]),
                                    "eval_rows": len(evals[-1]), "weight": src.weight}
    total = sum(len(t) for t in trains)
    if total == 0:
        raise ConfigError(f"data.split={cfg.split!r} leaves no train rows for step {step!r} (part {part})")
    if cfg.max_train_samples > 0:
        total = min(total, cfg.max_train_samples)
    train, counts = blend(trains, [s.weight for s in cfg.sources], cfg.seed, total)
    for src, k in zip(cfg.sources, counts, strict=True):
        report.sources[src.path]["sampled"] = k
    eval_ds = concatenate_datasets(evals)
    if 0 < cfg.max_eval_samples < len(eval_ds):
        eval_ds = eval_ds.shuffle(seed=cfg.seed).select(range(cfg.max_eval_samples))
    return train, eval_ds
