"""`turborlhf plan`: the memory formulas against exact byte counts of real tensors, and the command.

Activation formulas are checked against the bytes autograd actually saves (distinct storages seen
by a saved-tensor hook, parameters excluded) in the forward passes the trainers run, on tiny
Llama models of several shapes; weights/gradients/optimizer states against the tensors a trainer
builds. The comparison with measured peak RSS of real runs is docs/memory.md and
tests/e2e/test_plan_e2e.py.
"""
import json

import pytest
import torch

from turborlhf.plan import (kv_cache_bytes, model_shape, parse_bytes, train_activation_bytes)

SHAPES = [  # hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied
    (192, 2, 6, 2, 16, 448, 1000, True),
    (128, 3, 4, 4, 32, 320, 700, False),
]


def _config_dir(tmp_path, hidden, layers, heads, kv, hd, inter, vocab, tied):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=1024,
                      tie_word_embeddings=tied, pad_token_id=0)
    out = tmp_path / f"m{hidden}_{layers}_{tied}"
    cfg.save_pretrained(out)
    return out, cfg


def _saved_bytes(model, fn) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa-tied", "mha-untied"])
@pytest.mark.parametrize("head,packed", [("lm", False), ("values", False), ("score", False), ("score", True)])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("variant", ["full", "checkpointing", "lora", "fused", "fused-checkpointing", "fused-lora"])
def test_activation_formula_equals_saved_tensor_bytes(tmp_path, shape, head, packed, dtype, variant):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from turborlhf.config import LoraCfg
    from turborlhf.engine.train import autocast
    from turborlhf.models.forward import (last_token_scores, pack_shared_prefix, response_logprobs,
                                          shared_prefix_scores, token_values)
    from turborlhf.models.fused import use_fused_layers
    from turborlhf.models.load import apply_lora, enable_checkpointing

    if variant.endswith("lora") and packed:
        pytest.skip("LoRA reward models: covered by the unpacked score head")
    path, cfg = _config_dir(tmp_path, *shape)
    lora = LoraCfg(rank=4)
    s = model_shape(str(path), tuple(lora.target_modules))
    torch.manual_seed(0)
    if head == "lm":
        model = AutoModelForCausalLM.from_config(cfg).train()
    else:
        cfg.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(cfg).train()
    fused = variant.startswith("fused")
    if fused:
        assert s.fused_layers and use_fused_layers(model) > 0
    if variant.endswith("checkpointing"):
        enable_checkpointing(model)
    if variant.endswith("lora"):
        model = apply_lora(model, lora)
    B, T = 3, 40
    ids = torch.randint(3, shape[6], (B, T))
    attn = torch.ones(B, T, dtype=torch.long)
    if packed:
        a = [torch.randint(3, 500, (T // 2,)).tolist() for _ in range(B)]
        b = [x[:T // 4] + torch.randint(3, 500, (T // 4,)).tolist() for x in a]
        batch = pack_shared_prefix(a, b, 0)
        rows, row_len = batch.ids_BL.shape
        fn = lambda: shared_prefix_scores(model, batch)
    else:
        rows, row_len = B, T
        fn = {"lm": lambda: response_logprobs(model, ids, attn, attn),
              "values": lambda: token_values(model, ids, attn),
              "score": lambda: last_token_scores(model, ids, attn)}[head]

    def run():
        with autocast(dtype):
            fn()

    measured = _saved_bytes(model, run)
    est = train_activation_bytes(s, rows, row_len, B * (T - 1), dtype, head, packed=packed,
                                 gradient_checkpointing=variant.endswith("checkpointing"),
                                 lora_rank=4 if variant.endswith("lora") else 0, fused_layers=fused)
    # LoRA: the first layer's input needs no gradient (frozen embeddings), so it keeps a little less
    # (its input norm's tensors and q/k/v weight casts; the formula drops those)
    assert est["saved"] == pytest.approx(measured, rel=0.01), (est, measured)


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa-tied", "mha-untied"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("variant", ["full", "lora"])
def test_activation_formula_with_recomputed_logits(tmp_path, monkeypatch, shape, dtype, variant):
    """Above `MAX_KEPT_LOGITS_BYTES` the LM head keeps its hidden states instead of its logits."""
    import turborlhf.models.head_logprobs as HL

    monkeypatch.setattr(HL, "MAX_KEPT_LOGITS_BYTES", 0)
    test_activation_formula_equals_saved_tensor_bytes(tmp_path, shape, "lm", False, dtype, variant)


def test_model_shape_counts_parameters_from_config_only(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for shape in SHAPES:
        path, cfg = _config_dir(tmp_path, *shape)
        assert not list(path.glob("*.safetensors"))                       # no weights needed
        s = model_shape(str(path), ("q_proj", "v_proj"))
        m = AutoModelForCausalLM.from_config(cfg)
        assert s.params == sum(p.numel() for p in m.parameters())
        assert s.layer_linear == sum(mod.weight.numel() for n, mod in m.named_modules()
                                     if isinstance(mod, torch.nn.Linear) and ".layers." in n)
        cfg.num_labels = 1
        sc = AutoModelForSequenceClassification.from_config(cfg)
        assert s.scalar_params() == sum(p.numel() for p in sc.parameters())
        E, kvd = shape[0], shape[3] * shape[4]
        assert s.lora_in_out == shape[1] * ((E + shape[2] * shape[4]) + (E + kvd))   # q and v of every layer
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_shape(str(tmp_path / "not-trained-yet"))


def test_weights_grads_and_optimizer_states_match_the_tensors_a_trainer_builds(tiny_model):
    from turborlhf.config import LoraCfg, ModelCfg, OptimCfg
    from turborlhf.engine.train import clip_and_step, make_optimizer
    from turborlhf.models.forward import response_logprobs
    from turborlhf.models.load import load_tokenizer, load_trainable
    from turborlhf.plan import _train_role

    tok = load_tokenizer(str(tiny_model))
    for mcfg in (ModelCfg(name_or_path=str(tiny_model)), ModelCfg(name_or_path=str(tiny_model), lora=LoraCfg(rank=4)),
                 ModelCfg(name_or_path=str(tiny_model), freeze_layers=1)):
        s = model_shape(str(tiny_model), tuple(mcfg.lora.target_modules))
        role = _train_role("policy", s, mcfg, OptimCfg(), scalar=False, device_kind="cpu")
        m = load_trainable("causal", mcfg, tok)
        opt = make_optimizer(m, OptimCfg())
        ids = torch.randint(3, 200, (2, 12))
        response_logprobs(m, ids, torch.ones_like(ids), torch.ones_like(ids))[0].sum().backward()
        grads = sum(p.grad.nbytes for p in m.parameters() if p.grad is not None)
        clip_and_step(m, opt, None, 1.0)
        states = sum(t.nbytes for st in opt.state.values() for k, t in st.items() if k != "step")
        uniq = {p.untyped_storage().data_ptr(): p.nbytes for p in m.parameters()}
        assert role.weights == sum(uniq.values())
        assert role.grads == grads and role.optimizer == states


def test_kv_cache_formula_equals_the_engine_cache(tiny_model, monkeypatch):
    from turborlhf.rollout.base import SamplingParams
    from turborlhf.rollout.fast import FastEngine

    s = model_shape(str(tiny_model))
    eng = FastEngine(str(tiny_model), dtype="bf16", max_batch_size=8)
    seen = {}

    def spy(real):
        def alloc(*shape, **kw):
            t = real(*shape, **kw)
            if len(shape) == 5:
                seen[id(t)] = t.nbytes
            return t
        return alloc

    for name in ("zeros", "empty"):                # the cache is either, by its reader
        monkeypatch.setattr(torch, name, spy(getattr(torch, name)))
    eng.generate([[5, 6, 7] * 10] * 6, SamplingParams(max_new_tokens=40, min_new_tokens=40, temperature=1.0, seed=0))
    monkeypatch.undo()
    full = max(seen.values())                  # K (one of K/V) of the full cache; the prefill's are smaller
    assert kv_cache_bytes(s, 6, 30, 40, "bf16") == 2 * full


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2 ** 30 and parse_bytes("80GB") == 80 * 10 ** 9
    assert parse_bytes("512 MiB") == 512 * 2 ** 20 and parse_bytes("1e9") == 10 ** 9
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


def test_engine_weights_follow_rollout_weight_dtype(tiny_model):
    """The rollout engine's weights count 2 bytes per parameter with bf16 weight storage
    (`rollout.weight_dtype: bf16` on an fp32 engine), 4 with `same`."""
    from turborlhf.config import PPOConfig, load_config
    from turborlhf.plan import plan_config

    def engine_bytes(weight_dtype):
        cfg = load_config(PPOConfig, overrides=[f"actor.name_or_path={tiny_model}", "reward_model=rm",
                                                "data.prompts_file=p.jsonl", "rollout.dtype=fp32",
                                                "rollout.engine=fast", f"rollout.weight_dtype={weight_dtype}",
                                                "actor.device=cpu"])              # FastEngine: CPU only
        plan = plan_config("ppo", cfg, model_config=str(tiny_model))[0]
        return next(r for r in plan.roles if r.name == "rollout").weights

    assert engine_bytes("bf16") * 2 == engine_bytes("same") > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("prompt_len, resp_len", [(20, 40), (20, 260)])      # matmul / SDPA attention path
def test_shared_prompt_formula_equals_saved_tensor_bytes(tmp_path, dtype, prompt_len, resp_len):
    """`share_prompts` (GRPO's G samples of a prompt in one micro-batch) runs the prompt once but keeps
    the segment attention's own tensors: the plan used the unshared formula (on SmolLM2 at 32 + 480
    tokens 3.90 GiB planned against 4.71 saved)."""
    from transformers import AutoModelForCausalLM

    from turborlhf.engine.train import autocast
    from turborlhf.models.attention import use_training_attention
    from turborlhf.models.forward import response_logprobs
    from turborlhf.models.fused import use_fused_layers
    from turborlhf.models.memory import shared_prompt_train_bytes

    path, cfg = _config_dir(tmp_path, *SHAPES[0])
    s = model_shape(str(path))
    torch.manual_seed(0)
    model = use_training_attention(AutoModelForCausalLM.from_config(cfg).train())
    use_fused_layers(model)
    B, G, T = 4, 2, prompt_len + resp_len
    ids = torch.randint(3, SHAPES[0][6], (B, T))
    for k in range(0, B, G):
        ids[k:k + G, :prompt_len] = ids[k, :prompt_len]
    attn = torch.ones(B, T, dtype=torch.long)
    target = torch.cat([torch.zeros(B, prompt_len), torch.ones(B, resp_len)], 1)

    def run():
        with autocast(dtype, model):
            response_logprobs(model, ids, attn, target, share_prompts=True)

    measured = _saved_bytes(model, run)
    est = shared_prompt_train_bytes(s, B, G, prompt_len, resp_len, dtype, fused_layers=True)
    assert est["saved"] == pytest.approx(measured, rel=0.02), (est["saved"], measured)
