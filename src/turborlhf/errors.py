"""The error base classes the command line prints as one line. `UserError`: bad input that a person fixes (a config value, a data file, a model
directory, a reward-function path), as opposed to a bug. ``turborlhf`` prints such an error as one
line ``error: <message>`` and exits with code 2; ``--debug`` shows the full traceback instead.

`RunError`: a run that stopped because going on would be silently wrong (a NaN/inf step, a weight
sync that did not take, rollout/trainer log-probs that drifted apart): ``error: <message>`` and
exit code 1; the last checkpoint is the last good state.

This module imports nothing, so every layer (config, data, models, rewards) may raise it.
"""
from __future__ import annotations

__all__ = ["UserError", "RunError"]


class UserError(Exception):
    """Bad input named in the message (field, file and line, or path): one line, exit code 2."""


class RunError(RuntimeError):
    """A training run stopped at a step whose result would be wrong (the message names the role,
    tensor or check): one line, exit code 1."""
