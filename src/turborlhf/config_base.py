"""The base of every config section: `Cfg` (unknown keys are errors, instances are frozen, no
true/false for a number, no infinite or NaN float) and `ConfigError`. Imports neither torch nor
transformers."""
from __future__ import annotations

import os
import types
import typing
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from turborlhf.errors import UserError

__all__ = ["Cfg", "ConfigError", "run_input", "is_run_input", "check_complete"]


class ConfigError(UserError, ValueError):
    """A config file or override is invalid; the message names the dotted field."""


def _scalar_kinds(ann: Any) -> set:
    """The plain types among bool/int/float/str/None a field annotation accepts (unions unpacked);
    any other type counts as ``object``."""
    if typing.get_origin(ann) in (Union, types.UnionType):
        return set().union(*(_scalar_kinds(a) for a in typing.get_args(ann)))
    return {ann} if ann in (bool, int, float, str, type(None)) else {object}


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, nested mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_input(description: str, api: str) -> Any:
    """A field a run needs that a config may be built without (None until set): the Python API's
    trainers fill it from an argument, `api` (``train_dataset=``), as TRL's do, so
    ``SFTConfig(output_dir=...)`` is a config and the dataset goes to ``SFTTrainer``. `load_config`
    and every trainer refuse a config that leaves it unset (`check_complete`); ``--help`` shows it
    as required."""
    return Field(None, description=description, json_schema_extra={"run_input": api})


def is_run_input(field: Any) -> bool:
    """Whether the pydantic field `field` is a `run_input`."""
    return isinstance(field.json_schema_extra, dict) and "run_input" in field.json_schema_extra


def check_complete(cfg: "Cfg", prefix: str = "") -> None:
    """`ConfigError`, one line naming each field, for a config without what a run needs
    (`Cfg.missing_inputs`: a data file, PPO's reward), e.g. ``data.train_file: required (set it in
    the config, or pass train_dataset= to the Python API's trainer)``."""
    missing = cfg.missing_inputs(prefix)
    if missing:
        raise ConfigError("; ".join(missing))


# fields holding a local path (or a hub id / zoo name, which never starts with "~"), besides *_file and *_dir
_PATH_FIELDS = frozenset({"name_or_path", "path", "input", "model", "reward_model", "ref_model"})


class Cfg(BaseModel):
    """Base for all config parts: unknown keys are errors, instances are immutable, and true/false
    never stands for a number nor a number for true/false (pydantic's lax mode reads ``true`` as 1
    and 1 as true)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)
    # device/precision choices made for this host by `turborlhf.engine.run.resolve_hardware`
    # (field → {value, reason}); not a field: never in YAML, saved as the run's hardware.json
    _hardware: dict = PrivateAttr(default_factory=dict)

    def missing_inputs(self, prefix: str = "") -> list[str]:
        """What a run of this config still needs, one message per field, sections' included: each
        `run_input` left None, named with `prefix` (``sft.`` for a pipeline stage). [] when complete."""
        out = []
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if value is None and is_run_input(field):
                out.append(f"{prefix}{name}: required (set it in the config, or pass "
                           f"{field.json_schema_extra['run_input']} to the Python API's trainer)")
            elif isinstance(value, Cfg):
                out += value.missing_inputs(f"{prefix}{name}.")
        return out

    @model_validator(mode="before")
    @classmethod
    def _sections_over_the_commands_defaults(cls, data: Any) -> Any:
        """A section given as a mapping completes the command's own default of that section (a
        preset's ``algo``, SFT's ``optim.lr``), as `turborlhf.config_io.load_config` does:
        ``GRPOConfig(algo={"kl_coef": 0})`` ran GAE with a critic, the ``algo`` section's class
        defaults, and ``SFTConfig(optim={...})`` lost SFT's learning rate. Epochs given without
        ``max_steps`` count over a default step count, as in a file."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, field in cls.model_fields.items():
            if isinstance(data.get(name), dict) and field.default_factory is not None:
                default = field.default_factory()
                if isinstance(default, BaseModel):
                    merged[name] = _merge(default.model_dump(mode="json", exclude_unset=True), data[name])
                    # ``train={"epochs": 2}`` over PPO's default of 20 steps: the epochs count, as in a YAML file
                    # (`turborlhf.config_io._epochs_over_default_steps`)
                    if ("epochs" in data[name] and "max_steps" not in data[name]
                            and merged[name].get("max_steps")):
                        merged[name]["max_steps"] = 0
        return merged

    @field_validator("*", mode="before")
    @classmethod
    def _home_in_paths(cls, value: Any, info: ValidationInfo) -> Any:
        """``~`` at the start of a path field (``output_dir: ~/runs/x``) is the home directory, as in
        a shell: it wrote to a directory named ``~`` under the working directory."""
        name = info.field_name or ""
        if (isinstance(value, str) and value.startswith("~")
                and (name.endswith(("_file", "_dir")) or name in _PATH_FIELDS)):
            return os.path.expanduser(value)
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_number_mixing(cls, value: Any, info: ValidationInfo) -> Any:
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        if bool in kinds and kinds <= {bool, type(None)} and value is not None and not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
