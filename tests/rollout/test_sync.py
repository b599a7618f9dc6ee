"""Weight-sync verification (rollout/sync.py): passes for a correct push, fails for corrupted
weights (a perturbed tensor, swapped names, a stale engine) with an error naming the engine."""
import pytest
import torch

from rollout_helpers import tiny_llama
from turborlhf.rollout.fast import FastEngine
from turborlhf.rollout.hf import HFEngine
from turborlhf.rollout.sync import (Canary, WeightSyncError, canary_rows, make_canary, policy_weights, push_weights,
                                    start_sync_check, trainer_logprobs, verify_sync)

from turborlhf.rollout import kernels as _kernels

_K = _kernels.load(warn=False)
HAS_W16 = _K is not None and torch.float32 in _K.linear_dtypes       # fp32 kernel linears (AVX2 + FMA)
needs_w16 = pytest.mark.skipif(not HAS_W16, reason="no fp32 kernel linears here (bf16 weight storage needs them)")
ENGINES = {
    "fast-fp32": lambda m: FastEngine(m, dtype="fp32"),
    "fast-fp32-bf16-weights": lambda m: FastEngine(m, dtype="fp32", weight_dtype="bf16"),
    "fast-bf16": lambda m: FastEngine(m, dtype="bf16"),
    "hf-bf16": lambda m: HFEngine(m, dtype="bf16"),
}
TOL = {"fast-fp32": 1e-3, "fast-fp32-bf16-weights": 1e-3, "fast-bf16": 0.05, "hf-bf16": 0.05}
KINDS = [pytest.param(k, marks=needs_w16) if "weights" in k else k for k in ENGINES]


def _update(model, seed=1, scale=0.05):
    """A policy update: every parameter moves a little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("kind", KINDS)
def test_correct_sync_passes_and_stale_engine_fails(kind, prompts):
    model = tiny_llama(0)
    eng = ENGINES[kind](model)
    canary = make_canary(eng, prompts, n=3, response_tokens=8)
    assert len(canary.prompts) == 3 and all(len(r) == 8 for r in canary.responses)
    rep = verify_sync(eng, model, canary, TOL[kind])          # the engine was built right
    assert rep.verified and rep.max_mean_diff <= TOL[kind]
    model.train()
    _update(model, scale=0.2)
    with pytest.raises(WeightSyncError, match=type(eng).__name__):
        verify_sync(eng, model, canary, TOL[kind])            # stale: the update was not pushed
    rep = push_weights(eng, model, canary, TOL[kind])
    assert rep.verified and rep.max_mean_diff <= TOL[kind] and rep.push_s > 0
    assert model.training                                      # trainer's mode restored
    assert set(rep.metrics()) >= {"sync/logprob_mean_diff", "timing/weight_push"}


@pytest.mark.parametrize("kind", KINDS)
def test_canary_rows_follow_the_engines_arithmetic(kind, prompts):
    """8 rows where the engine computes in bf16 (the mean over rows averages its noise), 4 where
    it computes in fp32 (bf16-stored weights included): the default of make_canary."""
    eng = ENGINES[kind](tiny_llama(0))
    want = 4 if kind.startswith("fast-fp32") else 8
    assert canary_rows(eng) == want
    assert len(make_canary(eng, prompts * 3, response_tokens=4).prompts) == want


@pytest.mark.parametrize("kind", KINDS)
def test_one_perturbed_tensor_fails(kind, prompts):
    model = tiny_llama(0)
    eng = ENGINES[kind](model)
    canary = make_canary(eng, prompts, n=3, response_tokens=8)
    name = "model.layers.1.self_attn.v_proj.weight"
    w = dict(model.named_parameters())[name]
    eng.load_weights([(name, w + torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 0.5)])
    with pytest.raises(WeightSyncError) as e:
        verify_sync(eng, model, canary, TOL[kind])
    msg = str(e.value)
    assert type(eng).__name__ in msg and "sync_tolerance" in msg and "engine" in msg


def test_swapped_names_fail(prompts):
    """A name-mapping bug that loads without error (gate ↔ up) is caught by the canary."""
    model = tiny_llama(0)
    eng = FastEngine(model, dtype="bf16")
    canary = make_canary(eng, prompts, n=3, response_tokens=8)
    swap = {"gate_proj": "up_proj", "up_proj": "gate_proj"}

    def misnamed():
        for n, p in model.named_parameters():
            for a, b in swap.items():
                if f".{a}." in n:
                    n = n.replace(f".{a}.", f".{b}.")
                    break
            yield n, p
    eng.load_weights(misnamed())
    with pytest.raises(WeightSyncError, match="FastEngine"):
        verify_sync(eng, model, canary, 0.05)


def test_push_without_verify_and_wrappers(prompts):
    model = tiny_llama(0)
    eng = FastEngine(model, dtype="fp32")
    canary = make_canary(eng, prompts, n=2, response_tokens=4)
    _update(model, scale=0.2)
    rep = push_weights(eng, model, canary, verify=False)
    assert not rep.verified and "sync/logprob_mean_diff" not in rep.metrics()

    class DDPLike(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.module = m
    wrapped = DDPLike(model)
    _update(model, seed=2, scale=0.2)
    assert push_weights(eng, wrapped, canary, 1e-3).verified   # names without 'module.'


@pytest.mark.parametrize("weight_dtype", [None, pytest.param("bf16", marks=needs_w16)])
def test_lora_policy_is_merged(prompts, weight_dtype):
    peft = pytest.importorskip("peft")
    base = tiny_llama(0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)                          # adapters that change the outputs
    names = [n for n, _ in policy_weights(model)]
    assert names and not any("lora" in n or "base_model" in n for n in names)
    eng = FastEngine(tiny_llama(0), dtype="fp32", weight_dtype=weight_dtype)
    canary = make_canary(eng, prompts, n=2, response_tokens=6)
    with pytest.raises(WeightSyncError):
        verify_sync(eng, model, canary, 1e-3)              # engine still has the base weights
    assert push_weights(eng, model, canary, 1e-3).verified
    assert any("lora" in n for n, _ in model.named_parameters())  # trainer keeps its adapters


def test_trainer_logprobs_and_canary_validation(model, prompts):
    c = Canary(((1, 2, 3),), ((4, 5),))
    lp = trainer_logprobs(model, c)
    with torch.no_grad():
        ref = model(torch.tensor([[1, 2, 3, 4, 5]])).logits[0].log_softmax(-1)
    assert torch.allclose(torch.tensor(lp[0]), torch.stack([ref[2, 4], ref[3, 5]]), atol=1e-5)
    with pytest.raises(ValueError):
        Canary(((1,),), ())
    with pytest.raises(ValueError):
        Canary(((1,),), ((),))
    with pytest.raises(ValueError):
        make_canary(FastEngine(model, dtype="fp32"), [])


def test_wrong_length_scores_fail(model):
    class Liar:
        def score_logprobs(self, prompts, responses):
            return [[0.0] for _ in prompts]
    with pytest.raises(WeightSyncError, match="Liar"):
        verify_sync(Liar(), model, Canary(((1, 2),), ((3, 4),)), 0.05)


@pytest.mark.parametrize("rows", [0, 1])
def test_missing_canary_rows_fail(model, rows):
    """An engine answering for fewer rows than asked passed on those it returned (none: a
    ZeroDivisionError)."""
    eng = FastEngine(model, dtype="fp32")

    class Short:
        def score_logprobs(self, prompts, responses):
            return eng.score_logprobs(prompts, responses)[:rows]
    canary = Canary(((1, 2), (5, 6), (7,)), ((3, 4), (8,), (9, 10)))
    assert verify_sync(eng, model, canary, 1e-4).verified
    with pytest.raises(WeightSyncError, match=f"Short.* {rows} canary rows of 3"):
        verify_sync(Short(), model, canary, 1e-4)


def test_start_sync_check(prompts, capsys):
    from turborlhf.metrics import console_logging

    console_logging()                         # as every command does; the file alone has no handler otherwise
    model = tiny_llama(0)
    eng = FastEngine(model, dtype="fp32")
    assert start_sync_check(eng, model, prompts, verify=False) is None
    canary = start_sync_check(eng, model, prompts, verify=True, tol=1e-3, n=2, response_tokens=5)
    assert len(canary.prompts) == 2 and "matches the trainer" in capsys.readouterr().out
    bad = FastEngine(tiny_llama(1), dtype="fp32")                 # an engine built from other weights
    with pytest.raises(WeightSyncError):
        start_sync_check(bad, model, prompts, verify=True, tol=0.05)


def test_canary_keeps_only_the_end_of_long_prompts(model):
    """Each check costs a trainer forward over the canary: long prompts are cut to their end."""
    long = [list(range(3, 3 + 70)), list(range(5, 25))]
    canary = make_canary(FastEngine(model, dtype="fp32"), long, n=2, response_tokens=4, prompt_tokens=32)
    assert canary.prompts == (tuple(long[0][-32:]), tuple(long[1]))


def test_canary_rows_differ_for_templated_prompts():
    """Prompts that share a system prompt and an appended instruction (GSM8K's) give distinct
    canary rows: the shared start and end are removed before the window is taken."""
    from turborlhf.rollout.sync import canary_windows

    head, tail = [1, 2, 3], [7, 8, 9, 10]
    ps = [head + [20 + i] * (5 + i) + tail for i in range(3)]
    assert canary_windows(ps, 4) == [[20] * 4, [21] * 4, [22] * 4]
    assert canary_windows(ps, 16) == [[20] * 5, [21] * 6, [22] * 7]
    assert canary_windows([[1, 2, 3]] * 2, 2) == [[2, 3], [2, 3]]          # nothing differs: unchanged
    assert canary_windows([[5, 6, 7]], 2) == [[6, 7]]                      # one prompt: its end
    assert canary_windows([[1, 2], [1, 2, 3, 2]], 4) == [[1, 2], [1, 2, 3, 2]]   # a prompt would be emptied
    with pytest.raises(ValueError):
        canary_windows([], 4)


# ------------------------------------------------------------ realistic faults at the default tolerance
from turborlhf.config import RolloutCfg  # noqa: E402
from turborlhf.engine.hardware import BF16_FEATURES, cpu_features  # noqa: E402
from turborlhf.rollout.sync import default_tolerance  # noqa: E402

NATIVE_BF16 = bool(BF16_FEATURES & cpu_features())
DTYPES = ["fp32", pytest.param("bf16", marks=pytest.mark.skipif(not NATIVE_BF16, reason="no native bf16 on this CPU"))]


def test_default_tolerance_follows_the_engine_dtype():
    assert RolloutCfg().sync_tolerance is None                    # dtype auto: decided with the dtype, per host
    from turborlhf.config import PPOConfig, load_config
    from turborlhf.engine.run import resolve_hardware

    cfg = resolve_hardware(load_config(PPOConfig, overrides=["actor.name_or_path=x", "data.prompts_file=y",
                                                             "reward_model=z"]), show=False)
    assert cfg.rollout.sync_tolerance == default_tolerance(cfg.rollout.dtype)
    assert RolloutCfg(dtype="bf16").sync_tolerance == default_tolerance("bf16")
    assert RolloutCfg(dtype="fp32").sync_tolerance == default_tolerance("fp32") <= 1e-3
    assert default_tolerance(torch.float32) < default_tolerance("bf16") < 0.05
    assert RolloutCfg(dtype="fp32", sync_tolerance=0.2).sync_tolerance == 0.2     # an explicit value wins


def _stepped(model, steps, lr=1e-3, seed=0):
    """The trainer `steps` AdamW steps ahead (a next-token loss on random tokens)."""
    from turborlhf.config import OptimCfg
    from turborlhf.engine.train import make_optimizer

    model.train()
    opt = make_optimizer(model, OptimCfg(lr=lr))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, 512, (4, 24), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _silence_heads(model, layer=1, heads=(0,)):
    hd = model.config.hidden_size // model.config.num_attention_heads
    name = f"model.layers.{layer}.self_attn.o_proj.weight"
    w = dict(model.named_parameters())[name].detach().clone()
    for h in heads:
        w[:, h * hd:(h + 1) * hd] = 0
    return [(name, w)]


def _zero_down_proj_columns(model, layer=0, every=10):
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    w = dict(model.named_parameters())[name].detach().clone()
    w[:, ::every] = 0
    return [(name, w)]


@pytest.mark.parametrize("weight_dtype", [None, pytest.param("bf16", marks=needs_w16)])
def test_an_fp32_engine_catches_one_unpushed_optimizer_step(prompts, weight_dtype):
    """fp32 engines agree with the trainer to ~1e-6 nats, so their default tolerance is tight: one
    AdamW step that never reached the engine (0.013 here) passed the old one-size 0.05. With bf16
    weights the trainer's side rounds its weights alike, and the check stays as tight."""
    model = tiny_llama(0)
    eng = FastEngine(model, dtype="fp32", weight_dtype=weight_dtype)
    canary = make_canary(eng, prompts, n=5, response_tokens=8)
    assert canary.bf16_weights == (weight_dtype == "bf16")
    assert verify_sync(eng, model, canary).mean_diff < 1e-5
    if weight_dtype:                  # unrounded, the trainer would differ by the rounding alone
        import dataclasses
        assert verify_sync(eng, model, dataclasses.replace(canary, bf16_weights=False), tol=1.0).mean_diff > 1e-4
    _stepped(model, 1)
    assert verify_sync(eng, model, canary, tol=0.05).verified        # what the old default let through
    with pytest.raises(WeightSyncError):
        verify_sync(eng, model, canary)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fault", ["1 of 4 heads silenced", "10% of down_proj columns zeroed",
                                   "5 optimizer steps not pushed"])
def test_realistic_faults_are_caught_at_the_default_tolerance(dtype, fault, prompts):
    """Faults far smaller than 'every weight perturbed': what a partial push, a misplaced slice
    or a skipped refresh does. The default tolerance of the engine's dtype passes a correct push
    and stops each of these (the faults SmolLM2 gives under bf16 noise: docs/rollout.md)."""
    model = tiny_llama(0)
    eng = FastEngine(model, dtype=dtype)
    canary = make_canary(eng, prompts, n=5, response_tokens=8)
    assert verify_sync(eng, model, canary).verified                 # tol=None: the default for the dtype
    if fault.endswith("not pushed"):
        _stepped(model, 5)
    else:
        eng.load_weights(_silence_heads(model) if "heads" in fault else _zero_down_proj_columns(model))
    with pytest.raises(WeightSyncError, match=f"sync_tolerance {default_tolerance(dtype):g}"):
        verify_sync(eng, model, canary)
    assert push_weights(eng, model, canary).verified                 # the correct push passes again


def _rounded_copy_logprobs(model, canary):
    """The trainer side on a copy of the model with every 2-D parameter rounded (ties kept), as
    the check computed it before rounding one module at a time."""
    import copy
    import dataclasses

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16))
    return trainer_logprobs(rounded, dataclasses.replace(canary, bf16_weights=False))


@pytest.mark.parametrize("tie", [True, False])
def test_rounded_trainer_side_is_the_rounded_copy_and_leaves_the_weights_alone(prompts, tie):
    """`canary.bf16_weights`: each module's matrices are rounded while it runs (and the embedding's
    looked-up rows): the same log-probs as a rounded copy of the whole model, bit for bit, and
    the trainer's parameters are the same objects with the same values afterwards, also when a
    forward raises half-way."""
    model = tiny_llama(0, tie=tie)
    canary = Canary(tuple(tuple(p) for p in prompts), tuple(tuple(range(7, 13)) for _ in prompts), True)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    got = trainer_logprobs(model, canary)
    assert got == _rounded_copy_logprobs(model, canary)
    unrounded = trainer_logprobs(model, Canary(canary.prompts, canary.responses, False))
    assert max(abs(a - b) for r, s in zip(got, unrounded) for a, b in zip(r, s)) > 1e-4  # rounding mattered
    down = model.model.layers[1].mlp.down_proj

    def fail(mod, args, out):
        raise RuntimeError("boom")

    h = down.register_forward_hook(fail)      # runs after the rounding's pre-hook, before its restore
    with pytest.raises(RuntimeError, match="boom"):
        trainer_logprobs(model, canary)
    h.remove()
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    assert trainer_logprobs(model, canary) == got


def test_a_matrix_read_outside_its_module_falls_back_to_a_rounded_copy(prompts):
    """A forward that reads a module's weight without running the module (here the first MLP,
    written out with `F.linear`) would see unrounded weights: those are noticed and the whole
    forward runs again on a rounded copy, with the copy's result."""
    import torch.nn.functional as F

    model = tiny_llama(0)
    canary = Canary(tuple(tuple(p) for p in prompts), tuple(tuple(range(7, 13)) for _ in prompts), True)
    want = trainer_logprobs(model, canary)
    assert want == _rounded_copy_logprobs(model, canary)
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x: F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                                     mlp.down_proj.weight)
    assert trainer_logprobs(model, canary) == want


class _TwoMatrices(torch.nn.Module):
    """Two same-shaped matrices in one module."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.a.T + x @ self.b.T


class _Reentrant(torch.nn.Module):
    """Calls itself inside its own forward, and reads its matrix again after the inner call."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, depth=1):
        y = self(x @ self.w.T, depth - 1) if depth else x
        return y + x @ self.w.T


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.two, self.again, self.unused = (torch.nn.Embedding(16, 8), _TwoMatrices(), _Reentrant(),
                                                       torch.nn.Linear(8, 8))

    def forward(self, ids, read_unused=False):
        h = self.again(self.two(self.emb(ids)))
        if read_unused:                        # a module's weight read without running the module
            h = torch.nn.functional.linear(h, self.unused.weight)
        return torch.nn.functional.linear(h, self.emb.weight)      # the embedding read as an LM head


def test_rounding_covers_shared_shapes_reentrant_modules_and_tied_reads():
    """Each module's matrices are rounded while it runs: two same-shaped matrices of one module
    keep their own values, a module called inside its own forward keeps them rounded until the
    outer call ends, and the embedding (rounded for the whole block) reads rounded wherever it is
    read. The result equals a fully rounded copy bit for bit, every parameter is back afterwards,
    and a matrix read without its module running is reported as missed."""
    import copy

    from turborlhf.rollout.sync import _rounded_matrices

    torch.manual_seed(0)
    toy, ids = _Toy(), torch.tensor([[1, 5, 7, 2]])
    ref = copy.deepcopy(toy)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16))
    before = {n: (p, p.detach().clone()) for n, p in toy.named_parameters()}
    with torch.no_grad():
        with _rounded_matrices(toy) as missed:
            got = toy(ids)
        assert torch.equal(got, ref(ids)) and missed == {"unused.weight"}
        with _rounded_matrices(toy) as missed:
            toy(ids, read_unused=True)
        assert missed == {"unused.weight"}
        assert not torch.equal(toy(ids), ref(ids))                    # unrounded outside the block
    for n, p in toy.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    with pytest.raises(RuntimeError, match="no_grad"):
        with _rounded_matrices(toy):
            pass
