"""LoRA/QLoRA loading, merged weights, the adapter-disabled reference, gradient checkpointing and
optimizer-state offload, on the tiny random Llama."""
import pytest
import torch

from turborlhf.config import ConfigError, LoraCfg, ModelCfg, OptimCfg, load_config, SFTConfig
from turborlhf.data.tokenize import pad_batch
from turborlhf.engine.checkpoint import _write_hf
from turborlhf.engine.train import CPUOffloadAdamW, clip_and_step, make_optimizer
from turborlhf.models.forward import last_token_scores, response_logprobs
from turborlhf.models.load import (adapters_disabled, is_lora, load_causal_lm, load_tokenizer, load_trainable,
                                   merge_lora_for_save, merged_named_parameters)
from turborlhf.models.reference import LoraReference, reference_view

LORA = ModelCfg(name_or_path="unused", lora=LoraCfg(rank=4, alpha=8.0))


def _batch(seed=0, n=3, lo=5, hi=20):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 300, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
    ids, attn = pad_batch(seqs, 0)
    return ids, attn, attn.clone()


def _perturb_adapters(model, seed=0):
    """LoRA starts with B = 0 (merged == base); give the adapters values as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _logp(model, batch):
    with torch.no_grad():
        return response_logprobs(model, *batch)[0]


def test_load_trainable_lora_trains_only_adapters(tiny_model):
    tok = load_tokenizer(str(tiny_model))
    m = load_trainable("causal", LORA, tok, init=str(tiny_model))
    assert is_lora(m) and m.training
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with pytest.raises(ValueError, match="kind"):
        load_trainable("value", LORA, tok, init=str(tiny_model))


def test_lora_targets_must_name_modules_of_the_model(tiny_model):
    """An unknown or empty target list was peft's traceback at load time: a config error naming the field
    and the model's linear layers now; peft's dotted-suffix names still match."""
    tok = load_tokenizer(str(tiny_model))
    with pytest.raises(ConfigError, match=r"lora\.target_modules: nope not in .*q_proj"):
        load_trainable("causal", LORA.model_copy(update={"lora": LoraCfg(rank=4, target_modules=["q_proj", "nope"])}),
                       tok, init=str(tiny_model))
    dotted = LORA.model_copy(update={"lora": LoraCfg(rank=4, target_modules=["self_attn.q_proj"])})
    assert is_lora(load_trainable("causal", dotted, tok, init=str(tiny_model)))
    with pytest.raises(ConfigError, match=r"model\.lora: .*target_modules is empty"):
        load_config(SFTConfig, None, ["data.train_file=x", "model.lora.rank=4", "model.lora.target_modules=[]"])
    # a block, not a layer: peft's traceback with the block's whole repr; the hint leaves out the
    # tied LM head and embedding (refused as targets)
    with pytest.raises(ConfigError, match=r"lora\.target_modules: mlp names LlamaMLP modules, which LoRA cannot adapt; "
                                          r"name layers inside them \(down_proj, gate_proj, k_proj, o_proj, q_proj, "
                                          r"up_proj, v_proj\)"):
        load_trainable("causal", LORA.model_copy(update={"lora": LoraCfg(rank=4, target_modules=["mlp"])}),
                       tok, init=str(tiny_model))
    with pytest.raises(ConfigError, match=r"model\.lora\.alpha"):      # alpha 0: a zero update, nothing trains
        load_config(SFTConfig, None, ["data.train_file=x", "model.lora.rank=4", "model.lora.alpha=0"])


def test_a_resume_refuses_other_lora_settings_than_the_checkpoints(tiny_model, tmp_path):
    """The adapters come from the checkpoint: a changed rank, alpha or target list under
    --resume-changed was logged as taken and silently not used; LoRA switched on or off failed
    with an error naming no field."""
    from peft import PeftModel

    tok = load_tokenizer(str(tiny_model))
    m = load_trainable("causal", LORA, tok, init=str(tiny_model))
    assert isinstance(m, PeftModel)
    m.save_pretrained(tmp_path / "lora")
    load_tokenizer(str(tiny_model)).save_pretrained(tmp_path / "lora")
    assert is_lora(load_trainable("causal", LORA, tok, init=str(tiny_model), ckpt_dir=tmp_path / "lora"))
    other = LORA.model_copy(update={"lora": LoraCfg(rank=8, alpha=8.0)})
    with pytest.raises(ConfigError, match=r"lora\.rank: 4 -> 8: the checkpoint .* LoRA settings cannot change"):
        load_trainable("causal", other, tok, init=str(tiny_model), ckpt_dir=tmp_path / "lora")
    with pytest.raises(ConfigError, match=r"lora\.rank: 0, but the checkpoint .* holds LoRA adapters \(rank 4\)"):
        load_trainable("causal", LORA.model_copy(update={"lora": LoraCfg()}), tok, init=str(tiny_model),
                       ckpt_dir=tmp_path / "lora")
    with pytest.raises(ConfigError, match=r"lora\.rank: 4, but the checkpoint .* was saved without LoRA"):
        load_trainable("causal", LORA, tok, init=str(tiny_model), ckpt_dir=tiny_model)


def test_merged_weights_equal_the_adapted_model_and_share_the_rest(tiny_model):
    tok = load_tokenizer(str(tiny_model))
    m = load_trainable("causal", LORA, tok, init=str(tiny_model))
    _perturb_adapters(m)
    batch = _batch()
    plain = merge_lora_for_save(m)
    assert not is_lora(plain)
    ref_names = [n for n, _ in load_causal_lm(str(tiny_model)).named_parameters()]
    assert [n for n, _ in merged_named_parameters(m)] == ref_names          # plain HF names, same order
    assert torch.allclose(_logp(plain, batch), _logp(m, batch), atol=1e-5)
    base = m.get_base_model()
    # no full copy: the embeddings (not adapted) are the training model's own tensor
    assert plain.get_input_embeddings().weight.data_ptr() == base.get_input_embeddings().weight.data_ptr()
    # and the training model still has working adapters after the merge
    assert is_lora(m) and not torch.allclose(_logp(m, batch), _logp(load_causal_lm(str(tiny_model)), batch))


def test_an_embedding_adapter_is_merged_and_refused_on_tied_embeddings(tiny_model, tmp_path):
    """peft keeps an embedding's adapter in ``lora_embedding_A/B``, not ``lora_A/B``: the merge
    skipped it, so the exported model (and the weights a rollout engine got) kept the base
    embedding. On tied embeddings the adapter applies to the input side only and cannot be merged
    into the one shared matrix: refused, as the tied LM head is."""
    from turborlhf.models.tiny import save_tiny_causal_lm

    untied = save_tiny_causal_lm(tmp_path / "untied", tie_word_embeddings=False)
    tok = load_tokenizer(str(untied))
    cfg = LORA.model_copy(update={"lora": LoraCfg(rank=4, target_modules=["q_proj", "embed_tokens"])})
    m = load_trainable("causal", cfg, tok, init=str(untied))
    _perturb_adapters(m)
    batch = _batch()
    assert torch.allclose(_logp(merge_lora_for_save(m), batch), _logp(m, batch), atol=1e-5)
    assert not torch.allclose(_logp(m, batch), _logp(load_causal_lm(str(untied)), batch))
    with pytest.raises(ConfigError, match="lora.target_modules: 'embed_tokens' is the token embedding or the LM head"):
        load_trainable("causal", cfg, load_tokenizer(str(tiny_model)), init=str(tiny_model))


def test_scalar_lora_merge_keeps_the_trained_head(tiny_model):
    tok = load_tokenizer(str(tiny_model))
    m = load_trainable("scalar", LORA, tok, init=str(tiny_model))
    _perturb_adapters(m, seed=1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "score" in n and p.requires_grad:
                p.add_(0.3)                                                   # modules_to_save copy
    ids, attn, _ = _batch(seed=2)
    with torch.no_grad():
        assert torch.allclose(last_token_scores(merge_lora_for_save(m), ids, attn),
                              last_token_scores(m, ids, attn), atol=1e-5)


def test_adapter_disabled_actor_is_the_initial_policy(tiny_model):
    tok = load_tokenizer(str(tiny_model))
    m = load_trainable("causal", LORA, tok, init=str(tiny_model))
    _perturb_adapters(m, seed=3)
    batch = _batch(seed=4)
    base_logp = _logp(load_causal_lm(str(tiny_model), tok), batch)
    # bit-exact on the CPU; a GPU may pick other kernels for the wrapped layers (~1e-7)
    same = torch.equal if not torch.cuda.is_available() else (lambda a, b: torch.allclose(a, b, atol=1e-5))
    with reference_view(LoraReference(m)) as ref:
        assert same(_logp(ref, batch), base_logp)
    with adapters_disabled(m):
        assert same(_logp(m, batch), base_logp)
    assert not torch.allclose(_logp(m, batch), base_logp)                    # adapters back on
    with pytest.raises(ValueError):
        LoraReference(load_causal_lm(str(tiny_model)))


def test_lora_checkpoint_holds_adapters_and_resumes_exactly(tiny_model, tmp_path):
    tok = load_tokenizer(str(tiny_model))
    m = load_trainable("causal", LORA, tok, init=str(tiny_model))
    _perturb_adapters(m, seed=5)
    _write_hf(m, tok, tmp_path / "policy", merge=False)
    assert (tmp_path / "policy" / "adapter_config.json").exists()
    assert not (tmp_path / "policy" / "model.safetensors").exists()          # adapters only
    r = load_trainable("causal", LORA, tok, init=str(tiny_model), ckpt_dir=tmp_path / "policy")
    a = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    b = [(n, p) for n, p in r.named_parameters() if p.requires_grad]
    assert [n for n, _ in a] == [n for n, _ in b]                             # optimizer state lines up
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(a, b))
    batch = _batch(seed=6)
    assert torch.equal(_logp(m, batch), _logp(r, batch))


def test_qlora_is_refused_with_a_clear_error_where_it_cannot_run(tiny_model, tiny_data, tmp_path, capsys):
    with pytest.raises(ConfigError, match="lora.rank"):
        load_config(SFTConfig, None, ["data.train_file=x", "model.load_in_4bit=true"])
    cfg = ModelCfg(name_or_path=str(tiny_model), lora=LoraCfg(rank=4), load_in_4bit=True)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the guard does not apply")
    with pytest.raises(RuntimeError, match="CUDA GPU with bitsandbytes"):
        load_trainable("causal", cfg, None)
    # from the command line: one line naming the field, before output_dir is written (was a traceback
    # after it, with exit code 1)
    from turborlhf.cli import main
    out = tmp_path / "q"
    assert main(["sft", f"data.train_file={tiny_data / 'train_pairs.jsonl'}", f"model.name_or_path={tiny_model}",
                 "model.lora.rank=4", "model.load_in_4bit=true", f"output_dir={out}"]) == 2
    assert capsys.readouterr().err.startswith("error: model.load_in_4bit (QLoRA) needs a CUDA GPU")
    assert not out.exists()


class Params4bit(torch.nn.Parameter):
    """Stands in for bitsandbytes' packed 4-bit weight (found by its class name, as peft does):
    the matrix flattened to one column, its shape in `quant_state`."""


def _packed(w: torch.Tensor) -> Params4bit:
    p = Params4bit(w.detach().reshape(-1, 1).clone(), requires_grad=False)
    p.quant_state = tuple(w.shape)
    return p


def test_qlora_merge_dequantizes_the_packed_base(tiny_model, monkeypatch):
    """QLoRA (CUDA only) keeps the base's weights packed: the merge for a rollout engine or an
    export dequantizes them (peft's `dequantize_module_weight`) in adapted and plain layers alike
    and drops the quantization from the exported config. bitsandbytes' dequantization is replaced
    by the stand-in's unpacking here; what is checked is that every packed weight goes through it."""
    import peft.utils.integrations as integrations

    monkeypatch.setattr(integrations, "dequantize_bnb_weight",
                        lambda weight, state=None: weight.data.reshape(weight.quant_state))
    tok = load_tokenizer(str(tiny_model))
    cfg = ModelCfg(name_or_path="unused", lora=LoraCfg(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    m = load_trainable("causal", cfg, tok, init=str(tiny_model))
    _perturb_adapters(m)
    want = {n: t.clone() for n, t in merged_named_parameters(m)}
    base = m.get_base_model()
    attn = base.model.layers[0].self_attn
    # an adapted layer's base and two plain layers
    for layer in [attn.q_proj.get_base_layer(), attn.k_proj, base.model.layers[1].mlp.down_proj]:
        layer.weight = _packed(layer.weight)
    base.config.quantization_config = {"load_in_4bit": True}
    got = dict(merged_named_parameters(m))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    plain = merge_lora_for_save(m)
    assert not hasattr(plain.config, "quantization_config")
    assert all(torch.equal(p, want[n]) for n, p in plain.named_parameters())


def _saved_bytes(model, batch) -> int:
    """Bytes of the distinct tensors autograd keeps for backward during one forward."""
    seen: dict[tuple, int] = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = response_logprobs(model, *batch)[0]
    logp.sum().backward()
    return sum(seen.values())


def test_gradient_checkpointing_flag_saves_activation_memory_and_keeps_gradients(tiny_model):
    tok = load_tokenizer(str(tiny_model))
    batch = _batch(seed=7, n=4, lo=60, hi=90)
    grads, saved = {}, {}
    for gc in (False, True):
        m = load_trainable("causal", ModelCfg(name_or_path=str(tiny_model), gradient_checkpointing=gc), tok)
        # transformers renamed is_gradient_checkpointing (older 5.x releases have only that name)
        flag = getattr(type(m), "is_activation_checkpointing", None)
        assert (m.is_activation_checkpointing if flag is not None else m.is_gradient_checkpointing) == gc
        saved[gc] = _saved_bytes(m, batch)
        grads[gc] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert saved[True] < 0.6 * saved[False]
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.allclose(grads[True][k], grads[False][k], atol=1e-6) for k in grads[True])


def _adam_run(tiny_model, offload: bool, steps: int = 3, state=None):
    torch.manual_seed(0)
    m = load_causal_lm(str(tiny_model)).train()
    opt = make_optimizer(m, OptimCfg(lr=1e-2, weight_decay=0.1, state_dtype="fp32"), force_offload=offload)
    if state is not None:
        opt.load_state_dict(state)
    batch = _batch(seed=8, n=2)
    for _ in range(steps):
        (-response_logprobs(m, *batch)[0].sum()).backward()
        clip_and_step(m, opt, None, 1.0)
    return m, opt


def test_optimizer_offload_update_equals_plain_adamw(tiny_model):
    plain, opt_p = _adam_run(tiny_model, offload=False)
    off, opt_o = _adam_run(tiny_model, offload=True)
    assert isinstance(opt_o, CPUOffloadAdamW) and not isinstance(opt_p, CPUOffloadAdamW)
    for (n, p), (_, q) in zip(plain.named_parameters(), off.named_parameters()):
        assert torch.equal(p, q), n
    # the states live in the optimizer's own copies, not on the model's parameters
    model_ids = {id(p) for p in off.parameters()}
    assert all(id(p) not in model_ids for g in opt_o.param_groups for p in g["params"])
    # same state-dict layout: a checkpoint of one resumes the other
    sp, so = opt_p.state_dict(), opt_o.state_dict()
    assert sp["param_groups"] == so["param_groups"]
    assert all(torch.equal(sp["state"][i]["exp_avg_sq"], so["state"][i]["exp_avg_sq"]) for i in sp["state"])
    # on the CPU the config flag alone keeps plain AdamW (nothing to offload)
    m = load_causal_lm(str(tiny_model))
    assert type(make_optimizer(m, OptimCfg(offload=True, state_dtype="fp32"))) is torch.optim.AdamW
    assert opt_p.defaults["fused"] and opt_o.defaults["fused"]        # torch's fused kernel on both


def test_fused_adamw_update_matches_the_foreach_one(tiny_model):
    """make_optimizer's fused AdamW gives the update of the multi-tensor (foreach) AdamW."""
    fused, opt = _adam_run(tiny_model, offload=False)
    torch.manual_seed(0)
    m = load_causal_lm(str(tiny_model)).train()
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
              for g in make_optimizer(m, OptimCfg(lr=1e-2, weight_decay=0.1, state_dtype="fp32")).param_groups]
    cfg = OptimCfg(lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(groups, lr=1e-2, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True)
    batch = _batch(seed=8, n=2)
    for _ in range(3):
        (-response_logprobs(m, *batch)[0].sum()).backward()
        clip_and_step(m, ref, None, 1.0)
    diff = max(float((p - q).abs().max()) for p, q in zip(fused.parameters(), m.parameters()))
    assert 0 <= diff < 1e-5            # fp32 rounding of a different kernel (1.2e-6 measured)
    assert max(float((p - q).abs().max()) for p, q in zip(fused.parameters(), load_causal_lm(str(tiny_model)).parameters())) > 1e-3


def test_actor_hands_a_colocated_engine_merged_weights_one_at_a_time(tiny_model):
    """The actor's weights for an engine in its process (`ActorWorker.local_weights` under LoRA):
    the merged pairs come from a generator, made as the engine reads them, and an engine loaded
    from them scores what the merged model scores."""
    import inspect

    from turborlhf.rollout import make_engine
    from turborlhf.trainers.ppo.actor import MergedWeights

    tok = load_tokenizer(str(tiny_model))
    m = load_trainable("causal", LORA, tok, init=str(tiny_model))
    _perturb_adapters(m)
    weights = MergedWeights(m)
    assert inspect.isgenerator(weights.items())
    want = {n: t.clone() for n, t in merged_named_parameters(m)}
    engine = make_engine("hf", str(tiny_model), dtype="fp32")
    engine.load_weights(weights.items())
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, want[n]), n


def test_lora_on_the_head_of_a_tied_model_is_refused(tiny_model):
    """The LM head of a tied model is the embedding matrix: its merged adapter was overwritten by
    tie_weights() on export (logits off by 1.36 against the trained model), silently."""
    tok = load_tokenizer(str(tiny_model))
    with pytest.raises(ConfigError, match="lora.target_modules: 'lm_head' is the token embedding or the LM head"):
        load_trainable("causal", ModelCfg(name_or_path=str(tiny_model), device="cpu",
                                          lora=LoraCfg(rank=4, target_modules=["q_proj", "lm_head"])), tok)


@pytest.mark.parametrize("kind,rank", [("causal", 0), ("causal", 4), ("scalar", 4)])
def test_an_export_after_gradient_checkpointing_keeps_use_cache(kind, rank, tiny_model, tmp_path):
    """Gradient checkpointing turns the config's use_cache off for training; the exported
    config.json kept it off, so a plain forward of the exported model returned no cache."""
    import json

    from turborlhf.engine.run import export_model

    tok = load_tokenizer(str(tiny_model))
    cfg = ModelCfg(name_or_path=str(tiny_model), gradient_checkpointing=True, lora=LoraCfg(rank=rank))
    m = load_trainable(kind, cfg, tok)
    export_model(m, tok, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_cache"] is True
    assert (m.get_base_model() if is_lora(m) else m).config.use_cache is False      # training goes on without


def test_a_reward_model_is_refused_where_a_policy_is_expected(tmp_path):
    """A reward model's directory loaded as a causal LM got a random LM head (eval-dpo, eval-policy
    and sft ran on it, exit 0); the engines failed with a KeyError traceback."""
    from transformers import AutoModelForSequenceClassification

    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.models.tiny import tiny_llama_config
    from turborlhf.models.zoo import NotAModelError
    from turborlhf.rollout import make_engine

    tok = make_tiny_tokenizer()
    AutoModelForSequenceClassification.from_config(tiny_llama_config(len(tok), num_labels=1)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for load in (lambda: load_causal_lm(str(tmp_path)), lambda: make_engine("auto", str(tmp_path)),
                 lambda: load_trainable("causal", ModelCfg(name_or_path=str(tmp_path)), tok)):
        with pytest.raises(NotAModelError, match="a reward model or critic .LlamaForSequenceClassification."):
            load()
