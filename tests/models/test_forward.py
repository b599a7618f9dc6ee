"""Forward helpers: shared-prefix packing equals separate sequences; chunked log-probs equal HF."""
import pytest
import torch

from turborlhf.data.tokenize import pad_batch
from turborlhf.models.forward import (last_token_scores, pack_shared_prefix, response_logprobs,
                                      shared_prefix_scores)
from turborlhf.models.load import load_causal_lm, load_scalar_model


def _pairs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    toks = lambda k: torch.randint(3, 500, (k,), generator=g).tolist()
    A, B = [], []
    for _ in range(n):
        p = toks(r(1, 30))
        A.append(p + toks(r(1, 12)))
        B.append(p + toks(r(1, 12)))
    A.append([7, 8, 9])          # identical pair: continuation kept non-empty
    B.append([7, 8, 9])
    return A, B


def test_shared_prefix_scores_equal_separate_sequences(tiny_model):
    m = load_scalar_model(str(tiny_model)).eval()
    A, B = _pairs()
    with torch.no_grad():
        a, b = shared_prefix_scores(m, pack_shared_prefix(A, B, 0))
        ids, attn = pad_batch(A + B, 0)
        ref = last_token_scores(m, ids, attn)
    n = len(A)
    assert torch.allclose(a, ref[:n], atol=1e-5) and torch.allclose(b, ref[n:], atol=1e-5)


def test_shared_prefix_gradients_equal_separate(tiny_model):
    m = load_scalar_model(str(tiny_model))
    A, B = _pairs(seed=1)
    a, b = shared_prefix_scores(m, pack_shared_prefix(A, B, 0))
    (a - b).sum().backward()
    g1 = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    ids, attn = pad_batch(A + B, 0)
    s = last_token_scores(m, ids, attn)
    (s[:len(A)] - s[len(A):]).sum().backward()
    for k, p in m.named_parameters():
        assert torch.allclose(g1[k], p.grad, atol=1e-5), k


def test_response_logprobs_match_full_log_softmax(tiny_model):
    m = load_causal_lm(str(tiny_model)).eval()
    ids, attn = pad_batch([[1, 5, 9, 11, 13], [1, 4, 6]], 0)
    target = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float)
    with torch.no_grad():
        lp, ent = response_logprobs(m, ids, attn, target, with_entropy=True, chunk_tokens=2)
        full = torch.log_softmax(m(input_ids=ids, attention_mask=attn).logits.float(), -1)
    ref = torch.zeros_like(lp)
    ref[:, 1:] = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * target[:, 1:]
    assert torch.allclose(lp, ref, atol=1e-5)
    ref_ent = -(full.exp() * full).sum(-1)
    assert torch.allclose(ent[:, 1:][target[:, 1:].bool()], ref_ent[:, :-1][target[:, 1:].bool()], atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Padding removal: the packed forward equals the padded one
# ----------------------------------------------------------------------------------------------

def _ppo_layout(seed=0):
    """Rows ``[left-padded prompt | right-padded response]`` with a target mask on the responses."""
    g = torch.Generator().manual_seed(seed)
    P, R, B = 7, 5, 4
    ids = torch.randint(3, 500, (B, P + R), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for b, (lp, lr) in enumerate([(7, 5), (3, 2), (5, 5), (1, 1)]):
        attn[b, P - lp:P + lr] = 1
    target = torch.zeros(B, P + R)
    target[:, P:] = attn[:, P:]
    return ids, attn, target


def _padded_only(monkeypatch):
    import turborlhf.models.forward as F

    monkeypatch.setattr(F, "packs_sequences", lambda backbone: False)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_a_batch_with_nothing_to_score_stays_in_the_graph(tiny_model, entropy_grad):
    """A micro-batch whose rows have no scored token (empty responses): the log-probs still have a
    gradient graph on both head paths, so the loss's backward runs (the entropy bonus's plain path
    returned a detached tensor and the backward raised)."""
    m = load_causal_lm(str(tiny_model))
    ids, attn = pad_batch([[1, 5, 9], [1, 4]], 0)
    lp, ent = response_logprobs(m, ids, attn, torch.zeros_like(attn), with_entropy=True, entropy_grad=entropy_grad)
    assert lp.requires_grad and not lp.any()
    (lp.sum() + (ent.sum() if entropy_grad else 0)).backward()



@pytest.mark.parametrize("per_sequence", [False, True])
def test_packed_forward_is_used_and_equals_padded(tiny_model, monkeypatch, per_sequence):
    """Packed rows equal padded ones, values and gradients, whichever way the packed attention
    runs: causal SDPA one sequence at a time (fp32), or padded to the longest sequence with a mask
    (the path bf16 takes on short sequences with grad, here forced in fp32)."""
    import turborlhf.models.attention as A
    import turborlhf.models.forward as F

    m = load_causal_lm(str(tiny_model))
    assert F.packs_sequences(m.model)
    ids, attn, target = _ppo_layout()
    calls, seq_calls = [], []
    real, real_seq = F._packed_hidden_states, A._per_sequence_attention
    monkeypatch.setattr(F, "_packed_hidden_states", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(A, "_per_sequence_attention", lambda *a, **k: seq_calls.append(1) or real_seq(*a, **k))
    if not per_sequence:
        monkeypatch.setattr(A, "_pads_for_matmul_path", lambda q, max_len: True)
    lp, ent = response_logprobs(m, ids, attn, target, with_entropy=True, entropy_grad=True)
    (lp.sum() + ent.sum()).backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    assert calls == [1] and bool(seq_calls) == per_sequence
    m.zero_grad()
    _padded_only(monkeypatch)
    lp0, ent0 = response_logprobs(m, ids, attn, target, with_entropy=True, entropy_grad=True)
    (lp0.sum() + ent0.sum()).backward()
    assert torch.allclose(lp, lp0, atol=1e-5) and torch.allclose(ent, ent0, atol=1e-5)
    assert (lp[target == 0] == 0).all()
    for k, p in m.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-5), k


def test_packed_values_and_scores_equal_padded(tiny_model, monkeypatch):
    from turborlhf.models.forward import token_values

    m = load_scalar_model(str(tiny_model)).eval()
    ids, attn, _ = _ppo_layout(seed=1)
    with torch.no_grad():
        v, s = token_values(m, ids, attn), last_token_scores(m, ids, attn)
        _padded_only(monkeypatch)
        v0, s0 = token_values(m, ids, attn), last_token_scores(m, ids, attn)
    assert torch.allclose(v * attn, v0 * attn, atol=1e-5) and torch.allclose(s, s0, atol=1e-5)


def test_packed_forward_under_bf16_autocast_is_close(tiny_model, monkeypatch):
    m = load_causal_lm(str(tiny_model))
    ids, attn, target = _ppo_layout(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = response_logprobs(m, ids, attn, target)
        _padded_only(monkeypatch)
        lp0, _ = response_logprobs(m, ids, attn, target)
    assert (lp - lp0).abs().max() < 0.05 * lp0.abs().max()


def test_packed_bf16_autocast_with_grad_takes_the_matmul_path(tiny_model, monkeypatch):
    """fp32 master weights under bf16 autocast: the rotary embedding hands fp32 queries to the
    attention, which still computes in bf16, so short packed sequences with grad take the padded
    matmul path (not per-sequence flash attention, whose CPU backward is slow in bf16); fp32
    training and no-grad passes go one sequence at a time."""
    import turborlhf.models.attention as A

    m = load_causal_lm(str(tiny_model))
    ids, attn, target = _ppo_layout(seed=2)
    calls = []
    real_seq = A._per_sequence_attention
    monkeypatch.setattr(A, "_per_sequence_attention", lambda *a, **k: calls.append("seq") or real_seq(*a, **k))
    real_apply = A._SoftmaxAttention.apply
    monkeypatch.setattr(A._SoftmaxAttention, "apply", lambda *a: calls.append("matmul") or real_apply(*a))
    n = m.config.num_hidden_layers
    with torch.autocast("cpu", dtype=torch.bfloat16):
        response_logprobs(m, ids, attn, target)[0].sum().backward()
        assert calls == ["matmul"] * n
        calls.clear()
        with torch.no_grad():
            response_logprobs(m, ids, attn, target)
        assert calls == ["seq"] * n
    calls.clear()
    response_logprobs(m, ids, attn, target)[0].sum().backward()
    assert calls == ["seq"] * n


def test_sdpa_models_are_not_packed(tiny_model):
    from turborlhf.models.forward import packs_sequences

    m = load_causal_lm(str(tiny_model))
    m.set_attn_implementation("sdpa")        # its mask builder would let packed sequences attend to each other
    assert not packs_sequences(m.model)


def test_packed_forward_with_gradient_checkpointing_equals_padded(tiny_model, monkeypatch):
    """The varlen arguments reach every layer through transformers' checkpointed layers too."""
    from turborlhf.models.load import enable_checkpointing

    m = load_causal_lm(str(tiny_model))
    enable_checkpointing(m)
    ids, attn, target = _ppo_layout(seed=3)
    response_logprobs(m, ids, attn, target)[0].sum().backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    _padded_only(monkeypatch)
    response_logprobs(m, ids, attn, target)[0].sum().backward()
    for k, p in m.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-5), k


def test_score_head_runs_in_fp32_under_bf16_autocast(tiny_model):
    """Under autocast the head's output must not be rounded to bf16 (close pairs would tie)."""
    from turborlhf.engine.train import autocast
    from turborlhf.models.forward import hidden_states

    m = load_scalar_model(str(tiny_model)).eval()
    with torch.no_grad():
        m.score.weight.mul_(100.0)  # scores of a few units, where bf16 steps are 2^-7..2^-5
        ids, attn = pad_batch([[1, 5, 9, 11, 13], [1, 4, 6], [2, 3], [9, 9, 9, 9]], 0)
        with autocast("bf16"):
            s = last_token_scores(m, ids, attn)
            h = hidden_states(m, ids, attn)
        ref = torch.nn.functional.linear(h[torch.arange(4), attn.sum(1) - 1].float(), m.score.weight).squeeze(-1)
    assert s.dtype == torch.float32
    assert torch.equal(s, ref)
    assert not torch.equal(s, s.bfloat16().float())  # not on the bf16 grid


# ----------------------------------------------------------------------------------------------
# Shared prompts: the G responses to one prompt compute it once, with the same results
# ----------------------------------------------------------------------------------------------

def _group_layout(seed=0, G=3):
    """PPO layout with groups of G rows sharing a left-padded prompt (one response empty), plus a
    prompt of its own in the last row."""
    g = torch.Generator().manual_seed(seed)
    P, R = 9, 6
    prompts = [torch.randint(3, 500, (k,), generator=g) for k in (9, 4, 6)]
    groups = [(p, G) for p in prompts] + [(torch.randint(3, 500, (2,), generator=g), 1)]
    B = sum(n for _, n in groups)
    ids, attn = torch.zeros(B, P + R, dtype=torch.long), torch.zeros(B, P + R, dtype=torch.long)
    b = 0
    for prompt, n in groups:
        for _ in range(n):
            ids[b, P - len(prompt):P], attn[b, P - len(prompt):P] = prompt, 1
            r = 0 if b == 1 else int(torch.randint(1, R + 1, (1,), generator=g))
            ids[b, P:P + r], attn[b, P:P + r] = torch.randint(3, 500, (r,), generator=g), 1
            b += 1
    target = torch.zeros(B, P + R)
    target[:, P:] = attn[:, P:]
    return ids, attn, target


def _count_packed(monkeypatch):
    import turborlhf.models.forward as F

    packed = []
    real = F.SegmentPlan.__init__
    monkeypatch.setattr(F.SegmentPlan, "__init__", lambda self, q, k, pos: packed.append(pos.shape[0]) or real(self, q, k, pos))
    return packed


def test_shared_prompts_equal_separate_rows_with_gradients(tiny_model, monkeypatch):
    m = load_causal_lm(str(tiny_model))
    ids, attn, target = _group_layout()
    packed = _count_packed(monkeypatch)
    lp, ent = response_logprobs(m, ids, attn, target, with_entropy=True, entropy_grad=True, share_prompts=True)
    (lp.sum() + ent.sum()).backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    # each of the 3 shared prompts computed once: 2 × (9 + 4 + 6) fewer tokens than the rows hold
    assert packed == [int(attn.sum()) - 2 * (9 + 4 + 6)]
    m.zero_grad()
    lp0, ent0 = response_logprobs(m, ids, attn, target, with_entropy=True, entropy_grad=True)
    (lp0.sum() + ent0.sum()).backward()
    assert torch.allclose(lp, lp0, atol=1e-5) and torch.allclose(ent, ent0, atol=1e-5)
    assert (lp[target == 0] == 0).all() and (lp[target == 1] != 0).all()
    for k, p in m.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-5), k
    with torch.no_grad():                              # without grad the attention is SDPA's
        assert torch.allclose(response_logprobs(m, ids, attn, target, share_prompts=True)[0], lp0, atol=1e-5)
    assert len(packed) == 2


def test_shared_prompts_under_bf16_autocast_and_checkpointing(tiny_model, monkeypatch):
    from turborlhf.models.load import enable_checkpointing

    m = load_causal_lm(str(tiny_model))
    enable_checkpointing(m)
    ids, attn, target = _group_layout(seed=1, G=4)
    packed = _count_packed(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = response_logprobs(m, ids, attn, target, share_prompts=True)
        lp.sum().backward()
        grads = {k: p.grad.clone() for k, p in m.named_parameters()}
        m.zero_grad()
        lp0, _ = response_logprobs(m, ids, attn, target)
        lp0.sum().backward()
    assert len(packed) == 1
    assert (lp - lp0).abs().max() < 0.05 * lp0.abs().max()
    for k, p in m.named_parameters():
        assert (grads[k] - p.grad).abs().max() <= 0.05 * p.grad.abs().max() + 1e-6, k


def test_shared_prompts_fall_back_where_nothing_is_shared(tiny_model, monkeypatch):
    import turborlhf.models.forward as F

    m = load_causal_lm(str(tiny_model)).eval()
    packed = _count_packed(monkeypatch)
    ids, attn, target = _ppo_layout()                  # four different prompts
    with torch.no_grad():
        assert torch.equal(response_logprobs(m, ids, attn, target, share_prompts=True)[0],
                           response_logprobs(m, ids, attn, target)[0])
        ids, attn, target = _group_layout(seed=2)
        monkeypatch.setattr(F, "packs_sequences", lambda backbone: False)   # e.g. a GPU attention kernel
        assert torch.allclose(response_logprobs(m, ids, attn, target, share_prompts=True)[0],
                              response_logprobs(m, ids, attn, target)[0], atol=1e-5)
    assert packed == []


def test_segment_mask_keeps_responses_apart_and_windows():
    from turborlhf.models.forward import SegmentPlan

    # packed: prompt 0-1 (positions 0, 1), response a 2-3 (2, 3), response b 4 (2); segments in the
    # order prompt, b, a
    pos = torch.tensor([0, 1, 2, 3, 2])
    plan = SegmentPlan([torch.tensor([0, 1]), torch.tensor([4]), torch.tensor([2, 3])],
                       [torch.tensor([0, 1]), torch.tensor([0, 1, 4]), torch.tensor([0, 1, 2, 3])], pos)
    m = plan.mask()[:, 0].int()
    assert m[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0]]
    assert m[1].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]          # pad query slot: every valid key
    assert m[2].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert plan.mask(window=2)[2, 0].int().tolist() == [[0, 1, 1, 0], [0, 0, 1, 1]]
    assert plan.out_slot_N.tolist() == [0, 1, 4, 5, 2]            # slot s·Q + q of each packed token


def _scaled_logit_model(tmp_path, kind: str):
    """A tiny model whose causal-LM class transforms its head's output: Gemma2 caps the logits
    (final_logit_softcapping), Granite divides them (logits_scaling), Cohere multiplies them
    (logit_scale). Embeddings enlarged so the logits reach the cap's range."""
    from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig

    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = {"gemma2": lambda: Gemma2Config(**base, head_dim=16, sliding_window=64, final_logit_softcapping=5.0),
           "granite": lambda: GraniteConfig(**base, logits_scaling=8.0),
           "cohere": lambda: CohereConfig(**base, logit_scale=0.25)}[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval(), load_causal_lm(str(tmp_path))


@pytest.mark.parametrize("kind", ["gemma2", "granite", "cohere"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_model_classes_own_logits(tmp_path, kind, temperature):
    """The log-probs were the bare head's: Gemma2's soft cap, Granite's and Cohere's logit scales
    were left out (9 nats per token off on a Gemma2 with logits of ~24), so SFT/DPO/PPO trained
    another distribution than the model samples from. Now equal to HF's logits / temperature,
    with the entropy, and its gradient path too."""
    ref, model = _scaled_logit_model(tmp_path, kind)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    attn, tgt = torch.ones_like(ids), torch.zeros_like(ids)
    tgt[:, 4:] = 1
    with torch.no_grad():
        logits = ref(input_ids=ids).logits[:, :-1].float() / temperature
    logp_hf = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent_hf = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    sel = tgt[:, 1:].bool()
    with torch.no_grad():
        lp, ent = response_logprobs(model.eval(), ids, attn, tgt, with_entropy=True, temperature=temperature)
    torch.testing.assert_close(lp[:, 1:][sel], logp_hf[sel], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent[:, 1:][sel], ent_hf[sel], rtol=1e-4, atol=1e-4)
    lp, ent = response_logprobs(model, ids, attn, tgt, with_entropy=True, entropy_grad=True, temperature=temperature)
    torch.testing.assert_close(lp[:, 1:][sel].detach(), logp_hf[sel], rtol=1e-4, atol=1e-4)


def test_an_unknown_logit_scale_is_refused(tmp_path):
    from turborlhf.models.forward import final_logit_transform

    _, model = _scaled_logit_model(tmp_path, "granite")
    model.config.model_type = "granite_future"
    with pytest.raises(ValueError, match="logits_scaling=8.0"):
        final_logit_transform(model)


def test_reference_logps_equal_the_training_forward_under_bf16(tiny_model, tiny_data):
    """DPO/KTO compare the policy's training forward (with grad: the matmul attention path under
    bf16) with reference log-probs cached without grad. Those ran SDPA and rounded differently:
    on SmolLM2-135M in bf16 0.36 nats per sequence on average (0.92 at most), so at step 1 the
    implicit rewards were not 0 and the DPO loss not ln 2. `sequence_logps` now chooses the
    training forward's kernels: same numbers, whatever the batching."""
    import warnings

    from turborlhf.data.loaders import load_pairs
    from turborlhf.data.tokenize import encode_pair
    from turborlhf.models.forward import sequence_logps, summed_logps
    from turborlhf.models.load import load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    pairs = load_pairs(tiny_data / "train_pairs.jsonl", tok)[:8]
    seqs = [s for p in pairs for s in encode_pair(tok, p["prompt"], p["chosen"], p["rejected"], 96).values()]
    m = load_causal_lm(str(tiny_model), tok).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # bf16 emulated on a CPU without it: slower, same numbers
        cached = sequence_logps(m, tok.pad_token_id, seqs, "bf16", batch_size=16)
        trained = torch.cat([summed_logps(m, tok.pad_token_id, seqs[s:s + 4], "bf16")[0].detach()
                             for s in range(0, len(seqs), 4)])
    assert m.training and torch.equal(cached, trained), float((cached - trained).abs().max())


def test_a_4bit_policys_reference_cache_is_not_read_by_a_full_precision_run(tiny_model, tiny_data, tmp_path,
                                                                             monkeypatch):
    """A QLoRA policy (4-bit base) computes its own reference log-probs; a run reusing the directory
    without load_in_4bit (or the converse) must compute its own, not read the other's."""
    from turborlhf.data.loaders import load_pairs
    from turborlhf.data.tokenize import encode_pair
    from turborlhf.models import reference as R
    from turborlhf.models.load import load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    pairs = load_pairs(tiny_data / "train_pairs.jsonl", tok)[:2]
    sets = {"train": [s for p in pairs for s in encode_pair(tok, p["prompt"], p["chosen"], p["rejected"], 64).values()]}
    m = load_causal_lm(str(tiny_model), tok)
    computed = []
    real = R.compute_reference_logps
    monkeypatch.setattr(R, "compute_reference_logps", lambda *a, **k: computed.append(1) or real(*a, **k))
    for in_4bit in (True, False, False, True):
        m.is_loaded_in_4bit = in_4bit             # what transformers sets on a bitsandbytes 4-bit model
        R.reference_logps(tmp_path, str(tiny_model), tok, sets, "fp32", 4, initial_policy=m)
    assert len(computed) == 3        # the second full-precision call reads the first's cache
