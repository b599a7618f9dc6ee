"""Shared frozen trunks: models that hold the same frozen lower layers compute them once per sequence.

In the standard RLHF recipe the reference is the SFT model, the reward model starts from the SFT
model, and the critic starts from the reward model. With freeze tuning (``model.freeze_layers``,
``critic.freeze_layers``) their embeddings and lower N decoder layers stay exactly the SFT
model's, and PPO runs all three over the same rollout sequences: three times the same lower
layers on the same tokens, and a fourth time in the critic's update. `share_frozen_trunk` finds
such models (bit-for-bit equal, frozen lower layers) and gives them one `TrunkCache`;
`turborlhf.models.forward.hidden_states` then runs the lower layers once per sequence and only
the upper layers per model. The results are those of running each model whole (to float
rounding of a different batch composition, as for any change of batching).

What may share (`trunk_layers`): decoder stacks whose forward starts from the token embeddings
unchanged (Llama, Mistral, Qwen2/3; Gemma scales its embeddings and is left out), without
dropout, with one kind of attention in every layer (not Qwen's mix of full and sliding-window
layers, whose mask follows the layer's index), on one device, with the same parameter dtype and
the same layer settings (`COMPUTE_KEYS` of the config: norm epsilon, activation, attention
implementation...), whose embeddings and shared layers are frozen (``requires_grad`` False) and
equal. LoRA-wrapped layers differ by name and do not share. Sharing is per process (the PPO
driver's local backend).

The models of a group also hold those frozen weights once (`share_frozen_weights`): the later
members' embeddings and shared layers become the first member's tensors.

The cache keeps the layer-N hidden states of each sequence (its real tokens are the key, with the
autocast state) up to `TrunkCache.max_bytes`, least recently used first out; the PPO driver
clears it at each step's experience.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from typing import Optional, Sequence

import torch
from torch import nn

from turborlhf.models.load import backbone_of, decoder_layers

__all__ = ["TrunkCache", "trunk_layers", "share_frozen_trunk", "share_frozen_weights", "unshare", "clear_trunk_caches",
           "running_layers", "trunk_hidden_states"]

#: model types whose decoder stack feeds ``inputs_embeds`` to the first layer unchanged
SHAREABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_CACHES: "weakref.WeakSet[TrunkCache]" = weakref.WeakSet()


class TrunkCache:
    """Hidden states after the first `n_layers` decoder layers, per sequence (``T_real×H``
    tensors keyed by the autocast state and the sequence's real token ids), for the models that
    share those layers. Holds at most `max_bytes` (least recently used evicted); `hits` and
    `misses` count sequences looked up. Thread-safe: PPO's asynchronous rollouts score with a
    reward model on a background thread while the critic, sharing its trunk, trains."""

    def __init__(self, n_layers: int, max_bytes: int = 1 << 30) -> None:
        self.n_layers, self.max_bytes = n_layers, max_bytes
        self._rows: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = 0
        _CACHES.add(self)

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self.bytes = 0

    def get(self, key: tuple) -> Optional[torch.Tensor]:
        with self._lock:
            h = self._rows.get(key)
            if h is not None:
                self._rows.move_to_end(key)
            return h

    def put(self, key: tuple, h: torch.Tensor) -> None:
        with self._lock:
            if key in self._rows:
                return
            self._rows[key] = h
            self.bytes += h.numel() * h.element_size()
            while self.bytes > self.max_bytes and len(self._rows) > 1:
                _, old = self._rows.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._rows)


def clear_trunk_caches() -> None:
    """Empty every `TrunkCache` of this process (the PPO driver: a new rollout batch)."""
    for c in list(_CACHES):
        c.clear()


@contextlib.contextmanager
def running_layers(backbone: nn.Module, lo: int, hi: int):
    """Inside the block, `backbone`'s forward runs decoder layers ``lo..hi-1`` only, and skips the
    final norm unless ``hi`` is the last layer: its output is then the hidden state after layer
    ``hi-1``, and with ``inputs_embeds`` = that state a second call over ``hi..L-1`` finishes the
    stack. The layer list is restored on exit."""
    layers, norm = backbone.layers, backbone.norm
    backbone.layers = nn.ModuleList(list(layers)[lo:hi])
    if hi < len(layers):
        backbone.norm = nn.Identity()
    try:
        yield
    finally:
        backbone.layers, backbone.norm = layers, norm


# config settings that change what a decoder layer computes from equal weights
COMPUTE_KEYS = ("hidden_act", "rms_norm_eps", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
                "partial_rotary_factor", "attn_logit_softcapping", "query_pre_attn_scalar", "_attn_implementation")


def _shareable(model: nn.Module) -> bool:
    backbone = backbone_of(model)
    cfg = getattr(backbone, "config", None)
    kinds = set(getattr(cfg, "layer_types", None) or ())
    return (getattr(cfg, "model_type", None) in SHAREABLE_MODEL_TYPES and not hasattr(model, "get_base_model")
            and isinstance(getattr(backbone, "layers", None), nn.ModuleList) and hasattr(backbone, "norm")
            and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) == 0.0 and len(kinds) <= 1)


def _same_settings(a: nn.Module, b: nn.Module) -> bool:
    ca, cb = getattr(a, "config", None), getattr(b, "config", None)
    return all(getattr(ca, k, None) == getattr(cb, k, None) for k in COMPUTE_KEYS)


def _frozen_equal(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        return False
    for k, x in pa.items():
        y = pb[k]
        if x.requires_grad or y.requires_grad or x.dtype != y.dtype or x.device != y.device or x.shape != y.shape:
            return False
        try:
            if not torch.equal(x, y):
                return False
        except (RuntimeError, TypeError):          # sharded parameters (FSDP's DTensors): not shared
            return False
    return True


def trunk_layers(a: nn.Module, b: nn.Module) -> int:
    """How many leading decoder layers `a` and `b` share, frozen and bit-for-bit equal together
    with their input embeddings (0 when they cannot share at all; see the module docstring).
    At most L - 1: each model keeps at least its last layer of its own."""
    if not (_shareable(a) and _shareable(b)):
        return 0
    ba, bb = backbone_of(a), backbone_of(b)
    if (type(ba) is not type(bb) or not _same_settings(ba, bb)
            or not _frozen_equal(ba.get_input_embeddings(), bb.get_input_embeddings())):
        return 0
    if getattr(ba, "rotary_emb", None) is not None:
        ra, rb = ba.rotary_emb, bb.rotary_emb
        same_scale = getattr(ra, "attention_scaling", 1) == getattr(rb, "attention_scaling", 1)
        if not (same_scale and torch.equal(ra.inv_freq, rb.inv_freq)):
            return 0
    la, lb = decoder_layers(a), decoder_layers(b)
    n = 0
    while n < min(len(la), len(lb)) - 1 and _frozen_equal(la[n], lb[n]):
        n += 1
    return n


def share_frozen_trunk(models: Sequence[nn.Module], max_bytes: int = 1 << 30) -> list[tuple[list[int], int]]:
    """Give the models that share frozen lower layers (`trunk_layers`) one `TrunkCache`, attached
    to their decoder stacks. Models are grouped with the first earlier model they share at least
    one layer with; a group shares the fewest layers any member shares with its first. Returns
    ``[(indices into models, shared layers), ...]`` for the groups of two or more (empty: nothing
    shared)."""
    groups: list[dict] = []                       # {"idx": [model indices], "n": shared layers}
    for i, m in enumerate(models):
        for g in groups:
            n = trunk_layers(models[g["idx"][0]], m)
            if n > 0:
                g["idx"].append(i)
                g["n"] = min(g["n"], n)
                break
        else:
            groups.append({"idx": [i], "n": len(decoder_layers(m))})
    out = []
    for g in groups:
        if len(g["idx"]) > 1:
            cache = TrunkCache(g["n"], max_bytes)
            for i in g["idx"]:
                backbone_of(models[i])._turborlhf_trunk = cache
                if i != g["idx"][0]:
                    share_frozen_weights(models[g["idx"][0]], models[i], g["n"])
            out.append((g["idx"], g["n"]))
    return out


def share_frozen_weights(leader: nn.Module, follower: nn.Module, n_layers: int) -> None:
    """Make `follower` hold `leader`'s parameter tensors for the input embeddings and the first
    `n_layers` decoder layers, which `trunk_layers` found frozen and equal bit for bit: the values
    are those it had, held once. Every owner in `follower` is re-pointed (a tied LM head with its
    embeddings); only plain `nn.Parameter`s are (not quantized ones). On the CPU the follower's
    other parameters then get their own copy (`.data` replaced; the `Parameter` objects, which an
    optimizer holds, stay): transformers maps the checkpoint file into memory and each tensor is a
    view of that mapping, so the mapping and its resident pages (the shared layers' included) are
    released only once none is left. Peak RSS in fp32 (2-core AVX2-only EPYC): the PPO bench
    (reference and reward model from one base, 29 layers) 6.61 → 6.12 GiB; the demo's PPO stage
    (actor, reference, reward model and critic freeze-tuned from one SFT model, 15 of 30 layers)
    3.86 → 2.97 GiB."""
    pairs = [(backbone_of(leader).get_input_embeddings(), backbone_of(follower).get_input_embeddings())]
    pairs += list(zip(decoder_layers(leader)[:n_layers], decoder_layers(follower)[:n_layers]))
    swap: dict[int, nn.Parameter] = {}
    for a, b in pairs:
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
            if (na == nb and type(pa) is nn.Parameter and type(pb) is nn.Parameter and pa is not pb
                    and not (pa.requires_grad or pb.requires_grad) and pa.dtype == pb.dtype
                    and pa.device == pb.device and pa.shape == pb.shape):
                swap[id(pb)] = pa
    for module in follower.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in swap:
                module._parameters[name] = swap[id(p)]
    held = {id(p) for p in swap.values()}
    with torch.no_grad():
        for p in follower.parameters():
            if id(p) not in held and p.device.type == "cpu":
                p.data = p.data.clone()


def unshare(model: nn.Module) -> None:
    """Detach `model` from its trunk cache (it runs whole again)."""
    backbone = backbone_of(model)
    if hasattr(backbone, "_turborlhf_trunk"):
        del backbone._turborlhf_trunk


def _to(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-made index on `device`, copied without waiting for the device's queue."""
    return index if device.type == "cpu" else index.to(device, non_blocking=True)


def trunk_hidden_states(backbone: nn.Module, cache: TrunkCache, input_ids_BT: torch.Tensor,
                        attention_mask_BT: torch.Tensor, position_ids_BT: torch.Tensor, stack) -> torch.Tensor:
    """Final hidden states ``B×T×H`` of `backbone` for a 2-D padding mask, with the first
    ``cache.n_layers`` layers read from `cache` per row (computed without grad for the rows it
    lacks, then kept). `stack(backbone, ids, mask, positions, embeds=None)` runs the decoder stack
    (`turborlhf.models.forward`); the upper layers run on the cached states as ``inputs_embeds``,
    so gradients reach the upper layers only (the shared ones are frozen)."""
    B, T = input_ids_BT.shape
    dev = input_ids_BT.device
    valid_BT = attention_mask_BT.bool()
    on = torch.is_autocast_enabled(dev.type)
    ctx = (str(dev), on, torch.get_autocast_dtype(dev.type) if on else None)
    # the keys need the tokens on the host: one copy from a GPU; every index below is then made on
    # the host and sent without waiting (a boolean-mask index of a device tensor per row waited for
    # the device each time)
    ids_cpu, valid_cpu = input_ids_BT.cpu(), valid_BT.cpu()
    keys = [(ctx, tuple(ids_cpu[b][valid_cpu[b]].tolist())) for b in range(B)]
    rows = [cache.get(k) for k in keys]
    miss = [b for b, h in enumerate(rows) if h is None]
    cache.hits += B - len(miss)
    cache.misses += len(miss)
    lens = valid_cpu.sum(-1).tolist()
    if miss:
        m = torch.tensor(miss)
        with torch.no_grad(), running_layers(backbone, 0, cache.n_layers):
            m_dev = _to(m, dev)
            low = stack(backbone, input_ids_BT[m_dev], attention_mask_BT[m_dev], position_ids_BT[m_dev])
        real = _to(valid_cpu[m].reshape(-1).nonzero().squeeze(1), dev)     # the missed rows' real tokens
        got = low.reshape(len(miss) * T, -1).index_select(0, real).split([lens[b] for b in miss])
        for b, h in zip(miss, got):
            rows[b] = h.clone()             # its own storage: the cache counts and drops rows one by one
            cache.put(keys[b], rows[b])
    flat = _to(valid_cpu.reshape(-1).nonzero().squeeze(1), dev)             # b·T + t of each real token
    embeds = rows[0].new_zeros(B * T, rows[0].shape[-1]).index_copy_(0, flat, torch.cat(rows)).view(B, T, -1)
    with running_layers(backbone, cache.n_layers, len(backbone.layers)):
        return stack(backbone, input_ids_BT, attention_mask_BT, position_ids_BT, embeds)
