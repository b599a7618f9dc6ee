"""`turborlhf export`: a training checkpoint as a plain Hugging Face directory, LoRA merged.

    turborlhf export --checkpoint runs/sft --output exported/sft            # the run's latest checkpoint
    turborlhf export --checkpoint runs/ppo/checkpoints/step-000040 --model critic --output exported/critic
    turborlhf export --checkpoint runs/sft --output exported/sft --push-to-hub me/sft-model

``--checkpoint`` may be a run directory (its latest checkpoint, as ``--resume`` finds it), one checkpoint
``checkpoints/step-N`` (its ``policy``/``actor`` model unless ``--model`` names another), or a
model directory itself. A LoRA model directory (peft adapters, ``adapter_config.json``) is loaded
on its base (``base_model_name_or_path``, or ``--base``) and merged, ``W + scaling·B·A``
(``models.load.merge_lora_for_save``); a full model is copied as ``save_pretrained`` writes it. A
causal LM stays a causal LM; a reward model / critic (``*ForSequenceClassification``, peft task
``SEQ_CLS``) keeps its scalar head. The tokenizer is saved beside the weights. The export of a
reward model's final checkpoint gets the ``reward_mean``/``reward_std`` that the run's final
evaluation wrote into the run's own export (`turborlhf.engine.checkpoint.export_config_of`); an
earlier checkpoint's, whose weights were not evaluated, none, nor does a critic's or merged LoRA
adapters' (their base's statistics are not those of the new weights); a plain model directory
outside a checkpoint keeps its config's.

``--output`` is replaced whole (atomically), so it must be a new or empty directory or an earlier
export (model, tokenizer and generation files only); anything else, and the checkpoint's own run,
are refused with a one-line error: an export never deletes a run or unrelated files.

``--push-to-hub REPO`` then uploads the directory with ``huggingface_hub`` (``create_repo`` with
``exist_ok``, then ``upload_folder``); it needs network access and a token (``HF_TOKEN`` or
``huggingface-cli login``).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional

__all__ = ["resolve_model_dir", "export_checkpoint", "push_to_hub", "export_main"]

logger = logging.getLogger(__name__)

_POLICY_NAMES = ("policy", "actor")


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names the directory."""


def resolve_model_dir(checkpoint: str | Path, model: Optional[str] = None) -> Path:
    """The model directory inside a run directory, a checkpoint or a model directory."""
    d = Path(checkpoint)
    if not d.is_dir():
        raise ExportError(f"{d}: no such directory")
    if (d / "checkpoints").is_dir():
        from turborlhf.engine.checkpoint import earlier_run_checkpoints, latest_checkpoint

        ckpt = latest_checkpoint(d)        # as --resume finds it (a save cut short between its renames too)
        if ckpt is None:
            earlier = ", ".join(p.name for p in earlier_run_checkpoints(d))
            raise ExportError(f"{d}: its checkpoints/ holds no complete checkpoint" + (
                f" of its run ({earlier}: an earlier run's; give one as checkpoints/step-N)" if earlier else ""))
        d = ckpt
    if (d / "config.json").exists() or (d / "adapter_config.json").exists():
        if model:
            raise ExportError(f"{d} is a model directory; --model {model} applies to a checkpoint")
        return d
    subs = sorted(p.name for p in d.iterdir() if p.is_dir()
                  and ((p / "config.json").exists() or (p / "adapter_config.json").exists()))
    if not subs:
        raise ExportError(f"{d}: neither a run directory, a checkpoint nor a model directory")
    if model:
        if model not in subs:
            raise ExportError(f"{d}: no model {model!r}; it holds {subs}")
        return d / model
    pick = next((n for n in _POLICY_NAMES if n in subs), subs[0] if len(subs) == 1 else None)
    if pick is None:
        raise ExportError(f"{d}: holds {subs}; choose one with --model")
    return d / pick


def _check_output(src: Path, out: Path, what: str = "the checkpoint it exports from") -> None:
    """Refuse an `out` whose replacement would delete something other than an earlier export:
    the source run, checkpoint or LoRA base (`src` inside `out`, or `out` inside it: a checkpoint
    that held another step's weights, or an export that checkpoint rotation deletes), or a
    directory holding anything else. Raises ExportError naming it."""
    s, o = src.resolve(), out.resolve()
    if o == s or o in s.parents or s in o.parents:
        raise ExportError(f"--output {out}: would replace {what} ({src}) or write inside it; choose another "
                          "directory")
    if o.exists() and not o.is_dir():
        raise ExportError(f"--output {out}: a file, not a directory")
    if o.is_dir():
        from turborlhf.engine.run import EXPORT_FILES

        other = sorted(p.name for p in o.iterdir() if not (p.is_file() and (p.name in EXPORT_FILES or (
            p.name.startswith("model-") and p.name.endswith(".safetensors")))))
        if other:
            raise ExportError(f"--output {out}: holds {', '.join(other[:5])}{', ...' if len(other) > 5 else ''}, "
                              "which the export would delete; give a new or empty directory, or an earlier export")


def _is_scalar(config: dict) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def export_checkpoint(checkpoint: str | Path, output: str | Path, model: Optional[str] = None,
                      base: Optional[str] = None) -> Path:
    """Write the model of ``checkpoint`` (see ``resolve_model_dir``) to ``output`` as a plain HF
    directory (atomically, ``engine.checkpoint.save_hf_dir``), LoRA adapters merged. Returns
    ``output``. Raises ``ExportError`` for a directory it cannot resolve, a missing base, or an
    output whose replacement would delete anything but an earlier export (`_check_output`)."""
    import torch
    from transformers import AutoTokenizer

    from turborlhf.engine.checkpoint import export_config_of, save_hf_dir
    from turborlhf.models.load import forget_score_stats, load_causal_lm, load_scalar_model, load_tokenizer

    src = resolve_model_dir(checkpoint, model)
    _check_output(Path(checkpoint), Path(output))
    _check_output(src, Path(output))
    tok = load_tokenizer(str(src))
    adapter = src / "adapter_config.json"
    if adapter.exists():
        from peft import PeftModel

        acfg = json.loads(adapter.read_text())
        base = base or acfg.get("base_model_name_or_path")
        if not base:
            raise ExportError(f"{adapter}: no base_model_name_or_path; give the base with --base")
        if Path(base).is_dir():              # the adapters would be merged into it twice on a resume
            _check_output(Path(base), Path(output), "the adapters' base model")
        scalar = acfg.get("task_type") == "SEQ_CLS"
        try:
            loaded = forget_score_stats((load_scalar_model if scalar else load_causal_lm)(base, tok,
                                                                                        dtype=torch.float32))
        except OSError as e:
            raise ExportError(f"{adapter}: cannot load the base model {base!r} ({e}); give it with --base") from None
        net = PeftModel.from_pretrained(loaded, str(src))
    else:
        saved = json.loads((src / "config.json").read_text())
        scalar = _is_scalar(saved)
        net = (load_scalar_model if scalar else load_causal_lm)(str(src), tok, dtype=torch.float32)
        # a full model is copied as it is: its own pad id and tokenizer (`load_tokenizer` may switch
        # the pad to unk, and a reward model's pooling reads the rightmost token that is not the pad)
        net.config.pad_token_id = saved.get("pad_token_id")
        tok = AutoTokenizer.from_pretrained(str(src))
        if (src.parent / "trainer_state.pt").exists():      # trained weights: only the run's own statistics
            forget_score_stats(net)
    return save_hf_dir(net.eval(), tok, output, extra_config=export_config_of(src))


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False, token: Optional[str] = None) -> str:
    """Upload ``folder`` to the hub model repository ``repo_id`` (created if missing); returns the
    commit URL. Raises ``huggingface_hub`` errors (no network, no token, no permission)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                             commit_message="Upload model exported by turborlhf")
    return str(getattr(info, "commit_url", info))


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="turborlhf export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run directory, checkpoints/step-N, or a model directory")
    p.add_argument("--output", required=True, help="where the plain HF directory is written")
    p.add_argument("--model", default=None, help="which model of a checkpoint (policy/actor by default; critic...)")
    p.add_argument("--base", default=None, help="base model of LoRA adapters (default: their adapter_config.json)")
    p.add_argument("--push-to-hub", metavar="REPO", default=None, help="then upload it to this hub repository")
    p.add_argument("--private", action="store_true", help="create the hub repository as private")
    a = p.parse_args(argv)
    try:
        out = export_checkpoint(a.checkpoint, a.output, a.model, a.base)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logger.info(f"[export] {resolve_model_dir(a.checkpoint, a.model)} -> {out}")
    if a.push_to_hub:
        try:
            url = push_to_hub(out, a.push_to_hub, private=a.private)
        except Exception as e:  # network, auth or permission: the export itself is done
            print(f"error: pushing {out} to {a.push_to_hub} failed: {type(e).__name__}: "
                  f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}", file=sys.stderr)
            return 1
        logger.info(f"[export] pushed to {a.push_to_hub}: {url}")
    return 0
