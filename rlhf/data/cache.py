"""Tokenized datasets cached on disk, keyed by everything that changes them.

The key covers the tokenizer (its full serialized form and chat template), the step and its length
settings, the whole data config (sources, adapters, columns, weights, split, seed, caps, bad-row
rule) and a fingerprint of every local source file (size and modification time). Global rank 0
builds a missing entry (into a temporary folder, renamed into place) while the other ranks wait;
everyone then reads it with the datasets library's own ``load_from_disk`` -- no pickles. Hub
sources are keyed by id only: a dataset that changes on the hub under the same id needs
``RLHF_CACHE`` cleared.

    python -c "from rlhf.data.cache import cached_step_data; ..."   # used by the runners
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist
from datasets import Dataset, load_from_disk

from rlhf.config import DataConfig, looks_local
from rlhf.data.blend import DataReport, load_step_data

VERSION = 1


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([getattr(tokenizer, "chat_template", None), tokenizer.bos_token_id, tokenizer.eos_token_id,
                        tokenizer.pad_token_id])
    return hashlib.sha256((text + extra).encode()).hexdigest()


def source_fingerprint(path: str) -> list:
    if not looks_local(path):
        return [path]
    root = Path(os.path.expanduser(path))
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [[str(f.relative_to(root) if f != root else f.name), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def cache_key(step: str, data: DataConfig, tokenizer, settings: dict) -> str:
    key = {"version": VERSION, "step": step, "settings": settings, "data": asdict(data),
           "tokenizer": tokenizer_fingerprint(tokenizer),
           "sources": [source_fingerprint(s.path) for s in data.sources]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached_step_data(step: str, data: DataConfig, tokenizer, settings: dict, report: DataReport,
                     tokenize: Callable[[Dataset, str, DataReport], Dataset]) -> tuple[Dataset, Dataset, list[str]]:
    """(tokenized train rows, tokenized eval rows, eval prompts) of a step, from the cache or built."""
    from rlhf.models import cache_root

    digest = cache_key(step, data, tokenizer, settings)
    folder = cache_root() / "tokenized" / f"{step}-{digest}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    hit = (folder / "report.json").exists()
    if not hit and rank == 0:
        fresh = DataReport()
        train_rows, eval_rows = load_step_data(data, step, fresh, tokenizer)
        parts = {"train": tokenize(train_rows, "train", fresh), "eval": tokenize(eval_rows, "eval", fresh),
                 "eval_prompts": Dataset.from_dict({"prompt": list(eval_rows["prompt"])})}
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        for name, ds in parts.items():
            ds.save_to_disk(str(tmp / name))
        (tmp / "report.json").write_text(json.dumps(fresh.as_dict()))
        try:
            os.rename(tmp, folder)
        except OSError:  # built concurrently by another run with the same key: identical content
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    saved = json.loads((folder / "report.json").read_text())
    report.sources, report.dropped, report.truncated = saved["sources"], saved["dropped"], saved["truncated"]
    report.cache = {"hit": hit, "key": digest, "folder": str(folder)}
    prompts = list(load_from_disk(str(folder / "eval_prompts"))["prompt"])
    return load_from_disk(str(folder / "train")), load_from_disk(str(folder / "eval")), prompts
