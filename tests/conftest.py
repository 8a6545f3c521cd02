"""Shared test fixtures: hermetic caches, offline hubs, and Hydra composition of the real conf/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def rlhf_cache(tmp_path_factory):
    """Random models are built into a fresh cache per test session, never a user's."""
    path = tmp_path_factory.mktemp("rlhf_cache")
    os.environ["RLHF_CACHE"] = str(path)
    return path


def compose(overrides: list[str] | None = None):
    """The composed DictConfig that `python launch.py <overrides>` would get."""
    from rlhf.launch import compose_config

    return compose_config(overrides or [])
