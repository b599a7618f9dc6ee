"""Shared pieces of `compare_algo.py`: the peer registry and folders, the case registry
(`@case`), the seeded inputs and difference accumulators the cases use, and `load_peer`, which
imports a peer's released modules into a namespace. The cases themselves are in
`compare_openrlhf.py` and `compare_trl.py`; the driver is `compare_algo.py`."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]
RESULT_TAG = "COMPARE_RESULT "
TOL = 1e-5          # |ours - peer| allowed, fp32 and fp64
DIFFER_MIN = 1e-4   # an intended difference must be at least this large on the test inputs

# name -> (package, version); the folder is <cache>/peers/<package>-<version>-py<XY>/site-packages
PEERS = {
    "trl-1.16.0": ("trl", "1.16.0"),
    "trl-1.12.0": ("trl", "1.12.0"),
    "openrlhf-0.11.2": ("openrlhf", "0.11.2"),
    "openrlhf-0.9.0": ("openrlhf", "0.9.0"),
}


def peer_path(peer: str) -> Path:
    package, version = PEERS[peer]
    root = Path(os.environ.get("TURBORLHF_CACHE", Path.home() / ".cache" / "turborlhf")) / "peers"
    return root / f"{package}-{version}-py{sys.version_info.major}{sys.version_info.minor}" / "site-packages"


# Peers installed without their declared dependencies (deepspeed, vLLM, flash-attn, Ray, bitsandbytes...
# for OpenRLHF): the files compared need only torch and numpy; `load_peer` puts empty modules in
# place of the two imported at module level (deepspeed, ray) and of the package __init__ files.
OWN_FILES_ONLY = {"openrlhf"}


def install_peer(peer: str, timeout_s: float = 600.0):
    """Install `peer` into `peer_path(peer)` unless that folder exists, with
    `turborlhf.bench.peers.ensure_package`: TRL with the packages the environment lacks, OpenRLHF
    alone (`OWN_FILES_ONLY`). Needs PyPI; 2-6 s and 2-8 MB per peer.

    Returns the folder. Raises `turborlhf.bench.peers.PeerUnavailable` (the message carries pip's
    last lines) if pip fails or one pip call runs past `timeout_s` seconds.
    """
    from turborlhf.bench.peers import ensure_package

    folder = peer_path(peer)
    if folder.is_dir():
        return folder
    package, version = PEERS[peer]
    return ensure_package(package, version, root=folder.parents[1], timeout_s=timeout_s,
                          deps=package not in OWN_FILES_ONLY).path


# ------------------------------------------------------------------------------ case registry


@dataclass
class Case:
    key: str                 # unique id (the function name below)
    peer: str                # key of PEERS
    function: str            # ours
    peer_code: str           # the peer's code that is called
    options: str             # our options that reproduce the peer (and what is compared)
    doc: Optional[str]       # set when our default differs by design: where it is explained
    default_note: str        # what our default does instead
    dtypes: tuple[str, ...]
    fn: Callable = field(repr=False, compare=False)


CASES: list[Case] = []


def case(peer: str, function: str, peer_code: str, options: str, doc: Optional[str] = None,
         default_note: str = "", dtypes: tuple[str, ...] = ("float64", "float32")):
    def deco(fn):
        CASES.append(Case(fn.__name__, peer, function, peer_code, options, doc, default_note, dtypes, fn))
        return fn
    return deco


# What could not be compared, and why (printed under the table, written to the JSON).
NOT_COMPARABLE = [
    ("trl-1.12.0", "PPOTrainer.train: KL-shaped rewards, GAE, advantage whitening call, clipped policy and value "
     "losses, vf_clipfrac", "inline in the 300-line train loop (needs generation, models, optimizer); the same maths "
     "is compared against OpenRLHF's callable functions, and TRL's masked_* helpers are compared"),
    ("trl-1.16.0", "GRPOTrainer / RLOOTrainer group advantages (scale_rewards, LOO baseline, KL-in-reward)",
     "inline in _generate_and_score_completions (generation, reward functions, gathers); OpenRLHF's group "
     "estimators are compared instead"),
    ("trl-1.16.0", "AdaptiveKLController", "removed in TRL 0.14; compared against OpenRLHF's"),
    ("trl-1.16.0", "DPO loss types hinge, exo_pair, nca_pair, bco_pair, sppo_hard, aot*, apo_*, discopop, "
     "sigmoid_norm; KTO apo_zero_unpaired; GRPO sapo/cispo/vespo/luspo, sequence-level (GSPO) ratios, "
     "off-policy mask, entropy mask", "no turborlhf counterpart"),
    ("openrlhf-0.11.2", "PolicyLoss gspo and vLLM importance-sampling correction; masked_normalize (per-row "
     "whitening); flash_reinforce estimator", "no turborlhf counterpart (turborlhf whitens over the rollout "
     "batch, which is what OpenRLHF's estimators use)"),
    ("openrlhf-0.9.0", "VanillaKTOLoss", "not implemented in turborlhf (docs/algorithms/kto.md)"),
    ("all", "KTO mismatched-pair construction, KL all-reduce across ranks, micro-batch/DP scaling",
     "data pipeline and distributed code, not turborlhf.algo; see docs/algorithms/kto.md and reduce.py"),
]


# ------------------------------------------------------------------------------ helpers (worker)


class Diff:
    """Running max |a - b| over many comparisons (nan/inf or a shape mismatch count as inf)."""

    def __init__(self) -> None:
        self.max = 0.0
        self.n = 0

    def add(self, a, b, mask=None) -> None:
        import torch

        # python floats straight to fp64 (torch.as_tensor would round them to fp32 first)
        a, b = (x.detach().to(torch.float64) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)
                for x in (a, b))
        if mask is not None:
            mask = torch.as_tensor(mask).bool().expand(a.shape)
            a, b = a[mask], b[mask]
        self.n += 1
        if a.shape != b.shape:
            self.max = float("inf")
            return
        if a.numel() == 0:
            return
        both_nan = torch.isnan(a) & torch.isnan(b)
        d = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
        d = torch.nan_to_num(d, nan=float("inf"))
        self.max = max(self.max, float(d.max()))


def _g(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


SHAPES = [(1, 1), (2, 3), (5, 8), (8, 33)]


def rmask(g, B, T, empty=0):
    """Right-padded bool mask (B, T); row 0 is full; the last `empty` rows are empty."""
    import torch

    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[0] = T
    if empty:
        lens[B - empty:] = 0
    return torch.arange(T)[None, :] < lens[:, None]


def randn(g, *shape, dt="float64", scale=1.0):
    import torch

    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(getattr(torch, dt))


def rand(g, *shape, dt="float64", scale=1.0):
    import torch

    return (torch.rand(*shape, generator=g, dtype=torch.float64) * scale).to(getattr(torch, dt))


def junk(x, mask, g, scale=50.0):
    """x at valid positions, finite junk elsewhere (the peers multiply by the mask, so no nan)."""
    import torch

    j = (torch.randn(x.shape, generator=g, dtype=torch.float64) * scale).to(x.dtype)
    return torch.where(mask, x, j)


class _Acc:
    """Stand-in for accelerate.Accelerator on one process."""

    num_processes = 1
    sync_gradients = True

    def __init__(self):
        import torch

        self.device = torch.device("cpu")

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def unwrap_model(self, m):
        return m


class _TableModel:
    """Stand-in causal LM for TRL's fused-LM-head path: row i of the batch is looked up by input_ids[i, 0]
    in a table of per-token log-probs (already 0 outside the completion)."""

    training = True

    def __init__(self, table):
        self.table = table

    def __call__(self, input_ids=None, **kwargs):
        import torch
        from types import SimpleNamespace

        lp = self.table[input_ids[:, 0]]
        z = torch.zeros_like(lp)
        return SimpleNamespace(log_probs=lp, entropy=z, mean_logits=z, is_top1=torch.zeros(lp.shape, dtype=torch.bool))


def _metrics():
    from collections import defaultdict

    return defaultdict(lambda: defaultdict(list))


# ------------------------------------------------------------------------------ peer loaders


def load_peer(peer: str, folder: Path):
    """Import the peer's modules (from `folder`, which is first on sys.path) into a namespace."""
    import importlib
    import types

    ns = types.SimpleNamespace()
    package, version = PEERS[peer]
    if package == "trl":
        import trl

        if not Path(trl.__file__).resolve().is_relative_to(folder.resolve()):
            raise RuntimeError(f"trl imported from {trl.__file__}, not from {folder}")
        ns.version = trl.__version__
        import trl.trainer.utils as tu

        ns.utils = tu
        if version == "1.12.0":
            from trl.experimental.ppo import ppo_trainer

            ns.ppo = ppo_trainer
        else:
            from trl.experimental.cpo.cpo_trainer import CPOTrainer
            from trl.trainer.dpo_trainer import DPOTrainer
            from trl.trainer.grpo_trainer import GRPOTrainer
            from trl.trainer.kto_trainer import KTOTrainer
            from trl.trainer.reward_trainer import RewardTrainer
            from trl.trainer.rloo_trainer import RLOOTrainer

            ns.DPOTrainer, ns.KTOTrainer, ns.RewardTrainer = DPOTrainer, KTOTrainer, RewardTrainer
            ns.GRPOTrainer, ns.RLOOTrainer, ns.CPOTrainer = GRPOTrainer, RLOOTrainer, CPOTrainer
        return ns

    # OpenRLHF: empty stand-ins for the package __init__ files (they import deepspeed, flash-attn,
    # Ray actors, vLLM); the module files themselves are the released ones.
    base = folder / "openrlhf"
    for name, sub in [("openrlhf", ""), ("openrlhf.models", "models"), ("openrlhf.trainer", "trainer"),
                      ("openrlhf.trainer.ppo_utils", "trainer/ppo_utils"), ("openrlhf.trainer.ray", "trainer/ray"),
                      ("openrlhf.utils", "utils")]:
        m = types.ModuleType(name)
        m.__path__ = [str(base / sub)]
        sys.modules[name] = m
    for heavy in ("deepspeed", "ray"):
        sys.modules[heavy] = types.ModuleType(heavy)
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.RayActorGroup = type("RayActorGroup", (), {})
    sys.modules["openrlhf.trainer.ray.launcher"] = launcher
    from importlib import metadata

    ns.version = metadata.version("openrlhf")
    ns.loss = importlib.import_module("openrlhf.models.loss")
    ns.utils = importlib.import_module("openrlhf.models.utils")
    if version != "0.9.0":
        ns.klc = importlib.import_module("openrlhf.trainer.ppo_utils.kl_controller")
        ns.em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
    else:
        import tempfile

        import torch.distributed as dist

        if not dist.is_initialized():   # KTOLoss all-reduces its KL: a one-process gloo group
            fd, path = tempfile.mkstemp(prefix="compare_algo_pg_")
            os.close(fd)
            os.unlink(path)
            dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    return ns


# ============================================================================== OpenRLHF 0.11.2


# ------------------------------------------------------------------------------ shared by both peers' cases


def _pairs(g, B, dt, scale=8.0):
    pc, pr = -rand(g, B, dt=dt, scale=scale) - 1, -rand(g, B, dt=dt, scale=scale) - 1
    rc, rr = -rand(g, B, dt=dt, scale=scale) - 1, -rand(g, B, dt=dt, scale=scale) - 1
    return pc, pr, rc, rr

def _logprobs_vs(peer_fn, dt, g, d):
    """logprobs_from_logits (chunked and default) against a peer's `peer_fn(logits, labels)`."""
    import torch

    from turborlhf.algo import logprobs_from_logits

    for B, T, V in [(1, 1, 2), (2, 5, 7), (3, 16, 50)]:
        logits = randn(g, B, T, V, dt=dt, scale=3)
        labels = torch.randint(0, V, (B, T), generator=g)
        peer = peer_fn(logits.clone(), labels)
        d.add(logprobs_from_logits(logits, labels, chunk_size=3), peer)
        d.add(logprobs_from_logits(logits, labels), peer)


def _logprobs_bf16_vs(peer_fn, dt, g, d, dd):
    """bf16 logits: ours against the peer given fp32 logits (d) and its own bf16 result (dd)."""
    import torch

    from turborlhf.algo import logprobs_from_logits

    for B, T, V in [(2, 5, 7), (3, 16, 50)]:
        logits = randn(g, B, T, V, dt=dt, scale=3)
        labels = torch.randint(0, V, (B, T), generator=g)
        ours = logprobs_from_logits(logits, labels, chunk_size=4)
        d.add(ours, peer_fn(logits.float(), labels))
        dd.add(ours, peer_fn(logits.clone(), labels))


# the bf16 log-prob cases of both peers: same setting, same documented difference
_BF16_LOGPROBS = dict(
    options="the peer given logits.float(); ours upcasts each chunk itself", doc="docs/algorithms/README.md",
    default_note="bf16 logits: ours returns fp32 log-softmax of the bf16 values; the peer returns a bf16 log-softmax",
    dtypes=("bfloat16",))


def _entropy_vs(peer_fn, dt, g, d):
    """Our chunked entropy (chunk_size 3) against `peer_fn(logits)` on random logits of std 3."""
    from turborlhf.algo import entropy_from_logits

    for B, T, V in [(1, 1, 2), (2, 5, 7), (3, 16, 50)]:
        logits = randn(g, B, T, V, dt=dt, scale=3)
        d.add(entropy_from_logits(logits, chunk_size=3), peer_fn(logits))
