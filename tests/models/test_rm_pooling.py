"""A saved reward model scores the same in plain transformers as in turborlhf, on every supported
architecture: with a tokenizer that pads with its EOS (Llama-3 style, no spare token), and
through the packed chosen+rejected path the RM trainer and eval-rm use (Gemma2: eager attention
with logit soft-capping, sliding-window layers, scaled embeddings)."""
import json
import random

import pytest
import torch

from turborlhf.models.load import load_scalar_model, load_tokenizer
from turborlhf.rewards.model import encode_pairs, pair_scores, score_texts

PROMPTS = ["hello there how are you doing today", "tell me a story about a dog",
           "what is the answer", "hi"]
CHOSEN = ["I am fine, thanks for asking. The day is good.", "Once upon a time a dog ran.", "Yes.", "Hello!"]
REJECTED = ["bad", "no story today, sorry, I do not know any good one", "Yes.", ""]


def _eos_pad_tokenizer():
    """The tiny ChatML tokenizer without its unk token, so `load_tokenizer` keeps pad = EOS."""
    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.unk_token = None
    assert tok.pad_token_id == tok.eos_token_id
    return tok


def _config(arch: str, tok):
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    from turborlhf.models.tiny import tiny_llama_config

    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **ids)
    if arch == "llama":
        cfg = tiny_llama_config(len(tok), **ids)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "qwen2-sliding":       # every layer slides over 6 tokens (shorter than the pairs)
        cfg = Qwen2Config(use_sliding_window=True, sliding_window=6, max_window_layers=0, **common)
    elif arch == "mistral":
        cfg = MistralConfig(sliding_window=6, head_dim=16, **common)
    elif arch == "gemma2":              # alternating sliding (6 tokens) / full layers, soft-capping
        cfg = Gemma2Config(head_dim=16, sliding_window=6, query_pre_attn_scalar=16, **common)
    else:
        raise ValueError(arch)
    cfg.num_labels = 1
    return cfg


def _save_rm(arch: str, out, tok) -> str:
    """A randomly initialised reward model (head scaled up so scores spread) and `tok`, saved."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(_config(arch, tok))
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _hf_scores(model_dir: str, prompts, responses) -> torch.Tensor:
    """Plain transformers: prompt + response + EOS, right-padded by the saved tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    texts = [p + r + tok.eos_token for p, r in zip(prompts, responses)]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        return model(**batch).logits[:, 0].float()


def _rendered(tok):
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-sliding", "mistral", "gemma2"])
def test_saved_rm_scores_like_transformers(arch, tmp_path):
    model_dir = _save_rm(arch, tmp_path / arch, _eos_pad_tokenizer())
    tok = load_tokenizer(model_dir)
    assert tok.pad_token_id == tok.eos_token_id      # the case under test
    model = load_scalar_model(model_dir, tok).eval()
    prompts = _rendered(tok)
    hf = _hf_scores(model_dir, prompts + prompts, CHOSEN + REJECTED)
    ours = score_texts(model, tok, prompts + prompts, CHOSEN + REJECTED, max_len=256, dtype="fp32")
    assert torch.allclose(ours, hf, atol=1e-5), (ours, hf)
    enc = encode_pairs(tok, [{"prompt": p, "chosen": c, "rejected": r}
                             for p, c, r in zip(prompts, CHOSEN, REJECTED)], 256)
    n = len(prompts)
    with torch.no_grad():
        packed = torch.cat(pair_scores(model, tok, enc, "fp32", shared_prefix=True))
        unpacked = torch.cat(pair_scores(model, tok, enc, "fp32", shared_prefix=False))
    assert torch.allclose(unpacked, hf, atol=1e-5), (unpacked, hf)
    assert torch.allclose(packed, hf, atol=1e-5), (packed, hf)
    assert hf[:n].sub(hf[n:]).abs().max() > 1e-3             # the pairs are told apart at all
    # bf16 (the trainers' default): packed and unpacked agree to bf16 rounding
    with torch.no_grad():
        p16 = torch.cat(pair_scores(model, tok, enc, "bf16", shared_prefix=True))
        u16 = torch.cat(pair_scores(model, tok, enc, "bf16", shared_prefix=False))
    assert torch.allclose(p16, u16, atol=0.03 * float(hf.abs().max()) + 1e-3), (p16, u16)


def test_packed_pair_whose_continuation_is_only_eos(tmp_path):
    """With pad = EOS a response of no tokens is read at the prompt's last token, which the packed
    layout holds in the shared prefix."""
    model_dir = _save_rm("llama", tmp_path / "rm", _eos_pad_tokenizer())
    tok = load_tokenizer(model_dir)
    model = load_scalar_model(model_dir, tok).eval()
    p = _rendered(tok)[0]
    enc = encode_pairs(tok, [{"prompt": p, "chosen": "", "rejected": "Sure."},
                             {"prompt": p, "chosen": "Sure.", "rejected": ""}], 256)
    with torch.no_grad():
        packed = torch.cat(pair_scores(model, tok, enc, "fp32", shared_prefix=True))
    hf = _hf_scores(model_dir, [p] * 4, ["", "Sure.", "Sure.", ""])
    assert torch.allclose(packed, hf, atol=1e-5), (packed, hf)


def test_trained_rm_with_eos_pad_matches_transformers(tmp_path, tiny_data):
    """`turborlhf rm` on a pad = EOS model, then eval-rm's scores equal plain transformers'."""
    from tests.e2e.helpers import REPO, run_cli
    from turborlhf.evaluate import eval_rm
    from turborlhf.models.tiny import save_tiny_causal_lm

    base = save_tiny_causal_lm(tmp_path / "base", seed=0)
    _eos_pad_tokenizer().save_pretrained(base)
    out = tmp_path / "rm"
    run_cli("rm", "--config", REPO / "configs/tiny/rm.yaml", f"model.name_or_path={base}",
            f"data.train_file={tiny_data / 'train_pairs.jsonl'}", "data.max_samples=16", "train.max_steps=2",
            f"output_dir={out}")
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == _eos_pad_tokenizer().eos_token_id
    pairs = [json.loads(line) for line in (tiny_data / "test_pairs.jsonl").read_text().splitlines()[:12]]
    test_file = tmp_path / "pairs.jsonl"
    test_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    res = eval_rm(str(out), str(test_file), max_len=96, dtype="fp32")
    tok = load_tokenizer(str(out))
    enc = encode_pairs(tok, pairs, 96)
    # plain transformers on the very token ids eval-rm scored (same truncation)
    from transformers import AutoModelForSequenceClassification

    hf_model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        hf = [float(hf_model(input_ids=torch.tensor([e[k]])).logits[0, 0]) for e in enc for k in ("chosen", "rejected")]
    ch, rj = torch.tensor(hf[0::2]), torch.tensor(hf[1::2])
    assert res["accuracy"] == pytest.approx(float((ch > rj).float().mean()))
    assert res["margin"] == pytest.approx(float((ch - rj).mean()), abs=1e-5)
    assert res["score_mean"] == pytest.approx(float(torch.cat([ch, rj]).mean()), abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_ppo_reward_source_scores_like_transformers(arch, tmp_path):
    """PPO's in-process `model` reward source on the rollout layout (left-padded prompts,
    right-padded responses, pad = EOS; one response cut without EOS) equals plain transformers
    on each sequence alone."""
    from transformers import AutoModelForSequenceClassification

    from turborlhf.rewards.combine import RewardInputs, _ModelSource

    model_dir = _save_rm(arch, tmp_path / arch, _eos_pad_tokenizer())
    tok = load_tokenizer(model_dir)
    eos = tok.eos_token_id
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in _rendered(tok)]
    responses = [tok(r, add_special_tokens=False)["input_ids"] + [eos] for r in CHOSEN]
    responses[1] = responses[1][:-1]                                  # cut at the token budget: no EOS
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), P + R), eos)
    attn = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P], ids[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        attn[i, P - len(p):P + len(r)] = 1
    source = _ModelSource(model_dir, tok, "fp32", chunk=2)
    ours = source(RewardInputs(ids, attn, prompts, responses, tok))
    hf_model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        hf = torch.tensor([float(hf_model(input_ids=torch.tensor([p + r])).logits[0, 0])
                           for p, r in zip(prompts, responses)])
    assert torch.allclose(ours, hf, atol=1e-5), (ours, hf)


def test_encode_pairs_cuts_one_shared_prompt_and_the_rm_plan_groups_packed_lengths():
    """A pair whose long response leaves less room for the prompt: both sides keep the same
    prompt tokens (so the packed row computes them once, and the scores compare the responses in
    one context); `plan_pair_steps` sorts each step's pairs by packed row length."""
    from types import SimpleNamespace

    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.models.forward import packed_pair_len, shared_prefix_len
    from turborlhf.trainers.reward_model import plan_pair_steps

    tok = make_tiny_tokenizer()
    prompt = " ".join(["the dog ran home"] * 12)
    long_reply, short_reply = " ".join(["a cat sat"] * 10), "no"
    enc = encode_pairs(tok, [{"prompt": prompt, "chosen": short_reply, "rejected": long_reply}], 48)[0]
    c, r = enc["chosen"], enc["rejected"]
    assert len(r) == 48 and len(c) < 48                     # only the longer side fills the budget
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    n_prompt = shared_prefix_len(c, r)
    assert c[:n_prompt] == r[:n_prompt] == p_ids[len(p_ids) - n_prompt:]   # the same prompt suffix
    assert n_prompt >= 48 - len(tok(long_reply, add_special_tokens=False)["input_ids"]) - 1
    assert packed_pair_len(c, r) == len(c) + len(r) - n_prompt

    pairs = [{"prompt": prompt[: 8 + 7 * i], "chosen": "yes " * (i % 5), "rejected": "no"} for i in range(24)]
    encoded = encode_pairs(tok, pairs, 64)
    lens = [packed_pair_len(e["chosen"], e["rejected"]) for e in encoded]
    plan = plan_pair_steps(encoded, SimpleNamespace(pairs_per_step=4, epochs=1.0, max_steps=0, seed=3))
    assert sorted(i for step in plan for i in step) == list(range(24))
    assert all([lens[i] for i in step] == sorted(lens[i] for i in step) for step in plan)


def test_score_pairs_batches_the_rows_it_builds_by_their_length(monkeypatch):
    """The evaluation's batches hold pairs of similar row length: packed length (prompt once) for
    a model that packs pairs, the longer sequence for one that does not. Sorted by the summed
    lengths instead, long prompts with short replies and short prompts with long replies shared
    batches and padded each other. Scores come back in the pairs' order."""
    from turborlhf.models.forward import packed_pair_len
    from turborlhf.trainers import reward_model

    rng = random.Random(0)
    pairs = []
    for i in range(40):
        p = [5 + rng.randrange(3)] * rng.randrange(1, 60)
        pairs.append({"chosen": p + [1] * rng.randrange(1, 60), "rejected": p + [2] * rng.randrange(1, 60), "i": i})
    batches = []

    def fake_pair_scores(model, tok, batch, dtype):
        batches.append(batch)
        return torch.tensor([float(e["i"]) for e in batch]), -torch.tensor([float(e["i"]) for e in batch])

    monkeypatch.setattr(reward_model, "pair_scores", fake_pair_scores)
    for packs, row_len in ((True, lambda e: packed_pair_len(e["chosen"], e["rejected"])),
                           (False, lambda e: max(len(e["chosen"]), len(e["rejected"])))):
        model = torch.nn.Linear(1, 1)
        model._turborlhf_shares_prefixes = packs
        batches.clear()
        ch, rj = reward_model.score_pairs(model, None, pairs, "fp32", 8)
        assert ch.tolist() == [float(i) for i in range(40)] and rj.tolist() == [-float(i) for i in range(40)]
        spans = [(min(map(row_len, b)), max(map(row_len, b))) for b in batches]
        assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), spans   # no two batches overlap


def test_a_bf16_score_head_scores_in_fp32():
    """A frozen reward model loaded in bf16 (rejection sampling, conditional SFT, eval-policy)
    computed its head in bf16: every score was rounded to 8 significant bits, so best-of-n ties
    and quantile bins collapsed."""
    from torch import nn

    from turborlhf.models.forward import apply_score_head

    torch.manual_seed(0)
    model = nn.Module()
    model.score = nn.Linear(64, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.score.weight.mul_(20)
    hidden = torch.randn(32, 64).to(torch.bfloat16)
    scores = apply_score_head(model, hidden)
    want = hidden.double() @ model.score.weight.double().t()
    assert scores.dtype == torch.float32
    assert torch.allclose(scores.double(), want.squeeze(-1), rtol=1e-5, atol=1e-5)
    assert not torch.equal(scores, scores.to(torch.bfloat16).float())


def test_a_reward_model_saved_with_pad_eos_scores_as_transformers_does(tmp_path):
    """A reward model trained with pad = EOS (TRL's usual set-up) pools the token before the
    trailing EOS. Loading it for scoring rewrote its config.pad_token_id to the tokenizer's unk,
    so serve-rm and PPO's reward source read the EOS: −0.137 where transformers gives 0.076."""
    from transformers import AutoModelForSequenceClassification

    from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer
    from turborlhf.models.tiny import tiny_llama_config
    from turborlhf.rewards.server import RMScorer

    tok = make_tiny_tokenizer()
    assert tok.pad_token_id == tok.eos_token_id
    cfg = tiny_llama_config(len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, num_labels=1)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    prompt, response = "Human: hi\n\nAssistant:", " hello there"
    ids = tok(prompt + response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, 0].item()
    got = RMScorer(str(tmp_path), dtype="fp32", device="cpu")([prompt], [response])[0]
    assert got == pytest.approx(want, abs=1e-5)
