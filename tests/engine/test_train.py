"""clip_and_step stops the run at the step that made a NaN/inf: a non-finite loss, gradient or
parameter raises NonFiniteError naming the role and the tensor, and nothing of that step is saved."""
import math
import types
import warnings

import pytest
import torch

from turborlhf.engine.train import NonFiniteError, clip_and_step


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _backward(model, x=None):
    x = torch.randn(8, 4) if x is None else x
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_finite_step_updates_and_returns_the_norm(max_grad_norm):
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    _backward(m)
    expected = float(torch.norm(torch.stack([p.grad.norm() for p in m.parameters()])))
    norm = clip_and_step(m, torch.optim.SGD(m.parameters(), lr=0.1), None, max_grad_norm)
    assert math.isclose(norm, expected, rel_tol=1e-5)
    assert all(not torch.equal(b, p) for b, p in zip(before, m.parameters()))
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_raises_before_the_update(max_grad_norm, bad):
    m = _model()
    _backward(m)
    m[2].bias.grad[0] = bad
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError, match=r"^critic: gradient norm .*first offending gradient: 2\.bias \(1 of 1") as e:
        clip_and_step(m, opt, None, max_grad_norm, role="critic")
    assert "\n" not in str(e.value)
    assert all(torch.equal(b, p) for b, p in zip(before, m.parameters()))   # no update applied
    assert not opt.state                                                      # AdamW never stepped


def test_nan_loss_names_the_first_parameter_its_gradient_reaches():
    m = _model()
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    loss = _backward(m, x)
    assert loss.isnan()
    with pytest.raises(NonFiniteError, match=r"^policy: gradient norm nan.*: 0\.weight \("):
        clip_and_step(m, torch.optim.SGD(m.parameters(), lr=0.1), None, 1.0)
    # the loss itself, when the caller passes it, is named before anything else
    with pytest.raises(NonFiniteError, match=r"^actor: the loss is inf"):
        clip_and_step(m, torch.optim.SGD(m.parameters(), lr=0.1), None, 1.0, role="actor", loss=torch.tensor(math.inf))


def test_non_finite_parameter_after_the_step_raises():
    m = _model()
    _backward(m)
    for p in m.parameters():
        p.grad.fill_(0.0)
    m[0].weight.grad[1, 2] = 1e10
    # a finite gradient, an optimizer whose update overflows fp32 in one weight
    opt = torch.optim.SGD(m.parameters(), lr=1e38)
    with pytest.raises(NonFiniteError, match=r"^reward_model: non-finite parameter after the optimizer step "
                                             r".*: 0\.weight \(1 of 12 values non-finite, e\.g\. -inf\)"):
        clip_and_step(m, opt, None, 0.0, role="reward_model")


def test_sft_run_stops_at_the_nan_step_and_keeps_the_last_good_checkpoint(tiny_model, tiny_data, tmp_path,
                                                                          monkeypatch):
    """A real SFT run whose forward turns NaN right after checkpoint step-2: step 3 raises, no
    checkpoint or metrics row of step 3 is written, step-2 loads with finite weights, and
    --resume finishes the run from it."""
    from safetensors.torch import load_file

    import turborlhf.trainers.common as common      # the SFT loop (`fit_steps`) checkpoints from here
    import turborlhf.trainers.sft as sft
    from tests.e2e.helpers import REPO, metrics, run_cli
    from turborlhf.engine.checkpoint import latest_checkpoint, load_trainer_state

    poisoned = {"on": False}
    real_save, real_load = common.save_checkpoint, sft.load_trainable

    def save_then_poison(out, step, *a, **kw):
        path = real_save(out, step, *a, **kw)
        poisoned["on"] = step == 2
        return path

    def load_with_nan_hook(*a, **kw):
        model = real_load(*a, **kw)
        model.get_output_embeddings().register_forward_hook(
            lambda mod, inp, out: out * float("nan") if poisoned["on"] else out)
        return model

    monkeypatch.setattr(common, "save_checkpoint", save_then_poison)
    monkeypatch.setattr(sft, "load_trainable", load_with_nan_hook)
    out = tmp_path / "sft"
    args = ["sft", "--config", REPO / "configs/tiny/sft.yaml", f"model.name_or_path={tiny_model}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=16", f"output_dir={out}",
            "train.save_every=1", "train.keep_checkpoints=1", "log.tensorboard=false"]
    with pytest.raises(NonFiniteError, match=r"^policy: gradient norm nan at this step, first offending gradient: "):
        run_cli(*args, "--debug")       # --debug: the CLI re-raises instead of printing one line (exit 1)
    ckpt = latest_checkpoint(out)
    assert ckpt.name == "step-000002" and load_trainer_state(ckpt)["step"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == \
        ["latest", "step-000002"]
    w = load_file(str(ckpt / "policy" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in w.values())
    assert max(r["step"] for r in metrics(out)) == 2
    poisoned["on"] = False
    monkeypatch.setattr(common, "save_checkpoint", real_save)
    run_cli(*args, "--resume")
    assert latest_checkpoint(out).name == "step-000004"
    assert [r["step"] for r in metrics(out) if "train/loss" in r] == [1, 2, 3, 4]


def test_gradient_norm_that_overflows_fp32_raises_and_huge_finite_weights_do_not():
    m = _model()
    _backward(m)
    m[0].bias.grad[1] = 3e38                      # finite, but the global norm is inf
    with pytest.raises(NonFiniteError, match=r"0\.bias \(all values finite, largest magnitude 3e\+38"):
        clip_and_step(m, torch.optim.SGD(m.parameters(), lr=0.0), None, 1.0)
    m.zero_grad()
    with torch.no_grad():
        m[0].weight[0] = 3e38                     # finite weights whose norm overflows: let through
    _backward(m, torch.zeros(8, 4))
    clip_and_step(m, torch.optim.SGD(m.parameters(), lr=0.0), None, 1.0)


def test_bf16_state_adamw_clips_inside_its_step_as_torch_clips_the_gradients():
    """clip_and_step with BF16StateAdamW folds the clip coefficient into the update (no pass over
    the gradients) and checks the new weights with the kernel's count: the same weights as
    clip_grads_with_norm_ then step, and the same error when a weight turns non-finite."""
    from turborlhf.engine.optim import BF16StateAdamW

    a, b = _model(), _model()
    x = torch.randn(8, 4)
    oa, ob = BF16StateAdamW(a.parameters(), lr=1e-2), BF16StateAdamW(b.parameters(), lr=1e-2)
    for _ in range(3):
        _backward(a, x * 10)
        _backward(b, x * 10)
        norm = clip_and_step(a, oa, None, 0.5)
        total = torch.nn.utils.get_total_norm([p.grad for p in b.parameters()])
        assert math.isclose(norm, float(total), rel_tol=1e-5) and norm > 0.5     # clipped
        torch.nn.utils.clip_grads_with_norm_(list(b.parameters()), 0.5, torch.tensor(norm))
        ob.step()
        ob.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in a.parameters())
    for pa, pb in zip(a.parameters(), b.parameters()):      # the coefficient may differ in its last bit
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    _backward(a)
    with pytest.raises(NonFiniteError, match=r"^critic: non-finite parameter after the optimizer step .*: 0\.weight \("):
        clip_and_step(a, BF16StateAdamW(a.parameters(), lr=3e38), None, 0.0, role="critic")


def test_rng_state_carries_the_cuda_generators_where_the_device_count_matches(monkeypatch):
    """A checkpoint's random state holds each visible CUDA device's generator (LoRA dropout on a
    GPU draws from it) and restores it only with as many devices; no CUDA is faked beyond those
    four calls, so on a CPU host the CPU states round-trip as before."""
    from turborlhf.engine import train

    cpu = train.rng_state()
    assert "cuda" not in cpu or torch.cuda.is_available()
    a = torch.rand(3)
    train.set_rng_state(cpu)
    assert torch.equal(torch.rand(3), a)

    saved, restored = [torch.tensor([1, 2], dtype=torch.uint8)], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = train.rng_state()
    assert state["cuda"] is saved
    for count, want in ((1, [saved]), (2, [])):
        restored.clear()
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        train.set_rng_state(state)
        assert restored == want, count


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
def test_a_scheduler_sees_the_optimizer_step(state_dtype):
    """clip_and_step steps the optimizer through `step` (BF16StateAdamW's clipping coefficient as
    an argument), so torch's LR scheduler raises no "lr_scheduler.step() before optimizer.step()"
    warning, and the schedule advances once per step."""
    import warnings

    from turborlhf.config import OptimCfg
    from turborlhf.engine.train import make_optimizer, make_scheduler

    model = _model()
    opt = make_optimizer(model, OptimCfg(lr=1e-2, state_dtype=state_dtype, warmup_steps=2))
    sched = make_scheduler(opt, OptimCfg(lr=1e-2, warmup_steps=2), 10)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            lrs.append(opt.param_groups[0]["lr"])                      # the rate this step uses
            _backward(model, torch.randn(8, 4))
            clip_and_step(model, opt, sched, 0.5)
    assert lrs[0] < lrs[1] == lrs[2] == pytest.approx(1e-2)


def test_plan_steps_leaves_out_a_random_remainder_not_the_longest_examples():
    """Each length-sorted chunk's short last batch was dropped: with fewer than 50 steps of data
    the same longest examples were never trained, in every epoch."""
    import random

    from turborlhf.engine.run import plan_steps

    rng = random.Random(0)
    lengths = [rng.randrange(10, 500) for _ in range(100)]
    plan = plan_steps(lengths, per_step=8, epochs=10, max_steps=0, seed=0)
    assert len(plan) == 120 and all(len(b) == 8 for b in plan)
    seen = [i for b in plan for i in b]
    assert set(seen) == set(range(100))                        # every example, over the epochs
    for e in range(10):                                        # each epoch: 96 distinct examples
        assert len(set(i for b in plan[12 * e:12 * (e + 1)] for i in b)) == 96
    longest = sorted(range(100), key=lambda i: -lengths[i])[:4]
    assert all(i in seen for i in longest)
    assert plan_steps([5, 3, 4], per_step=8, epochs=1, max_steps=0, seed=0) == [[1, 2, 0]]   # one short step


def test_compute_device_is_where_an_offloading_fsdp_model_computes(monkeypatch):
    """Under FSDP's CPU offload the parameters seen outside a forward are host-memory shards:
    autocast and the forwards' input placement took the CPU for a model computing on the GPU (its
    bf16 autocast off, the canary's indices on the wrong device). `shard_fsdp` records the device."""
    from torch import nn

    from turborlhf.engine import hardware
    from turborlhf.engine.train import autocast, compute_device

    model = nn.Linear(4, 4)
    assert compute_device(model) == torch.device("cpu")
    model._turborlhf_compute_device = torch.device("cuda", 0)
    assert compute_device(model) == torch.device("cuda", 0)
    monkeypatch.setattr(hardware, "compute_dtype", lambda dtype, device_type: "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # torch: CUDA autocast without CUDA is disabled
        with autocast("bf16", model):
            assert not torch.is_autocast_enabled("cpu")
        with autocast("bf16", nn.Linear(4, 4)):
            assert torch.is_autocast_enabled("cpu")


def test_fsdp_roles_load_on_the_cpu_and_shard_onto_the_device(monkeypatch):
    """PPO's actor and critic loaded whole onto the GPU before FSDP sharded them: every rank held
    the full fp32 model first, out of memory where FSDP (and its offload) should make it fit."""
    from turborlhf.config import ModelCfg
    from turborlhf.trainers.ppo import roles

    role = roles.Trainable.__new__(roles.Trainable)
    for strategy, world, want in [("fsdp", 2, "cpu"), ("fsdp", 1, "cuda"), ("ddp", 2, "cuda")]:
        role.cfg = types.SimpleNamespace(distributed=types.SimpleNamespace(dp_strategy=strategy))
        monkeypatch.setattr(roles, "dp_rank_world", lambda w=world: (0, w))
        assert role._load_cfg(ModelCfg(name_or_path="x", device="cuda")).device == want
