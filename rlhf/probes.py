"""Probes of the environment that decide what a run can load: asked once, in seconds, before
anything waits on them.

    python -c "from rlhf.probes import hub_unreachable; print(hub_unreachable('facebook/opt-125m'))"
"""

from __future__ import annotations


def hub_unreachable(repo_id: str) -> str | None:
    """Why a hub model id cannot be loaded here, or None: it is in the Hugging Face cache, or the hub
    answers. Asked once, in seconds, instead of from_pretrained's minutes of retries on every rank."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set and it is not in the Hugging Face cache (HF_HOME)"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as err:
        return f"{host} cannot be reached ({err}) and it is not in the Hugging Face cache (HF_HOME)"
    return None
