"""Fused update (algo.fused_update): with one PPO epoch of one mini-batch, actor and critic
backpropagate through their experience forward. It must give the same run as the unfused update
(which runs that forward twice) and must really skip the second forward."""
import pytest
import torch

from tests.e2e.helpers import REPO, max_weight_diff, metrics, run_cli, weights


def _ppo(tiny_model, tiny_rm, tiny_data, out, *extra):
    run_cli("ppo", "--config", REPO / "configs/tiny/ppo.yaml", f"actor.name_or_path={tiny_model}",
            f"reward_model={tiny_rm}", f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}",
            "data.max_samples=32", f"output_dir={out}", "train.max_steps=2", "algo.ppo_epochs=1",
            "algo.num_mini_batches=1", "algo.entropy_coef=0.01", "rollout.engine=hf", *extra)


def _count_forwards(monkeypatch) -> dict:
    """Counts model forwards per role (actor = causal LM, critic = scalar head) inside the workers."""
    from turborlhf.trainers.ppo.actor import ActorWorker
    from turborlhf.trainers.ppo.critic import CriticWorker

    counts = {"actor": 0, "critic": 0}
    for cls, role in ((ActorWorker, "actor"), (CriticWorker, "critic")):
        init = cls.__init__

        def wrapped(self, *a, _init=init, _role=role, **kw):
            _init(self, *a, **kw)

            def hook(module, args, _role=_role):
                counts[_role] += 1
            self.model.get_input_embeddings().register_forward_pre_hook(hook)   # once per forward pass
        monkeypatch.setattr(cls, "__init__", wrapped)
    return counts


@pytest.mark.parametrize("micro", ["4", "2"])   # 4 rows: one micro-batch (auto fuses) / two (only "always" fuses)
def test_fused_update_matches_unfused_and_skips_a_forward(micro, tiny_model, tiny_rm, tiny_data, tmp_path,
                                                          monkeypatch):
    counts = _count_forwards(monkeypatch)
    runs = {}
    for mode in ("never", "always"):
        for k in counts:
            counts[k] = 0
        out = tmp_path / mode
        _ppo(tiny_model, tiny_rm, tiny_data, out, f"algo.fused_update={mode}", f"train.micro_batch_size={micro}")
        runs[mode] = (dict(counts), [r for r in metrics(out) if "policy/loss" in r], weights(out))
    (c_off, m_off, w_off), (c_on, m_on, w_on) = runs["never"], runs["always"]
    n_micro = 4 // int(micro)
    # 2 steps: the unfused run does experience + training forwards, the fused one only the former
    assert c_off["critic"] - c_on["critic"] == 2 * n_micro
    assert c_off["actor"] - c_on["actor"] == 2 * n_micro
    assert max_weight_diff(w_off, w_on) < 1e-5
    assert max_weight_diff(weights(tiny_model), w_on) > 1e-6                  # it trained
    for a, b in zip(m_off, m_on):
        for k in ("policy/loss", "critic/loss", "policy/entropy", "policy/grad_norm", "critic/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
        # the KL sums per-token differences of log-probs near -6 over a response: fp32 rounding of the
        # two forwards (their batch shapes differ) leaves ~1e-6 (a real AVX2-only EPYC: 1.07e-6)
        assert b["policy/kl"] == pytest.approx(a["policy/kl"], rel=1e-4, abs=1e-5)
        assert b["policy/clipfrac"] == 0.0 and b["policy/approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_fused_update_modes(tiny_model):
    from turborlhf.config import PPOConfig, load_config
    from turborlhf.trainers.ppo import use_fused_update

    class G:
        world_size = 1

    def cfg(*o):
        return load_config(PPOConfig, REPO / "configs/tiny/ppo.yaml",
                           [f"actor.name_or_path={tiny_model}", "reward_model=x", "data.prompts_file=x",
                            "algo.ppo_epochs=1", "algo.num_mini_batches=1", "train.micro_batch_size=4", *o])
    assert use_fused_update(cfg("algo.fused_update=both"), 4, G)
    assert not use_fused_update(cfg("algo.fused_update=both"), 8, G)       # two micro-batches: declined
    assert use_fused_update(cfg("algo.fused_update=always"), 8, G)
    assert not use_fused_update(cfg("algo.fused_update=never"), 4, G)
    assert not use_fused_update(cfg("algo.num_mini_batches=2"), 4, G)      # second mini-batch is off-policy
    assert not use_fused_update(cfg("algo.ppo_epochs=2", "algo.fused_update=always"), 4, G)

    class Actor(G):
        role = "actor"

    class Critic(G):
        role = "critic"
    for mode in ("auto", "actor"):                                         # fp32 (this config): the actor only
        assert use_fused_update(cfg(f"algo.fused_update={mode}"), 4, Actor)
        assert not use_fused_update(cfg(f"algo.fused_update={mode}"), 8, Actor)
        assert not use_fused_update(cfg(f"algo.fused_update={mode}"), 4, Critic)  # its graph would meet the actor's
    # bf16 on the CPU: auto keeps the critic's graph too (no weight casts kept: cheap); not on a GPU,
    # nor before the device is decided, nor with `actor`
    bf16 = ("actor.dtype=bf16", "distributed.device=cpu")
    assert use_fused_update(cfg("algo.fused_update=auto", *bf16), 4, Critic)
    assert not use_fused_update(cfg("algo.fused_update=auto", *bf16), 8, Critic)
    assert not use_fused_update(cfg("algo.fused_update=actor", *bf16), 4, Critic)
    assert not use_fused_update(cfg("algo.fused_update=auto", "actor.dtype=bf16", "distributed.device=gpu"), 4, Critic)
    assert not use_fused_update(cfg("algo.fused_update=auto", "actor.dtype=bf16"), 4, Critic)
    # fp32 on the CPU: the critic's graph too where AdamW keeps bf16 moments (which save what it costs)
    from turborlhf.engine.optim import load_kernel
    fp32_cpu = ("distributed.device=cpu", "algo.fused_update=auto")
    assert use_fused_update(cfg(*fp32_cpu, "optim.state_dtype=bf16"), 4, Critic)
    assert not use_fused_update(cfg(*fp32_cpu, "optim.state_dtype=fp32"), 4, Critic)
    assert use_fused_update(cfg(*fp32_cpu), 4, Critic) == (load_kernel(warn=False) is not None)     # auto: bf16 moments
    # LoRA dropout: a training-mode forward is a dropout sample, not the policy's old log-probs
    lora = ("actor.lora.rank=4", "algo.fused_update=always")
    assert use_fused_update(cfg(*lora, "actor.lora.dropout=0"), 4, Actor)
    assert not use_fused_update(cfg(*lora, "actor.lora.dropout=0.1"), 4, Actor)
    assert use_fused_update(cfg("algo.fused_update=both"), 4, Critic)
    assert not use_fused_update(cfg("algo.fused_update=both"), 8, Critic)
    assert use_fused_update(cfg("algo.fused_update=always"), 8, Critic)
    # data parallel: a rank given no rows (fewer micro-batches than ranks) has no graph to take, so the
    # update ran `train(kept=...)` there and failed ("kept no experience forward")
    class Pair(Actor):
        world_size = 2
    assert use_fused_update(cfg("algo.fused_update=always"), 8, Pair)          # 2 micro-batches: one per rank
    for mode in ("auto", "always"):
        assert not use_fused_update(cfg(f"algo.fused_update={mode}"), 4, Pair)  # 1 micro-batch: rank 1 idle


def test_kept_forward_is_named_by_the_driver():
    """The fused update's kept forwards are an explicit handle: `train` gets them only under the
    name the experience call kept them as; another name, or more micro-batches than kept
    forwards, fails loudly, and an update without a name drops them (their graphs are freed)."""
    from types import SimpleNamespace

    from turborlhf.trainers.ppo.roles import Trainable

    w = Trainable()
    w.cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size=2))
    ids = torch.arange(10).view(5, 2)
    x = torch.ones(5, 3, requires_grad=True)
    out = w._keep_forwards("step 0", ids, lambda s: (x[s] * 2, None))
    assert torch.equal(out, torch.full((5, 3), 2.0)) and not out.requires_grad
    with pytest.raises(RuntimeError, match="'step 1'"):
        w._take_kept("step 1")
    assert w._kept is None                                   # a wrong name drops them too
    w._keep_forwards("step 0", ids, lambda s: (x[s] * 2, None))
    assert w._take_kept(None) is None and w._kept is None
    w._keep_forwards("step 0", ids, lambda s: (x[s] * 2, None))
    kept = w._take_kept("step 0")
    assert w._kept is None
    assert [(k.ids_BS[0, 0].item(), k.ids_BS.shape[0]) for k in (kept.next(), kept.next(), kept.next())] == \
        [(0, 2), (4, 2), (8, 1)]                             # the micro-batches in order
    with pytest.raises(RuntimeError, match="more micro-batches"):
        kept.next()
