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
# PPO is one trainer, the package trainers/ppo/. Its imports run one way: the driver → the workers
# and step-1 helpers → experience → turborlhf.algo. Within the middle tier: actor and critic build
# on roles (their shared base), async_rollout → rlvr → rollout. The package's __init__ re-exports.
PPO = "ppo"
PPO_MODULES = ("driver", "actor", "critic", "roles", "rollout", "rlvr", "async_rollout", "experience")
PPO_EDGES = {("driver", m) for m in PPO_MODULES if m != "driver"} | {
    ("actor", "roles"), ("actor", "experience"), ("critic", "roles"), ("critic", "experience"),
    ("roles", "experience"), ("rollout", "experience"), ("rlvr", "rollout"), ("async_rollout", "rlvr")}


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


def _trainer_modules() -> dict[str, "pathlib.Path"]:
    """Trainer module name → file: ``sft`` for trainers/sft.py, ``ppo.driver`` for
    trainers/ppo/driver.py, ``ppo`` for the package's __init__."""
    trainers = _src() / "trainers"
    out = {p.stem: p for p in trainers.glob("*.py") if p.stem != "__init__"}
    out.update({f"{PPO}.{p.stem}": p for p in (trainers / PPO).glob("*.py") if p.stem != "__init__"})
    out[PPO] = trainers / PPO / "__init__.py"
    return out


def _trainer_of(mod: str, names) -> "str | None":
    """The trainer module an absolute import names (``ppo.roles`` before ``ppo``), or None."""
    parts = mod.split(".")
    if parts[:2] != ["turborlhf", "trainers"] or len(parts) < 3:
        return None
    if len(parts) > 3 and f"{parts[2]}.{parts[3]}" in names:
        return f"{parts[2]}.{parts[3]}"
    return parts[2] if parts[2] in names else None


def _trainer_edges() -> dict[tuple[str, str], list[int]]:
    """(importer, imported) trainer modules → lines, over trainers/*.py and trainers/ppo/*.py."""
    import ast

    modules = _trainer_modules()
    edges: dict[tuple[str, str], list[int]] = {}
    for name, path in modules.items():
        for mod, line, _ in _imported_modules(ast.parse(path.read_text())):
            target = _trainer_of(mod, modules)
            if target is not None and target != name:
                edges.setdefault((name, target), []).append(line)
    return edges


def test_no_trainer_module_imports_another():
    """A trainer imports only neutral modules (`trainers.common`, `data`, `models`, ...), never
    another trainer; within PPO only the one-way edges of `PPO_EDGES` (the package's __init__
    re-exports from its own modules)."""
    bad = []
    for (a, b), lines in sorted(_trainer_edges().items()):
        if b in NEUTRAL and a not in NEUTRAL:
            continue
        if a == PPO and b.startswith(f"{PPO}."):
            continue
        if a.startswith(f"{PPO}.") and b.startswith(f"{PPO}.") and (a[4:], b[4:]) in PPO_EDGES:
            continue
        bad.append(f"trainers/{a.replace('.', '/')}.py imports trainers.{b} (line {lines[0]})")
    assert not bad, "\n".join(bad)


def test_ppo_edges_are_one_way():
    """The allowed PPO edges form no cycle, experience imports no other PPO module, and nothing
    under trainers/ppo/ imports the driver back (or the package, whose __init__ imports it)."""
    import graphlib

    graphlib.TopologicalSorter({a: {b for x, b in PPO_EDGES if x == a} for a, _ in PPO_EDGES}).static_order()
    assert not {b for a, b in PPO_EDGES if a == "experience"}
    for (a, b), lines in _trainer_edges().items():
        if a.startswith(f"{PPO}."):
            assert b not in (PPO, f"{PPO}.driver"), f"trainers/{a.replace('.', '/')}.py imports {b} (line {lines[0]})"


def test_ppo_is_a_package_without_flat_modules():
    """The old flat modules are gone (no shims), and the package re-exports the old public names."""
    import turborlhf.trainers.ppo as ppo

    assert not sorted((_src() / "trainers").glob("ppo_*.py"))
    assert set(_trainer_modules()) >= {f"{PPO}.{m}" for m in PPO_MODULES}
    for name in ("phases", "train", "train_steps", "Experience", "assemble", "make_experience", "score_and_advantages",
                 "ppo_update", "minibatch_schedule", "merge_rank_stats", "rollout_items", "generate", "sync_weights",
                 "build_roles", "ADVANTAGE_ESTIMATORS", "RunInterrupted"):
        assert hasattr(ppo, name), name
    assert ppo.driver.ActorWorker.__module__ == "turborlhf.trainers.ppo.actor"    # Ray pickles by module path


def test_ppo_modules_import_turborlhf_at_the_top():
    """The PPO modules import turborlhf modules at module level (function-level imports hid the
    circular driver ↔ workers dependency); only heavy optional imports (transformers, torch's
    distributed checkpointing) may stay inside functions."""
    import ast

    modules = _trainer_modules()
    for name in [PPO, *(f"{PPO}.{m}" for m in PPO_MODULES), "common"]:
        tree = ast.parse(modules[name].read_text())
        late = [(m, line) for m, line, in_fn in _imported_modules(tree) if in_fn and m.startswith("turborlhf")]
        assert not late, f"trainers/{name}: imports inside functions: {late}"


def test_evaluate_imports_no_ppo_or_conditional_sft():
    """`turborlhf.evaluate` takes the batch layout and the score tags from neutral modules
    (`data.tokenize`, `data.conditioning`), not from the trainers that also use them."""
    import ast

    tree = ast.parse((_src() / "evaluate.py").read_text())
    mods = {m for m, _, _ in _imported_modules(tree)}
    bad = sorted(m for m in mods if m.startswith(("turborlhf.trainers.ppo", "turborlhf.trainers.conditional_sft")))
    assert not bad, bad


def test_the_import_check_sees_a_back_edge(tmp_path):
    """The parser the checks above rely on finds imports inside functions and `from pkg import mod`,
    and maps them to the PPO module they name."""
    import ast

    code = ("from turborlhf.trainers.ppo import roles as W\n"
            "import turborlhf.trainers.ppo.rlvr as rlvr\n"
            "def f():\n    from turborlhf.trainers.ppo.driver import ppo_update\n")
    found = _imported_modules(ast.parse(code))
    assert ("turborlhf.trainers.ppo.roles", 1, False) in found
    assert ("turborlhf.trainers.ppo.driver", 4, True) in found
    names = _trainer_modules()
    assert _trainer_of("turborlhf.trainers.ppo.roles", names) == "ppo.roles"
    assert _trainer_of("turborlhf.trainers.ppo.driver.ppo_update", names) == "ppo.driver"
    assert _trainer_of("turborlhf.trainers.ppo", names) == "ppo"
    assert _trainer_of("turborlhf.trainers.ppo.train", names) == "ppo"
    assert _trainer_of("turborlhf.trainers.sft", names) == "sft"
    assert _trainer_of("turborlhf.trainers.ppo.rlvr", names) == "ppo.rlvr"
