"""Saving models in Hugging Face format from any ZeRO stage, with LoRA merged by default.

    python -c "from rlhf.checkpoint import save_hf_model; ..."   # used by the runners
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from rlhf.distributed import any_rank, sum_over_ranks


def gather_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full CPU state dict on rank 0 (None elsewhere).

    Under ZeRO-3 each parameter is gathered on its own, so peak device memory stays one parameter
    above the shard, not a whole model.
    """
    module = engine.module
    rank = dist.get_rank() if dist.is_initialized() else 0
    if engine.zero_optimization_stage() != 3:
        if rank != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    # Every name of a tied parameter (OPT's lm_head is its input embedding), as state_dict() has
    # them: a strict load of the state (LoRA merging) needs both.
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            if rank == 0:
                out[name] = out[seen[id(param)]]
            continue
        seen[id(param)] = name
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if rank == 0:
                out[name] = param.detach().to("cpu", copy=True)
    if rank == 0:
        # Persistent buffers only, as state_dict() has them (not e.g. LLaMA's rotary inv_freq).
        for prefix, sub in module.named_modules():
            for name, buf in sub.named_buffers(recurse=False):
                if buf is not None and name not in sub._non_persistent_buffers_set:
                    out.setdefault(f"{prefix}.{name}" if prefix else name, buf.detach().to("cpu", copy=True))
    return out if rank == 0 else None


def param_fingerprint(engine) -> tuple[float, float]:
    """(sum, sum of squares) of every parameter, summed over ranks: a cheap check that a model that
    must not train (PPO's reference) did not, and that one that must (the actor) did."""
    totals = torch.zeros(2, dtype=torch.float64)
    for p in engine.module.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data  # a ZeRO-3 rank holds a shard
        local = local.detach().double().cpu()
        totals += torch.stack([local.sum(), local.pow(2).sum()])
    if engine.zero_optimization_stage() == 3:
        totals = sum_over_ranks(totals)
    return totals[0].item(), totals[1].item()


def _fresh_like(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """An untrained CPU twin of ``module`` (causal LM or reward model), built from its config."""
    from transformers import AutoModelForCausalLM

    from rlhf.models import RewardModel

    if isinstance(module, RewardModel):
        return RewardModel.from_config(module.config, dtype=dtype)
    return AutoModelForCausalLM.from_config(module.config, dtype=dtype)


# ----------------------------------------------------------------------------- a full disk
def _out_of_space(err: BaseException) -> str | None:
    """Why ``err`` (or an error it came from) is a write that ran out of room, or None. torch.save
    reports a short write from C++ without an errno ("file write failed", "unexpected pos"), so
    for those the reason is read from the machine: a full disk or a file-size limit."""
    import errno
    import resource

    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            return os.strerror(err.errno)
        text = str(err)
        for sign in ("No space left", "File too large", "Disk quota"):
            if sign in text:
                return sign
        if "file write failed" in text or "unexpected pos" in text:
            if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
                return "a write was cut short (the disk is full or a file reached the file-size limit)"
            return "a write was cut short (the disk is full)"
        err = err.__cause__ or err.__context__
    return None


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def space_error(why: str, folder: Path, what: str, needed: int, kept: str):
    """The one-line error of a save that ran out of room: the folder, the bytes it takes, what is free
    there (and the file-size limit, if one is set), and what was kept."""
    import resource
    import shutil

    from rlhf.errors import DiskFullError

    root = next((p for p in [Path(folder), *Path(folder).parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(root).free
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limit_text = "" if limit == resource.RLIM_INFINITY else f", and a file-size limit (ulimit -f) of {_size(limit)}"
    return DiskFullError(f"cannot write {what} into {folder}: {why}. It takes about {_size(needed)}; {_size(free)} "
                         f"free there{limit_text}. {kept}; free space and run the same command again")


def save_hf_model(engine, tokenizer, out: Path, merge_lora: bool = True) -> Path | None:
    """Write config, safetensors weights and tokenizer that from_pretrained loads (rank 0 writes).

    Causal LMs load with AutoModelForCausalLM, reward models with
    AutoModelForSequenceClassification. LoRA adapters are merged into the base weights unless
    ``merge_lora`` is false (then only the adapter is written, PEFT's format). The folder is written
    beside ``out`` and renamed into place: a save cut short (a full disk) never leaves a model folder
    that looks whole.
    """
    import shutil

    state = gather_state_dict(engine)
    if state is None:
        if dist.is_initialized():
            dist.barrier()
        return None
    final, out = out, out.with_name(f".tmp-{out.name}")
    shutil.rmtree(out, ignore_errors=True)
    try:
        _write_hf(engine.module, state, tokenizer, out, merge_lora)
    except Exception as err:
        if not (why := _out_of_space(err)):
            raise
        shutil.rmtree(out, ignore_errors=True)
        needed = sum(t.numel() * t.element_size() for t in state.values())
        latest = final.parent / "checkpoints" / "latest"
        kept = (f"The checkpoint {latest.read_text().strip()} is kept and a rerun resumes from it" if latest.exists()
                else "No checkpoint was saved (checkpoint.every_steps), so a rerun trains again")
        raise space_error(why, final.parent, f"the model {final.name}/", needed, kept) from err
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)
    if dist.is_initialized():
        dist.barrier()
    return final


def _write_hf(module, state: dict, tokenizer, out: Path, merge_lora: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(module, "peft_config") and merge_lora:
        from peft import get_peft_model

        # Rebuild the wrapped model on CPU, load the trained state, merge the adapters: the output
        # is a plain model that needs no PEFT to use.
        base = module.get_base_model()
        fresh = get_peft_model(_fresh_like(base, next(iter(state.values())).dtype), module.peft_config["default"])
        fresh.load_state_dict(state, strict=True)
        merged = fresh.merge_and_unload()
        if hasattr(base, "generation_config"):
            merged.generation_config = base.generation_config
        merged.save_pretrained(out, state_dict=merged.state_dict())
    else:
        module.save_pretrained(out, state_dict=state)
    tokenizer.save_pretrained(out)


# ----------------------------------------------------------------------------- exact resume
def rng_state() -> dict:
    """Python, numpy and torch RNG states in types torch.load(weights_only=True) accepts."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached],
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])


class Checkpointer:
    """Atomic periodic checkpoints of a runner's trainable engines plus its client state.

    A checkpoint is written into ``checkpoints/.tmp-step_N`` by every rank (DeepSpeed's
    save_checkpoint per engine, one client-state file per rank), renamed into place by rank 0, and
    only then is ``checkpoints/latest`` replaced -- so a crash during a save leaves the previous
    checkpoint usable. The last ``keep_last`` are kept. Client state holds the step, the position in
    the data, RNG states and whatever the runner adds; it is read with weights_only=True.
    """

    def __init__(self, run_dir: Path, engines: dict, every_steps: int, keep_last: int):
        self.root = Path(run_dir) / "checkpoints"
        self.engines, self.every_steps, self.keep_last = engines, every_steps, keep_last
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def save(self, step: int, state: dict, name: str | None = None, make_latest: bool = True) -> Path:
        import shutil

        name = name or f"step_{step:08d}"
        tmp, final = self.root / f".tmp-{name}", self.root / name
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        try:
            for role, engine in self.engines.items():
                engine.save_checkpoint(str(tmp), tag=role, save_latest=False)
            torch.save({"state": state, "rng": rng_state()}, tmp / f"client_rank{self.rank}.pt")
        except Exception as err:
            # A full disk or a file-size limit: this rank stops with one line; the launcher stops the
            # others. The half-written folder goes; `latest` still names the last whole checkpoint.
            if not (why := _out_of_space(err)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise space_error(why, self.root, f"the checkpoint {name}", self._bytes_needed(),
                              self._kept()) from err
        self._barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            if make_latest:
                pointer = self.root / "latest.tmp"
                pointer.write_text(name)
                os.replace(pointer, self.root / "latest")  # the pointer moves last
                kept = sorted(p for p in self.root.glob("step_*") if p.is_dir())
                for old in kept[: max(len(kept) - self.keep_last, 0)]:
                    shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        if self.rank == 0:  # after the barrier: the other ranks train on while rank 0 draws
            from rlhf.observe import curves

            curves.refresh(self.root.parent, at_checkpoint=True)
        return final

    def _kept(self) -> str:
        pointer = self.root / "latest"
        if pointer.exists():
            return f"The previous checkpoint {pointer.read_text().strip()} is kept and a rerun resumes from it"
        return "No earlier checkpoint exists, so a rerun starts over"

    def _bytes_needed(self) -> int:
        """The size of the last whole checkpoint, or (the first one) about what its engines hold: the
        weights plus fp32 master weights and two Adam moments per trainable parameter."""
        pointer = self.root / "latest"
        if pointer.exists() and (last := self.root / pointer.read_text().strip()).is_dir():
            return folder_bytes(last)
        return sum(p.numel() * (p.element_size() + (12 if p.requires_grad else 0))
                   for engine in self.engines.values() for p in engine.module.parameters())

    def after_step(self, step: int, state: dict, stop: StopRequest, logger, what: str) -> None:
        """At an optimizer-step boundary: save when due or when a signal asked to stop; then stop.

        A signal reaches the ranks at different moments; saving is collective, so every rank acts
        on the signal as soon as any rank has it (a rank saving alone would hang the job)."""
        stop_now = any_rank(bool(stop))
        if self.due(step) or stop_now:
            self.save(step, state)
        if stop_now:
            logger.close()
            raise SystemExit(f"[{what}] stopped by signal {stop.signum or 'on another rank'} after step {step}; "
                             "checkpoint saved")

    def stop_if_nonfinite(self, step: int, state: dict, what: str, value: float, unit: str = "optimizer step"):
        """When ``value`` is not finite on any rank: save the state, marked and never made `latest`,
        and stop the run naming the step. Every rank decides from the same reduced flag."""
        if not any_rank(not math.isfinite(value)):
            return
        where = self.save(step, state, name=f"nonfinite_step_{step:08d}", make_latest=False)
        raise FloatingPointError(f"{what} is {value} at {unit} {step} (on this or another rank); the state is "
                                 f"saved, marked, in {where}")

    def load(self) -> dict | None:
        """Restore the engines from the latest checkpoint; its client state (RNG states under
        "rng", for the runner to set where its straight run was), or None.

        A checkpoint that cannot be read (a truncated file, a disk that filled up) is named in a
        warning and the next older kept one is tried; every rank moves on together."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        latest = pointer.read_text().strip()
        older = sorted((p.name for p in self.root.glob("step_*") if p.is_dir() and p.name != latest), reverse=True)
        for name in [latest, *older]:
            folder = self.root / name
            try:
                for role, engine in self.engines.items():
                    engine.load_checkpoint(str(folder), tag=role, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
                saved = torch.load(folder / f"client_rank{self.rank}.pt", weights_only=True)
                error = None
            except Exception as err:  # noqa: BLE001 - any unreadable file: fall back, named
                error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if not any_rank(error is not None):
                return {**saved["state"], "rng": saved["rng"]}
            if self.rank == 0:
                print(f"[checkpoint] WARNING: cannot resume from {folder} ({error or 'failed on another rank'}); "
                      "trying the previous kept checkpoint", flush=True)
        raise RuntimeError(f"no checkpoint in {self.root} can be read; start over with resume=never or delete "
                           f"{self.root}")

class StopRequest:
    """SIGINT / SIGTERM set a flag; the runner finishes its optimizer step, saves and exits."""

    # The last signal any stop request of this process got: a rank running a chain's steps in turn
    # (rlhf.worker) reads it between steps, as a signal after a loop's last look would otherwise be lost.
    last_signal = 0

    def __init__(self):
        import signal

        self.signum = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        from rlhf.launch import ranks

        self.signum = StopRequest.last_signal = signum
        ranks.ended("signal", f"signal {signum}")

    def __bool__(self) -> bool:
        return self.signum != 0
