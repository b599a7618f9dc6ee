#!/usr/bin/env python
"""Compare `turborlhf.algo` numerically with the peers' own implementations (issue 3).

Every comparison feeds the same seeded random tensors (several shapes, right-padded masks with
finite junk in the padding, advantages of both signs, fp64 and fp32 where the values stay O(1-100))
to one of our functions and to the peer's code, and records the largest absolute difference.
Where our default differs from the peer by design, the row also records the difference with
our *default* options, and the table points at the doc that explains it.

Each peer runs in its own child process with only its folder (then our ``src``) on
``PYTHONPATH``, so two versions of one package never meet. The peer's code is called as it is:
module functions directly, ``nn.Module`` losses as they are, and trainer methods unbound with a
small stand-in ``self`` (a ``SimpleNamespace`` carrying the attributes the method reads) and a
stand-in model that returns given per-token log-probs. Nothing of the peers is copied here.
OpenRLHF files are imported by path under empty stand-ins for its package ``__init__`` files,
with ``deepspeed``, ``ray`` and ``openrlhf.trainer.ray.launcher`` stubbed (imported at module
level but not used by the functions compared); its ``@torch.compile``'d ``compute_entropy`` is
called through ``__wrapped__`` (the same Python code, run eagerly).

Install the peers (each into its own folder; never into the project's environment). The folder
names end in ``-py<major><minor>/site-packages`` of the interpreter that runs this script::

    PY=/work/main/.venv/bin/python          # the interpreter you run this script with
    P=~/.cache/turborlhf/peers              # or $TURBORLHF_CACHE/peers
    # TRL 1.16.0 and 1.12.0 (1.12 is the last with PPO, trl.experimental.ppo), with the
    # dependencies the environment lacks, exactly as `turborlhf bench` installs them:
    PYTHONPATH=src $PY -c "from turborlhf.bench.peers import ensure_package as e
    e('trl', '1.16.0'); e('trl', '1.12.0')"
    # OpenRLHF: only its own files (torch and transformers come from the environment)
    $PY -m pip install --no-deps --target $P/openrlhf-0.11.2-py311/site-packages openrlhf==0.11.2
    # 0.9.0 still has KTOLoss (0.9.10, 0.10.0 and 0.11.x do not: KTO was removed in 2026-03)
    $PY -m pip install --no-deps --target $P/openrlhf-0.9.0-py311/site-packages openrlhf==0.9.0

Usage (1 thread, small tensors, < 1 min; no model is loaded)::

    PYTHONPATH=src python benchmarks/peers/compare_algo.py [--peer trl-1.16.0 ...] [--json]

A peer whose folder is missing is reported as "not installed". Results and the explanation of
every intended difference: docs/algorithms/README.md. The same comparisons run as tests in
tests/algo/test_vs_peers.py (skipped when a peer folder is absent).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
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

ORL = "openrlhf-0.11.2"
ORL_KTO = "openrlhf-0.9.0"


@case(ORL, "masked_mean", "openrlhf.models.utils.masked_mean", "dim=None and dim=1 (non-empty rows)")
def orl_masked_mean(P, dt, g, d, dd):
    from turborlhf.algo import masked_mean

    for B, T in SHAPES:
        m = rmask(g, B, T)
        x = junk(randn(g, B, T, dt=dt), m, g)
        d.add(masked_mean(x, m), P.utils.masked_mean(x, m.to(x.dtype)))
        d.add(masked_mean(x, m, dim=1), P.utils.masked_mean(x, m.to(x.dtype), dim=1))


@case(ORL, "reduce_loss(token_mean)", "openrlhf.models.loss.aggregate_loss(token_level_loss=True)",
      "local count; and two micro-batches summed with the global num_tokens (= batch_num_tokens, dp_size=1)")
def orl_reduce_token(P, dt, g, d, dd):
    import torch

    from turborlhf.algo import reduce_loss

    agg = P.loss.aggregate_loss
    for B, T in SHAPES:
        m = rmask(g, B, T)
        mf = m.to(getattr(torch, dt))
        loss = junk(randn(g, B, T, dt=dt, scale=2), m, g)
        d.add(reduce_loss(loss, m, "token_mean"), agg(loss, mf))
        if B > 1:
            k, n = B // 2, mf.sum()
            ours = reduce_loss(loss[:k], m[:k], num_tokens=n) + reduce_loss(loss[k:], m[k:], num_tokens=n)
            peer = agg(loss[:k], mf[:k], batch_num_tokens=n) + agg(loss[k:], mf[k:], batch_num_tokens=n)
            d.add(ours, peer)


@case(ORL, "reduce_loss(seq_mean_token_mean)", "openrlhf.models.loss.aggregate_loss(token_level_loss=False)",
      "with an empty sequence; local count, and two micro-batches with the global num_seqs (= global_batch_size)")
def orl_reduce_seq(P, dt, g, d, dd):
    import torch

    from turborlhf.algo import reduce_loss

    agg = P.loss.aggregate_loss
    for B, T in SHAPES:
        m = rmask(g, B, T, empty=1 if B > 2 else 0)
        mf = m.to(getattr(torch, dt))
        loss = junk(randn(g, B, T, dt=dt, scale=2), m, g)
        d.add(reduce_loss(loss, m, "seq_mean_token_mean"), agg(loss, mf, token_level_loss=False))
        if B > 1:
            k, s = B // 2, (m.sum(1) > 0).sum().to(mf.dtype)
            ours = sum(reduce_loss(loss[a:b], m[a:b], "seq_mean_token_mean", num_seqs=s) for a, b in [(0, k), (k, B)])
            peer = sum(agg(loss[a:b], mf[a:b], token_level_loss=False, global_batch_size=s)
                       for a, b in [(0, k), (k, B)])
            d.add(ours, peer)


def _ppo_inputs(g, B, T, dt, extreme: bool, junk_scale=50.0, big_frac=0.1):
    import torch

    m = rmask(g, B, T)
    old = -rand(g, B, T, dt=dt, scale=3.0)
    delta = randn(g, B, T, dt=dt, scale=0.3)
    big = rand(g, B, T) < big_frac                 # a few large ratios (dual clip becomes active)
    delta = torch.where(big, delta + 1.5 * torch.sign(delta), delta)
    if extreme:                                    # |log ratio| > 20: OpenRLHF's and our clamp
        huge = rand(g, B, T) < 0.05
        delta = torch.where(huge, delta + 25.0 * torch.sign(delta), delta)
    logp = old + delta
    adv = randn(g, B, T, dt=dt)
    return m, junk(logp, m, g, junk_scale), junk(old, m, g, junk_scale), junk(adv, m, g, junk_scale)


@case(ORL, "ppo_policy_loss + reduce_loss(token_mean)", "openrlhf.models.loss.PolicyLoss (ppo)",
      "eps_low/eps_high/dual_clip = (0.2,0.2,-), (0.2,0.28,-), (0.1,0.3,3); loss, clipfrac=clip_ratio, "
      "ppo_kl; |log ratio| > 20 in fp64")
def orl_policy_loss(P, dt, g, d, dd):
    from turborlhf.algo import ppo_policy_loss, reduce_loss

    for el, eh, dc in [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)]:
        layer = P.loss.PolicyLoss(clip_eps_low=el, clip_eps_high=eh, dual_clip=dc)
        for B, T in SHAPES:
            m, logp, old, adv = _ppo_inputs(g, B, T, dt, extreme=dt == "float64")
            loss, clip_ratio, ppo_kl = layer(logp, old, adv, action_mask=m.to(logp.dtype))[:3]
            ours, st = ppo_policy_loss(logp, old, adv, m, el, eh, dc)
            d.add(reduce_loss(ours, m), loss)
            d.add(st["clipfrac"], clip_ratio)
            d.add(st["ppo_kl"], ppo_kl)


@case(ORL, "value_loss + reduce_loss(token_mean)", "openrlhf.models.loss.ValueLoss",
      "clip None, 0.2, 0.5 (the 1/2 is inside value_loss)")
def orl_value_loss(P, dt, g, d, dd):
    from turborlhf.algo import reduce_loss, value_loss

    for clip in (None, 0.2, 0.5):
        layer = P.loss.ValueLoss(clip_eps=clip)
        for B, T in SHAPES:
            m = rmask(g, B, T)
            old = randn(g, B, T, dt=dt)
            v = junk(old + randn(g, B, T, dt=dt, scale=0.4), m, g)
            ret = junk(randn(g, B, T, dt=dt), m, g)
            old = junk(old, m, g)
            d.add(reduce_loss(value_loss(v, old, ret, m, clip), m), layer(v, old, ret, action_mask=m.to(v.dtype)))


@case(ORL, "pairwise_rm_loss + reduce_seq_loss", "openrlhf.models.loss.PairWiseLoss, LogExpLoss",
      "no margin / margin; LogExp = no margin")
def orl_rm_loss(P, dt, g, d, dd):
    from turborlhf.algo import pairwise_rm_loss, reduce_seq_loss

    for B in (1, 3, 8, 33):
        c, r = randn(g, B, dt=dt, scale=2), randn(g, B, dt=dt, scale=2)
        margin = randn(g, B, dt=dt).abs()
        d.add(reduce_seq_loss(pairwise_rm_loss(c, r)[0]), P.loss.PairWiseLoss()(c, r))
        d.add(reduce_seq_loss(pairwise_rm_loss(c, r, margin)[0]), P.loss.PairWiseLoss()(c, r, margin))
        d.add(reduce_seq_loss(pairwise_rm_loss(c, r)[0]), P.loss.LogExpLoss()(c, r))


def _pairs(g, B, dt, scale=8.0):
    pc, pr = -rand(g, B, dt=dt, scale=scale) - 1, -rand(g, B, dt=dt, scale=scale) - 1
    rc, rr = -rand(g, B, dt=dt, scale=scale) - 1, -rand(g, B, dt=dt, scale=scale) - 1
    return pc, pr, rc, rr


@case(ORL, "dpo_loss + reduce_seq_loss", "openrlhf.models.loss.DPOLoss",
      "variant sigmoid / cdpo (label_smoothing 0.1, 0.3) / ipo (summed log-probs), beta 0.1, 0.5; loss and "
      "chosen/rejected rewards", dtypes=("float64",))
def orl_dpo(P, dt, g, d, dd):
    from turborlhf.algo import dpo_loss, reduce_seq_loss

    for variant, eps, ipo in [("sigmoid", 0.0, False), ("cdpo", 0.1, False), ("cdpo", 0.3, False), ("ipo", 0.0, True)]:
        for beta in (0.1, 0.5):
            layer = P.loss.DPOLoss(beta, label_smoothing=eps, ipo=ipo)
            for B in (1, 3, 8, 33):
                pc, pr, rc, rr = _pairs(g, B, dt)
                loss, cr, rj = layer(pc, pr, rc, rr)
                ours, st = dpo_loss(pc, pr, rc, rr, beta, variant, label_smoothing=eps)
                d.add(reduce_seq_loss(ours), loss)
                d.add(st["chosen_rewards"], cr)
                d.add(st["rejected_rewards"], rj)


@case(ORL, "kl_estimate", "openrlhf.models.utils.compute_approx_kl", "k1, k2, k3 with clamp=10.0",
      doc="docs/algorithms/ppo.md", default_note="clamp=None (no clamp, as TRL and the paper formulas)")
def orl_kl(P, dt, g, d, dd):
    from turborlhf.algo import kl_estimate

    for est in ("k1", "k2", "k3"):
        for B, T in SHAPES + [(4, 64)]:
            logp = -rand(g, B, T, dt=dt, scale=3)
            ref = logp + randn(g, B, T, dt=dt, scale=6)      # |log ratio| up to ~20: the clamp matters
            peer = P.utils.compute_approx_kl(logp, ref, kl_estimator=est)
            d.add(kl_estimate(logp, ref, est, clamp=10.0), peer)
            dd.add(kl_estimate(logp, ref, est), peer)


@case(ORL, "kl_penalized_rewards", "openrlhf.models.utils.compute_reward",
      "kl_coef 0, 0.05; clip=(-2, 2) = reward_clip_range; valid positions (OpenRLHF leaves -coef*kl of the "
      "caller's already-masked kl at padding)")
def orl_reward(P, dt, g, d, dd):
    from turborlhf.algo import kl_penalized_rewards

    for coef in (0.0, 0.05):
        for B, T in SHAPES:
            m = rmask(g, B, T)
            scores = randn(g, B, dt=dt, scale=3)
            kl = junk(randn(g, B, T, dt=dt, scale=0.1), m, g)
            peer = P.utils.compute_reward(scores, coef, kl, action_mask=m, reward_clip_range=(-2.0, 2.0))
            d.add(kl_penalized_rewards(scores, kl, m, coef, clip=(-2.0, 2.0)), peer, mask=m)


@case(ORL, "gae", "RemoteExperienceMaker.get_advantages_and_returns (unbound, self unused)",
      "(gamma, lam) = (1, .95), (.99, .95), (1, 1), (.9, 0); advantages and returns, whole tensor")
def orl_gae(P, dt, g, d, dd):
    from turborlhf.algo import gae

    f = P.em.RemoteExperienceMaker.get_advantages_and_returns
    for gamma, lam in [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.9, 0.0)]:
        for B, T in SHAPES:
            m = rmask(g, B, T)
            v, r = junk(randn(g, B, T, dt=dt), m, g), junk(randn(g, B, T, dt=dt, scale=0.3), m, g)
            pa, pr = f(None, v, r, m, gamma, lam)
            oa, orr = gae(v, r, m, gamma, lam)
            d.add(oa, pa)
            d.add(orr, pr)


@case(ORL, "discounted_returns", "RemoteExperienceMaker.get_cumulative_returns (unbound, self unused)",
      "gamma 1, 0.9; whole tensor")
def orl_returns(P, dt, g, d, dd):
    from turborlhf.algo import discounted_returns

    f = P.em.RemoteExperienceMaker.get_cumulative_returns
    for gamma in (1.0, 0.9):
        for B, T in SHAPES:
            m = rmask(g, B, T)
            r = junk(randn(g, B, T, dt=dt, scale=0.3), m, g)
            d.add(discounted_returns(r, m, gamma), f(None, r, m, gamma))


def _orl_pipeline(P, est, dt, g, d, dd, gamma, lam, kl_coef=0.01, n_samples=4, prompts=3):
    """OpenRLHF's whole compute_advantages_and_returns (baseline, reward shaping, returns, global whitening)
    on two experiences holding a shuffled rollout, against the same steps written with turborlhf.algo."""
    import functools
    import types

    import torch

    from turborlhf.algo import (discounted_returns, gae, group_mean_baseline, group_normalized_advantages,
                                kl_penalized_rewards, leave_one_out_advantages, masked_whiten)

    REM = P.em.RemoteExperienceMaker
    N = prompts * n_samples
    for T in (1, 6, 20):
        m = rmask(g, N, T)
        scores = randn(g, N, dt=dt)
        scores[:n_samples] = 1.0                                  # one group with identical rewards
        kl = torch.where(m, randn(g, N, T, dt=dt, scale=0.05), torch.zeros((), dtype=scores.dtype))
        values = torch.where(m, randn(g, N, T, dt=dt), torch.zeros((), dtype=scores.dtype))
        perm = torch.randperm(N, generator=g).tolist()
        parts = [perm[:5], perm[5:]]
        exps = [types.SimpleNamespace(rewards=scores[idx].clone(), index=list(idx), kl=kl[idx], action_mask=m[idx],
                                      values=values[idx], info={}, advantages=None, returns=None) for idx in parts]
        args = types.SimpleNamespace(
            rollout=types.SimpleNamespace(n_samples_per_prompt=n_samples),
            algo=types.SimpleNamespace(advantage=types.SimpleNamespace(estimator=est, gamma=gamma, lambd=lam,
                                                                       no_std_norm=False)),
            reward=types.SimpleNamespace(clip_range=(-10.0, 10.0)))
        self = types.SimpleNamespace(strategy=types.SimpleNamespace(args=args), advantage_estimator=est,
                                     kl_ctl=types.SimpleNamespace(value=kl_coef))
        self.get_advantages_and_returns = functools.partial(REM.get_advantages_and_returns, self)
        self.get_cumulative_returns = functools.partial(REM.get_cumulative_returns, self)
        REM.compute_advantages_and_returns(self, exps)

        def ours(eps):
            s = scores.view(prompts, n_samples)
            if est == "rloo":
                s = leave_one_out_advantages(s)
            elif est == "reinforce_baseline":
                s = group_mean_baseline(s)
            elif est == "dr_grpo":
                s = group_normalized_advantages(s, std=False)
            elif est == "group_norm":
                s = group_normalized_advantages(s) if eps is None else group_normalized_advantages(s, eps=eps)
            rewards = kl_penalized_rewards(s.reshape(-1), kl, m, kl_coef, clip=(-10.0, 10.0))
            if est == "gae":
                adv, ret = gae(values, rewards, m, gamma, lam)
            else:
                ret = discounted_returns(rewards, m, gamma)
                adv = ret
            if est in ("gae", "reinforce", "reinforce_baseline"):
                adv = masked_whiten(adv, m)
            return adv, ret

        for diff, eps in ((d, 1e-9), (dd, None)):
            if diff is dd and est != "group_norm":
                continue
            adv, ret = ours(eps)
            for e in exps:
                idx = torch.tensor(e.index)
                diff.add(adv[idx], e.advantages, mask=m[idx])
                diff.add(ret[idx], e.returns, mask=m[idx])


def _pipeline_case(est, gamma, lam, ours_desc, doc=None, default_note=""):
    def fn(P, dt, g, d, dd):
        _orl_pipeline(P, est, dt, g, d, dd, gamma, lam)
    fn.__name__ = f"orl_pipeline_{est}"
    case(ORL, f"advantage pipeline: {ours_desc}",
         f"RemoteExperienceMaker.compute_advantages_and_returns (estimator={est}, stand-in self)",
         f"gamma={gamma}, lam={lam}, kl_coef 0.01, reward clip (-10, 10), 3 prompts x 4 samples shuffled into 2 "
         "experiences; advantages and returns at valid positions"
         + ("; group_normalized_advantages(eps=1e-9)" if est == "group_norm" else ""),
         doc=doc, default_note=default_note)(fn)


_pipeline_case("gae", 1.0, 0.95, "kl_penalized_rewards, gae, masked_whiten (biased)")
_pipeline_case("reinforce", 0.95, 1.0, "kl_penalized_rewards, discounted_returns, masked_whiten")
_pipeline_case("rloo", 1.0, 1.0, "leave_one_out_advantages, kl_penalized_rewards, discounted_returns")
_pipeline_case("reinforce_baseline", 1.0, 1.0, "group_mean_baseline, ..., discounted_returns, masked_whiten")
_pipeline_case("group_norm", 1.0, 1.0, "group_normalized_advantages, kl_penalized_rewards, discounted_returns",
               doc="docs/algorithms/critic_free.md", default_note="eps=1e-4 on the std (TRL's value)")
_pipeline_case("dr_grpo", 1.0, 1.0, "group_normalized_advantages(std=False), kl_penalized_rewards, "
               "discounted_returns")


@case(ORL, "AdaptiveKLController, FixedKLController", "openrlhf.trainer.ppo_utils.kl_controller",
      "30 updates with random current KL and n_steps; value after each", dtypes=("float64",))
def orl_klctl(P, dt, g, d, dd):
    from turborlhf.algo import AdaptiveKLController, FixedKLController

    for init, target, horizon in [(0.2, 6.0, 10000.0), (0.05, 0.5, 500.0)]:
        ours, peer = AdaptiveKLController(init, target, horizon), P.klc.AdaptiveKLController(init, target, horizon)
        fo, fp = FixedKLController(init), P.klc.FixedKLController(init)
        for cur, n in zip(rand(g, 30, scale=3 * target).tolist(), (rand(g, 30, scale=511) + 1).long().tolist()):
            ours.update(cur, n)
            peer.update(cur, n)
            fo.update(cur, n)
            fp.update(cur, n)
            d.add(ours.value, float(peer.value))
            d.add(fo.value, float(fp.value))


@case(ORL, "sft_nll_loss + reduce_loss", "openrlhf.models.loss.SFTLoss", "token_level_loss True = token_mean, "
      "False = seq_mean_token_mean")
def orl_sft(P, dt, g, d, dd):
    from turborlhf.algo import reduce_loss, sft_nll_loss

    for B, T in SHAPES:
        m = rmask(g, B, T)
        lp = junk(-rand(g, B, T, dt=dt, scale=5), m, g)
        mf = m.to(lp.dtype)
        d.add(reduce_loss(sft_nll_loss(lp, m), m), P.loss.SFTLoss(token_level_loss=True)(lp, mf))
        d.add(reduce_loss(sft_nll_loss(lp, m), m, "seq_mean_token_mean"),
              P.loss.SFTLoss(token_level_loss=False)(lp, mf))


def _lm_batch(g, B, L, V, dt):
    import torch

    logits = randn(g, B, L, V, dt=dt, scale=3)
    labels = torch.randint(0, V, (B, L), generator=g)
    prompt = torch.randint(0, L - 1, (B,), generator=g)
    lens = torch.randint(1, L, (B,), generator=g)
    pos = torch.arange(L)[None, :]
    keep = (pos > prompt[:, None]) & (pos <= prompt[:, None] + lens[:, None])
    keep[:, 0] = False
    keep[0, 1] = True                                    # at least one target
    return logits, labels.masked_fill(~keep, -100)


@case(ORL, "logprobs_from_logits + sft_nll_loss + reduce_loss", "openrlhf.models.loss.GPTLMLoss",
      "shifted logits/labels, -100 ignored; chunk_size=3")
def orl_gptlm(P, dt, g, d, dd):
    from turborlhf.algo import logprobs_from_logits, reduce_loss, sft_nll_loss

    for B, L, V in [(1, 3, 5), (3, 9, 11), (4, 17, 32)]:
        logits, labels = _lm_batch(g, B, L, V, dt)
        lab = labels[:, 1:]
        m = lab != -100
        lp = logprobs_from_logits(logits[:, :-1], lab, chunk_size=3)
        d.add(reduce_loss(sft_nll_loss(lp, m), m), P.loss.GPTLMLoss()(logits, labels))


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


@case(ORL, "logprobs_from_logits", "openrlhf.models.utils.log_probs_from_logits (torch fallback, no flash-attn)",
      "chunk_size 3 and default")
def orl_logprobs(P, dt, g, d, dd):
    _logprobs_vs(P.utils.log_probs_from_logits, dt, g, d)


@case(ORL, "logprobs_from_logits (bf16 logits)", "openrlhf.models.utils.log_probs_from_logits (bf16 row loop)",
      **_BF16_LOGPROBS)
def orl_logprobs_bf16(P, dt, g, d, dd):
    _logprobs_bf16_vs(P.utils.log_probs_from_logits, dt, g, d, dd)


@case(ORL, "entropy_from_logits", "openrlhf.models.utils.compute_entropy.__wrapped__ (eager, not compiled)",
      "chunk_size 3")
def orl_entropy(P, dt, g, d, dd):
    _entropy_vs(P.utils.compute_entropy.__wrapped__, dt, g, d)


# ============================================================================== OpenRLHF 0.9.0 (KTO)


@case(ORL_KTO, "kto_kl_estimate + kto_loss + reduce_seq_loss", "openrlhf.models.loss.KTOLoss (world_size 1, gloo)",
      "beta 0.1, 0.01, 0.5; weights (1,1), (1.33,1), (1,0.7); one side empty; z0 clamped and not; loss, KL, rewards")
def orl_kto(P, dt, g, d, dd):
    import torch

    from turborlhf.algo import kto_kl_estimate, kto_loss, reduce_seq_loss

    for beta, wd, wu in [(0.1, 1.0, 1.0), (0.01, 1.0, 1.0), (0.1, 1.33, 1.0), (0.5, 1.0, 0.7)]:
        layer = P.loss.KTOLoss(beta, wd, wu, world_size=1, device=torch.device("cpu"))
        for k, (b1, b2) in enumerate([(3, 2), (1, 4), (6, 6), (0, 3), (3, 0)]):
            pc, rc = -rand(g, b1, dt=dt, scale=20) - 1, -rand(g, b1, dt=dt, scale=20) - 1
            pr, rr = -rand(g, b2, dt=dt, scale=20) - 1, -rand(g, b2, dt=dt, scale=20) - 1
            rkl = -rand(g, b1 + b2, dt=dt, scale=20) - 1
            pkl = rkl + randn(g, b1 + b2, dt=dt, scale=0.5) + (0.3 if k % 2 else -0.3)
            loss, cr, rj, kl = layer(pc, pr, pkl, rc, rr, rkl)
            z0 = kto_kl_estimate(pkl, rkl)
            ours, st = kto_loss(pc, rc, pr, rr, z0, beta, wd, wu)
            d.add(reduce_seq_loss(ours), loss)
            d.add(z0, kl)
            d.add(st["chosen_rewards"], cr)
            d.add(st["rejected_rewards"], rj)


# ============================================================================== TRL 1.16.0

TRL = "trl-1.16.0"
TRL12 = "trl-1.12.0"


@case(TRL, "logprobs_from_logits", "trl.trainer.utils.selective_log_softmax (torch path)", "chunk_size 3 and default")
def trl_logprobs(P, dt, g, d, dd):
    _logprobs_vs(P.utils.selective_log_softmax, dt, g, d)


@case(TRL, "logprobs_from_logits (bf16 logits)", "trl.trainer.utils.selective_log_softmax (bf16 row loop)",
      **_BF16_LOGPROBS)
def trl_logprobs_bf16(P, dt, g, d, dd):
    _logprobs_bf16_vs(P.utils.selective_log_softmax, dt, g, d, dd)


@case(TRL, "entropy_from_logits", "trl.trainer.utils.entropy_from_logits (torch path)", "chunk_size 3; peer's 4")
def trl_entropy(P, dt, g, d, dd):
    _entropy_vs(lambda logits: P.utils.entropy_from_logits(logits, chunk_size=4), dt, g, d)


def _dpo_batch(g, B, L, dt):
    """2B rows [chosen; rejected]: prompt then completion, right-padded; table of per-token log-probs aligned
    with the shifted labels (0 outside the completion), as TRL's fused LM head returns them."""
    import torch

    rows = 2 * B
    p = torch.randint(1, L, (rows,), generator=g)
    c = torch.stack([torch.randint(1, int(L - pi) + 1, (1,), generator=g)[0] for pi in p])
    pos = torch.arange(L)[None, :]
    cmask = ((pos >= p[:, None]) & (pos < (p + c)[:, None])).long()
    zero = torch.zeros((), dtype=getattr(torch, dt))
    table = torch.where(cmask[:, 1:].bool(), -rand(g, rows, L - 1, dt=dt, scale=2), zero)
    input_ids = torch.randint(0, 50, (rows, L), generator=g)
    input_ids[:, 0] = torch.arange(rows)
    attn = (pos < (p + c)[:, None]).long()
    return table, cmask, input_ids, attn


def _trl_dpo(P, loss_type, beta, eps, table, cmask, input_ids, attn, ref_c, ref_r):
    from types import SimpleNamespace

    model = _TableModel(table)
    self = SimpleNamespace(model=model, accelerator=_Acc(), aux_loss_enabled=False, ld_alpha=None,
                           precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                           loss_weights=[1.0], beta=beta, label_smoothing=eps, use_weighting=False, _metrics=_metrics(),
                           _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": input_ids, "attention_mask": attn, "completion_mask": cmask,
              "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss = P.DPOTrainer._compute_loss(self, model, inputs, return_outputs=False)
    return loss, self._metrics["train"]


def _dpo_vs_trl(P, dt, g, d, dd, loss_type, variant, eps_list, **ours_kw):
    from turborlhf.algo import dpo_loss, reduce_seq_loss

    for eps in eps_list:
        for beta in (0.1, 0.5):
            for B, L in [(1, 3), (3, 6), (6, 12)]:
                table, cmask, ids, attn = _dpo_batch(g, B, L, dt)
                ref_c, ref_r = -rand(g, B, dt=dt, scale=10) - 1, -rand(g, B, dt=dt, scale=10) - 1
                loss, met = _trl_dpo(P, loss_type, beta, eps, table, cmask, ids, attn, ref_c, ref_r)
                s = table.sum(1)
                lens = cmask.sum(1)
                kw = dict(ours_kw)
                if kw.pop("lengths", False):
                    kw.update(len_c_B=lens[:B], len_r_B=lens[B:])
                ours, st = dpo_loss(s[:B], s[B:], ref_c, ref_r, beta, variant, label_smoothing=eps, **kw)
                d.add(reduce_seq_loss(ours), loss)
                d.add(st["chosen_rewards"].mean(), met["rewards/chosen"][-1])
                d.add(st["rejected_rewards"].mean(), met["rewards/rejected"][-1])
                d.add(st["accuracy"], met["rewards/accuracies"][-1])
                d.add(st["margin"], met["rewards/margins"][-1])
                if dd is not None:
                    default, _ = dpo_loss(s[:B], s[B:], ref_c, ref_r, beta, variant)
                    dd.add(reduce_seq_loss(default), loss)


@case(TRL, "dpo_loss + reduce_seq_loss", "DPOTrainer._compute_loss (loss_type sigmoid; stand-in self and model, "
      "precomputed reference log-probs)", "variant sigmoid, beta 0.1, 0.5; loss, rewards/chosen|rejected|accuracies|"
      "margins", dtypes=("float64",))
def trl_dpo_sigmoid(P, dt, g, d, dd):
    _dpo_vs_trl(P, dt, g, d, None, "sigmoid", "sigmoid", [0.0])


@case(TRL, "dpo_loss + reduce_seq_loss", "DPOTrainer._compute_loss (loss_type robust)",
      "variant robust, label_smoothing 0.1, 0.3", dtypes=("float64",))
def trl_dpo_robust(P, dt, g, d, dd):
    _dpo_vs_trl(P, dt, g, d, None, "robust", "robust", [0.1, 0.3])


@case(TRL, "dpo_loss + reduce_seq_loss", "DPOTrainer._compute_loss (loss_type ipo)",
      "variant ipo, ipo_normalize_by_length=True, len_c_B/len_r_B = completion-token counts",
      doc="docs/algorithms/dpo.md", default_note="IPO on summed log-probs (author code, OpenRLHF)",
      dtypes=("float64",))
def trl_dpo_ipo(P, dt, g, d, dd):
    _dpo_vs_trl(P, dt, g, d, dd, "ipo", "ipo", [0.0], ipo_normalize_by_length=True, lengths=True)


@case(TRL, "dpo_loss(reference_free=True)", "trl.experimental.cpo.CPOTrainer.cpo_loss (alpha 0; stand-in self)",
      "variant sigmoid (label_smoothing 0, 0.1) / ipo; the reference log-probs passed are ignored; rewards "
      "compared with zero reference log-probs", dtypes=("float64",))
def trl_cpo(P, dt, g, d, dd):
    from types import SimpleNamespace

    import torch

    from turborlhf.algo import dpo_loss

    for loss_type, variant, eps in [("sigmoid", "sigmoid", 0.0), ("sigmoid", "cdpo", 0.1), ("ipo", "ipo", 0.0)]:
        for beta in (0.1, 0.5):
            self = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=eps, loss_type=loss_type, simpo_gamma=0.5,
                                   accelerator=_Acc())
            for B in (1, 3, 8, 33):
                pc, pr, rc, rr = _pairs(g, B, dt)
                losses, cr, rj = P.CPOTrainer.cpo_loss(self, pc, pr)
                ours, _ = dpo_loss(pc, pr, rc, rr, beta, variant, label_smoothing=eps, reference_free=True)
                d.add(ours, losses)
                _, st = dpo_loss(pc, pr, torch.zeros_like(pc), torch.zeros_like(pr), beta, variant,
                                 label_smoothing=eps, reference_free=True)
                d.add(st["chosen_rewards"], cr)
                d.add(st["rejected_rewards"], rj)


@case(TRL, "kto_kl_estimate + kto_loss + reduce_seq_loss", "KTOTrainer._compute_loss (loss_type kto; stand-in "
      "self and model, precomputed reference log-probs)", "beta 0.1, 0.5; weights (1,1), (1.33,1); all-desirable "
      "batch; loss, kl, rewards/chosen|rejected", dtypes=("float64",))
def trl_kto(P, dt, g, d, dd):
    import functools
    from types import SimpleNamespace

    from turborlhf.algo import kto_kl_estimate, kto_loss, reduce_seq_loss

    for beta, wd, wu in [(0.1, 1.0, 1.0), (0.5, 1.33, 1.0)]:
        for k, (N, L) in enumerate([(2, 4), (5, 7), (8, 12), (3, 5)]):
            label = rand(g, N) < 0.5
            label[0] = True
            if k < 3 and N > 1:
                label[1] = False                        # the last batch may be all desirable
            table, cmask, ids, attn = _dpo_batch(g, N, L, dt)          # 2N rows: N main, N KL
            kl_shift = 0.3 if k % 2 else -0.3
            ref_all = table.sum(1) + randn(g, 2 * N, dt=dt, scale=0.5) + kl_shift
            model = _TableModel(table)
            self = SimpleNamespace(model=model, accelerator=_Acc(), calculate_KL=True, precompute_ref_logps=True,
                                   loss_type="kto", beta=beta, desirable_weight=wd, undesirable_weight=wu,
                                   aux_loss_enabled=False, _metrics=_metrics(), _total_train_tokens=0, _tp_size=1)
            self._compute_kl_logps = functools.partial(P.KTOTrainer._compute_kl_logps, self)
            inputs = {"input_ids": ids[:N], "attention_mask": attn[:N], "completion_mask": cmask[:N],
                      "KL_input_ids": ids[N:], "KL_attention_mask": attn[N:], "KL_completion_mask": cmask[N:],
                      "label": label, "ref_logps": ref_all[:N], "ref_KL_logps": ref_all[N:]}
            loss = P.KTOTrainer._compute_loss(self, model, inputs, return_outputs=False)
            met = self._metrics["train"]
            s = table.sum(1)
            pi, pkl = s[:N], s[N:]
            z0 = kto_kl_estimate(pkl, ref_all[N:])
            ours, st = kto_loss(pi[label], ref_all[:N][label], pi[~label], ref_all[:N][~label], z0, beta, wd, wu)
            d.add(reduce_seq_loss(ours), loss)
            d.add(z0, met["kl"][-1])
            d.add(st["chosen_rewards"].mean(), met["rewards/chosen"][-1])
            if (~label).any():
                d.add(st["rejected_rewards"].mean(), met["rewards/rejected"][-1])


@case(TRL, "pairwise_rm_loss + reduce_seq_loss", "RewardTrainer.compute_loss (stand-in self and model)",
      "margin none / given; center_coef None / 0.01; loss, accuracy, margin")
def trl_rm(P, dt, g, d, dd):
    from types import SimpleNamespace

    import torch

    from turborlhf.algo import pairwise_rm_loss, reduce_seq_loss

    for center in (None, 0.01):
        for with_margin in (False, True):
            for B in (1, 3, 8, 33):
                c, r = randn(g, B, dt=dt, scale=2), randn(g, B, dt=dt, scale=2)
                c[0] = r[0] if B > 1 else c[0]                 # a tie counts as wrong
                margin = randn(g, B, dt=dt).abs() if with_margin else None
                self = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Acc(), _metrics=_metrics(),
                                       args=SimpleNamespace(center_rewards_coefficient=center),
                                       _total_train_tokens=0, _tp_size=1)
                inputs = {"input_ids": torch.zeros(2 * B, 3, dtype=torch.long),
                          "attention_mask": torch.ones(2 * B, 3, dtype=torch.long)}
                if margin is not None:
                    inputs["margin"] = margin
                model = lambda **kw: SimpleNamespace(logits=torch.cat([c, r])[:, None])  # noqa: E731
                loss = P.RewardTrainer.compute_loss(self, model, inputs)
                ours, st = pairwise_rm_loss(c, r, margin, center_coef=center)
                met = self._metrics["train"]
                d.add(reduce_seq_loss(ours), loss)
                d.add(st["accuracy"], met["accuracy"][-1])
                d.add(st["margin"], met["margin"][-1])


def _grpo_inputs(g, B, T, dt, empty=0):
    import torch

    m = rmask(g, B, T, empty=empty)
    old = -rand(g, B, T, dt=dt, scale=2.0)
    delta = randn(g, B, T, dt=dt, scale=0.3)
    big = rand(g, B, T) < 0.15
    delta = torch.where(big, delta + 1.5 * torch.sign(delta), delta)
    logp = old + delta
    ref = logp + randn(g, B, T, dt=dt, scale=0.3)
    adv = randn(g, B, dt=dt)
    js = 3.0   # TRL does not clamp the log-ratio: keep the padding junk small enough for exp()
    return m, junk(logp, m, g, js), junk(old, m, g, js), junk(ref, m, g, js), adv


def _trl_grpo(P, loss_type, beta, el, eh, delta, m, logp, old, ref, adv, max_len):
    from types import SimpleNamespace

    import torch

    B, T = logp.shape

    def per_token(model, input_ids, attention_mask, logits_to_keep, compute_entropy=True, compute_aux_loss=False, **kw):
        return logp, torch.zeros_like(logp), None

    self = SimpleNamespace(_get_per_token_logps_and_entropies=per_token, top_entropy_quantile=1.0,
                           off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
                           args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
                           loss_type=loss_type, epsilon_low=el, epsilon_high=eh, use_vllm=False,
                           vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
                           current_gradient_accumulation_steps=1, max_completion_length=max_len, accelerator=_Acc(),
                           _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=_metrics())
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": m.long(),
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": m.sum().to(logp.dtype)}
    if beta:
        inputs["ref_per_token_logps"] = ref
    loss = P.GRPOTrainer._compute_loss(self, None, inputs)
    return loss, self._metrics["train"]


def _grpo_vs_trl(P, dt, g, d, dd, loss_type, mode, empty=0):
    from turborlhf.algo import kl_estimate, masked_mean, ppo_policy_loss, reduce_loss, sequence_to_token

    for beta in (0.0, 0.04):
        for el, eh, delta in [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0)]:
            for B, T in [(1, 1), (4, 5), (8, 16)]:
                if empty and B < 3:
                    continue
                m, logp, old, ref, adv = _grpo_inputs(g, B, T, dt, empty=empty)
                loss, met = _trl_grpo(P, loss_type, beta, el, eh, delta, m, logp, old, ref, adv, T + 2)
                ours_BT, st = ppo_policy_loss(logp, old, sequence_to_token(adv, m), m, el, eh, dual_clip=delta)
                if beta:
                    kl_BT = kl_estimate(logp, ref, "k3")
                    ours_BT = ours_BT + beta * kl_BT
                    d.add(masked_mean(kl_BT, m), met["kl"][-1])
                kw = {"token_sum_norm": {"max_len": T + 2}, "token_mean": {"num_tokens": m.sum()},
                      "seq_mean_token_mean": {"num_seqs": B} if empty else {}}[mode]
                d.add(reduce_loss(ours_BT, m, mode, **kw), loss)
                d.add(st["clipfrac"], met["clip_ratio/region_mean"][-1])
                if dd is not None:
                    dd.add(reduce_loss(ours_BT, m, mode), loss)


_GRPO_COMMON = ("beta 0 / 0.04 (+beta*k3 kl_estimate); eps (0.2,0.2), (0.2,0.28); TRL delta=3 as dual_clip=3; "
                "loss, clip_ratio/region_mean=clipfrac, kl")


@case(TRL, "ppo_policy_loss + kl + reduce_loss(seq_mean_token_mean)", "GRPOTrainer._compute_loss (loss_type grpo; "
      "stand-in self)", _GRPO_COMMON)
def trl_grpo_grpo(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, None, "grpo", "seq_mean_token_mean")


@case(TRL, "ppo_policy_loss + kl + reduce_loss(token_mean)", "GRPOTrainer._compute_loss (loss_type bnpo)",
      _GRPO_COMMON)
def trl_grpo_bnpo(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, None, "bnpo", "token_mean")


@case(TRL, "ppo_policy_loss + kl + reduce_loss(token_mean, num_tokens)", "GRPOTrainer._compute_loss (loss_type "
      "dapo, the default; num_items_in_batch = tokens)", _GRPO_COMMON)
def trl_grpo_dapo(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, None, "dapo", "token_mean")


@case(TRL, "ppo_policy_loss + kl + reduce_loss(token_sum_norm, max_len)", "GRPOTrainer._compute_loss (loss_type "
      "dr_grpo; max_completion_length = T+2 = max_len)", _GRPO_COMMON)
def trl_grpo_dr(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, None, "dr_grpo", "token_sum_norm")


@case(TRL, "reduce_loss(seq_mean_token_mean) with an empty completion", "GRPOTrainer._compute_loss (loss_type grpo)",
      "num_seqs=B (TRL counts a fully masked completion as a 0-loss sequence)", doc="docs/algorithms/README.md",
      default_note="empty sequences are left out of the mean (OpenRLHF's aggregate_loss)")
def trl_grpo_empty(P, dt, g, d, dd):
    _grpo_vs_trl(P, dt, g, d, dd, "grpo", "seq_mean_token_mean", empty=1)


@case(TRL, "ppo_policy_loss on sequence sums (B, 1)", "RLOOTrainer._compute_loss (stand-in self)",
      "logp/old = masked_sum over tokens as (B,1), mask of ones, token_mean = mean over sequences; eps (0.2,0.2), "
      "(0.2,0.28)", doc="docs/algorithms/critic_free.md",
      default_note="token-level ratio per token (OpenRLHF), as our trainers use it")
def trl_rloo(P, dt, g, d, dd):
    from types import SimpleNamespace

    import torch

    from turborlhf.algo import masked_sum, ppo_policy_loss, reduce_loss, sequence_to_token

    for el, eh in [(0.2, 0.2), (0.2, 0.28)]:
        for B, T in [(1, 1), (4, 5), (8, 16)]:
            m, logp, old, _, adv = _grpo_inputs(g, B, T, dt)
            old_seq = masked_sum(old, m, dim=1)

            def per_token(model, *a, **kw):
                return logp, torch.zeros_like(logp), None

            self = SimpleNamespace(_get_per_token_logps_and_entropies=per_token, aux_loss_enabled=False,
                                   epsilon_low=el, epsilon_high=eh, model=SimpleNamespace(training=True),
                                   accelerator=_Acc(), _metrics=_metrics())
            inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long),
                      "prompt_mask": torch.ones(B, 2, dtype=torch.long),
                      "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": m.long(),
                      "old_logps": old_seq, "advantages": adv}
            loss = P.RLOOTrainer._compute_loss(self, None, inputs)
            ones = torch.ones(B, 1, dtype=torch.bool)
            seq, _ = ppo_policy_loss(masked_sum(logp, m, dim=1)[:, None], old_seq[:, None], adv[:, None], ones, el, eh)
            d.add(reduce_loss(seq, ones), loss)
            tok, _ = ppo_policy_loss(logp, old, sequence_to_token(adv, m), m, el, eh)
            dd.add(reduce_loss(tok, m), loss)


# ============================================================================== TRL 1.12.0 (PPO helpers)


@case(TRL12, "masked_mean", "trl.experimental.ppo.ppo_trainer.masked_mean", "axis None and 1 (non-empty rows)")
def trl12_masked_mean(P, dt, g, d, dd):
    from turborlhf.algo import masked_mean

    for B, T in SHAPES:
        m = rmask(g, B, T)
        x = junk(randn(g, B, T, dt=dt), m, g)
        d.add(masked_mean(x, m), P.ppo.masked_mean(x, m.to(x.dtype)))
        d.add(masked_mean(x, m, dim=1), P.ppo.masked_mean(x, m.to(x.dtype), axis=1))


_SHAPES2 = [(1, 2), (2, 3), (5, 8), (8, 33)]   # >= 2 valid tokens (unbiased variance)


@case(TRL12, "masked_var", "trl.experimental.ppo.ppo_trainer.masked_var", "unbiased=True (TRL's default); "
      "also both with unbiased=False", doc="docs/algorithms/ppo.md",
      default_note="unbiased=False (biased, as OpenRLHF and the Ziegler et al. author code)")
def trl12_masked_var(P, dt, g, d, dd):
    from turborlhf.algo import masked_var

    for B, T in _SHAPES2:
        m = rmask(g, B, T)
        x = junk(randn(g, B, T, dt=dt, scale=2), m, g)
        mf = m.to(x.dtype)
        d.add(masked_var(x, m, unbiased=True), P.ppo.masked_var(x, mf))
        d.add(masked_var(x, m, unbiased=False), P.ppo.masked_var(x, mf, unbiased=False))
        dd.add(masked_var(x, m), P.ppo.masked_var(x, mf))


@case(TRL12, "masked_whiten", "trl.experimental.ppo.ppo_trainer.masked_whiten", "unbiased=True; shift_mean True "
      "and False; valid positions (TRL's caller zero-fills the padding, ours does it itself)",
      doc="docs/algorithms/ppo.md", default_note="unbiased=False (biased variance, OpenRLHF)")
def trl12_masked_whiten(P, dt, g, d, dd):
    from turborlhf.algo import masked_whiten

    for shift in (True, False):
        for B, T in _SHAPES2:
            m = rmask(g, B, T)
            x = junk(randn(g, B, T, dt=dt, scale=2) + 0.5, m, g)
            peer = P.ppo.masked_whiten(x, m.to(x.dtype), shift_mean=shift)
            d.add(masked_whiten(x, m, shift_mean=shift, unbiased=True), peer, mask=m)
            dd.add(masked_whiten(x, m, shift_mean=shift), peer, mask=m)


# ------------------------------------------------------------------------------ worker / driver


def status(row: dict) -> str:
    if row.get("error"):
        return "ERROR"
    if row["max_diff"] is None:
        return "not installed"
    if not row["max_diff"] <= TOL:
        return "MISMATCH"
    if row["doc"]:
        if row["default_diff"] is not None and row["default_diff"] > DIFFER_MIN:
            return f"intended difference (see {row['doc']})"
        return "MISMATCH (the default was expected to differ)"
    return "match"


def worker(peer: str, seeds: int) -> dict:
    import torch

    torch.set_num_threads(1)
    folder = peer_path(peer)
    P = load_peer(peer, folder)
    rows = []
    for c in [c for c in CASES if c.peer == peer]:
        d, dd = Diff(), Diff()
        err = None
        t0 = time.perf_counter()
        try:
            for dt in c.dtypes:
                for seed in range(seeds):
                    c.fn(P, dt, _g(1000 * seed + 17), d, dd)
        except Exception:   # one broken comparison must not hide the others
            err = traceback.format_exc(limit=6)
        row = {k: v for k, v in asdict(c).items() if k != "fn"}
        row.update(max_diff=d.max, n=d.n, default_diff=dd.max if dd.n else None, error=err,
                   seconds=round(time.perf_counter() - t0, 2))
        row["status"] = status(row)
        rows.append(row)
    import transformers

    return {"peer": peer, "version": P.version, "folder": str(folder), "torch": torch.__version__,
            "transformers": transformers.__version__, "rows": rows}


def run_peer(peer: str, seeds: int = 3, timeout: float = 1200) -> dict:
    """Run one peer's comparisons in a child process (its folder first on PYTHONPATH, then our src)."""
    folder = peer_path(peer)
    base = {"peer": peer, "version": PEERS[peer][1], "folder": str(folder)}
    if not folder.is_dir():
        rows = [{**{k: v for k, v in asdict(c).items() if k != "fn"}, "max_diff": None, "n": 0, "default_diff": None,
                 "error": None, "status": "not installed"} for c in CASES if c.peer == peer]
        return {**base, "installed": False, "rows": rows}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO / "src")]), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "TURBORLHF_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", peer, "--seeds", str(seeds)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return {**json.loads(line[len(RESULT_TAG):]), "installed": True}
    tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
    raise RuntimeError(f"comparison worker for {peer} failed (exit {res.returncode}):\n{tail}")


def _fmt(x) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.1e}"


def markdown_table(results: list[dict]) -> str:
    lines = ["| ours | peer | peer code | our options (reproducing the peer) | dtypes | max abs diff "
             "| default: abs diff | result |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for r in res["rows"]:
            peer = f"{res['peer'].split('-')[0]} {res.get('version', '')}"
            default = _fmt(r["default_diff"]) + (f" ({r['default_note']})" if r["doc"] else "")
            cells = [f"`{r['function']}`", peer, r["peer_code"], r["options"], ", ".join(r["dtypes"]),
                     _fmt(r["max_diff"]), default, r["status"]]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", action="append", choices=sorted(PEERS), help="only these peers (repeatable)")
    ap.add_argument("--seeds", type=int, default=3, help="random draws per case and dtype (default 3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--worker", choices=sorted(PEERS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(RESULT_TAG + json.dumps(worker(args.worker, args.seeds)), flush=True)
        return 0
    results = []
    for peer in args.peer or list(PEERS):
        print(f"[compare] {peer} ...", file=sys.stderr, flush=True)
        results.append(run_peer(peer, args.seeds))
    print(f"turborlhf.algo vs peers, {time.strftime('%Y-%m-%d')}; tolerance {TOL:g} (max |ours - peer| over "
          f"{args.seeds} seeds x shapes x dtypes); an intended difference must exceed {DIFFER_MIN:g} with our default")
    for res in results:
        where = res["folder"] if res["installed"] else f"not installed ({res['folder']})"
        extra = f", torch {res['torch']}, transformers {res['transformers']}" if res["installed"] else ""
        print(f"- {res['peer']}: {where}{extra}")
    print()
    print(markdown_table(results))
    print("\nNot compared:")
    for peer, what, why in NOT_COMPARABLE:
        print(f"- {peer}: {what} -- {why}")
    errors = [r for res in results for r in res["rows"] if r.get("error")]
    for r in errors:
        print(f"\nERROR in {r['key']}:\n{r['error']}", file=sys.stderr)
    bad = [r for res in results for r in res["rows"] if r["status"].startswith(("MISMATCH", "ERROR"))]
    if args.json:
        print(json.dumps({"date": time.strftime("%Y-%m-%d"), "tolerance": TOL, "differ_min": DIFFER_MIN,
                          "results": results, "not_comparable": NOT_COMPARABLE}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
