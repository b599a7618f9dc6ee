"""Rule-based reward functions: a Python file (``path/to/module.py:function``), an importable
module (``package.module:function``) or a built-in verifier by name (``gsm8k_accuracy``, see
`turborlhf.rewards.verifiers`).

The function is called once per rollout batch with texts and returns one number per response::

    def my_reward(prompts: list[str], responses: list[str]) -> list[float]:
        return [float(len(r) < 200) for r in responses]

    def exact(prompts, completions, answer, **columns) -> list[float]:   # TRL's convention
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

- ``prompts[i]`` is the prompt exactly as the policy saw it: the chat-template-rendered text
  (for SmolLM2 ``"<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``);
- ``responses[i]`` is the sampled response decoded without special tokens (no EOS);
- a function that names ``prompts``, ``completions`` or ``completion_ids`` (the responses' token
  ids) or takes ``**kwargs`` is called by keyword, as TRL's GRPO calls reward functions
  (``responses`` names the completions too); any other gets ``(prompts, responses)``
  positionally (`callable_kwargs`);
- the prompts file's other columns (e.g. ``answer``) are passed by name, each a list aligned
  with the responses (a prompt's value repeated for each of its samples), as TRL's GRPO does:
  all of them to a function with ``**kwargs``, else those it names as parameters (a named
  parameter without a default that the file lacks is an error). A plain two-argument function
  gets no columns;
- the result is any sequence of ``len(responses)`` finite numbers (a list, tuple, numpy array or
  1-D tensor; bools, numpy's too, count as 0/1), in the same order. As in TRL, ``None`` marks a response the
  function does not score (one of several task-specific functions): as a reward source it is
  left out of that row's weighted sum; a row no source scores is an error
  (`turborlhf.rewards.combine.combine_scores`).

A file is imported by path (``importlib``), so it need not be on ``sys.path`` nor be part of a
package; it is imported once per `load_reward_function` call. A spec whose module part has no
``/`` and does not end in ``.py`` is imported as a module.

Errors are `RewardFunctionError` (a ``ValueError``) naming the spec: a spec without
``:function`` that is not a built-in name, a missing file or module, a file that fails to
import, a missing or non-callable attribute, and, at call time, a missing column, a result of
the wrong length or with non-numeric / non-finite values.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Set
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from turborlhf.errors import UserError

__all__ = ["RewardFunctionError", "load_reward_function", "call_reward_function", "callable_kwargs", "RewardFn",
           "finite_number"]

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


class RewardFunctionError(UserError, ValueError):
    """A reward function could not be loaded, or returned something other than one number per response."""


_SPEC_FORMS = "'path/to/module.py:function', 'package.module:function' or a built-in name"


def _builtins() -> dict[str, Callable]:
    from turborlhf.rewards.verifiers import BUILTIN_REWARDS

    return BUILTIN_REWARDS


def _split_spec(spec: str) -> tuple[Path, str]:
    path, sep, func = spec.rpartition(":")
    if not sep or not path or not func or "/" in func or "\\" in func:
        raise RewardFunctionError(f"reward function {spec!r}: expected {_SPEC_FORMS} "
                                  f"({', '.join(_builtins())})")
    return Path(path).expanduser(), func


def _is_module_name(path: Path, text: str) -> bool:
    """``package.module`` (dotted identifiers, not a file here) rather than a file path."""
    return (not path.exists() and not text.endswith(".py")
            and all(part.isidentifier() for part in text.split(".")))


def _import_module(spec: str, name: str):
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise RewardFunctionError(f"reward function {spec!r}: importing module {name!r} failed: "
                                  f"{type(e).__name__}: {e}") from e


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise RewardFunctionError(f"reward function {spec!r}: file {path} not found")
    resolved = path.resolve()
    mod_name = f"turborlhf_reward_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    mspec = importlib.util.spec_from_file_location(mod_name, resolved)
    if mspec is None or mspec.loader is None:
        raise RewardFunctionError(f"reward function {spec!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module  # lets dataclasses / pickling inside the file find their module
    try:
        mspec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise RewardFunctionError(f"reward function {spec!r}: importing {path} failed: "
                                  f"{type(e).__name__}: {e}") from e
    return module


def load_reward_function(spec: str) -> RewardFn:
    """Resolve a reward-function spec to its callable.

    Args:
        spec: a built-in name (``"gsm8k_accuracy"``, `turborlhf.rewards.verifiers.BUILTIN_REWARDS`),
            ``"path/to/module.py:function"`` (the path may be relative to the working directory)
            or ``"package.module:function"`` (imported with `importlib.import_module`).

    Returns:
        The callable ``fn(prompts, responses, **columns) -> list[float]``.

    Raises:
        RewardFunctionError: bad spec, missing file, import failure (the original error is
            chained), missing attribute (the module's callables are listed), or not callable.
    """
    if ":" not in spec and spec in _builtins():
        return _builtins()[spec]
    path, func = _split_spec(spec)
    module_text = spec.rpartition(":")[0]
    if _is_module_name(path, module_text):
        module = _import_module(spec, module_text)
        where = f"module {module_text}"
    else:
        module = _import_file(spec, path)
        where = str(path)
    fn = getattr(module, func, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise RewardFunctionError(f"reward function {spec!r}: {where} has no attribute {func!r} "
                                  f"(functions defined there: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: {func!r} is a {type(fn).__name__}, not callable")
    return fn


def callable_kwargs(fn: Callable, prompts: list[str], completions: list[str], columns: Mapping[str, list],
                    name: str, completion_ids: Optional[Sequence[Sequence[int]]] = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to call `fn` with: by keyword as TRL's GRPOTrainer calls its reward
    functions (``prompts``, ``completions``, ``completion_ids``, the columns) where `fn` names one of
    those texts or takes ``**kwargs`` (a parameter named ``responses`` gets the completions too),
    else ``(prompts, completions)`` positionally plus the columns it names.

    Raises:
        RewardFunctionError: `fn` names a column (a parameter without a default) the data lacks.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):                   # no signature (a builtin): texts only
        return (prompts, completions), {}
    P = inspect.Parameter
    var_kw = any(p.kind is P.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    texts = {"prompts": prompts, "completions": completions}
    if completion_ids is not None:
        texts["completion_ids"] = [list(ids) for ids in completion_ids]
    if "responses" in named:                           # this module's own name for them
        texts["responses"] = completions
    if var_kw or named & set(texts):
        args: tuple = ()
        kwargs = {k: v for k, v in texts.items() if k in named or (var_kw and k != "responses")}
        taken = set(texts)
    else:                                             # fn(p, r, ...): the texts positionally
        args = (prompts, completions)
        positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        taken = {p.name for p in positional[:2]}
        kwargs = {}
    for p in params:
        if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p.name not in taken and p.name not in columns \
                and p.default is P.empty:
            raise RewardFunctionError(f"{name} needs the column {p.name!r}, which the training data does not have "
                                      f"(its columns: {', '.join(sorted(columns)) or 'none'})")
    kwargs.update({k: v for k, v in columns.items() if k not in taken and (var_kw or k in named)})
    return args, kwargs


def finite_number(v: numbers.Real) -> bool:
    """Whether the number `v` is finite as a float (an int above 1e308 is not: OverflowError)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def call_reward_function(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                         name: str = "reward function",
                         columns: Optional[Mapping[str, Sequence]] = None,
                         allow_none: bool = False,
                         completion_ids: Optional[Sequence[Sequence[int]]] = None) -> list[float]:
    """Call ``fn(prompts, responses, **columns)`` and check its result.

    Args:
        fn: a function loaded with :func:`load_reward_function` (or any such callable).
        prompts: rendered prompt texts, one per response.
        responses: response texts (no special tokens), same length as ``prompts``.
        name: how errors name the function (its spec).
        columns: the prompts file's other columns, each a list aligned with ``responses``;
            passed as `callable_kwargs` selects.
        completion_ids: the responses' token ids, for a function taking TRL's ``completion_ids``.
        allow_none: a ``None`` value (the response not scored, TRL's convention) becomes NaN
            instead of an error.

    Returns:
        One float per response: finite, or NaN for a ``None`` where `allow_none`.

    Raises:
        RewardFunctionError: a column list of another length, a column the function requires is
            missing, or the result is not a sequence of ``len(responses)`` finite numbers.
    """
    for key, values in (columns or {}).items():
        if len(values) != len(responses):
            raise RewardFunctionError(f"{name}: column {key!r} has {len(values)} values for "
                                      f"{len(responses)} responses")
    args, kwargs = callable_kwargs(fn, list(prompts), list(responses), dict(columns or {}), name, completion_ids)
    out = fn(*args, **kwargs)
    if hasattr(out, "tolist"):  # numpy array or tensor
        out = out.tolist()
    try:
        if isinstance(out, (Mapping, Set)):         # its keys, or no order: not one value per response
            raise TypeError
        values = list(out)
    except TypeError:
        raise RewardFunctionError(f"{name} returned a {type(out).__name__}; expected a list of "
                                  f"{len(responses)} numbers") from None
    if len(values) != len(responses):
        raise RewardFunctionError(f"{name} returned {len(values)} values for {len(responses)} responses")
    scores = []
    for i, v in enumerate(values):
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:      # numpy scalars (np.bool_), 0-d tensors
            v = v.item()
        if v is None and allow_none:
            scores.append(math.nan)
            continue
        if not isinstance(v, numbers.Real) or not finite_number(v):
            raise RewardFunctionError(f"{name} returned {v!r} at index {i}; expected a finite number")
        scores.append(float(v))
    return scores
