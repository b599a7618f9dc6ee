"""The base of every config section: `Cfg` (unknown keys are errors, instances are frozen, no
true/false for a number, no infinite or NaN float) and `ConfigError`. Imports neither torch nor
transformers."""
from __future__ import annotations

import types
import typing
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationInfo, field_validator

from turborlhf.errors import UserError

__all__ = ["Cfg", "ConfigError"]


class ConfigError(UserError, ValueError):
    """A config file or override is invalid; the message names the dotted field."""


def _scalar_kinds(ann: Any) -> set:
    """The plain types among bool/int/float/str/None a field annotation accepts (unions unpacked);
    any other type counts as ``object``."""
    if typing.get_origin(ann) in (Union, types.UnionType):
        return set().union(*(_scalar_kinds(a) for a in typing.get_args(ann)))
    return {ann} if ann in (bool, int, float, str, type(None)) else {object}


class Cfg(BaseModel):
    """Base for all config parts: unknown keys are errors, instances are immutable, and true/false
    never stands for a number nor a number for true/false (pydantic's lax mode reads ``true`` as 1
    and 1 as true)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)
    # device/precision choices made for this host by `turborlhf.engine.run.resolve_hardware`
    # (field → {value, reason}); not a field: never in YAML, saved as the run's hardware.json
    _hardware: dict = PrivateAttr(default_factory=dict)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_number_mixing(cls, value: Any, info: ValidationInfo) -> Any:
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        if bool in kinds and kinds <= {bool, type(None)} and value is not None and not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
