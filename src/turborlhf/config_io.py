"""Loading, overriding and describing the configs of `turborlhf.config`: YAML file + dotted
overrides → a validated config (`load_config`), one section validated alone (`validate_section`),
a config back to a plain dict (`config_to_dict`), and the help text of every field (`config_help`).
Re-exported by `turborlhf.config`, where callers import them from.

This module imports neither torch nor transformers.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from turborlhf.config import Cfg, ConfigError
from turborlhf.config_base import check_complete, is_run_input

C = TypeVar("C", bound=Cfg)

def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: cannot set a sub-field of non-mapping '{p}'")
        node = child
    node[parts[-1]] = value


def parse_override(text: str, cls: type[Cfg] | None = None) -> tuple[str, Any]:
    """``"a.b=3"`` → ``("a.b", 3)``; the value is parsed as YAML (numbers, bools, lists, null),
    except for a text field of `cls` (``str``/``Optional[str]``), which keeps the text as given
    (``null`` aside): YAML would read ``#`` as a comment and ``2024`` as a number. A text value
    wholly in matching quotes (``name="a b"``, as a script may pass it) loses them, as Hydra's do.
    Elsewhere a number YAML 1.1 reads otherwise (octal ``010``, base-60 ``1:30``) is a `ConfigError`."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if cls is not None and _is_text(_field_annotation(cls, key)) and raw.strip() not in ("null", "~"):
        return key, _unquote(raw)
    try:
        value = _load_yaml(raw, field=key) if raw.strip() else ""
    except _Yaml11NumberError as e:
        raise ConfigError(e.problem) from None
    except yaml.YAMLError:
        value = raw
    return key, value


def _unquote(raw: str) -> str:
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            return raw
        if isinstance(value, str):
            return value
    return raw


def _field_annotation(cls: type[Cfg], dotted: str) -> Any:
    """The annotation of the dotted field of `cls` (None where the path leaves the config classes)."""
    node: Any = cls
    ann = None
    for part in dotted.split("."):
        if node is None or part not in node.model_fields:
            return None
        ann = node.model_fields[part].annotation
        node = getattr(node, "stage_configs", {}).get(part) or _cfg_class(ann)    # a pipeline stage: its command's
    return ann


def _is_text(ann: Any) -> bool:
    return ann is str or (getattr(ann, "__args__", None) is not None and set(ann.__args__) == {str, type(None)})


def _format_error(err: ValidationError, prefix: str = "", cls: type[Cfg] | None = None) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(config)"
        lines.append(f"{prefix}{loc}: {e['msg']}{_did_you_mean(cls, e)}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _did_you_mean(cls: type[Cfg] | None, error: dict) -> str:
    """`` (did you mean 'lr'?)`` for an unknown key of `cls` close to one of its section's fields."""
    import difflib

    if cls is None or error.get("type") != "extra_forbidden" or not error["loc"]:
        return ""
    node: Any = cls
    for part in error["loc"][:-1]:
        node = _cfg_class(node.model_fields[part].annotation) if part in getattr(node, "model_fields", {}) else None
    close = difflib.get_close_matches(str(error["loc"][-1]), list(getattr(node, "model_fields", {})), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def default_tree(cls: type[Cfg]) -> dict:
    """The defaults of `cls` as a nested dict, as the command sets them (a section's
    ``default_factory`` wins over the section class's own defaults), so that overriding one field
    of a section keeps the command's other defaults. Required fields are left out."""
    tree: dict = {}
    for name, f in cls.model_fields.items():
        if f.is_required():
            sub = _cfg_class(f.annotation)
            if sub is not None:
                tree[name] = default_tree(sub)
            continue
        value = f.get_default(call_default_factory=True)
        tree[name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else json.loads(json.dumps(value))
    return tree


# YAML 1.1 (PyYAML) reads a plain integer with a leading zero as octal: ``seed: 010`` is 8.
_LEADING_ZERO_INT = re.compile(r"[-+]?0[0-7_]+")
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _Yaml11NumberError(yaml.constructor.ConstructorError):
    """A plain scalar YAML 1.1 reads as a number other than the one written: a leading-zero integer
    whose octal value differs from its decimal one, or a base-60 (``1:30``) integer or float."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (PyYAML keeps the last value
    silently: ``lr: 1e-5`` ... ``lr: 3e-4`` further down trained at 3e-4), an integer with a
    leading zero that YAML 1.1 would read as octal (``max_steps: 010`` ran 8 steps), and a plain
    scalar with colons that YAML 1.1 would read as a base-60 number (``run_name: 1:30`` is 90,
    ``1:30.5`` is 90.5): `_Yaml11NumberError` naming the dotted field. ``0``, ``00`` and ``07`` (the
    same either way), ``0:30`` and ``12:60`` (text to YAML 1.1 too) and quoted text stay."""

    field = ""       # the dotted field the document is the value of (an override), "" for a file

    def construct_document(self, node):
        self._refuse_yaml11_numbers(node, self.field, set())
        return super().construct_document(node)

    def _refuse_yaml11_numbers(self, node, path: str, seen: set) -> None:
        if id(node) in seen:        # an alias: checked where its anchor is
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                self._refuse_yaml11_numbers(value_node, f"{path}.{key}" if path else str(key), seen)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._refuse_yaml11_numbers(item, f"{path}[{i}]", seen)
        elif node.tag == _INT and _LEADING_ZERO_INT.fullmatch(node.value):
            text = node.value.replace("_", "")
            if int(text, 8) != int(text, 10):
                raise _Yaml11NumberError(None, None, f"{path or 'value'}: {node.value} would be read as octal "
                                         f"{int(text, 8)} (YAML 1.1); write {int(text, 10)} or {int(text, 8)}",
                                         node.start_mark)
        elif node.tag in (_INT, _FLOAT) and ":" in node.value:       # no other int or float has a colon
            value = self.construct_yaml_int(node) if node.tag == _INT else self.construct_yaml_float(node)
            raise _Yaml11NumberError(None, None, f"{path or 'value'}: {node.value} would be read as the base-60 "
                                     f"number {value} (YAML 1.1); quote it ('{node.value}') for text, "
                                     f"or write {value}", node.start_mark)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first at line {seen[key] + 1})", key_node.start_mark)
            seen.setdefault(key, key_node.start_mark.line)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, field: str = "") -> Any:
    loader = _UniqueKeyLoader(text)
    loader.field = field
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML config file holds; `ConfigError` naming the file when it is missing, not
    YAML (a key given twice in one mapping included), or not a mapping, and naming the line and the
    dotted field of a plain number that YAML 1.1 reads otherwise: an integer with a leading zero,
    octal to it (``seed: 010``), or colons, base 60 to it (``run_name: 1:30`` is 90)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = _load_yaml(p.read_text()) or {}
    except _Yaml11NumberError as e:
        raise ConfigError(f"{p}, line {e.problem_mark.line + 1}: {e.problem}") from None
    except (OSError, UnicodeDecodeError) as e:      # a directory, a binary file, no permission
        raise ConfigError(f"{p}: cannot read it as a YAML config ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {problem or e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return data


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = (),
                base: dict | None = None) -> C:
    """Build `cls` from a YAML file (optional), a base dict, then ``key.sub=value`` overrides.

    Order of precedence: overrides > YAML file > base > the command's defaults.
    Raises `ConfigError` naming the file or the dotted field, also for a config without what a
    run needs (`turborlhf.config_base.check_complete`: a data file, PPO's reward), in one line.
    """
    given: dict = json.loads(json.dumps(base)) if base else {}       # what the user set, defaults aside
    if path is not None:
        _deep_update(given, read_yaml(path))
    tree: dict = _deep_update(default_tree(cls), json.loads(json.dumps(given)))
    for ov in overrides:
        key, value = parse_override(ov, cls)
        _set_dotted(tree, key, value)
        _set_dotted(given, key, value)
    _epochs_over_default_steps(tree, given)
    try:
        cfg = cls.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e, cls=cls)) from None
    check_complete(cfg)
    return cfg


def _epochs_over_default_steps(tree: dict, given: dict) -> None:
    """``train.epochs`` set and ``train.max_steps`` left to a command's default of N > 0 (PPO and
    GRPO: 20): the epochs count (``max_steps`` 0), as they do where the default is 0; the default
    silently won over them."""
    train, set_train = tree.get("train"), given.get("train")
    if (isinstance(train, dict) and isinstance(set_train, dict) and "epochs" in set_train
            and "max_steps" not in set_train and train.get("max_steps")):
        train["max_steps"] = 0


def _deep_update(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v
    return dst


def validate_section(cls: type[C], tree: dict, section: str) -> C:
    """Validate a dict (e.g. a pipeline stage section) on top of the command's defaults and
    prefix error paths with `section`; a config without what a run needs is refused as by `load_config`."""
    given = json.loads(json.dumps(tree))
    full = _deep_update(default_tree(cls), json.loads(json.dumps(given)))
    _epochs_over_default_steps(full, given)
    try:
        cfg = cls.model_validate(full)
    except ValidationError as e:
        raise ConfigError(_format_error(e, prefix=f"{section}.", cls=cls)) from None
    check_complete(cfg, prefix=f"{section}.")
    return cfg


def config_to_dict(cfg: Cfg) -> dict:
    return cfg.model_dump(mode="json")


def config_help(cls: type[Cfg], prefix: str = "", defaults: Cfg | None = None, item: bool = False) -> list[str]:
    """One line per leaf field: ``--a.b  TYPE  default=X  help`` (defaults as the parent sets them).
    A list of sections (``rewards``) is one ``--rewards`` line (set it whole) followed by its items'
    fields as ``rewards[].kind``, whose defaults and requirements hold per item."""
    lines = []
    for name, f in cls.model_fields.items():
        key = f"{prefix}{name}"
        ann = f.annotation
        sub = _cfg_class(ann)
        value = getattr(defaults, name) if defaults is not None else (
            None if f.is_required() else f.get_default(call_default_factory=True))
        if sub is not None and getattr(ann, "__origin__", None) is list:
            lines.append(_help_line(key, "list", _default_text(f, value, defaults, item), f, item))
            lines.extend(config_help(sub, prefix=key + "[].", item=True))
            continue
        if sub is not None:
            lines.extend(config_help(sub, prefix=key + ".", defaults=value if isinstance(value, Cfg) else None,
                                     item=item))
            continue
        if is_run_input(f):             # Optional only until the run is given it
            ann = next(a for a in getattr(ann, "__args__", (ann,)) if a is not type(None))
        tname = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        lines.append(_help_line(key, tname, _default_text(f, value, defaults, item), f, item))
    return lines


def _default_text(f, value: Any, defaults: Cfg | None, item: bool) -> str:
    if (f.is_required() and defaults is None) or is_run_input(f):     # a run input: unset by default, needed
        return "needed per item" if item else "required"
    return f"{'item ' if item else ''}default={_short(value)}"


def _help_line(key: str, tname: str, default: str, f, item: bool) -> str:
    flag = f"  {key:<38}" if item else f"  --{key:<36}"      # an item's field is no override of its own
    return f"{flag} {tname:<14} {default:<22} {f.description or ''}"


def _cfg_class(ann) -> type[Cfg] | None:
    if isinstance(ann, type) and issubclass(ann, Cfg):
        return ann
    for a in getattr(ann, "__args__", ()) or ():
        if isinstance(a, type) and issubclass(a, Cfg):
            return a
    return None


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 20 else s[:17] + "..."
