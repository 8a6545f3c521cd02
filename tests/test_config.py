"""Every YAML under conf/ composes and validates; each bad input fails with a message naming its key."""

from __future__ import annotations

import re
import subprocess

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from rlhf.config import Config, ConfigError, SFTStepConfig, to_schema
from tests.conftest import ROOT, compose, run_cli

GROUP_FILES = sorted(p for p in (ROOT / "conf").rglob("*.yaml") if p.parent != ROOT / "conf")


def test_conf_tree_is_found():
    groups = {p.parent.name for p in GROUP_FILES}
    assert {"model", "hardware", "zero", "step", "data"} <= groups


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: str(p.relative_to(ROOT / "conf")))
def test_every_config_file_composes_and_validates(path):
    group = path.parent.relative_to(ROOT / "conf").as_posix()
    if group.startswith("stage/"):
        # A stage file is a delta over its step's config, named after the step.
        stage = f"{group[len('stage/'):]}/{path.stem}"
        # DeepSpeed-Chat's lengths need a real model's positions; the tiny default has 256.
        model = [] if stage.startswith("e2e/") else ["model=opt-1.3b"]
        cfg = compose([f"step={path.stem}", *model, f"+stage={stage}"])
        assert isinstance(to_schema(cfg), Config)
        written = OmegaConf.load(path)
        written.pop("defaults", None)
        for key, value in _leaves(OmegaConf.to_container(written)):
            assert OmegaConf.select(cfg, key) == value, f"{stage}: {key}"
        return
    cfg = to_schema(compose([f"{group}={path.stem}"]))
    assert isinstance(cfg, Config)
    if group in ("model", "hardware", "data"):  # zero has no name; step, experiment, pipeline are _global_ deltas
        assert getattr(cfg, group).name == path.stem


def _leaves(node, prefix=""):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_default_config_is_typed():
    cfg = to_schema(compose())
    assert isinstance(cfg.step, SFTStepConfig)
    assert cfg.model.name == "tiny-llama" and cfg.zero.stage == 0 and cfg.hardware.precision == "fp32"
    assert cfg.step.global_batch_size == cfg.step.micro_batch_size_per_device * cfg.step.gradient_accumulation_steps


LEAF = re.compile(r"^\s*(- )?[\w.]+:\s*[^\s#]")
PARENT = re.compile(r"^\s*(- )?[\w.]+:\s*$")


def test_every_user_key_has_a_comment_line_above():
    """A leaf key needs a comment directly above it (or above its parent key when it is the first child)."""
    for path in GROUP_FILES + [ROOT / "conf" / "config.yaml"]:
        lines = path.read_text().splitlines()
        in_defaults = False
        for i, line in enumerate(lines):
            if line.startswith("defaults:"):
                in_defaults = True
                continue
            if in_defaults and (line.startswith(" ") or not line.strip()):
                continue
            in_defaults = False
            if not LEAF.match(line):
                continue
            above = lines[i - 1].strip() if i else ""
            parent_ok = PARENT.match(lines[i - 1]) and i > 1 and lines[i - 2].strip().startswith("#")
            assert above.startswith("#") or parent_ok, f"{path.relative_to(ROOT)}:{i + 1} {line.strip()!r} has no comment above"


# ------------------------------------------------------------------------------ bad input
def test_unknown_key_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="step.lrr"):
        compose(["step.lrr=1"])


def test_wrong_type_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="step.epochs"):
        compose(["step.epochs=many"])


def test_missing_zero_stage_names_the_group():
    with pytest.raises(MissingConfigException, match="zero"):
        compose(["zero=7"])


def test_stage_value_out_of_range_names_the_key():
    with pytest.raises(ConfigError, match="zero.stage=5"):
        to_schema(compose(["zero.stage=5"]))


def test_batch_not_divisible_names_the_keys():
    with pytest.raises(ConfigError, match="step.global_batch_size=10 is not divisible"):
        to_schema(compose(["step.global_batch_size=10", "step.micro_batch_size_per_device=4"]))


def test_missing_data_path_names_the_source():
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path='/nonexistent/data' does not exist"):
        to_schema(compose(["data.sources=[{path: /nonexistent/data}]"]))


@pytest.mark.parametrize("split", ["0,0,0", "1,2", "a,b,c", "-1,2,3"])
def test_bad_split_names_the_key(split):
    with pytest.raises(ConfigError, match="data.split"):
        to_schema(compose([f"data.split='{split}'"]))


def test_choice_errors_list_the_allowed_values():
    with pytest.raises(ConfigError, match="optim.scheduler='cosin' is not allowed; choose one of cosine, linear"):
        to_schema(compose(["optim.scheduler=cosin"]))
    with pytest.raises(ConfigError, match="hardware.precision=fp16 is not supported"):
        to_schema(compose(["hardware.precision=fp16"]))
    with pytest.raises(ConfigError, match="zero.offload_param needs zero.stage=3"):
        to_schema(compose(["zero=2", "zero.offload_param.device=cpu"]))


def _launch(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=300)


def test_cli_zero_7_exits_nonzero_naming_zero():
    proc = _launch("step=sft", "zero=7")
    assert proc.returncode != 0
    assert "zero" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_user_error_is_one_line_without_traceback(tmp_path):
    proc = _launch("step.global_batch_size=10", f"run_dir={tmp_path}")
    assert proc.returncode == 2
    assert "config error: step.global_batch_size=10" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "config.yaml").exists(), "nothing may be written before validation passes"


SWEEP_FILES = sorted((ROOT / "sweeps").rglob("*.yaml"))


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
def test_every_sweep_composes_and_sweeps_real_keys(path):
    from omegaconf import OmegaConf

    cfg = compose([f"sweep={path.stem}"])
    to_schema(cfg)
    params = OmegaConf.load(path).hydra.sweeper.params
    assert params, f"{path.name} sweeps nothing"
    for key in params:
        node = cfg
        for part in key.split("."):
            assert part in node, f"{path.name} sweeps {key!r}, which the config does not have"
            node = node[part]


def test_every_step_trains_on_its_part_of_the_split_with_the_roles_its_settings_build():
    """Each step's spec names its part of DeepSpeed-Chat's split and its roles (tests/test_steps.py
    runs every entry); PPO's settings leave out the roles they do not use."""
    from rlhf.config import STEPS
    # SFT, reward and PPO each train on their own part of the split; every preference method on the
    # reward part's pairs.
    assert [STEPS[s].split_index for s in ("sft", "reward", "ppo")] == [0, 1, 2]
    preference = [spec for spec in STEPS.values() if spec.runner == "preference"]
    assert {"dpo", "simpo"} <= {spec.schema.name for spec in preference}
    assert {spec.split_index for spec in preference} == {STEPS["reward"].split_index}
    ppo = to_schema(compose(["step=ppo", "step.reward_fn=rule", "step.reward_model_weight=0"]))
    from rlhf.config import step_roles

    assert [r.name for r in step_roles(ppo)] == ["actor", "reference", "critic"]


def test_a_key_added_with_plus_that_the_schema_lacks_is_refused_with_the_nearest_key():
    # Hydra's own hint for a misspelled key is `+key=...`; the run must not go on without it.
    with pytest.raises(ConfigError, match=r"step.max_step is not a key of the config; did you mean step.max_steps\?"):
        to_schema(compose(["+step.max_step=3"]))
    with pytest.raises(ConfigError, match="foo is not a key of the config"):
        to_schema(compose(["+foo.bar=1"]))


def test_a_misspelled_key_on_the_command_line_is_one_line_exit_2_with_the_nearest_key(tmp_path):
    """Without `+`, Hydra itself refuses the key (6 lines, exit 1, advice to add `+`): we say it in one."""
    from rlhf.config import check_override_keys

    with pytest.raises(ConfigError, match=r"step.kl_coeff is not a key of the config; did you mean step.kl_coef\?"):
        check_override_keys(["step=ppo", "step.kl_coeff=0.1"])
    check_override_keys(["step=ppo", "step.kl_coef=0.1", "zero=3"])  # known keys pass
    proc = run_cli("optim.lrr=1e-4", f"run_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "config error: optim.lrr is not a key of the config; did you mean optim.lr?"
    assert not (tmp_path / "config.yaml").exists()


def test_a_model_folder_that_does_not_exist_is_refused_before_anything_loads(tmp_path):
    from rlhf.launch import run

    with pytest.raises(ConfigError, match=r"model.path='./no-such-model' does not exist"):
        run(compose(["model.path=./no-such-model", "model.random_init=false", f"run_dir={tmp_path}"]))
    assert not (tmp_path / "config.yaml").exists()


def test_hydra_output_follows_run_dir(tmp_path):
    """With run_dir set, Hydra's own files go there, not into a second folder under ./runs."""
    proc = run_cli("step=sft", "launch.dry_run=true", f"run_dir={tmp_path / 'mine'}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "mine" / ".hydra" / "config.yaml").exists()


def test_the_reference_s_table_of_step_defaults_is_what_each_step_composes_to():
    """docs/reference.md's per-step defaults (learning rate, schedule, batch, length, eval cadence) are
    written by hand: each row is checked against the composed config of every step it names."""
    text = (ROOT / "docs" / "reference.md").read_text().split("| step (`conf/step/`) |", 1)[1]
    seen = set()
    for line in text.split("\n\n", 1)[0].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for step in re.findall(r"`([a-z]+)`", cells[0]):
            cfg = to_schema(compose([f"step={step}"]))
            lr = float(cells[1].split()[0])
            scheduler, warmup = (x.strip() for x in cells[2].split(","))
            got = (cfg.optim.lr, cfg.optim.scheduler, cfg.optim.warmup_steps, cfg.step.micro_batch_size_per_device,
                   cfg.step.max_seq_len, cfg.step.eval_every_steps)
            assert got == (lr, scheduler, int(warmup), int(cells[3]), int(cells[4]), int(cells[5].split()[0])), step
            seen.add(step)
    assert {"sft", "reward", "ppo", "dpo", "simpo", "orpo", "kto"} <= seen


@pytest.mark.parametrize(("override", "suggestion"), [
    ("max_steps=5", "step.max_steps"),                   # the right name under another group
    ("optim.learning_rate=1e-3", "optim.lr"),            # a peer trainer's name (TRL, transformers)
    ("learning_rate=1e-3", "optim.lr"),
    ("num_generations=8", "step.samples_per_prompt"),
    ("optim.lrr=1e-3", "optim.lr"),                      # a typo
])
def test_a_key_the_config_lacks_names_the_key_people_mean(override, suggestion):
    from rlhf.config import check_override_keys

    with pytest.raises(ConfigError, match=rf"is not a key of the config; did you mean {re.escape(suggestion)}\?$"):
        check_override_keys([override])


def test_a_hub_id_as_a_model_option_points_to_model_path():
    from rlhf.config import check_override_keys

    with pytest.raises(ConfigError, match=r"model=Qwen/Qwen2.5-0.5B: no such option; .* goes in "
                                          r"model.path=Qwen/Qwen2.5-0.5B"):
        check_override_keys(["model=Qwen/Qwen2.5-0.5B"])
