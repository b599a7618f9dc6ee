"""Shared helpers for the rollout tests (unique module name: importable from any test dir)."""
import torch


def tiny_llama(seed: int = 0, tie: bool = True, **kw):
    """A tiny random Llama with weights large enough that greedy outputs vary."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tie, initializer_range=0.2, **kw)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 2, tie: bool = True):
    """A tiny random Qwen2 (q/k/v biases, drawn large so they matter), in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    q = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=512, initializer_range=0.2,
                                     tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for n, p in q.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return q
