"""Loading policies (causal LMs), critics and reward models (causal-LM backbone + scalar head).

Weights are kept in fp32 ("master weights"); compute runs under bf16 autocast when the config
says `dtype: bf16` (see `turborlhf.engine.train.autocast`). A critic or reward model is a
`AutoModelForSequenceClassification` with `num_labels=1`: built from a causal-LM directory it
gets a fresh scalar head `score` (normal(0, initializer_range)); built from a saved reward model
it is reloaded as is, so `AutoModelForSequenceClassification.from_pretrained(dir)` loads what we save.

Padding: when a tokenizer pads with its EOS token (SmolLM2 does), HF's sequence-classification
pooling ("rightmost token != pad_token_id") would skip the trailing EOS. We switch the pad token
to the tokenizer's unk token when it is distinct, and set `config.pad_token_id` accordingly, so
the saved reward model scores the EOS position. A tokenizer with no spare token (Llama-3 style:
no unk) keeps pad = EOS; our scoring then reads the token HF's pooling reads, the last one before
the trailing EOS (`turborlhf.models.forward.score_index`), so scores agree either way.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from turborlhf.errors import UserError
from turborlhf.models.attention import use_training_attention
from turborlhf.models.fused import use_fused_layers
from turborlhf.models.zoo import resolve_model_path

__all__ = ["load_tokenizer", "load_causal_lm", "load_scalar_model", "load_trainable", "backbone_of",
           "apply_lora", "is_lora", "merge_lora_for_save", "merged_named_parameters", "adapters_disabled",
           "quantization_config_4bit", "SCORE_STATS", "forget_score_stats"]

# config fields a reward model's final evaluation writes (`turborlhf.trainers.reward_model`, OpenRLHF's
# convention: consumers may normalise scores with them); true of the weights they were measured on only
SCORE_STATS = ("reward_mean", "reward_std")


def load_tokenizer(name_or_path: str):
    """Tokenizer with a pad token distinct from EOS when possible; right padding."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        if os.path.isdir(path):
            raise
        from turborlhf.models.zoo import ZOO, NotAModelError      # a mistyped path reads as a hub id

        raise NotAModelError(f"{name_or_path}: not a local directory, nor a zoo name ({', '.join(ZOO)}), and the "
                             f"hub did not give it ({str(e).strip().splitlines()[0]})") from None
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        if tok.unk_token_id is not None and tok.unk_token_id != tok.eos_token_id:
            tok.pad_token = tok.unk_token
        elif tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def _sync_special_ids(model, tok) -> None:
    if tok is None:
        return
    model.config.pad_token_id = tok.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tok.pad_token_id


class QLoRAUnavailable(UserError, RuntimeError):
    """``load_in_4bit`` on a machine that cannot run it: one line naming the field."""


def quantization_config_4bit(field: str = "model.load_in_4bit"):
    """`transformers.BitsAndBytesConfig` of QLoRA (Dettmers et al. 2023): NF4 weights, double
    quantisation of the block constants, bf16 compute. Raises `QLoRAUnavailable` (a RuntimeError
    and a `UserError` naming `field`) when this machine cannot run it (no CUDA device, or
    bitsandbytes not installed): bitsandbytes' 4-bit kernels are CUDA only in the versions
    documented for transformers' `load_in_4bit`."""
    import importlib.util

    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device is visible (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append("bitsandbytes is not installed (pip install 'turborlhf[qlora]')")
    if problems:
        raise QLoRAUnavailable(f"{field} (QLoRA) needs a CUDA GPU with bitsandbytes: " + "; ".join(problems)
                               + ". Use LoRA without load_in_4bit on this machine.")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def enable_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant torch checkpoint):
    transformers' ``activation_checkpointing_enable`` (5.x), or its older name
    ``gradient_checkpointing_enable``."""
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _from_pretrained(auto_cls, path: str, tokenizer, gradient_checkpointing: bool, dtype: torch.dtype,
                     load_in_4bit: bool = False, device: str | torch.device = "cpu", device_field: str = "device",
                     **kw) -> nn.Module:
    """`auto_cls.from_pretrained` plus the conventions of this module (special ids, no dropout,
    trainable padding row, gradient checkpointing, on CPU the short-sequence training attention of
    `turborlhf.models.attention`); weights loaded straight onto `device` (``auto``: see
    `turborlhf.engine.hardware.resolve_device`); 4-bit NF4 weights on the current CUDA device
    with `load_in_4bit` (then prepared for k-bit training with peft). A `HardwareError` for a device
    this host lacks names `device_field`, the setting `device` came from."""
    from turborlhf.engine.hardware import resolve_device

    device = resolve_device(device, device_field) if isinstance(device, str) else torch.device(device)
    if load_in_4bit:
        kw.update(quantization_config=quantization_config_4bit(), device_map={"": torch.cuda.current_device()})
    elif device.type != "cpu":
        kw.update(device_map={"": device})
    model = auto_cls.from_pretrained(path, dtype=dtype, **kw)
    use_training_attention(model)
    if not load_in_4bit and next(model.parameters()).device.type == "cpu":
        use_fused_layers(model)
    _sync_special_ids(model, tokenizer)
    _disable_dropout(model)
    _unfreeze_padding_row(model)
    if not load_in_4bit:            # packing, shared-prefix pairs and log-probs checked against the model's own
        from turborlhf.models.probe import check_training_forward

        check_training_forward(model, scalar=auto_cls.__name__.endswith("SequenceClassification"))
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    elif gradient_checkpointing:
        enable_checkpointing(model)
    if gradient_checkpointing:    # an export writes the model's own value back (checkpoint._write_hf)
        model._use_cache_before_checkpointing = model.config.use_cache
        model.config.use_cache = False
    return model


def check_causal_lm(path: str) -> None:
    """`NotAModelError` when the local model directory `path` holds a sequence-classification
    model (a reward model or critic: ``config.json``'s ``architectures``, or a peft adapter's
    ``SEQ_CLS`` task): loaded as a causal LM it gets a random LM head, whose samples and log-probs
    are noise. Anything else (a causal LM, a hub id, no config) passes."""
    import json

    from turborlhf.models.zoo import NotAModelError

    def read(name: str) -> dict:
        try:
            with open(os.path.join(path, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    archs = [a for a in read("config.json").get("architectures") or [] if a.endswith("ForSequenceClassification")]
    if archs or read("adapter_config.json").get("task_type") == "SEQ_CLS":
        raise NotAModelError(f"{path}: a reward model or critic ({', '.join(archs) or 'a SEQ_CLS adapter'}), not a "
                             "causal LM: as a policy its LM head would be random; give a policy directory")


def load_causal_lm(name_or_path: str, tokenizer=None, gradient_checkpointing: bool = False,
                   dtype: torch.dtype = torch.float32, load_in_4bit: bool = False,
                   device: str | torch.device = "cpu", device_field: str = "device") -> nn.Module:
    """Causal LM in `dtype` (fp32 master weights by default) on `device` (``"auto"``: cuda, mps,
    cpu), train mode off (call .train()). `load_in_4bit`: NF4 weights on the GPU (QLoRA; see
    `quantization_config_4bit`). Raises `NotAModelError` for a reward model's directory
    (`check_causal_lm`), `turborlhf.engine.hardware.HardwareError` for a device this host lacks,
    naming `device_field` (the setting `device` came from, e.g. ``actor.device``)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    check_causal_lm(path)
    return _from_pretrained(AutoModelForCausalLM, path, tokenizer, gradient_checkpointing, dtype, load_in_4bit,
                            device, device_field)


def load_scalar_model(name_or_path: str, tokenizer=None, gradient_checkpointing: bool = False,
                      dtype: torch.dtype = torch.float32, load_in_4bit: bool = False,
                      device: str | torch.device = "cpu", device_field: str = "device") -> nn.Module:
    """`AutoModelForSequenceClassification(num_labels=1)`: a reward model or critic, on `device`.

    From a causal-LM directory the head is new; from a saved reward model it is reloaded. Raises
    `turborlhf.models.zoo.NotAModelError` for an architecture transformers has no
    sequence-classification class for (Granite, OLMoE, CodeGen...);
    `turborlhf.engine.hardware.HardwareError` for a device this host lacks, naming `device_field`
    (the setting `device` came from, e.g. ``model.device``).
    """
    import logging

    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # "newly initialized: score.weight" is expected here
    try:
        return _from_pretrained(AutoModelForSequenceClassification, resolve_model_path(name_or_path), tokenizer,
                                gradient_checkpointing, dtype, load_in_4bit, device, device_field, num_labels=1)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        from turborlhf.models.zoo import NotAModelError

        kind = str(e).split("<class '")[-1].split("'>")[0].rsplit(".", 1)[-1] if "<class '" in str(e) else "its config"
        raise NotAModelError(f"{name_or_path}: transformers has no sequence-classification class for {kind}, so "
                             "it cannot be a reward model or critic (scalar head); use another architecture") from None
    finally:
        hf_logging.set_verbosity(prev)


def load_trainable(kind: str, model_cfg, tokenizer, init: Optional[str] = None,
                   ckpt_dir: Optional[str | os.PathLike] = None) -> nn.Module:
    """A model to train, built as `model_cfg` (`turborlhf.config.ModelCfg`) says, in train mode.

    Args:
        kind: ``"causal"`` (policy/actor) or ``"scalar"`` (reward model / critic, scalar head).
        model_cfg: gives ``lora`` (rank 0 = full fine-tuning), ``load_in_4bit`` (QLoRA),
            ``gradient_checkpointing`` and ``device`` (where the model is loaded).
        tokenizer: its pad id is written into the model config.
        init: where the weights start (default ``model_cfg.name_or_path``).
        ckpt_dir: a checkpoint's model directory when resuming.

    Full fine-tuning loads the checkpoint's weights when resuming, else `init`. With LoRA the
    frozen base always comes from `init` (fp32, or NF4 with ``load_in_4bit``) and the adapters
    are new (`apply_lora`) or the checkpoint's (peft adapter directory, see `save_for_resume`).
    The config loses a reward model's ``reward_mean``/``reward_std`` (`forget_score_stats`): the
    weights about to be trained are no longer those they were measured on.
    Raises ValueError for an unknown `kind`, RuntimeError for QLoRA on a machine without CUDA or
    bitsandbytes.
    """
    loaders = {"causal": load_causal_lm, "scalar": load_scalar_model}
    if kind not in loaders:
        raise ValueError(f"kind must be one of {sorted(loaders)}, got {kind!r}")
    init = init or model_cfg.name_or_path
    if ckpt_dir is None and os.path.isfile(os.path.join(resolve_model_path(init), "adapter_config.json")):
        from turborlhf.models.zoo import NotAModelError

        raise NotAModelError(f"{init}: a LoRA adapter directory, not a model to train; give its base model "
                             "(with model.lora.rank for new adapters) or export it merged first (turborlhf export)")
    lora = model_cfg.lora if model_cfg.lora.rank > 0 else None
    src = init if (lora is not None or ckpt_dir is None) else str(ckpt_dir)
    model = forget_score_stats(loaders[kind](src, tokenizer, gradient_checkpointing=model_cfg.gradient_checkpointing,
                                             load_in_4bit=model_cfg.load_in_4bit,
                                             device=getattr(model_cfg, "device", "cpu")))
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is not None and rows < len(tokenizer):     # an id past the table: an IndexError mid-step
        from turborlhf.errors import UserError

        raise UserError(f"{init}: its embedding has {rows} rows for the tokenizer's {len(tokenizer)} tokens; give "
                        "the tokenizer it was trained with, or resize its embeddings (resize_token_embeddings) "
                        "and save it")
    if ckpt_dir is not None:
        _check_resumed_lora(ckpt_dir, lora)
    if lora is not None:
        if ckpt_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(ckpt_dir), is_trainable=True)
        else:
            model = apply_lora(model, lora)
    freeze_layers(model, getattr(model_cfg, "freeze_layers", 0))
    return model.train()


def forget_score_stats(model: nn.Module) -> nn.Module:
    """Remove `SCORE_STATS` from the config of `model` (a LoRA model's: its base's), in place;
    returns `model`. For a model whose weights change after loading (trained, or adapters merged
    into it): the statistics of the weights it was loaded from would be saved with new weights (and
    a critic started from a reward model outputs values, not rewards). A trainer that evaluates the
    new weights writes fresh ones into its export."""
    cfg = (model.get_base_model() if is_lora(model) else model).config
    for k in SCORE_STATS:
        if hasattr(cfg, k):
            delattr(cfg, k)
    return model


def _check_resumed_lora(ckpt_dir, lora) -> None:
    """ConfigError when the LoRA settings `lora` (None: full fine-tuning) differ from those the
    checkpoint's model directory `ckpt_dir` was saved with: its adapters (or weights) are what a
    resume loads, so a changed rank, alpha, dropout or target list would be logged but not used."""
    from turborlhf.config import ConfigError

    path = Path(ckpt_dir) / "adapter_config.json"
    if not path.is_file():
        if lora is not None:
            raise ConfigError(f"lora.rank: {lora.rank}, but the checkpoint {ckpt_dir} was saved without LoRA (full "
                              "fine-tuning); LoRA settings cannot change on resume (start a new run from its export)")
        return
    saved = json.loads(path.read_text())
    if lora is None:
        raise ConfigError(f"lora.rank: 0, but the checkpoint {ckpt_dir} holds LoRA adapters (rank {saved.get('r')}); "
                          "LoRA settings cannot change on resume (start a new run from its export)")
    was = {"rank": saved.get("r"), "alpha": saved.get("lora_alpha"), "dropout": saved.get("lora_dropout"),
           "target_modules": sorted(saved.get("target_modules") or [])}
    now = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
           "target_modules": sorted(lora.target_modules)}
    changed = [f"lora.{k}: {was[k]} -> {now[k]}" for k in now if was[k] != now[k]]
    if changed:
        raise ConfigError(f"{'; '.join(changed)}: the checkpoint {ckpt_dir} holds adapters of the earlier settings, "
                          "which a resume loads; LoRA settings cannot change on resume (start a new run, from the "
                          "checkpoint's export to keep its training)")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM or scalar model (``layers`` in Llama/Qwen/Mistral, ``h``
    in GPT-2); raises ValueError for a model without such a list."""
    backbone = backbone_of(model)
    for name in ("layers", "h", "layer"):
        layers = getattr(backbone, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(backbone).__name__} has no list of decoder layers (layers/h/layer)")


def freeze_layers(model: nn.Module, n: int) -> None:
    """Freeze tuning: the input side (embeddings, and position embeddings or embedding norms where
    the model has them) and decoder layers ``0..n-1`` keep their weights (``requires_grad=False``);
    the layers above, the final norm and the head train. Autograd then
    records nothing below layer `n`, so backward stops there: a step costs about
    ``1 + 2·(L - n)/L`` forward passes instead of 3 (L layers). The optimizer skips frozen
    parameters (`turborlhf.engine.train.make_optimizer`). With tied embeddings (SmolLM2) the LM
    head is the embedding matrix and stays fixed too. ``n = 0`` changes nothing; raises
    `turborlhf.config.ConfigError` (a ValueError) when `n` is not below the model's layer count."""
    if n <= 0:
        return
    layers = decoder_layers(model)
    if n >= len(layers):
        from turborlhf.config import ConfigError      # a ValueError the command line prints as one line

        raise ConfigError(f"freeze_layers={n} must be below the model's {len(layers)} decoder layers "
                          "(something has to train)")
    for child in backbone_of(model).children():       # the input side: what the model builds before
        if child is layers:                           # its layer list (GPT-2's wpe, embedding norms)
            break
        child.requires_grad_(False)
    model.get_input_embeddings().weight.requires_grad_(False)
    for layer in layers[:n]:
        layer.requires_grad_(False)


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder stack (returns hidden states) of a causal LM or scalar model, LoRA or not."""
    base = model
    if hasattr(base, "get_base_model"):  # peft
        base = base.get_base_model()
    return getattr(base, base.base_model_prefix)


def _unfreeze_padding_row(model: nn.Module) -> None:
    """HF builds ``nn.Embedding(padding_idx=config.pad_token_id)``, whose row never receives
    gradient. When pad == EOS (SmolLM2) that silently freezes the EOS embedding, and the frozen row
    changes whenever the pad id does. Pad positions are masked out of every loss here, so the
    padding row needs no special treatment: clear it."""
    emb = model.get_input_embeddings()
    if isinstance(emb, nn.Embedding):
        emb.padding_idx = None


def _disable_dropout(model: nn.Module) -> None:
    """RLHF convention (TRL `disable_dropout`, OpenRLHF): dropout off so log-probs are deterministic.

    Besides ``nn.Dropout`` modules, the rates modules copied from the config when they were built
    and apply functionally (Llama/Qwen2/Mistral attention's ``attention_dropout``, OPT's
    ``dropout``): zeroing the config afterwards does not reach those."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for k, v in vars(m).items():
            if "dropout" in k and isinstance(v, float):
                setattr(m, k, 0.0)
    for k in ("attention_dropout", "hidden_dropout", "dropout"):
        if hasattr(model.config, k) and isinstance(getattr(model.config, k), float):
            setattr(model.config, k, 0.0)


def is_lora(model: nn.Module) -> bool:
    """True for a peft-wrapped model (LoRA adapters)."""
    return hasattr(model, "get_base_model") and hasattr(model, "disable_adapter")


def apply_lora(model: nn.Module, lora_cfg) -> nn.Module:
    """Wrap with peft LoRA adapters when `lora_cfg.rank > 0` (else return model unchanged).
    Only the adapters (and a scalar model's ``score`` head, via ``modules_to_save``) train."""
    if not lora_cfg or lora_cfg.rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    task = "SEQ_CLS" if hasattr(model, "score") else "CAUSAL_LM"
    head = model.get_output_embeddings() if task == "CAUSAL_LM" else None
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        # one matrix for both: an adapter on either side would be merged into both on export
        tied = (head, model.get_input_embeddings())
        names = {n for n, m in model.named_modules() if any(m is t for t in tied)}
        targets = [lora_cfg.target_modules] if isinstance(lora_cfg.target_modules, str) else lora_cfg.target_modules
        hit = [t for t in targets if t in names or t in {n.rsplit(".", 1)[-1] for n in names}]
        if hit:
            from turborlhf.config import ConfigError

            raise ConfigError(f"lora.target_modules: {hit[0]!r} is the token embedding or the LM head of a model "
                              "with tied embeddings (one matrix for both), whose adapter applies to one side only "
                              "and would be merged into both when the model is saved tied; leave it out")
    pcfg = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules=list(lora_cfg.target_modules), task_type=task,
                      modules_to_save=["score"] if task == "SEQ_CLS" else None)
    from turborlhf.config import ConfigError

    modules = dict(model.named_modules())       # peft matches a name or a dotted suffix of it
    for t in pcfg.target_modules:
        hit = [m for n, m in modules.items() if n == t or n.endswith("." + t)]
        if not hit:
            raise ConfigError(f"lora.target_modules: {t} not in {type(model).__name__} (layers LoRA can adapt there: "
                              f"{_adaptable_names(model, task)})")
        if other := next((m for m in hit if not isinstance(m, _adaptable_types())), None):
            raise ConfigError(f"lora.target_modules: {t} names {type(other).__name__} modules, which LoRA cannot "
                              f"adapt; name layers inside them ({_adaptable_names(model, task)})")
    return get_peft_model(model, pcfg)


def _adaptable_types() -> tuple[type, ...]:
    """Layer classes peft's LoRA adapts (QLoRA's 4-bit linears are ``nn.Linear`` subclasses)."""
    from transformers.pytorch_utils import Conv1D

    return nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, Conv1D


def _adaptable_names(model: nn.Module, task: str) -> str:
    """The last names of `model`'s layers a target may name: not a tied embedding or LM head, not
    a scalar model's ``score`` (trained whole)."""
    skip = {"score"} if task == "SEQ_CLS" else set()
    if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        tied = (model.get_output_embeddings(), model.get_input_embeddings())
        skip |= {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if any(m is t for t in tied)}
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, _adaptable_types())}
    return ", ".join(sorted(names - skip))


def merge_lora_for_save(model: nn.Module) -> nn.Module:
    """A plain HF model with adapters merged; the training model keeps its adapters.

    The merged model is built on the meta device and takes the tensors of
    `merged_named_parameters` (plus the base's buffers): only the adapted weights are new
    tensors, the rest is shared with `model`, so no second full copy is made. Returns `model`
    itself when it has no adapters.
    """
    if not is_lora(model):
        return model
    base = model.get_base_model()
    config = copy.deepcopy(base.config)
    for quantized in ("quantization_config", "_pre_quantization_dtype"):   # QLoRA: the merge is dequantized
        if hasattr(config, quantized):
            delattr(config, quantized)
    with torch.device("meta"):
        plain = type(base)(config)
    plain.load_state_dict(dict(merged_named_parameters(model)), strict=False, assign=True)
    for name, buf in _plain_buffers(model).items():
        owner, _, leaf = name.rpartition(".")
        plain.get_submodule(owner)._buffers[leaf] = buf
    if getattr(plain.config, "tie_word_embeddings", False):
        plain.tie_weights()
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"merging LoRA left tensors unset: {left[:5]}")
    if getattr(base, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(base.generation_config)
    return plain.eval()


def _lora_layout(model: nn.Module):
    """(base model, adapter name, LoraLayer class, ModulesToSaveWrapper class) of a peft model."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    return model.get_base_model(), model.active_adapter, LoraLayer, ModulesToSaveWrapper


def merged_named_parameters(model: nn.Module):
    """(plain HF name, tensor) of every parameter with the LoRA adapters merged,
    ``W + scaling·B·A`` (peft's `get_delta_weight`), computed module by module without copying
    the model: what a rollout engine or an export needs. A model without adapters yields its own
    ``named_parameters()``. Tensors of non-adapted parameters are the model's own (no grad), except
    that a QLoRA base's bitsandbytes weights (packed 4-bit ``Params4bit``, ``Int8Params``) are
    dequantized to full matrices (peft's `dequantize_module_weight`, as its own merge does)."""
    if not is_lora(model):
        yield from model.named_parameters()
        return
    base, adapter, LoraLayer, Wrapper = _lora_layout(model)
    skip: list[str] = []
    seen: set[int] = set()
    with torch.no_grad():
        for mname, module in base.named_modules():
            if any(mname.startswith(p) for p in skip):
                continue
            pre = f"{mname}." if mname else ""
            if isinstance(module, LoraLayer):
                skip.append(pre)
                layer = module.get_base_layer()
                w = _dequantized_weight(layer)
                has = (adapter in getattr(module, "lora_A", {})                  # linears
                       or adapter in getattr(module, "lora_embedding_A", {}))    # an embedding's adapter
                if has and adapter not in module.merged_adapters:
                    w = w + module.get_delta_weight(adapter).to(w.dtype)
                yield pre + "weight", w.detach()
                if getattr(layer, "bias", None) is not None:
                    yield pre + "bias", layer.bias.detach()
            elif isinstance(module, Wrapper):
                skip.append(pre)
                active = module.modules_to_save[adapter] if adapter in module.modules_to_save else module.original_module
                for n, p in active.named_parameters():
                    yield pre + n, p.detach()
            else:
                for n, p in module.named_parameters(recurse=False):
                    if id(p) not in seen:                       # tied weights: the first name only
                        seen.add(id(p))
                        yield pre + n, (_dequantized_weight(module) if n == "weight" else p).detach()


def _dequantized_weight(module: nn.Module) -> torch.Tensor:
    """`module.weight` as a full matrix: bitsandbytes' packed weights dequantized (QLoRA's base,
    on CUDA), any other weight as it is."""
    if type(module.weight).__name__ not in ("Params4bit", "Int8Params"):
        return module.weight
    from peft.utils.integrations import dequantize_module_weight

    return dequantize_module_weight(module)


def _plain_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    base, adapter, LoraLayer, Wrapper = _lora_layout(model)
    out = {}
    for name, buf in base.named_buffers():
        out[name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
            .replace(".original_module.", ".")] = buf
    return out


def adapters_disabled(model: nn.Module):
    """Context manager: `model` with its LoRA adapters switched off (peft ``disable_adapter``),
    i.e. the frozen base it started from; a no-op for a model without adapters."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def env_threads(n: int = 0) -> int:
    n = n or int(os.environ.get("TURBORLHF_THREADS", "0")) or (os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n
