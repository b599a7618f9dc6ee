"""Rule-based reward functions loaded from a Python file: ``path/to/module.py:function``.

The function is called once per rollout batch with texts and returns one number per response::

    def my_reward(prompts: list[str], responses: list[str]) -> list[float]:
        return [float(len(r) < 200) for r in responses]

- ``prompts[i]`` is the prompt exactly as the policy saw it: the chat-template-rendered text
  (for SmolLM2 ``"<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``);
- ``responses[i]`` is the sampled response decoded without special tokens (no EOS);
- the result is any sequence of ``len(responses)`` finite numbers (a list, tuple, numpy array or
  1-D tensor; bools count as 0/1), in the same order.

The file is imported by path (``importlib``), so it need not be on ``sys.path`` nor be part of a
package; it is imported once per `load_reward_function` call.

Errors are `RewardFunctionError` (a ``ValueError``) naming the spec: a spec without
``:function``, a missing file, a file that fails to import, a missing or non-callable attribute,
and, at call time, a result of the wrong length or with non-numeric / non-finite values.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import numbers
import sys
from pathlib import Path
from typing import Callable, Sequence

from turborlhf.errors import UserError

__all__ = ["RewardFunctionError", "load_reward_function", "call_reward_function", "RewardFn"]

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


class RewardFunctionError(UserError, ValueError):
    """A reward function could not be loaded, or returned something other than one number per response."""


def _split_spec(spec: str) -> tuple[Path, str]:
    path, sep, func = spec.rpartition(":")
    if not sep or not path or not func or "/" in func or "\\" in func:
        raise RewardFunctionError(f"reward function {spec!r}: expected 'path/to/module.py:function'")
    return Path(path).expanduser(), func


def load_reward_function(spec: str) -> RewardFn:
    """Import ``module.py`` from a file path and return its ``function``.

    Args:
        spec: ``"path/to/module.py:function"`` (the path may be relative to the working directory).

    Returns:
        The callable ``fn(prompts: list[str], responses: list[str]) -> list[float]``.

    Raises:
        RewardFunctionError: bad spec, missing file, import failure (the original error is
            chained), missing attribute (the file's callables are listed), or not callable.
    """
    path, func = _split_spec(spec)
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
    fn = getattr(module, func, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == mod_name)
        raise RewardFunctionError(f"reward function {spec!r}: {path} has no attribute {func!r} "
                                  f"(functions defined there: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: {func!r} is a {type(fn).__name__}, not callable")
    return fn


def call_reward_function(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                         name: str = "reward function") -> list[float]:
    """Call ``fn(prompts, responses)`` and check its result.

    Args:
        fn: a function loaded with :func:`load_reward_function` (or any such callable).
        prompts: rendered prompt texts, one per response.
        responses: response texts (no special tokens), same length as ``prompts``.
        name: how errors name the function (its spec).

    Returns:
        One finite float per response.

    Raises:
        RewardFunctionError: the result is not a sequence of ``len(responses)`` finite numbers.
    """
    out = fn(list(prompts), list(responses))
    if hasattr(out, "tolist"):  # numpy array or tensor
        out = out.tolist()
    try:
        values = list(out)
    except TypeError:
        raise RewardFunctionError(f"{name} returned a {type(out).__name__}; expected a list of "
                                  f"{len(responses)} numbers") from None
    if len(values) != len(responses):
        raise RewardFunctionError(f"{name} returned {len(values)} values for {len(responses)} responses")
    scores = []
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise RewardFunctionError(f"{name} returned {v!r} at index {i}; expected a finite number")
        scores.append(float(v))
    return scores
