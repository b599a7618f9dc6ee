"""Shared frozen trunks (`turborlhf.models.trunk`): which models share, that sharing changes no
result or gradient, that the lower layers run once per sequence, and the cache's bounds."""
import gc

import pytest
import torch

from turborlhf.config import ModelCfg
from turborlhf.engine.train import trainable_parameters
from turborlhf.models.forward import last_token_scores, response_logprobs, token_values
from turborlhf.models.load import decoder_layers, load_causal_lm, load_tokenizer, load_trainable
from turborlhf.models.tiny import save_tiny_causal_lm
from turborlhf.models.trunk import (TrunkCache, clear_trunk_caches, share_frozen_trunk, trunk_layers, unshare)


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny4"), seed=1, layers=4)


def _roles(path, freeze=2):
    """reference (frozen causal LM), reward model and critic (scalar, lower `freeze` layers frozen)
    from the same weights: the PPO roles of a freeze-tuned pipeline, all on the CPU (`device: auto`
    would put the scalar models on a GPU where one is visible, away from the reference)."""
    tok = load_tokenizer(str(path))
    ref = load_causal_lm(str(path), tok).eval().requires_grad_(False)
    rm = load_trainable("scalar", ModelCfg(name_or_path=str(path), freeze_layers=freeze, device="cpu"), tok).eval().requires_grad_(False)
    critic = load_trainable("scalar", ModelCfg(name_or_path=str(path), freeze_layers=freeze, device="cpu"), tok)
    return ref, rm, critic


def _batch():
    """Left-padded prompts and right-padded responses, as PPO lays out its rows."""
    ids = torch.tensor([[0, 0, 5, 9, 17, 4, 8, 0], [3, 6, 2, 11, 30, 12, 7, 9], [0, 4, 4, 21, 5, 0, 0, 0]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [1] * 8, [0, 1, 1, 1, 1, 0, 0, 0]])
    target = attn.clone()
    target[:, :4] = 0
    return ids, attn, target.float()


def _outputs(ref, rm, critic, ids, attn, target):
    with torch.no_grad():
        lp = response_logprobs(ref, ids, attn, target)[0]
        sc = last_token_scores(rm, ids, attn)
    v = token_values(critic, ids, attn)
    (v * attn).sum().backward()
    grads = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
    critic.zero_grad(set_to_none=True)
    return lp, sc, v.detach(), grads


def test_sharing_changes_no_result_and_runs_the_trunk_once(model4):
    ref, rm, critic = _roles(model4)
    ids, attn, target = _batch()
    want = _outputs(ref, rm, critic, ids, attn, target)
    assert share_frozen_trunk([ref, rm, critic]) == [([0, 1, 2], 2)]
    calls = []
    hook = decoder_layers(ref)[0].register_forward_hook(lambda *a: calls.append(1))
    for layer in (decoder_layers(rm)[0], decoder_layers(critic)[0]):      # the same layer values, other modules
        layer.register_forward_hook(lambda *a: calls.append(1))
    got = _outputs(ref, rm, critic, ids, attn, target)
    assert len(calls) == 1                                                 # one trunk pass for three models
    for a, b in zip(want[:3], got[:3]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert want[3].keys() == got[3].keys() and all(n.startswith(("model.layers.2", "model.layers.3", "model.norm",
                                                                  "score")) for n in got[3])
    for n in want[3]:
        torch.testing.assert_close(got[3][n], want[3][n], rtol=1e-4, atol=1e-6)
    cache = ref.model._turborlhf_trunk
    assert cache is critic.model._turborlhf_trunk and len(cache) == 3 and (cache.hits, cache.misses) == (6, 3)
    # a critic update over a sub-batch in another layout (padding cut off) hits the cache
    token_values(critic, ids[[0, 2], :7], attn[[0, 2], :7])
    assert len(calls) == 1 and cache.hits == 8
    clear_trunk_caches()
    assert len(cache) == 0
    token_values(critic, ids, attn)
    assert len(calls) == 2
    hook.remove()
    for m in (ref, rm, critic):
        unshare(m)


def _mappings(path) -> int:
    """How many times this process maps `path`'s weights file (transformers maps it per load)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if line.rstrip().endswith(str(path / "model.safetensors")))
    except OSError:
        return 0


def test_shared_layers_are_held_once(model4):
    gc.collect()                     # earlier tests' models, and their mappings, go first
    base = _mappings(model4)
    ref, rm, critic = _roles(model4)
    ref2 = load_causal_lm(str(model4), load_tokenizer(str(model4))).requires_grad_(False)   # tied LM head
    trained = trainable_parameters(critic)
    own = {n: p.detach().clone() for n, p in critic.named_parameters()}
    mapped = _mappings(model4) - base
    assert share_frozen_trunk([ref, rm, critic, ref2]) == [([0, 1, 2, 3], 2)]
    for m in (rm, critic, ref2):
        assert m.model.embed_tokens.weight is ref.model.embed_tokens.weight
        for i in range(2):
            for (n, p), q in zip(decoder_layers(m)[i].named_parameters(), decoder_layers(ref)[i].parameters()):
                assert p is q, (i, n)
        assert all(p is not q for p, q in zip(decoder_layers(m)[2].parameters(), decoder_layers(ref)[2].parameters()))
    assert ref2.lm_head.weight is ref.model.embed_tokens.weight               # the tie follows its embeddings
    assert all(p is q for p, q in zip(trainable_parameters(critic), trained))    # the optimizer's objects stay
    for n, p in critic.named_parameters():                                       # and every value
        assert torch.equal(p, own[n]), n
    if mapped:   # the followers' checkpoint mappings are gone, their pages with them
        gc.collect()
        assert mapped == 4 and _mappings(model4) - base == 1
    for m in (ref, rm, critic, ref2):
        unshare(m)


def test_sharing_under_autocast_is_keyed_apart(model4):
    ref, rm, _ = _roles(model4)
    ids, attn, target = _batch()
    share_frozen_trunk([ref, rm])
    with torch.no_grad():
        fp32 = last_token_scores(rm, ids, attn)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = last_token_scores(rm, ids, attn)
        response_logprobs(ref, ids, attn, target)
    cache = rm.model._turborlhf_trunk
    assert len(cache) == 6 and cache.hits == 3             # the bf16 rows were not read from the fp32 ones
    assert not torch.equal(fp32, bf16)


def test_what_may_share(model4, tmp_path):
    ref, rm, critic = _roles(model4, freeze=3)
    assert trunk_layers(ref, rm) == 3 and trunk_layers(rm, critic) == 3
    ref_all, _, critic1 = _roles(model4, freeze=1)
    assert trunk_layers(ref_all, ref) == 3                 # two frozen copies of one model: all but the last layer
    assert trunk_layers(critic, critic1) == 1              # the fewer frozen layers
    with torch.no_grad():
        decoder_layers(rm)[1].mlp.up_proj.weight[0, 0] += 1e-3
    assert trunk_layers(ref, rm) == 1                      # equal bit for bit, or not shared
    _, _, trainable = _roles(model4, freeze=0)
    assert trunk_layers(ref, trainable) == 0               # trainable embeddings
    other = load_causal_lm(str(save_tiny_causal_lm(tmp_path / "other", seed=2, layers=4)),
                           load_tokenizer(str(model4))).requires_grad_(False)
    assert trunk_layers(ref, other) == 0
    groups = share_frozen_trunk([ref, other, rm, critic1])
    assert groups == [([0, 2, 3], 1)]                      # the group shares what all its members share
    for m in (ref, rm, critic1):
        unshare(m)
    # equal weights computing differently: another norm epsilon or activation shares nothing
    tok = load_tokenizer(str(model4))
    for setting in ({"rms_norm_eps": 0.5}, {"hidden_act": "gelu"}):
        d = save_tiny_causal_lm(tmp_path / str(setting), seed=1, layers=4, **setting)
        assert trunk_layers(ref, load_causal_lm(str(d), tok).requires_grad_(False)) == 0, setting


def test_mixed_full_and_sliding_attention_layers_do_not_share(tmp_path):
    """Qwen2 picks each layer's mask by its index in the layer list: a trunk's upper layers ran
    with the lower layers' kind (hidden states off by ~1 on an unpadded batch)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = load_tokenizer(str(save_tiny_causal_lm(tmp_path / "tok")))
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                      max_window_layers=2, pad_token_id=tok.pad_token_id)
    assert len(set(cfg.layer_types)) == 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "q")
    a, b = (load_trainable("causal", ModelCfg(name_or_path=str(tmp_path / "q"), freeze_layers=2, device="cpu"), tok)
            for _ in range(2))
    assert trunk_layers(a, b) == 0


def test_cache_is_bounded():
    c = TrunkCache(2, max_bytes=3 * 40)
    for i in range(5):
        c.put(("k", i), torch.zeros(10))                   # 40 bytes each
    assert len(c) == 3 and c.bytes == 120 and c.get(("k", 0)) is None and c.get(("k", 4)) is not None
    c.get(("k", 2))
    c.put(("k", 5), torch.zeros(10))                       # least recently used out: 3
    assert c.get(("k", 3)) is None and c.get(("k", 2)) is not None
