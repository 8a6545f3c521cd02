"""How a PPO step's time grows with model size and with answer length, on this machine.

Runs the real PPO runner (as bench/ppo_step.py does: one process, 4 prompts of 64 tokens, eos
suppressed, bf16) over three random OPT sizes at 64 answer tokens, and over three answer lengths at
the middle size. Prints one JSON line per point with the per-phase medians, then one JSON line with
the fitted growth exponents (slope of log time against log size or log length: 1.0 is linear) and
writes a two-panel PNG. With a KV cache, generation should grow about linearly in the answer length
(each new token attends to the ones before it, which is cheap at these lengths next to the matmuls).

    python bench/scaling.py                      # writes runs/bench_scaling/scaling.png
    python bench/scaling.py --steps 4 --out /tmp/scaling
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ppo_step import runner_step_times  # noqa: E402

# (hidden, layers, heads): about 1.3M, 5.3M and 21M parameters with the 8192-token vocabulary.
SIZES = [(128, 2, 4), (256, 4, 8), (512, 6, 8)]
LENGTHS = [32, 64, 128]


def model_overrides(hidden: int, layers: int, heads: int) -> list[str]:
    return ["model=tiny-opt", f"model.name=bench-opt-{hidden}x{layers}", f"model.hidden_size={hidden}",
            f"model.num_layers={layers}", f"model.num_heads={heads}", f"model.ffn_size={4 * hidden}",
            "model.vocab_size=8192", "model.max_positions=256"]


def params(hidden: int, layers: int, vocab: int = 8192) -> int:
    """Weights of an OPT-shaped model (embeddings tied with the head), biases and norms left out."""
    return layers * 12 * hidden * hidden + vocab * hidden


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x: the growth exponent."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per point (after 2 warm-up steps)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_scaling")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from rlhf.preflight.probes import cpu_bf16

    points = []
    for hidden, layers, heads in SIZES:
        for new in LENGTHS if hidden == SIZES[1][0] else [64]:
            med, cfg, _ = runner_step_times(model_overrides(hidden, layers, heads), args.steps, new_tokens=new)
            point = {"hidden": hidden, "layers": layers, "params_m": round(params(hidden, layers) / 1e6, 2),
                     "new_tokens": new, **{k: round(v, 4) for k, v in med.items()}}
            print(json.dumps(point), flush=True)
            points.append(point)

    by_size = sorted((p for p in points if p["new_tokens"] == 64), key=lambda p: p["params_m"])
    by_length = sorted((p for p in points if p["hidden"] == SIZES[1][0]), key=lambda p: p["new_tokens"])
    growth = {f"{phase}_vs_{axis}": round(slope([p[key] for p in pts], [p[phase] for p in pts]), 3)
              for axis, key, pts in (("params", "params_m", by_size), ("length", "new_tokens", by_length))
              for phase in ("generate_s", "train_s", "step_s")}
    (args.out / "scaling.json").write_text(json.dumps({"points": points, "growth": growth}, indent=1))
    plot(by_size, by_length, args.out / "scaling.png")
    print(json.dumps({"growth_exponents": growth, "cpu_bf16": cpu_bf16(), "threads": cfg.hardware.torch_threads,
                      "plot": str(args.out / "scaling.png")}))


def plot(by_size: list[dict], by_length: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, pts, key, label in ((axes[0], by_size, "params_m", "parameters per model (M), 64 answer tokens"),
                                (axes[1], by_length, "new_tokens", f"answer tokens, hidden {SIZES[1][0]}")):
        for phase in ("generate_s", "experience_s", "train_s", "step_s"):
            ax.plot([p[key] for p in pts], [p[phase] for p in pts], marker="o", label=phase.removesuffix("_s"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([p[key] for p in pts], [str(p[key]) for p in pts], minor=False)
        ax.minorticks_off()
        ax.set_xlabel(label)
        ax.set_ylabel("seconds per PPO step (median)")
        ax.legend()
    fig.suptitle("PPO step time on CPU (actor, reference, critic and reward model of one size)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()
