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


# ----------------------------------------------------------------------------------------------
# Trainer modules: no trainer imports another; PPO's modules import one way
# ----------------------------------------------------------------------------------------------

def _src():
    import pathlib

    import turborlhf

    return pathlib.Path(turborlhf.__file__).parent


# Neutral modules under trainers/ that any trainer may import (they import no trainer).
NEUTRAL = {"common"}
# PPO is one trainer in four modules; imports flow driver → roles → compute (+ the RLVR helpers).
# The driver (ppo) → its step-1 helpers (ppo_async → ppo_rlvr → ppo_rollout) → the role workers
# (ppo_workers) → their compute (ppo_compute).
PPO_EDGES = {("ppo", "ppo_workers"), ("ppo", "ppo_compute"), ("ppo", "ppo_rlvr"), ("ppo", "ppo_async"),
             ("ppo", "ppo_rollout"), ("ppo_async", "ppo_rlvr"), ("ppo_rlvr", "ppo_rollout"), ("ppo_rlvr", "ppo_compute"),
             ("ppo_rollout", "ppo_compute"), ("ppo_workers", "ppo_compute")}


def _imported_modules(tree) -> list[tuple[str, int, bool]]:
    """(absolute module name, line, inside a function) for every import of `tree`; ``from pkg
    import name`` yields ``pkg.name`` too, since `name` may be a submodule."""
    import ast

    out = []

    def visit(node, in_fn):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_fn) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                out.append((child.module, child.lineno, in_fn))
                out.extend((f"{child.module}.{a.name}", child.lineno, in_fn) for a in child.names)
            visit(child, fn)
    visit(tree, False)
    return out


def _trainer_edges() -> dict[tuple[str, str], list[int]]:
    """(importer, imported) trainer modules → lines, over trainers/*.py."""
    import ast

    edges: dict[tuple[str, str], list[int]] = {}
    trainers = _src() / "trainers"
    names = {p.stem for p in trainers.glob("*.py")} - {"__init__"}
    for path in trainers.glob("*.py"):
        for mod, line, _ in _imported_modules(ast.parse(path.read_text())):
            parts = mod.split(".")
            if parts[:2] == ["turborlhf", "trainers"] and len(parts) > 2 and parts[2] in names:
                if parts[2] != path.stem:
                    edges.setdefault((path.stem, parts[2]), []).append(line)
    return edges


def test_no_trainer_module_imports_another():
    """A trainer imports only neutral modules (`trainers.common`, `data`, `models`, ...), never
    another trainer; within PPO only driver → workers → compute. ppo_workers and ppo_compute never
    import the driver."""
    bad = []
    for (a, b), lines in sorted(_trainer_edges().items()):
        if b in NEUTRAL and a not in NEUTRAL:
            continue
        if (a, b) in PPO_EDGES:
            continue
        bad.append(f"trainers/{a}.py imports trainers.{b} (line {lines[0]})")
    assert not bad, "\n".join(bad)


def test_ppo_workers_and_compute_never_import_the_driver():
    import ast

    for name in ("ppo_workers", "ppo_compute", "ppo_rollout", "ppo_rlvr", "ppo_async"):
        tree = ast.parse((_src() / "trainers" / f"{name}.py").read_text())
        mods = {m for m, _, _ in _imported_modules(tree)}
        assert "turborlhf.trainers.ppo" not in mods, f"{name} imports the PPO driver"
        assert name != "ppo_compute" or "turborlhf.trainers.ppo_workers" not in mods


def test_ppo_modules_import_turborlhf_at_the_top():
    """The PPO modules import turborlhf modules at module level (function-level imports hid the
    circular driver ↔ workers dependency); only heavy optional imports (transformers, torch's
    distributed checkpointing) may stay inside functions."""
    import ast

    for name in ("ppo", "ppo_workers", "ppo_compute", "ppo_rollout", "ppo_rlvr", "ppo_async", "common"):
        tree = ast.parse((_src() / "trainers" / f"{name}.py").read_text())
        late = [(m, line) for m, line, in_fn in _imported_modules(tree) if in_fn and m.startswith("turborlhf")]
        assert not late, f"trainers/{name}.py imports inside functions: {late}"


def test_evaluate_imports_no_ppo_or_conditional_sft():
    """`turborlhf.evaluate` takes the batch layout and the score tags from neutral modules
    (`data.tokenize`, `data.conditioning`), not from the trainers that also use them."""
    import ast

    tree = ast.parse((_src() / "evaluate.py").read_text())
    mods = {m for m, _, _ in _imported_modules(tree)}
    bad = sorted(m for m in mods if m.startswith(("turborlhf.trainers.ppo", "turborlhf.trainers.conditional_sft")))
    assert not bad, bad


def test_the_import_check_sees_a_back_edge(tmp_path):
    """The parser the checks above rely on finds imports inside functions and `from pkg import mod`."""
    import ast

    code = ("from turborlhf.trainers import ppo_workers as W\n"
            "def f():\n    from turborlhf.trainers.ppo import generate\n")
    found = _imported_modules(ast.parse(code))
    assert ("turborlhf.trainers.ppo_workers", 1, False) in found
    assert ("turborlhf.trainers.ppo", 3, True) in found
