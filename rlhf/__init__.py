"""DeepSpeed-Chat's RLHF pipeline as a config-driven experiment framework: `python launch.py --help`."""

import os

# Without a GPU DeepSpeed falls back to its CPU accelerator, but warns about it on every import (each
# rank, each run). Naming that same fallback up front keeps the console for what matters; a
# DS_ACCELERATOR already set wins. The ranks inherit it through the environment.
if "DS_ACCELERATOR" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
