"""Guardrail: turborlhf.algo imports only torch and the standard library."""

import subprocess
import sys

FORBIDDEN = ("transformers", "ray", "vllm", "pydantic", "yaml", "accelerate", "peft")


def test_algo_imports_only_torch():
    code = (
        "import sys\n"
        "import turborlhf.algo\n"
        "import turborlhf.algo.advantages, turborlhf.algo.kl, turborlhf.algo.logprobs\n"
        "import turborlhf.algo.losses, turborlhf.algo.masked, turborlhf.algo.reduce\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_algo_sources_import_nothing_else():
    """Static check: every import in algo/*.py is torch, stdlib, or turborlhf.algo itself."""
    import ast
    import pathlib

    import turborlhf.algo

    allowed_roots = {"torch", "__future__", "typing", "math", "collections", "dataclasses", "functools"}
    for path in pathlib.Path(turborlhf.algo.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                ok = name.split(".")[0] in allowed_roots or name.startswith("turborlhf.algo")
                assert ok, f"{path.name} imports {name}"
