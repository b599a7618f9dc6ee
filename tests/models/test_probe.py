"""The load-time check of turborlhf's own forward paths (`turborlhf.models.probe`) on tiny random
models of architectures where they do not hold: packing (StableLM drops the attention arguments,
a Mamba hybrid carries state across packed rows), shared-prefix reward pairs (MPT's ALiBi by
column), a logit multiplier (Falcon-H1); Llama keeps every fast path."""
import logging

import pytest
import torch
import transformers as T

from turborlhf.models.forward import last_token_scores, response_logprobs
from turborlhf.models.load import load_causal_lm, load_scalar_model
from turborlhf.models.probe import shares_prefixes
from turborlhf.rewards.model import pair_scores

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _save(tmp_path, config, cls=T.AutoModelForCausalLM, **kw):
    torch.manual_seed(0)
    model = cls.from_config(config, dtype=torch.float32, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return tmp_path


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (3, 9), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 5:] = 0
    attn[2, 3:] = 0
    return ids, attn


def _hf_logprobs(path, ids, attn):
    """transformers' own per-row log-probs of each row's real tokens."""
    ref = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = torch.zeros(ids.shape)
    with torch.no_grad():
        for b in range(ids.shape[0]):
            n = int(attn[b].sum())
            lp = ref(input_ids=ids[b:b + 1, :n]).logits.log_softmax(-1)[0]
            out[b, 1:n] = lp[:-1].gather(-1, ids[b, 1:n, None]).squeeze(-1)
    return out


@pytest.mark.parametrize("name, config", [
    ("stablelm", lambda: T.StableLmConfig(**BASE, partial_rotary_factor=0.25)),
    ("granitemoehybrid", lambda: T.GraniteMoeHybridConfig(
        **BASE, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_n_groups=1, mamba_chunk_size=8, num_local_experts=0, shared_intermediate_size=128)),
    ("llama", lambda: T.LlamaConfig(**BASE)),
])
def test_packing_is_used_only_where_it_equals_the_models_own_forward(name, config, tmp_path, caplog, monkeypatch):
    """StableLM's layers drop the varlen attention arguments and a Mamba layer carries its state
    from one packed sequence into the next: their packed log-probs were off by up to 4 nats/token."""
    import turborlhf.models.probe as P

    monkeypatch.setattr(P, "_WARNED", set())         # each warning is given once per process
    path = _save(tmp_path / name, config())
    ids, attn = _batch()
    with caplog.at_level(logging.WARNING):
        model = load_causal_lm(str(path))
    packs = model.config._attn_implementation == "turborlhf"
    assert packs == (name == "llama")
    assert ("packed training batches are not exact" in caplog.text) == (name != "llama")
    with torch.no_grad():
        ours = response_logprobs(model, ids, attn, attn)[0]
    torch.testing.assert_close(ours * attn, _hf_logprobs(path, ids, attn) * attn, atol=1e-4, rtol=0)


def test_reward_pairs_of_an_alibi_model_are_scored_as_separate_rows(tmp_path):
    """MPT biases attention by column index, not position: the rejected answer of a shared-prefix
    row ``[prompt | chosen | rejected]`` was scored at the wrong distances."""
    path = _save(tmp_path / "mpt", T.MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=96, max_seq_len=256,
                                               pad_token_id=0, num_labels=1),
                 cls=T.AutoModelForSequenceClassification)
    rm = load_scalar_model(str(path))
    assert not shares_prefixes(rm)
    tok = type("Tok", (), {"pad_token_id": 0})()
    chosen, rejected = [5, 6, 7, 8, 9, 10], [5, 6, 7, 20, 21]
    a, b = pair_scores(rm, tok, [{"chosen": chosen, "rejected": rejected}], "fp32")
    with torch.no_grad():
        alone = [last_token_scores(rm, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in
                 (chosen, rejected)]
    torch.testing.assert_close(torch.cat([a, b]), torch.cat(alone), atol=1e-5, rtol=0)
    llama = load_scalar_model(str(_save(tmp_path / "llama", T.LlamaConfig(**BASE, num_labels=1),
                                        cls=T.AutoModelForSequenceClassification)))
    assert shares_prefixes(llama)


def test_a_logit_multiplier_is_applied_and_an_unknown_one_is_refused(tmp_path, monkeypatch):
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier``: the log-probs were the bare
    head's (1.6 nats/token off at 0.25); a transform turborlhf does not know is refused at load."""
    import turborlhf.models.forward as F

    path = _save(tmp_path / "falcon_h1", T.FalconH1Config(**BASE, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                                            mamba_d_state=16, mamba_chunk_size=8,
                                                            lm_head_multiplier=0.25))
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        ours = response_logprobs(load_causal_lm(str(path)), ids, attn, attn)[0]
    torch.testing.assert_close(ours, _hf_logprobs(path, ids, attn), atol=1e-4, rtol=0)
    monkeypatch.delitem(F._LOGIT_SCALES, "falcon_h1")
    with pytest.raises(ValueError, match="model type 'falcon_h1': its log-probs differ from the model's own logits"):
        load_causal_lm(str(path))


def test_an_architecture_without_a_scalar_head_is_one_clear_error(tmp_path):
    """transformers has no sequence-classification class for CodeGen: its raw error listed every
    model type it knows."""
    from turborlhf.models.zoo import NotAModelError

    path = _save(tmp_path / "codegen", T.CodeGenConfig(n_embd=32, n_layer=1, n_head=2, vocab_size=96, rotary_dim=8))
    with pytest.raises(NotAModelError, match="no sequence-classification class for CodeGenConfig, so it cannot be a "
                                             "reward model or critic"):
        load_scalar_model(str(path))


def test_a_bf16_model_is_checked_too(tmp_path):
    """A reward model scored in bf16 (serve-rm, the RM scorer) loads with bf16 weights: packing is
    checked for it as well."""
    path = _save(tmp_path / "stablelm", T.StableLmConfig(**BASE, partial_rotary_factor=0.25))
    assert load_causal_lm(str(path), dtype=torch.bfloat16).config._attn_implementation == "sdpa"
    llama = _save(tmp_path / "llama", T.LlamaConfig(**BASE))
    assert load_causal_lm(str(llama), dtype=torch.bfloat16).config._attn_implementation == "turborlhf"
