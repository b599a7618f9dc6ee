"""The actor's micro-step on a hand-built experience: micro-batches accumulate to the mini-batch's
gradient under every loss reduction, and the logged entropy is a per-token mean whatever the
reduction."""
import copy

import pytest
import torch

from turborlhf.config import PPOConfig
from turborlhf.trainers.ppo.actor import actor_micro_step, policy_mask
from turborlhf.trainers.ppo.experience import Experience, minibatch_counts, rank_micro_batches
from turborlhf.trainers.ppo.roles import add_stats, stats_as_floats

B, P, R = 8, 3, 6


@pytest.fixture(scope="module")
def setup():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    lens = torch.tensor([6, 1, 3, 2, 5, 1, 4, 2])
    mask = (torch.arange(R)[None] < lens[:, None]).float()
    ids = torch.randint(1, 50, (B, P + R))
    attn = torch.cat([torch.ones(B, P), mask], 1).long()
    old = -torch.rand(B, R) * 3 * mask
    adv = torch.randn(B, 1).expand(B, R) * mask
    exp = Experience(ids, attn, P, mask, torch.ones(B, dtype=torch.bool), old, old.clone(), None, torch.zeros(B),
                     torch.zeros(B), torch.zeros(B, R), adv_BR=adv, returns_BR=adv)
    return model, exp


def _step(model, exp, micro, **algo):
    cfg = PPOConfig(actor={"name_or_path": "x", "dtype": "fp32"}, reward_model="rm", data={"prompts_file": "f"},
                    algo={"advantage_estimator": "grpo", "n_samples_per_prompt": 2, **algo},
                    rollout={"max_new_tokens": R})
    m = copy.deepcopy(model)
    mini = torch.arange(B)
    counts, stats = minibatch_counts(policy_mask(exp)[mini], cfg), {}     # as ActorWorker.train
    for sub in rank_micro_batches(exp, mini, micro):
        add_stats(stats, actor_micro_step(m, cfg, sub, counts, 0.05))
    return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]), stats_as_floats(stats)


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_micro_batches_accumulate_to_the_mini_batch_and_entropy_is_a_token_mean(setup, reduction):
    """Dr. GRPO's constant normaliser (token_sum_norm) logged policy/entropy scaled by mean length
    / max_new_tokens (half the token mean here)."""
    model, exp = setup
    whole, stats = _step(model, exp, 8, loss_reduction=reduction)
    for micro in (2, 3):
        g, s = _step(model, exp, micro, loss_reduction=reduction)
        assert torch.allclose(g, whole, atol=1e-6, rtol=1e-5)
        assert s["policy/entropy"] == pytest.approx(stats["policy/entropy"], rel=1e-5)
    _, ref = _step(model, exp, 8, loss_reduction="token_mean")
    assert stats["policy/entropy"] == pytest.approx(ref["policy/entropy"], rel=1e-6)


def test_the_reference_computes_as_the_actor_so_the_first_kl_is_zero(tmp_path):
    """The reference had bf16 weights under bf16 (the actor: fp32 master weights under autocast):
    their roundings differ (a bf16 residual stream), a KL of ~0.2 nats per sequence between equal
    models at step 0, in the reward penalty and the adaptive controller."""
    from turborlhf.models.load import load_tokenizer, load_trainable
    from turborlhf.models.tiny import save_tiny_causal_lm
    from turborlhf.trainers.ppo.actor import actor_forward
    from turborlhf.trainers.ppo.roles import ReferenceWorker

    d = str(save_tiny_causal_lm(tmp_path / "m"))
    cfg = PPOConfig(actor={"name_or_path": d, "dtype": "bf16", "device": "cpu"}, reward_model="rm",
                    data={"prompts_file": "f"}, distributed={"device": "cpu"}, algo={"kl_coef": 0.1},
                    rollout={"max_new_tokens": R})
    tok = load_tokenizer(d)
    torch.manual_seed(1)
    lens = torch.tensor([6, 2, 4])
    mask = (torch.arange(R)[None] < lens[:, None]).float()
    ids = torch.randint(3, len(tok), (3, P + R))
    attn = torch.cat([torch.ones(3, P), mask], 1).long()
    ref = ReferenceWorker(cfg, threads=1).logprobs(ids, attn, mask, P)
    actor = load_trainable("causal", cfg.actor, tok).eval()
    own = actor_forward(actor, cfg, ids, attn, torch.cat([torch.zeros(3, P), mask], 1), P)[0].detach()   # with grad
    assert torch.allclose(ref * mask, own * mask, atol=1e-6)


@pytest.mark.parametrize("preset", ["grpo", "ppo"])
def test_reference_and_old_logprobs_round_as_the_training_forward(tmp_path, preset):
    """In bf16 the training forward (with grad) took the matmul attention and the reference and
    old log-probs (no grad) took SDPA: up to 0.14 nats per token apart on SmolLM2 at step 0, so a
    GRPO step whose advantages were all zero moved the policy by a full Adam step (the KL term's
    gradient of that rounding noise). The same kernels on the same rows: bit-identical."""
    from turborlhf.models.load import load_tokenizer
    from turborlhf.models.tiny import save_tiny_causal_lm
    from turborlhf.presets import GRPOConfig
    from turborlhf.trainers.ppo.actor import ActorWorker, actor_forward
    from turborlhf.trainers.ppo.roles import ReferenceWorker

    d = str(save_tiny_causal_lm(tmp_path / "m"))
    cls = GRPOConfig if preset == "grpo" else PPOConfig
    cfg = cls(actor={"name_or_path": d, "dtype": "bf16", "device": "cpu"}, reward_model="rm",
              data={"prompts_file": "f"}, distributed={"device": "cpu"}, rollout={"max_new_tokens": 24},
              algo={"kl_coef": 0.1}, train={"micro_batch_size": 8})
    tok = load_tokenizer(d)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, len(tok), (2, 9), generator=g).repeat_interleave(4, 0)    # 2 prompts × 4 samples
    resp_len = 24
    mask = (torch.arange(resp_len)[None] < torch.tensor([24, 20, 17, 9, 24, 3, 12, 22])[:, None]).float()
    ids = torch.cat([prompts, torch.randint(3, len(tok), (8, resp_len), generator=g)], 1)
    attn = torch.cat([torch.ones(8, 9), mask], 1).long()
    actor = ActorWorker(cfg, None, total_updates=1, threads=1)
    ref = ReferenceWorker(cfg, threads=1).logprobs(ids, attn, mask, 9)
    old = actor.logprobs(ids, attn, mask, 9)
    train = actor_forward(actor.model, cfg, ids, attn, torch.cat([torch.zeros(8, 9), mask], 1), 9)[0]
    assert train.requires_grad
    assert torch.equal(ref * mask, old * mask) and torch.equal(old * mask, train.detach() * mask)


def test_old_logprobs_of_a_lora_actor_are_the_policys_not_a_dropout_sample(tmp_path):
    """peft adds LoRA dropout after loading switched dropout off: the experience's old log-probs
    were computed in training mode, a dropout sample (the on-policy ratio not 1)."""
    from turborlhf.models.tiny import save_tiny_causal_lm
    from turborlhf.trainers.ppo.actor import ActorWorker

    d = str(save_tiny_causal_lm(tmp_path / "m"))
    cfg = PPOConfig(actor={"name_or_path": d, "dtype": "fp32", "device": "cpu",
                           "lora": {"rank": 4, "dropout": 0.5}},
                    reward_model="rm", data={"prompts_file": "f"}, distributed={"device": "cpu"},
                    rollout={"max_new_tokens": R})
    worker = ActorWorker(cfg, None, total_updates=1, threads=1)
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)               # a trained adapter: its dropout moves the output
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (2, P + R))
    mask = torch.ones(2, R)
    attn = torch.ones(2, P + R, dtype=torch.long)
    a, b = (worker.logprobs(ids, attn, mask, P) for _ in range(2))
    assert torch.equal(a, b) and worker.model.training


def test_critic_clipfrac_is_the_share_where_the_clipped_value_term_is_active():
    """critic/clipfrac counted |V − V_old| > ε_v, while algo.value_clipfrac (TRL's vf_clipfrac, the
    definition documented) counts where the clipped term is the larger one: a value that moved
    more than ε_v away from its return (the unclipped term the larger) was counted too."""
    from types import SimpleNamespace

    from turborlhf.algo import value_clipfrac
    from turborlhf.config import PPOAlgoCfg
    from turborlhf.trainers.ppo.critic import critic_micro_step

    old = torch.zeros(1, 4)
    returns = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    v = torch.tensor([[0.5, -0.5, 0.1, 0.0]], requires_grad=True)    # towards, away, within, still
    mask = torch.ones(1, 4)
    sub = SimpleNamespace(P=1, mask_BR=mask, values_BR=old, returns_BR=returns)
    sub.to = lambda device: sub
    kept = SimpleNamespace(take=lambda s: (v, None))
    cfg = SimpleNamespace(algo=PPOAlgoCfg(value_clip=0.2))
    stats = critic_micro_step(None, cfg, sub, {"num_tokens": 4}, kept=kept)
    want = float(value_clipfrac(v.detach(), old, returns, mask, 0.2))
    assert float(stats["critic/clipfrac"]) == pytest.approx(want) == 0.25      # the first token's only


@pytest.mark.parametrize("algo", [
    {"policy_loss": "gspo", "loss_reduction": "seq_mean_token_mean"},
    {"policy_loss": "cispo", "loss_reduction": "token_mean"},
    {"policy_loss": "cispo", "loss_reduction": "token_sum_norm"},
    {"policy_loss": "ppo", "eps_clip_high": 0.28, "kl_use_loss": True, "kl_estimator": "k3", "entropy_coef": 0.01,
     "loss_reduction": "seq_mean_token_mean"}])
def test_every_policy_loss_accumulates_with_is_weights_and_the_overlong_filter(setup, algo):
    """GSPO, CISPO and clip-higher PPO with a KL loss and an entropy bonus, the policy loss weighted by
    TIS weights and two rows masked out by the overlong filter: any micro-batch size gives the
    mini-batch's gradient and the same logged statistics."""
    model, base = setup
    exp = copy.copy(base)
    exp.is_weight_BR = torch.rand(B, R, generator=torch.Generator().manual_seed(1)) * base.mask_BR
    exp.loss_mask_BR = base.mask_BR * torch.tensor([1, 0, 1, 1, 0, 1, 1, 1.0])[:, None]
    whole, stats = _step(model, exp, 8, **algo)
    for micro in (1, 3):
        g, s = _step(model, exp, micro, **algo)
        assert torch.allclose(g, whole, atol=1e-6, rtol=1e-5)
        for k, v in stats.items():
            assert s[k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
