"""The time and cost forecast (rlhf/preflight/forecast/): FLOPs and ZeRO traffic against hand-worked numbers,
phases that add up, a preset without a price, and figures that do not depend on the machine."""

from __future__ import annotations

import pytest

from rlhf.config import ModelConfig, to_schema
from rlhf.preflight import forecast
from tests.conftest import compose, compose_step

# Two OPT-like layers of width 8: per layer 4h^2 + 4h (attention) + 2hf + f + h (feed-forward) + 4h
# (two LayerNorms) = 256 + 32 + 512 + 32 + 8 + 32 = 872 parameters; the LM head is 10 x 8 = 80.
TOY = ModelConfig(name="toy", family="opt", num_layers=2, hidden_size=8, num_heads=2, ffn_size=32, vocab_size=10,
                  max_positions=16, random_init=True)


def test_flops_by_hand():
    assert forecast.matmul_params(TOY, lm_head=True) == 2 * 872 + 80
    assert forecast.matmul_params(TOY, lm_head=False) == 2 * 872
    # 10 tokens attending to 4 on average: 10 * (2 * 1824 + 2 * 2 layers * 4 * 8) = 37,760.
    assert forecast.forward_flops(TOY, 10, 4, True) == 37_760
    # Training on sequences of 8 (causal: 4 on average): forward + two backward matmuls = 3 passes,
    # 4 with checkpointing; adapters only skip the frozen weights' gradients (2 passes).
    assert forecast.train_flops(TOY, 10, 8, True, checkpointing=False, lora=False) == 3 * 37_760
    assert forecast.train_flops(TOY, 10, 8, True, checkpointing=True, lora=False) == 4 * 37_760
    assert forecast.train_flops(TOY, 10, 8, True, checkpointing=True, lora=True) == 3 * 37_760


def test_generation_in_tensor_parallel_slices_by_hand():
    """Two devices each holding half of every layer decode both their rows together: per device and
    decoding step, half the layers' weights (the tied embedding whole), its own rows' KV cache, and two
    all-reduces per layer of the pair's activations, each sending and receiving half of it."""
    rates = forecast.Rates(flops=1e30, memory=1e9, link=1e9, layer_overhead_s=0.0, node_link=1e8)
    weights = forecast.param_counts(TOY)[0] * 2  # fp16
    tables = 2 * TOY.vocab_size * TOY.hidden_size  # OPT ties its head to the embedding
    kv = 2 * 2 * 4 * (4 + 2) * 8 * 2  # as in the test below: 4 rows, prompts and answers of 4
    # 2 layers x 2 all-reduces x 2 (t - 1) / t x (2 devices x 4 rows) x 8 wide x 2 bytes.
    reduce_step = 2 * 2 * 1 * 8 * 8 * 2 / 1e8
    prefill_reduce = 2 * 2 * 1 * 8 * 4 * 8 * 2 / 1e8  # the prompts' 4 tokens at once
    step = ((weights - tables) / 2 + tables + kv) / 1e9 + reduce_step
    assert forecast.generation_s(TOY, 4, 4, 4, 4, "fp16", rates, shards=2) == pytest.approx(
        prefill_reduce + 4 * step)
    whole = (weights + kv) / 1e9
    assert forecast.generation_s(TOY, 4, 4, 4, 4, "fp16", rates) == pytest.approx(4 * whole)


def test_zero_traffic_by_hand():
    """1,000 fp16 parameters (2,000 bytes) over 4 devices at 1 GB/s: one all-gather or reduce-scatter
    moves 3/4 of the tensor per device, 1.5 us."""
    rates = forecast.Rates(flops=1e12, memory=1e12, link=1e9, layer_overhead_s=0.0)
    one = 1.5e-6
    assert forecast.collective_s(2000, 4, rates) == pytest.approx(one)
    assert forecast.zero_comm_s(3, 1000, 1000, 2, 4, "fp16", rates) == pytest.approx(2 * 3 * one)
    assert forecast.zero_comm_s(2, 1000, 1000, 2, 4, "fp16", rates) == pytest.approx(3 * one)
    assert forecast.zero_comm_s(0, 1000, 1000, 2, 4, "fp16", rates) == pytest.approx(2 * one)
    assert forecast.zero_comm_s(3, 1000, 1000, 2, 1, "fp16", rates) == 0.0, "one device talks to nobody"


def test_a_decode_step_replayed_as_a_cuda_graph_by_hand(monkeypatch):
    """The eager loop reads the weights and the KV cache at its mean length per decoding step and pays
    a dispatch cost per layer; the static step replayed as a graph attends over the cache up to the
    end of its span (here the whole cache: 8 positions fit the first span) and dispatches nothing per
    layer. FLOPs are made free so that bytes alone count."""
    from rlhf.generation import decode

    # Spans of 4 positions, a prompt of 3 and an answer of 6: the tokens at positions 3..8 need 4..9
    # positions, rounded up to 4, 8, 8, 8, 8 and the whole cache, 9.
    monkeypatch.setattr(decode, "STATIC_SPAN", 4)
    assert forecast.static_attended(3, 6) == pytest.approx((4 + 8 + 8 + 8 + 8 + 9) / 6)
    monkeypatch.setattr(decode, "STATIC_SPAN", 0)
    assert forecast.static_attended(3, 6) == 9
    monkeypatch.undo()
    rates = forecast.Rates(flops=1e30, memory=1e9, link=1e9, layer_overhead_s=1e-3)
    weights = forecast.param_counts(TOY)[0] * 2  # fp16
    # 4 rows, prompts of 4, answers of 4: KV bytes = 2 (k, v) x 2 layers x 4 rows x length x 8 wide x 2 bytes.
    eager = weights / 1e9 + 2 * 2 * 4 * (4 + 2) * 8 * 2 / 1e9 + 2 * 1e-3
    graph = weights / 1e9 + 2 * 2 * 4 * (4 + 4) * 8 * 2 / 1e9
    assert forecast.generation_s(TOY, 4, 4, 4, 4, "fp16", rates) == pytest.approx(4 * eager)
    assert forecast.generation_s(TOY, 4, 4, 4, 4, "fp16", rates, static=True, graph=True) == pytest.approx(4 * graph)
    # A GPU PPO step forecasts the graph only where the actor is whole on the device.
    on = to_schema(compose(["experiment=opt-1.3b_a6000", "step=ppo", "step.decode_graph=true"]))
    off = to_schema(compose(["experiment=opt-1.3b_a6000", "step=ppo"]))
    f_on, f_off = forecast.forecast(on, part_rows=1000), forecast.forecast(off, part_rows=1000)
    assert f_on.phases["generation"] < f_off.phases["generation"]
    assert any("CUDA graph" in n for n in f_on.notes) and not any("CUDA graph" in n for n in f_off.notes)


@pytest.mark.parametrize("overrides", [
    ["experiment=opt-13b_8xa100-40g", "step=sft"],
    ["experiment=opt-66b_64xa100-80g", "step=ppo"],
    ["experiment=opt-1.3b_a6000", "step=reward"],
])
def test_phases_sum_to_the_total_and_the_price_makes_the_cost(overrides):
    cfg = to_schema(compose(overrides))
    f = forecast.forecast(cfg, rows=762_560)
    assert f.seconds == pytest.approx(sum(f.phases.values())) and all(v >= 0 for v in f.phases.values())
    assert f.device_hours == pytest.approx(f.seconds * cfg.world_size / 3600)
    text = forecast.table(f)
    if cfg.hardware.price_per_device_hour:
        assert f.cost == pytest.approx(f.device_hours * cfg.hardware.price_per_device_hour)
        assert f"at ${cfg.hardware.price_per_device_hour:g} per device-hour" in text
    else:
        assert f.cost is None and "time only" in text
    # Twice the rows, twice the steps and time, to a step's rounding (nothing else changes).
    assert forecast.forecast(cfg, rows=2 * 762_560).seconds == pytest.approx(2 * f.seconds, rel=0.05)


def test_the_forecast_of_a_gpu_preset_is_the_same_on_every_machine():
    """GPU presets read datasheet figures, never the machine running the dry-run: the figures are
    reproducible (bench/forecast.py relies on it); a layer-by-layer ZeRO-3 generation across 8 nodes
    shows up as generation time, several times what tensor-parallel slices over each node take."""
    cfg = to_schema(compose_step(["experiment=opt-66b_64xa100-80g"], "ppo"))  # with the chain's stage files
    a, b = forecast.forecast(cfg, part_rows=1000), forecast.forecast(cfg, part_rows=1000)
    assert a.as_dict() == b.as_dict()
    assert any("tensor-parallel slices over 8 ranks" in n for n in a.notes)
    layered = to_schema(compose_step(["experiment=opt-66b_64xa100-80g", "pipeline.ppo.step.zero3_generation=layerwise"],
                                     "ppo"))
    slow = forecast.forecast(layered, part_rows=1000)
    assert any("layer by layer" in n for n in slow.notes)
    assert slow.phases["generation"] > slow.phases["updates"]
    assert slow.phases["generation"] > 5 * a.phases["generation"]


def test_a_gpu_preset_without_a_peak_has_no_forecast_and_says_why(tmp_path, capsys):
    from rlhf.launch import run

    overrides = ["step=sft", "hardware=a6000", "model=opt-125m", "hardware.peak_tflops=0", "launch.dry_run=true",
                 f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    assert "forecast [sft]: none (hardware=a6000 has no hardware.peak_tflops" in capsys.readouterr().out


def test_the_project_s_own_h200_figures_are_forecast_within_one_and_a_half_times():
    """bench/forecast.py's own-H200 cells (bench/gpu.sh's SFT and PPO steps, rows of exact lengths,
    measured per training step): within the issue's 1.5x. The benchmark's lengths stand in for the
    data's, and the evaluations, which the measured figure leaves out, are taken out of the forecast."""
    from bench import forecast as bench

    for name, (cfg, measured, lengths) in bench.own_configs().items():
        f = forecast.forecast(cfg, lengths=lengths)
        assert ("(256 + 256) tokens" if name.startswith("ppo") else "x 512 tokens") in f.work, f.work
        per_step = (f.seconds - f.phases["evaluation"]) / f.steps
        assert 1 / 1.5 <= per_step / measured <= 1.5, (name, per_step, measured)


def test_zero_offload_by_hand_and_in_the_forecast():
    """8 devices, 8,000 16-bit parameters, 2 micro batches, host link and host memory at 1 GB/s (per
    device): the optimizer's share (1,000 parameters) sends gradients down and weights up (2 x 2,000
    bytes: 4 us) and CPU-Adam streams 34 bytes each (34 us); the parameters' share is fetched for the
    forward and the backward of each micro batch (2 x 2 x 2,000 bytes: 8 us). An offload preset shows
    it as its own phase; one without host figures leaves it out and says so."""
    cfg = to_schema(compose(["step=sft", "hardware=8xa100-80g", "zero=3-offload", "model=opt-1.3b"]))
    assert forecast.bytes_per_param(cfg.hardware.precision) == 2
    rates = forecast.Rates(flops=1e12, memory=1e12, link=1e9, layer_overhead_s=0.0, host_link=1e9, host_memory=1e9)
    assert forecast.offload_s(cfg, 8000, 8000, 2, rates, []) == pytest.approx(4e-6 + 34e-6 + 8e-6)
    f = forecast.forecast(cfg, rows=100_000)
    assert f.phases["offload"] > 0 and f.seconds == pytest.approx(sum(f.phases.values()))
    plain = forecast.forecast(to_schema(compose(["step=sft", "hardware=8xa100-80g", "zero=3", "model=opt-1.3b"])),
                              rows=100_000)
    assert "offload" not in plain.phases
    single = forecast.forecast(to_schema(compose(["step=sft", "hardware=a6000", "zero=2-offload", "model=opt-1.3b"])),
                               rows=100_000)
    assert any("no hardware.host_memory_gbs for hardware=a6000" in n for n in single.notes)


def test_cpu_training_overhead_is_probed_on_the_model_and_falls_back_per_layer():
    """On CPU a training micro batch's cost beyond its FLOPs is measured on a random copy of the
    model (cached per process); a model too large to probe, or rates without a probe (GPUs), use
    the per-layer figure."""
    tiny = to_schema(compose(["model=tiny-llama"])).model
    rates = forecast.Rates(flops=1e11, memory=float("inf"), link=float("inf"), layer_overhead_s=1e-4,
                           train_layer_overhead_s=2e-3, probe=("fp32", 1))
    probed = forecast.probe_cpu_training(tiny, "fp32", 1, 1e11)
    assert forecast.overheads_s(tiny, rates) == probed and min(probed) >= 0
    big = to_schema(compose(["model=opt-1.3b"])).model
    assert forecast.probe_cpu_training(big, "fp32", 1, 1e11) is None
    assert forecast.overheads_s(big, rates) == pytest.approx((big.num_layers * 2e-3, big.num_layers * 2e-3 / 3))
    gpu = forecast.Rates(flops=1e14, memory=1e12, link=1e11, layer_overhead_s=1e-4, train_layer_overhead_s=0.0)
    assert forecast.overheads_s(tiny, gpu) == (0.0, 0.0)


def test_the_policy_s_own_answers_are_forecast_only_where_a_rule_scores_the_prompts():
    """The reward model's pairs from the policy's answers and PPO's start check run only where a rule
    scores the prompts: the shipped task's chain forecasts both; on hub data without data.rule neither."""
    rates = forecast.Rates(flops=1e11, memory=1e10, link=1e9, layer_overhead_s=1e-5)
    hub = ["data.sources=[{path: Dahoas/rm-static}]"]

    def both(extra):
        return [forecast.forecast(to_schema(compose_step(["pipeline=e2e", *extra], s)), part_rows=1000, rates=rates,
                                  lengths=(20.0, 12.0)) for s in ("reward", "ppo")]

    (reward, ppo), (hub_reward, hub_ppo) = both([]), both(hub)
    assert reward.phases["policy samples"] > 0 and "policy samples" not in hub_reward.phases
    assert any("up to 4,000 pairs from the policy's own answers" in n for n in reward.notes)  # 1000 prompts x 4
    assert reward.steps > hub_reward.steps
    assert ppo.phases["evaluation"] > hub_ppo.phases["evaluation"]  # the start check's sampled pass
    assert ppo.phases["generation"] == hub_ppo.phases["generation"]


def test_hub_data_is_forecast_from_its_dataset_cards_published_rows():
    # DeepSpeed-Chat's four datasets: 76,256 + 112,052 + 33,143 + 76,256 train rows, 40% for the reward model.
    rows, how = forecast.step_rows(to_schema(compose(["data=dschat-blend", "step=reward"])))
    assert rows == int(297_707 * 0.4) and how.startswith("published (the dataset cards): 297,707 train rows")
    # UltraFeedback's preference split, not its other splits.
    cfg = to_schema(compose(["data=ultrafeedback", "step=sft"]))
    assert forecast.step_rows(cfg)[0] == int(61_135 * 0.2)
    cfg.data.sources[0].train_split = "train_gen"
    assert forecast.step_rows(cfg) == (0, "hub data: set launch.forecast_rows to the blend's train rows")


def test_a_launch_of_several_ranks_counts_its_start_up_and_the_ops_this_machine_has_not_compiled(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    rates = forecast.Rates(flops=1e12, memory=1e12, link=1e9, layer_overhead_s=0.0)

    def start_up(*overrides: str) -> float:
        found = forecast.forecast(to_schema(compose(["step=sft", "step.max_steps=10", *overrides])), part_rows=1000,
                                  rates=rates)
        return found.phases.get("start-up", 0.0)

    assert start_up("hardware=cpu") == 0.0  # in-process, and one CPU rank compiles no op
    # Two CPU ranks: the launch, and the shared-memory all-reduce compiled on this machine's first such run.
    assert start_up("hardware=cpu-2rank") == forecast.LAUNCH_S + forecast.OP_BUILD_S
    built = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built.parent.mkdir(parents=True)
    built.touch()
    assert start_up("hardware=cpu-2rank") == forecast.LAUNCH_S
    assert start_up("hardware=cpu-2rank", "zero=2-offload") == forecast.LAUNCH_S + forecast.OP_BUILD_S  # CPU-Adam
    # A GPU preset's machine is not this one: the launch is counted, its build cache is not guessed.
    gpu = forecast.forecast(to_schema(compose(["step=sft", "hardware=8xa100-80g", "zero=2-offload",
                                               "step.max_steps=10"])), part_rows=1000, rates=rates)
    assert gpu.phases["start-up"] == forecast.LAUNCH_S and any("cpu_adam" in n for n in gpu.notes)


def test_prompts_the_run_would_drop_for_length_are_said_and_not_counted(tmp_path):
    """A PPO step's prompts longer than step.max_prompt_len are dropped by the run at its start; the
    dry-run's forecast says how many, names the budget that keeps them, and counts only the rest. The
    data is built so that every prompt is either 3 words or 60: the count is exact by construction, and
    equals what the run's own prompt filter (rollout.prompt_dataset) drops from the same rows."""
    import json
    import random

    from rlhf.data.blend import DataReport
    from rlhf.generation.rollout import prompt_dataset
    from rlhf.preflight.forecast.work import data_tokenizer, step_data

    rng = random.Random(0)
    data = tmp_path / "mixed"
    data.mkdir()

    def row(i: int) -> dict:
        words = 60 if rng.random() < 0.4 else 3
        return {"prompt": f" Human: {i} " + " ".join(rng.choice("abcdefgh") for _ in range(words)) + " Assistant:",
                "chosen": " yes", "rejected": " no"}

    for split, n in (("train", 400), ("eval", 32)):
        (data / f"{split}.json").write_text(json.dumps([row(i) for i in range(n)]))
    cfg = to_schema(compose(["step=ppo", f"data.sources=[{{path: {data}}}]", "step.max_prompt_len=32",
                             "step.rollout_batch_size_per_device=8", "step.micro_batch_size_per_device=8"]))
    prompts = list(dict.fromkeys(step_data(cfg)[0]["prompt"]))
    long = sum(len(p.split()) > 60 for p in prompts)
    assert 0 < long < len(prompts)
    f = forecast.forecast(cfg)
    said = [n for n in f.notes if "longer than step.max_prompt_len=32" in n]
    assert said and said[0].startswith(f"{long} of {len(prompts)} train prompts"), f.notes
    assert "the run drops them" in said[0] and "pipeline.ppo.step.max_prompt_len" in said[0]
    assert f.work.startswith(f"{len(prompts) - long} prompts x"), f.work
    report = DataReport()
    prompt_dataset(step_data(cfg)[0], data_tokenizer(cfg), 32, report, "train")
    assert report.dropped["train"] == {"prompt longer than step.max_prompt_len=32": long}
    # The budget the note names keeps every prompt.
    fix = int(said[0].split("step.max_prompt_len=")[2].split()[0])
    kept = forecast.forecast(to_schema(compose(["step=ppo", f"data.sources=[{{path: {data}}}]",
                                                f"step.max_prompt_len={fix}", "step.rollout_batch_size_per_device=8",
                                                "step.micro_batch_size_per_device=8"])))
    assert not any("longer than step.max_prompt_len" in n for n in kept.notes), kept.notes
