"""Commands for using trained models: ``generate`` (batch inference to JSONL), ``chat``
(interactive, multi-turn) and ``export`` (a checkpoint, LoRA merged, as a plain HF directory,
optionally pushed to the hub). Heavy modules are imported only by the chosen command."""
from __future__ import annotations

COMMANDS = {
    "generate": ("turborlhf.commands.generate", "generate_main"),
    "chat": ("turborlhf.commands.generate", "chat_main"),
    "export": ("turborlhf.commands.export", "export_main"),
}


def main(name: str, argv: list[str]) -> int:
    """Run command ``name`` with its arguments; returns the exit status."""
    import importlib

    module, func = COMMANDS[name]
    return getattr(importlib.import_module(module), func)(argv)
