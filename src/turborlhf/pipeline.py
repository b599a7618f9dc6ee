"""`turborlhf pipeline`: prepare data → SFT → RM → PPO → evaluation in one run directory.

    turborlhf pipeline --config configs/hh_smollm2/demo.yaml

Stage wiring (each stage section of the YAML overrides the command's own config):
- prepare: raw HH lines → ``<run_dir>/data`` (pairs, NeMo-style comparisons and prompts, KTO).
- sft: base model on the chosen responses of the train pairs → ``<run_dir>/sft``.
- rm: SFT model + scalar head on the train pairs → ``<run_dir>/rm`` (InstructGPT initialises
  the RM from the SFT model).
- ppo: actor and reference = SFT model, critic initialised from the RM → ``<run_dir>/ppo``.
- eval: RM accuracy on the test pairs; SFT and PPO policies sampled with the same seed on the
  same test prompts and scored by the same RM, each prompt's two answers in one pass
  (`turborlhf.evaluate.eval_policy_pair`); a plot and a summary.

``--resume`` skips stages whose directory holds a ``.done`` marker and resumes an interrupted
stage from its last checkpoint.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from turborlhf.config import (PipelineConfig, PPOConfig, RMConfig, SFTConfig, _deep_update, config_to_dict,
                              validate_section)
from turborlhf.metrics import format_duration

logger = logging.getLogger(__name__)

__all__ = ["run"]


def _stage_cfg(cls, base: dict, section: dict, name: str):
    tree = json.loads(json.dumps(base))
    _deep_update(tree, json.loads(json.dumps(section)))
    return validate_section(cls, tree, name)


def stage_configs(cfg: PipelineConfig, model: str) -> dict:
    """The validated SFT, RM and PPO configs the pipeline runs, with the paths between stages
    (data files, the SFT model feeding RM and PPO, the RM feeding PPO) filled in; `model` is the
    base model (path or zoo name). Raises ConfigError naming the stage section."""
    run_dir = Path(cfg.run_dir)
    data = run_dir / "data"
    sft_out = str(run_dir / "sft") if "sft" in cfg.stages else model
    pairs = {"train_file": str(data / "train_pairs.jsonl"), "test_file": str(data / "test_pairs.jsonl")}
    ppo_base = {"actor": {"name_or_path": sft_out}, "reference": sft_out, "reward_model": str(run_dir / "rm"),
                "output_dir": str(run_dir / "ppo"), "data": {"prompts_file": str(data / "train_prompts.jsonl")}}
    return {
        "sft": _stage_cfg(SFTConfig, {"model": {"name_or_path": model}, "output_dir": str(run_dir / "sft"),
                                      "data": pairs}, cfg.sft, "sft"),
        "rm": _stage_cfg(RMConfig, {"model": {"name_or_path": sft_out}, "output_dir": str(run_dir / "rm"),
                                    "data": pairs}, cfg.rm, "rm"),
        "ppo": _stage_cfg(PPOConfig, ppo_base, cfg.ppo, "ppo"),
    }


def run(cfg: PipelineConfig, resume: bool = False) -> dict:
    from turborlhf.engine.malloc import release_freed_memory
    from turborlhf.models.zoo import resolve_model_path

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "pipeline.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    data = run_dir / "data"
    model = resolve_model_path(cfg.model)
    stage_dirs = {"prepare": data, "sft": run_dir / "sft", "rm": run_dir / "rm", "ppo": run_dir / "ppo",
                  "eval": run_dir / "eval"}
    # validate every stage config before spending minutes on the first one
    stage_cfgs = stage_configs(cfg, model)
    sft_cfg, rm_cfg, ppo_cfg = stage_cfgs["sft"], stage_cfgs["rm"], stage_cfgs["ppo"]
    sft_out = str(stage_dirs["sft"]) if "sft" in cfg.stages else model
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    for stage in cfg.stages:
        done = stage_dirs[stage] / ".done"
        if resume and done.exists():
            logger.info(f"[pipeline] {stage}: done before, skipped")
            continue
        logger.info(f"\n[pipeline] ===== {stage} =====")
        t0 = time.perf_counter()
        if stage == "prepare":
            _prepare(cfg, model, data)
        elif stage == "sft":
            from turborlhf.trainers.sft import train as sft_train

            sft_train(sft_cfg, resume=resume)
        elif stage == "rm":
            from turborlhf.trainers.reward_model import train as rm_train

            rm_train(rm_cfg, resume=resume)
        elif stage == "ppo":
            from turborlhf.trainers.ppo import train as ppo_train

            ppo_train(ppo_cfg, resume=resume)
        elif stage == "eval":
            from turborlhf.report import evaluate_pipeline

            evaluate_pipeline(cfg, run_dir, sft_out, data, timings)
        timings[stage] = round(time.perf_counter() - t0, 1)
        release_freed_memory()    # the next stage's working set differs (engine.malloc)
        stage_dirs[stage].mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps({"seconds": timings[stage]}))
        logger.info(f"[pipeline] {stage} took {format_duration(timings[stage])}")
    total = time.perf_counter() - t_all
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.setdefault("stage_seconds", {}).update(timings)
    summary["total_seconds"] = round(total, 1)
    summary_path.write_text(json.dumps(summary, indent=2))
    from turborlhf.report import print_summary

    print_summary(summary)
    logger.info(f"[pipeline] finished in {format_duration(total)}; summary: {summary_path}")
    return summary


def _prepare(cfg: PipelineConfig, model: str, data: Path) -> None:
    from turborlhf.data.hh_rlhf import prepare_hh
    from turborlhf.models.load import load_tokenizer

    tok = load_tokenizer(model)
    report = prepare_hh(cfg.prepare.input, data, tok, test_fraction=cfg.prepare.test_fraction,
                        strict=cfg.prepare.strict)
    logger.info(f"[prepare] {json.dumps({k: v for k, v in report.items() if not isinstance(v, (dict, list))})}")
