"""BF16StateAdamW (optim.state_dtype=bf16): AdamW with bf16 moments and stochastic rounding."""
import copy

import pytest
import torch

from turborlhf.config import OptimCfg
from turborlhf.engine.optim import BF16StateAdamW, _round_bf16_stochastic, load_kernel
from turborlhf.engine.train import make_optimizer

needs_kernel = pytest.mark.skipif(load_kernel(warn=False) is None, reason="no C compiler / not x86-64 Linux")


def _params(n=3, size=(37, 53), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(size, generator=g)) for _ in range(n)]


def _run(opt, params, steps, seed=1, scale=1e-2):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * scale
        opt.step()


@needs_kernel
def test_kernel_equals_the_torch_ops():
    a, b = _params(), _params()
    oa = BF16StateAdamW(a, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ob = BF16StateAdamW(b, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, use_kernel=False)
    _run(oa, a, 4)
    _run(ob, b, 4)
    for pa, pb in zip(a, b):
        # the kernel contracts to fused multiply-adds: the fp32 values may differ in the last bit,
        # which can flip a stochastic rounding; nothing more
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
        for k in ("exp_avg", "exp_avg_sq"):
            sa, sb = oa.state[pa][k], ob.state[pb][k]
            assert sa.dtype == sb.dtype == torch.bfloat16
            assert (sa != sb).float().mean() < 1e-3


def test_torch_ops_in_slices_equal_one_pass(monkeypatch):
    """The torch-ops path (a GPU's) updates large tensors slice by slice to bound its temporaries;
    each element's stochastic rounding draws on its index in the whole tensor, so the result is
    that of one pass, bit for bit (slices of 100 elements here, not a divisor of 37·53)."""
    import turborlhf.engine.optim as optim

    a, b = _params(), _params()
    oa = BF16StateAdamW(a, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, use_kernel=False)
    ob = BF16StateAdamW(b, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, use_kernel=False)
    _run(oa, a, 3)
    monkeypatch.setattr(optim, "_TORCH_SLICE", 100)
    _run(ob, b, 3)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        assert all(torch.equal(oa.state[pa][k], ob.state[pb][k]) for k in ("exp_avg", "exp_avg_sq"))


# gradient magnitudes: zero, fp32 denormals (< 1.2e-38), ones whose g² or (1-b2)·g² is denormal
# or zero (1e-30 ... 3e-18: the band where a -ffast-math build wrote NaN), ordinary, and ones whose
# g² overflows to inf (1e20, 1e30: exp_avg_sq = inf, the update is then 0, as in torch's AdamW)
EXTREME_GRADS = [0.0, 1e-44, 1e-40, 1e-30, 1e-21, 1e-20, 3e-20, 1e-19, 1e-18, 3e-18, 1e-3, 1.0, 1e15, 1e20, 1e30]


@pytest.mark.parametrize("use_kernel", [False, pytest.param(None, marks=needs_kernel)])
@pytest.mark.parametrize("numel", [27, 1043])         # 27: the kernel's 256-bit tail; 1043: 512-bit lanes + tails
def test_extreme_gradients_stay_finite_and_match_fp32_adamw(use_kernel, numel):
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in EXTREME_GRADS]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    lr, steps = 1e-2, 4
    opt = BF16StateAdamW(ours, lr=lr, weight_decay=0.1, use_kernel=use_kernel)
    ref_opt = torch.optim.AdamW(ref, lr=lr, weight_decay=0.1)
    for _ in range(steps):
        for a, b, mag in zip(ours, ref, EXTREME_GRADS):
            a.grad = torch.randn(numel, generator=gen) * mag
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    for a, b, mag in zip(ours, ref, EXTREME_GRADS):
        assert torch.isfinite(a).all(), f"|g| = {mag:g}: {int((~torch.isfinite(a)).sum())} non-finite weights"
        for k in ("exp_avg", "exp_avg_sq"):
            assert not opt.state[a][k].isnan().any(), f"|g| = {mag:g}: NaN in {k}"
        # the moments are bf16 with stochastic rounding (about 0.4% per store): each step's update
        # (at most lr in size) may differ from fp32 AdamW's by ~1%
        torch.testing.assert_close(a, b, rtol=0, atol=steps * lr * 0.02, msg=f"|g| = {mag:g}")


def test_stochastic_rounding_is_unbiased_and_round_to_nearest_is_not():
    lo = torch.tensor(1.0).bfloat16().float()
    x = lo + 0.3 * 2.0 ** -7                       # 30% of the way to the next bf16 value (ulp 2^-7 at 1)
    x_N = x.repeat(100_000)
    # seeded: the bound below is ~1.8 standard errors of the mean, so unseeded draws failed ~8% of runs
    r_N = torch.randint(0, 2 ** 32, (100_000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    sr = _round_bf16_stochastic(x_N, r_N).float()
    assert set(sr.unique().tolist()) == {float(lo), float(lo) + 2.0 ** -7}
    assert abs(float(sr.mean()) - float(x)) < 2e-5               # E[round(x)] = x
    assert abs(float(x_N.bfloat16().float().mean()) - float(x)) > 2e-3   # round-to-nearest: biased
    for special in (float("inf"), float("-inf")):
        assert _round_bf16_stochastic(torch.tensor([special]), torch.tensor([0xFFFF])).float().item() == special
    assert _round_bf16_stochastic(torch.tensor([float("nan")]), torch.tensor([0xFFFF])).isnan().all()


@pytest.mark.parametrize("use_kernel", [False, pytest.param(None, marks=needs_kernel)])
def test_second_moment_does_not_freeze(use_kernel):
    """At beta2=0.999 one step moves exp_avg_sq by 0.1% < bf16's resolution: with round-to-nearest
    storage it stalls far below g² (checked below); stochastic rounding tracks it."""
    g, steps, b2 = 1e-2, 3000, 0.999
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = BF16StateAdamW([p], lr=0.0, betas=(0.9, b2), use_kernel=use_kernel)
    v_rne = torch.zeros(4096, dtype=torch.bfloat16)
    for _ in range(steps):
        p.grad = torch.full_like(p, g)
        opt.step()
        v_rne = (b2 * v_rne.float() + (1 - b2) * g * g).bfloat16()
    target = (1 - b2 ** steps) * g * g
    v = opt.state[p]["exp_avg_sq"].float()
    assert abs(float(v.mean()) / target - 1) < 0.01
    assert float(v_rne.float().mean()) / target < 0.8


@pytest.mark.parametrize("use_kernel", [False, pytest.param(None, marks=needs_kernel)])
def test_tracks_fp32_adamw_on_a_regression(use_kernel):
    torch.manual_seed(0)
    X, w_true = torch.randn(512, 32), torch.randn(32, 1)
    y = X @ w_true + 0.1 * torch.randn(512, 1)
    models = [torch.nn.Linear(32, 1) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(models[0].parameters(), lr=3e-2, weight_decay=0.01),
            BF16StateAdamW(models[1].parameters(), lr=3e-2, weight_decay=0.01, use_kernel=use_kernel)]
    losses = [[], []]
    for step in range(400):
        idx = torch.randint(0, 512, (32,))
        for m, o, ls in zip(models, opts, losses):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(X[idx]), y[idx])
            loss.backward()
            o.step()
            with torch.no_grad():
                ls.append(float(torch.nn.functional.mse_loss(m(X), y)))
    assert losses[0][0] > 5 and losses[0][-1] < 0.05 and losses[1][-1] < 0.05
    rel = (models[1].weight - models[0].weight).norm() / models[0].weight.norm()
    assert rel < 0.02


def test_state_dict_resume_is_exact_and_converts_from_and_to_fp32_adamw():
    a = _params()
    opt = BF16StateAdamW(a, lr=1e-3, weight_decay=0.1)
    _run(opt, a, 3)
    sd = copy.deepcopy(opt.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    resumed = BF16StateAdamW(b, lr=1e-3, weight_decay=0.1)
    resumed.load_state_dict(sd)
    assert all(resumed.state[p]["exp_avg"].dtype == torch.bfloat16 for p in b)
    _run(opt, a, 2, seed=7)
    _run(resumed, b, 2, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))                     # deterministic rounding
    # torch's AdamW loads our state (widened to fp32), and ours loads torch's (rounded)
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    plain = torch.optim.AdamW(c, lr=1e-3, weight_decay=0.1)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert plain.state[c[0]]["exp_avg"].dtype == torch.float32
    _run(plain, c, 1)
    back = BF16StateAdamW([torch.nn.Parameter(p.detach().clone()) for p in c], lr=1e-3)
    back.load_state_dict(plain.state_dict())
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in back.state.values())


def test_rejects_non_fp32_parameters():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="fp32 parameters"):
        BF16StateAdamW([p]).step()


@pytest.mark.parametrize("compute", ["bf16", "fp32"])
@pytest.mark.parametrize("kernel", [True, False])
def test_make_optimizer_picks_the_state_dtype(monkeypatch, compute, kernel):
    from turborlhf.engine import hardware, optim

    # the default (auto): bf16 moments on the CPU wherever the C kernel builds, whatever the
    # compute precision; the compute choice and the kernel's build are pinned, so no host decides it
    monkeypatch.setattr(hardware, "compute_dtype", lambda requested="auto", device="cpu": compute)
    monkeypatch.setattr(optim, "load_kernel", lambda warn=True: object() if kernel else None)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    auto = make_optimizer(model, OptimCfg())
    assert isinstance(auto, BF16StateAdamW) == kernel
    assert isinstance(make_optimizer(model, OptimCfg(state_dtype="bf16")), BF16StateAdamW)   # explicit: every host
    fp32 = make_optimizer(model, OptimCfg(state_dtype="fp32"))
    assert type(fp32) is torch.optim.AdamW and fp32.defaults["fused"]
    with pytest.raises(ValueError, match="state_dtype"):
        OptimCfg(state_dtype="fp8")


@pytest.mark.parametrize("use_kernel", [False, pytest.param(None, marks=needs_kernel)])
def test_scaled_step_equals_clipping_the_gradients_first(use_kernel):
    """`step_scaled(c)` (the clip folded into the update) writes what clip_grads_with_norm_'s
    ``grad *= c`` followed by `step` writes, and leaves the gradients alone."""
    a, b = _params(), _params()
    oa, ob = (BF16StateAdamW(x, lr=1e-3, weight_decay=0.1, use_kernel=use_kernel) for x in (a, b))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for pa, pb in zip(a, b):
            pa.grad = torch.randn(pa.shape, generator=g)
            pb.grad = pa.grad.clone()
        grads = [p.grad.clone() for p in a]
        bad = oa.step_scaled(0.37)
        for p in b:
            p.grad.mul_(torch.tensor(0.37))
        ob.step()
        assert all(torch.equal(p.grad, q) for p, q in zip(a, grads))
        assert bad == (None if use_kernel is False else 0)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(oa.state[pa][k], ob.state[pb][k])


@needs_kernel
def test_kernel_counts_the_non_finite_weights_it_writes():
    ps = _params(n=2)
    opt = BF16StateAdamW(ps, lr=3e38)            # step size lr/(1-b1) overflows fp32: every weight of ps[0] non-finite
    ps[0].grad = torch.ones_like(ps[0])
    ps[1].grad = None                            # not stepped
    assert opt.step_scaled(1.0) == ps[0].numel()
    assert not torch.isfinite(ps[0]).any() and torch.isfinite(ps[1]).all()


@needs_kernel
def test_sum_of_squares_and_count_nonfinite_kernels():
    from turborlhf.engine.optim import count_nonfinite, sum_of_squares

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=g) * 3 for n in (1, 17, 70_001, 200_000)]   # tails and several 64k chunks
    ref = sum(float((t.double() ** 2).sum()) for t in ts)
    assert sum_of_squares(ts) == pytest.approx(ref, rel=1e-6)
    assert count_nonfinite(ts) == 0
    ts[2][5], ts[3][-1], ts[3][70_000] = float("nan"), float("inf"), -float("inf")
    assert count_nonfinite(ts) == 3
    assert sum_of_squares(ts) != sum_of_squares(ts)                             # NaN propagates
    assert sum_of_squares([torch.tensor([3e38, 1.0])]) == float("inf")          # fp32 squares, as torch's fp32 norm
    assert sum_of_squares([torch.ones(4, 4).t()]) is None                       # not contiguous: torch's norm instead
    assert sum_of_squares([torch.ones(4, dtype=torch.bfloat16)]) is None
    assert count_nonfinite([torch.ones(4, dtype=torch.float64)]) is None


def test_choose_state_dtype(monkeypatch):
    from turborlhf.engine import cbuild, optim
    from turborlhf.engine.hardware import choose_state_dtype

    # on a GPU torch's fused fp32 AdamW, bf16 compute or not: the bf16-moment kernel is CPU-only
    for compute in (["bf16", "bf16"], ["fp32"], ["bf16", "fp32"]):
        dt, why = choose_state_dtype(compute, ["cuda"] * len(compute))
        assert dt == "fp32" and "CPU-only" in why, compute
    has_kernel = load_kernel(warn=False) is not None
    for compute in (["fp32", "fp32"], ["bf16", "bf16"]):
        dt, why = choose_state_dtype(compute, ["cpu", "cpu"])
        assert dt == ("bf16" if has_kernel else "fp32") and ("C kernel" in why), compute
    assert choose_state_dtype(["fp32", "fp32"], ["cpu", "cuda"])[0] == "fp32"      # not every model on the CPU
    # a compiler whose build fails ($CC wrong, headers missing): fp32, not the ~70x slower torch fallback
    monkeypatch.setattr(cbuild, "compiler", lambda: "gcc")
    monkeypatch.setattr(optim, "load_kernel", lambda warn=True: None)
    assert choose_state_dtype(["fp32"], ["cpu"]) == ("fp32",
                                                    "fp32 moments: the bf16-moment C kernel failed to build here")


def test_no_weight_decay_on_embeddings_whatever_their_name():
    """The no-decay group was chosen by the substring "embed" in a parameter's name: GPT-2's
    token and position embeddings (wte, wpe) got weight decay."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from turborlhf.config import OptimCfg
    from turborlhf.engine.train import make_optimizer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    opt = make_optimizer(model, OptimCfg(weight_decay=0.1, state_dtype="fp32"))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(model.transformer.wte.weight) not in decayed and id(model.transformer.wpe.weight) not in decayed
    assert id(model.transformer.h[0].attn.c_attn.weight) in decayed
