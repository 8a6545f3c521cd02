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
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from datasets import Dataset, concatenate_datasets, load_dataset

from rlhf import rewards
from rlhf.config import STEPS, ConfigError, DataConfig, DataError, SourceConfig, looks_local
from rlhf.data.adapters import (
    ADAPTERS,
    EVAL_SPLITS,
    HUB_CONFIGS,
    HUB_IDS,
    ChatFormat,
    chat_tokenizer,
    map_columns,
    render_conversation,
)

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
    """Map a source's own columns to prompt / chosen / rejected, naming the row and column that fail;
    with a ``tokenizer`` (rlhf.data.adapters.chat_tokenizer) prompts and answers are rendered through
    its chat template, DeepSpeed-Chat's turns parsed back into messages."""
    fmt = ChatFormat(tokenizer)
    name = src.adapter or (src.path if src.path in ADAPTERS else "")
    if name or src.columns:
        adapter = ADAPTERS[name] if name else map_columns(dict(src.columns))

        def fn(row: dict) -> dict:
            return fmt.row(adapter(row))
    elif "messages" in ds.column_names:
        name = "conversation"

        def fn(row: dict) -> dict:
            messages = row["messages"]
            if messages and messages[-1].get("role") != "assistant" and row.get("answer"):
                # A question with a reference answer: the answer is the assistant's turn to learn.
                messages = [*messages, {"role": "assistant", "content": row["answer"]}]
            prompt, chosen = render_conversation(messages, fmt=fmt)
            rejected = row.get("rejected") or ""
            if isinstance(rejected, list):  # a rejected conversation: its last answer
                rejected = render_conversation(rejected, fmt=fmt)[1]
            else:
                rejected = fmt.answer(rejected) if tokenizer is not None else rejected
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    else:
        if "chosen" not in ds.column_names and "answer" in ds.column_names:
            # Prompt-and-answer rows (a question with its reference answer): the answer is what SFT
            # learns and what a rule with a reference compares against; no rejected answer.
            ds = ds.rename_column("answer", "chosen")
        missing = [c for c in ("prompt", "chosen") if c not in ds.column_names]
        if missing:
            raise DataError(f"{key}.path={src.path!r} has no column {missing[0]!r}"
                            + (" (nor 'answer')" if missing[0] == "chosen" else "") + f" (columns: {ds.column_names}); "
                             f"set {key}.columns or {key}.adapter")
        if "rejected" not in ds.column_names:
            ds = ds.add_column("rejected", [""] * len(ds))
        ds = ds.select_columns(list(COMMON))
        if tokenizer is None:
            return ds
        name, fn = "", fmt.row

    def safe(row: dict, idx: int) -> dict:
        try:
            return fn(row)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
            raise DataError(f"{key} ({src.path}), row {idx + 1}: the {name or 'columns'} adapter cannot read it "
                             f"({type(err).__name__}: {err}); columns: {list(row)}") from None

    return ds.map(safe, with_indices=True, remove_columns=ds.column_names)


def _json_rows_ok(path: Path, on_bad_row: str, report: DataReport | None) -> Path:
    """A local json/jsonl file, checked before datasets reads it (whose errors name neither file nor
    line): a line that is not a JSON object stops the run naming file and 1-based line, or with
    data.on_bad_row=drop is dropped, counted, and the rest read from a cleaned copy; a file with no
    rows stops the run."""
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not valid JSON at line {err.lineno}, column {err.colno} ({err.msg})") from None
        if not rows:
            raise DataError(f"{path} holds no rows (an empty list)")
        return path
    kept, bad = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            ok = isinstance(json.loads(line), dict)
        except json.JSONDecodeError:
            ok = False
        (kept if ok else bad).append(line if ok else number)
    if bad and on_bad_row == "error":
        raise DataError(f"{path}, line {bad[0]}: not a JSON object ({len(bad)} such line(s)); set "
                        "data.on_bad_row=drop to drop and count them")
    if not kept:
        raise DataError(f"{path} holds no rows" + (f" ({len(bad)} line(s), none a JSON object)" if bad else " (empty)"))
    if not bad:
        return path
    if report is not None:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        report.drop("source", f"{path}: not a JSON object (line {shown})", len(bad))
    from rlhf.models import cache_root

    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    clean = cache_root() / "clean" / f"{path.stem}-{digest}.jsonl"
    clean.parent.mkdir(parents=True, exist_ok=True)
    tmp = clean.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text("\n".join(kept) + "\n")
    os.replace(tmp, clean)
    return clean


def _raw(src: SourceConfig, split: str, key: str, on_bad_row: str = "drop",
         report: DataReport | None = None) -> tuple[Dataset, str]:
    """One split of a source as datasets loads it, and what names it in messages (file or hub id)."""
    path = os.path.expanduser(src.path)
    if not looks_local(src.path):
        return load_dataset(HUB_IDS.get(src.path, src.path), HUB_CONFIGS.get(src.path), split=split), src.path
    p = Path(path)
    if p.is_dir():
        files = _split_files(p)
        if split not in files:
            raise DataError(f"{key}.path={src.path!r} has no '{split}' file "
                            f"(found: {', '.join(files) or 'none'}; formats {', '.join(FORMATS)})")
        p = Path(files[split])
    elif p.suffix not in FORMATS:
        raise DataError(f"{key}.path={src.path!r}: unknown format {p.suffix!r}; use {', '.join(FORMATS)}")
    readable = _json_rows_ok(p, on_bad_row, report) if p.suffix in (".json", ".jsonl") else p
    ds = load_dataset(FORMATS[p.suffix], data_files={"train": str(readable)}, split="train")
    if len(ds) == 0:
        raise DataError(f"{p} holds no rows")
    return ds, str(p)


def load_text_sources(cfg: DataConfig) -> list[str]:
    """Texts of data.ptx_sources: their `text` column (or columns.text)."""
    texts: list[str] = []
    for i, src in enumerate(cfg.ptx_sources):
        ds, _ = _raw(src, src.train_split, f"data.ptx_sources[{i}]", cfg.on_bad_row)
        column = src.columns.get("text", "text")
        if column not in ds.column_names:
            raise DataError(f"data.ptx_sources[{i}].path={src.path!r} has no column {column!r} "
                             f"(columns: {ds.column_names}); set data.ptx_sources[{i}].columns.text")
        texts += [t for t in ds[column] if isinstance(t, str) and t.strip()]
    return texts


def load_source(src: SourceConfig, split: str, index: int, tokenizer=None, on_bad_row: str = "drop",
                report: DataReport | None = None) -> Dataset:
    """One split of one source in the common columns, with ``source`` and ``row`` columns for error messages."""
    key = f"data.sources[{index}]"
    local_file = looks_local(src.path) and Path(os.path.expanduser(src.path)).is_file()
    if local_file and split != src.train_split:
        raise DataError(f"{key}.path={src.path!r} is a single file; it has no '{split}' split. "
                                "Point the source at a folder with train and eval files.")
    if not looks_local(src.path) and split == src.eval_split == "eval" and src.path in EVAL_SPLITS:
        split = EVAL_SPLITS[src.path]  # the dataset's own name for its evaluation split
    ds, name = _raw(src, split, key, on_bad_row, report)
    ds = _adapt(ds, src, key, tokenizer)
    ds = ds.add_column("row", list(range(len(ds))))
    return ds.add_column("source", [name] * len(ds))


def _seed_for(seed: int, path: str) -> int:
    # Per-source seed: adding a source to a blend must not reshuffle the others' splits. Keyed by the
    # source's name (hub id, or the folder/file name), never its absolute location: a checkout or
    # data folder elsewhere must get the same split, or the same command gives other numbers.
    name = path if not looks_local(path) else Path(os.path.expanduser(path)).name
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


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
        raise DataError("the blend selected no rows: every source's part is empty")
    out = concatenate_datasets(picked)
    return out.shuffle(seed=int(rng.integers(2**31))), counts.tolist()


def heldout_split(prompts: list, seed: int, cap: int = 0) -> tuple[list[int], list[int]]:
    """Indices of the held-out rows readiness rules select on (stop a step, keep its best model) and
    of the rows every reported figure comes from: the rows of the first and of the second half of the
    distinct ``prompts`` (one per row; all rows of a prompt stay in one part) shuffled by ``seed``
    (data.seed), at most ``cap`` prompts each (0: no cap). A rule that stops the moment a noisy
    estimate crosses its line, or keeps the best of many estimates, makes that estimate optimistic; a
    figure from prompts it never saw is not. Shuffled, because eval rows come in file order, source by
    source: halves in that order would select on the first sources of a blend and report on the last.
    The order depends on the number of distinct prompts and the seed alone (not on the prompts' type or
    text), so every step of a chain selects on the same prompts and reports on the same others."""
    distinct = list(dict.fromkeys(prompts))
    order = np.random.default_rng(seed).permutation(len(distinct))
    distinct = [distinct[i] for i in order]
    half = len(distinct) // 2
    size = min(half, cap) if cap > 0 else half
    select, report = set(distinct[:size]), set(distinct[half:half + size])
    return [i for i, p in enumerate(prompts) if p in select], [i for i, p in enumerate(prompts) if p in report]


def load_step_data(cfg: DataConfig, step: str, report: DataReport, tokenizer=None) -> tuple[Dataset, Dataset]:
    """Train rows of ``step``'s part of the blend, and the blend's eval rows (conversations rendered
    with ``tokenizer``'s chat template when it has one and data.chat_template=auto)."""
    part = STEPS[step].split_index
    tokenizer = chat_tokenizer(tokenizer, cfg.chat_template)
    trains, evals = [], []
    for i, src in enumerate(cfg.sources):
        full = load_source(src, src.train_split, i, tokenizer, cfg.on_bad_row, report)
        if STEPS[step].seqs_per_row == 2 and not any(full["rejected"]):  # pairs, or unpaired rows made of them
            raise DataError(f"data.sources[{i}] ({src.path}) has no rejected answers (prompt-and-answer rows): "
                            f"step {step} learns from preference pairs. Give it a source with chosen and rejected "
                            "answers, or train on these rows with SFT and PPO/GRPO against a rule (pipeline=rlvr)")
        trains.append(split_part(full, cfg.split_fractions, part, _seed_for(cfg.seed, src.path)))
        evals.append(load_source(src, src.eval_split, i, tokenizer, cfg.on_bad_row, report))
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


def references(cfg: DataConfig, tokenizer=None) -> dict[str, str]:
    """Each prompt's reference answer (its row's answer, or chosen) over every source's train and eval
    rows, keyed by the prompt as the steps render it: what a rule that takes a reference compares
    against. The answer is its content, without the chat template's end of turn."""
    table: dict[str, str] = {}
    tokenizer = chat_tokenizer(tokenizer, cfg.chat_template)
    fmt = ChatFormat(tokenizer)
    for i, src in enumerate(cfg.sources):
        for split in dict.fromkeys((src.train_split, src.eval_split)):
            try:
                rows = load_source(src, split, i, tokenizer, "drop", None)
            except DataError:
                continue  # a single file has no eval split; its train rows were read
            for prompt, chosen in zip(rows["prompt"], rows["chosen"], strict=True):
                if chosen:
                    table.setdefault(prompt, fmt.content(chosen))
    return table


def _reading_content(rule, data: DataConfig, tokenizer):
    """``rule`` scoring the content of each answer: the text before the template's end of turn (a
    policy that closes its turn with a text marker, or writes on past it, is scored on its answer)."""
    fmt = ChatFormat(chat_tokenizer(tokenizer, data.chat_template))
    if rule is None or not fmt.turn_end:
        return rule

    def score(prompt: str, answer: str) -> float:
        return rule(prompt, fmt.content(answer))

    score.ref = rule.ref  # type: ignore[attr-defined]
    return score


def data_rule(data: DataConfig, prompts: list[str], tokenizer=None):
    """rewards.task_rule for a step's data config: a rule that takes a reference reads it from the
    data's rows (rendered with ``tokenizer``, as the step renders its prompts)."""
    return _reading_content(rewards.task_rule(data.rule, prompts, lambda: references(data, tokenizer)), data, tokenizer)


def named_rule(ref: str, key: str, data: DataConfig, tokenizer=None):
    """rewards.resolve, with the data's rows as the references of a rule that takes one."""
    return _reading_content(rewards.resolve(ref, key, lambda: references(data, tokenizer)), data, tokenizer)
