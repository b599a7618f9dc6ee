"""The user-error base class: bad input that a person fixes (a config value, a data file, a model
directory, a reward-function path), as opposed to a bug. ``turborlhf`` prints such an error as one
line ``error: <message>`` and exits with code 2; ``--debug`` shows the full traceback instead.

This module imports nothing, so every layer (config, data, models, rewards) may raise it.
"""
from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """Bad input named in the message (field, file and line, or path): one line, exit code 2."""
