"""Freeze tuning (``model.freeze_layers``): which weights train, that backward stops at the first
trainable layer, the errors, and the pipeline's critic section."""
import pytest
import torch

from turborlhf.config import LoraCfg, ModelCfg, OptimCfg, PipelineConfig
from turborlhf.engine.train import clip_and_step, make_optimizer
from turborlhf.models.forward import last_token_scores, response_logprobs
from turborlhf.models.load import decoder_layers, load_tokenizer, load_trainable
from turborlhf.models.tiny import save_tiny_causal_lm


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    """The tiny Llama with 4 decoder layers (the session's tiny model has 2)."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny4"), seed=1, layers=4)


def _ids(n=3, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (n, T), generator=g)
    return ids, torch.ones_like(ids)


def test_scalar_model_trains_only_the_layers_above_the_frozen_ones(model4):
    tok = load_tokenizer(str(model4))
    m = load_trainable("scalar", ModelCfg(name_or_path=str(model4), freeze_layers=3), tok)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    layers = decoder_layers(m)
    assert not m.get_input_embeddings().weight.requires_grad
    assert all(not p.requires_grad for layer in layers[:3] for p in layer.parameters())
    assert all(p.requires_grad for p in layers[3].parameters()) and m.score.weight.requires_grad

    seen = []                                   # what reaches the first trainable layer: no graph below
    layers[3].register_forward_pre_hook(lambda mod, args, kw: seen.append(args[0] if args else kw["hidden_states"]),
                                        with_kwargs=True)
    opt = make_optimizer(m, OptimCfg(lr=1e-2, state_dtype="fp32"))
    last_token_scores(m, *_ids()).sum().backward()
    assert seen and not seen[0].requires_grad
    trained = {n for n, p in m.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in m.named_parameters() if p.requires_grad}
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == \
        sum(p.numel() for p in m.parameters() if p.requires_grad)
    clip_and_step(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), 1.0)
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith(("model.layers.3.", "model.norm", "score")) for n in changed), changed


def test_frozen_causal_lm_keeps_tied_head_and_matches_the_unfrozen_forward(model4):
    tok = load_tokenizer(str(model4))
    full = load_trainable("causal", ModelCfg(name_or_path=str(model4)), tok)
    frozen = load_trainable("causal", ModelCfg(name_or_path=str(model4), freeze_layers=2), tok)
    ids, attn = _ids(seed=1)
    lp_full = response_logprobs(full, ids, attn, attn.float())[0]
    lp_frozen = response_logprobs(frozen, ids, attn, attn.float())[0]
    # freezing changes what trains, not the forward (up to the kernels chosen with and without a graph)
    torch.testing.assert_close(lp_frozen, lp_full, rtol=0, atol=1e-5)
    lp_frozen.sum().backward()
    assert frozen.get_input_embeddings().weight.grad is None
    assert decoder_layers(frozen)[2].mlp.up_proj.weight.grad is not None


def test_freeze_layers_errors_name_the_field(model4):
    tok = load_tokenizer(str(model4))
    with pytest.raises(ValueError, match=r"^freeze_layers=4 must be below the model's 4 decoder layers"):
        load_trainable("scalar", ModelCfg(name_or_path=str(model4), freeze_layers=4), tok)
    with pytest.raises(ValueError, match="freeze_layers and lora"):
        ModelCfg(freeze_layers=1, lora=LoraCfg(rank=4))
    with pytest.raises(ValueError):
        ModelCfg(freeze_layers=-1)


def test_pipeline_critic_section_still_starts_from_the_runs_reward_model(tmp_path):
    from turborlhf.pipeline import stage_configs

    cfg = PipelineConfig(run_dir=str(tmp_path), model="m", ppo={"critic": {"freeze_layers": 3}})
    ppo = stage_configs(cfg, "m")["ppo"]
    assert ppo.critic.freeze_layers == 3 and ppo.critic_init == str(tmp_path / "rm")
    assert stage_configs(PipelineConfig(run_dir=str(tmp_path), model="m"), "m")["ppo"].critic is None


def test_ppo_critic_section_without_a_model_starts_from_the_reward_model():
    """`turborlhf ppo ... critic.freeze_layers=N`: the critic section's other fields do not make the
    critic start from ModelCfg's default model (a SmolLM2 critic beside a tiny policy once trained
    silently); critic.name_or_path still wins when set."""
    from turborlhf.config import PPOConfig

    from turborlhf.config import config_to_dict

    base = dict(actor={"name_or_path": "a"}, reward_model="rm", data={"prompts_file": "p.jsonl"})
    cfg = PPOConfig(**base, critic={"freeze_layers": 1})
    assert cfg.critic_init == "rm" and cfg.critic.freeze_layers == 1
    assert PPOConfig(**config_to_dict(cfg)).critic_init == "rm"              # the saved config says so too
    assert PPOConfig(**base, critic=ModelCfg(freeze_layers=1)).critic_init == "rm"      # the Python API's form
    assert PPOConfig(**base, critic={"name_or_path": "c", "freeze_layers": 1}).critic_init == "c"
    assert PPOConfig(**base).critic_init == "rm"
    sources = dict(base, reward_model=None, rewards=[{"kind": "function", "path": "f.py:g"},
                                                     {"kind": "model", "path": "rm2"}])
    assert PPOConfig(**sources, critic={"freeze_layers": 1}).critic_init == "rm2"
    # no model to start from (function rewards only): an error, not ModelCfg's default model
    functions = dict(base, reward_model=None, rewards=[{"kind": "function", "path": "f.py:g"}])
    with pytest.raises(ValueError, match="critic.name_or_path"):
        PPOConfig(**functions, critic={"freeze_layers": 1})
    assert PPOConfig(**functions, critic={"name_or_path": "c"}).critic_init == "c"


def test_loaded_models_have_no_dropout_even_where_modules_copied_the_rate(tmp_path):
    """Llama attention copies config.attention_dropout when built and applies it functionally:
    zeroing the config after loading left the policy's log-probs noisy in training mode."""
    from turborlhf.data.tokenize import encode_prompt_response
    from turborlhf.models.forward import summed_logps
    from turborlhf.models.load import load_causal_lm

    d = save_tiny_causal_lm(tmp_path / "m", attention_dropout=0.3)
    tok = load_tokenizer(str(d))
    model = load_causal_lm(str(d), tok)
    assert model.model.layers[0].self_attn.attention_dropout == 0.0
    seq = encode_prompt_response(tok, "hello there how are you", "fine thanks", 64)
    model.train()
    with torch.no_grad():
        a, b = (float(summed_logps(model, tok.pad_token_id, [seq], "fp32")[0]) for _ in range(2))
    model.eval()
    with torch.no_grad():
        c = float(summed_logps(model, tok.pad_token_id, [seq], "fp32")[0])
    assert a == b == pytest.approx(c, abs=1e-5)


def test_freeze_layers_freezes_every_input_side_parameter(tmp_path):
    """GPT-2's learned position embeddings (wpe) sit beside the token embeddings: they kept
    training under freeze_layers, and backward ran through every frozen layer to reach them."""
    from transformers import AutoModelForCausalLM, GPT2Config

    tok = load_tokenizer(str(save_tiny_causal_lm(tmp_path / "tok")))
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=3, n_head=2, n_positions=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    model = load_trainable("causal", ModelCfg(name_or_path=str(tmp_path / "gpt2"), freeze_layers=2, device="cpu"), tok)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("transformer.h.2.", "transformer.ln_f.")) for n in trainable), trainable


def test_ppo_refuses_a_reference_it_would_not_use():
    """reference (the API's ref_model) with kl_coef=0 was accepted and never loaded, silently."""
    from turborlhf.config import GRPOConfig

    base = dict(reward_model="rm", data={"prompts_file": "p.jsonl"}, reference="ref")
    with pytest.raises(ValueError, match="reference=ref is unused with algo.kl_coef=0"):
        GRPOConfig(**base, algo={"kl_coef": 0.0})
    assert GRPOConfig(**base).reference == "ref"


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path):
    """Its top token ids fell past the embedding: an IndexError in the middle of a step."""
    from transformers import AutoModelForCausalLM

    from turborlhf.config import ModelCfg
    from turborlhf.errors import UserError
    from turborlhf.models.load import load_trainable

    d = save_tiny_causal_lm(tmp_path / "m")
    tok = load_tokenizer(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d))
    model.resize_token_embeddings(len(tok) - 4)
    model.save_pretrained(str(d))
    with pytest.raises(UserError, match=f"its embedding has {len(tok) - 4} rows for the tokenizer's {len(tok)} tokens"):
        load_trainable("causal", ModelCfg(name_or_path=str(d)), tok)
