"""In-process Python callables as reward sources (the Python API's ``reward_funcs=``, `turborlhf.api`).

A callable is called once per rollout batch, by keyword as TRL's GRPOTrainer calls its reward
functions, and returns one number per completion::

    def accuracy(prompts, completions, answer, **kwargs) -> list[float]:
        return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]

- ``prompts[i]``: the prompt as the policy saw it (chat-template-rendered text, cut to
  ``rollout.max_prompt_len`` tokens), one per completion;
- ``completions[i]``: the sampled response decoded without special tokens (no EOS);
- every other column of the training dataset's row, by name, each a list aligned with the
  completions (a prompt's value repeated for each of its samples), as TRL does: all of them to a
  function with ``**kwargs``, else those it names (a named parameter without a default that the
  data lacks is an error). A function whose parameters are neither called ``prompts`` /
  ``completions`` nor take ``**kwargs`` gets ``(prompts, completions)`` positionally;
- the result is checked as for file functions (`turborlhf.rewards.functions.call_reward_function`).

Differences from TRL: ``prompts`` are rendered text, not the dataset's message lists, and
``completions`` are plain strings for conversational data too.

Columns are found by the prompt's token ids (`PromptColumns`, built from the dataset by
`turborlhf.api`); two rows whose prompts encode to the same ids share the first row's columns.

Callables reach Ray workers (``distributed.backend=ray``) through `RewardCallables`, which pickles
them with cloudpickle *by value*: a function defined in a script, a notebook or a test module the
workers cannot import arrives with its code and the globals it uses.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from turborlhf.rewards.functions import RewardFunctionError, call_reward_function, callable_kwargs

__all__ = ["RewardCallables", "PromptColumns", "CallableSource", "callable_kwargs"]


class PromptColumns(dict):
    """``{prompt token ids (tuple): {column: value}}``: a training row's other fields, found from the
    prompt ids the policy generated from."""

    def lookup(self, prompt_ids: Sequence[Sequence[int]]) -> dict[str, list]:
        """``{column: [value per row]}`` over the union of the rows' columns (None where a row has none)."""
        rows = [self.get(tuple(int(t) for t in p), {}) for p in prompt_ids]
        names = list(dict.fromkeys(k for r in rows for k in r))
        return {k: [r.get(k) for r in rows] for k in names}


def _dumps_by_value(obj: Any) -> bytes:
    """cloudpickle `obj`, with the modules of the callables in it pickled by value when they are not
    importable from an installed package (scripts, test files, notebooks)."""
    import cloudpickle

    modules = []
    for fn in (obj.values() if isinstance(obj, dict) else [obj]):
        mod = inspect.getmodule(fn)
        name = getattr(mod, "__name__", "__main__")
        file = str(getattr(mod, "__file__", "") or "")
        if name in ("__main__", "builtins") or name.split(".")[0] == "turborlhf" or not file \
                or "site-packages" in file or "dist-packages" in file or name in sys.builtin_module_names:
            continue
        if name in sys.modules and mod not in modules:
            modules.append(mod)
    registered = []
    try:
        for mod in modules:
            try:
                cloudpickle.register_pickle_by_value(mod)
                registered.append(mod)
            except ValueError:          # already registered by the user, or not a real module
                pass
        return cloudpickle.dumps(obj)
    finally:
        for mod in registered:
            cloudpickle.unregister_pickle_by_value(mod)


def _loads(blob: bytes, columns: Optional[PromptColumns]) -> "RewardCallables":
    import cloudpickle

    return RewardCallables(cloudpickle.loads(blob), columns)


class RewardCallables(dict):
    """``{source name: callable}`` with the training rows' columns (`PromptColumns`, or None); in
    this process the callables themselves (closures keep their state), pickled (for Ray workers)
    by value with cloudpickle (module docstring)."""

    def __init__(self, funcs: Mapping[str, Callable] = (), columns: Optional[PromptColumns] = None) -> None:
        super().__init__(funcs)
        self.columns = columns

    def __reduce__(self):
        try:
            blob = _dumps_by_value(dict(self))
        except Exception as e:
            raise RewardFunctionError(f"reward functions {sorted(self)}: cannot be sent to Ray workers with "
                                      f"cloudpickle ({type(e).__name__}: {e}); use distributed.backend=local or a "
                                      "function defined at module level") from e
        return (_loads, (blob, self.columns))

    def source(self, key: str, name: str) -> "CallableSource":
        """The reward source of callable `key` (a ``kind: callable`` entry's ``path``), named `name`.

        Raises:
            RewardFunctionError: no callable `key` was given (a config written by the Python API
                run from the command line, which cannot pass callables)."""
        if key not in self:
            raise RewardFunctionError(f"rewards: the callable reward source {key!r} exists only in the Python "
                                      "process that passed it (GRPOTrainer(reward_funcs=...)); give a "
                                      "path/to/module.py:function source (kind: function) on the command line")
        return CallableSource(self[key], name, self.columns)




class CallableSource:
    """A reward source (`turborlhf.rewards.combine`) calling an in-process Python callable."""

    may_skip_rows = True          # None (NaN) for a response the callable does not score

    def __init__(self, fn: Callable, name: str, columns: Optional[PromptColumns] = None) -> None:
        if not callable(fn):
            raise RewardFunctionError(f"reward function {name!r} is a {type(fn).__name__}, not callable")
        self.fn, self.name, self.columns = fn, name, columns

    def __call__(self, inp) -> torch.Tensor:
        prompts, completions = inp.texts()
        cols = getattr(inp, "columns", None)        # a trainer that passes the rows' columns itself
        if cols is None:
            cols = self.columns.lookup(inp.prompt_ids) if self.columns is not None else {}
        label = f"reward function {self.name!r}"
        ids = getattr(inp, "response_ids", None)
        return torch.tensor(call_reward_function(self.fn, prompts, completions, name=label, columns=cols,
                                                 allow_none=True, completion_ids=ids))
