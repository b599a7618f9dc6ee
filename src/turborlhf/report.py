"""The pipeline's evaluation stage: held-out RM accuracy, SFT vs PPO policy reward on the same test
prompts (same seed, same sampling settings, same reward model), a plot of the PPO run, sample
responses, and ``summary.json``."""
from __future__ import annotations

import json
import math
from pathlib import Path

from turborlhf.data.jsonl import file_sha256

__all__ = ["evaluate_pipeline", "plot_ppo", "rm_eval_covers"]


def plot_ppo(metrics_file: Path, out_png: Path) -> bool:
    """Reward, KL and response length per PPO step → PNG. Returns False if there is nothing to plot."""
    rows = [json.loads(l) for l in metrics_file.read_text().splitlines() if l.strip()] if metrics_file.exists() else []
    rows = [r for r in rows if "rollout/reward_mean" in r]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(axes, ("rollout/reward_mean", "policy/kl", "rollout/response_length"),
                              ("reward (RM score, mean)", "KL to reference (per sequence)", "response length (tokens)")):
        ax.plot(steps, [math.nan if r.get(key) is None else r[key] for r in rows], marker="o", ms=3)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return True


def rm_eval_covers(rm_res: dict, test_pairs: str) -> bool:
    """Whether the RM stage's ``eval.json`` (`rm_res`) scored `test_pairs` with length strata: the
    same file content (``data_sha256``; a run directory copied or moved keeps it), or, written
    before the digest was stored, the same path."""
    if "length" not in rm_res:
        return False
    if rm_res.get("data_sha256"):
        return Path(test_pairs).is_file() and rm_res["data_sha256"] == file_sha256(test_pairs)
    return Path(rm_res.get("data", "")).resolve() == Path(test_pairs).resolve()


def evaluate_pipeline(cfg, run_dir: Path, sft_dir: str, data: Path, timings: dict, rm_max_len: int = 1024,
                      rm_dtype: str = "auto", rm_device: str = "auto") -> dict:
    """The pipeline's eval stage. `rm_max_len`, `rm_dtype`, `rm_device`: the RM stage's
    ``data.max_len``, ``model.dtype`` and ``model.device``, with which a reward model the RM stage
    did not evaluate is scored (a device this host lacks is refused naming ``rm.model.device``);
    the policies sample and are scored per ``eval.rollout`` (errors name ``eval.rollout.device``)."""
    from turborlhf.evaluate import eval_policy_pair, eval_rm

    E = cfg.eval
    rm_dir, ppo_dir, ev_dir = str(run_dir / "rm"), str(run_dir / "ppo"), run_dir / "eval"
    ev_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"model": cfg.model, "run_dir": str(run_dir)}
    # the RM stage scored the same held-out pairs with the final model (rm/eval.json, at its max_len);
    # a reward model trained elsewhere, or by a version that wrote no length strata, is scored here
    # (at the RM stage's length budget, precision and device)
    rm_eval, test_pairs = run_dir / "rm" / "eval.json", str(data / "test_pairs.jsonl")
    rm_res = json.loads(rm_eval.read_text()) if rm_eval.exists() else {}
    if not rm_eval_covers(rm_res, test_pairs):      # at the RM stage's length budget, as it trained
        rm_res = eval_rm(rm_dir, test_pairs, max_len=rm_max_len, dtype=rm_dtype, device=rm_device,
                         device_field="rm.model.device")
    summary["rm_test_accuracy"] = rm_res["accuracy"]
    summary["rm_test_pairs"] = rm_res["n"]
    summary["rm_test_length"] = rm_res["length"]
    R = E.rollout
    common = dict(n=E.n_prompts, max_new_tokens=R.max_new_tokens, temperature=R.temperature, top_p=R.top_p,
                  seed=E.seed, engine=R.engine, dtype=R.dtype, device=R.device, max_prompt_len=R.max_prompt_len)
    prompts = str(data / "test_prompts.jsonl")
    # both policies on the same prompts and seed; the RM scores each prompt's two answers with the
    # prompt computed once, and the PPO policy's KL is to the SFT policy
    outs = (str(ev_dir / "sft_samples.jsonl"), str(ev_dir / "ppo_samples.jsonl"))
    sft_res, ppo_res = eval_policy_pair(sft_dir, ppo_dir, rm_dir, prompts, **common, samples_out=outs,
                                        device_field="eval.rollout.device")
    std = sft_res["reward_std"] or 1.0
    summary["sft_policy"] = {k: sft_res[k] for k in ("reward_mean", "reward_std", "n", "response_length_mean",
                                                    "eos_fraction")}
    summary["ppo_policy"] = {k: ppo_res[k] for k in ("reward_mean", "reward_std", "n", "response_length_mean",
                                                    "eos_fraction", "kl_to_reference")}
    summary["ppo_minus_sft_reward_in_sft_std"] = (ppo_res["reward_mean"] - sft_res["reward_mean"]) / std
    summary["eval_settings"] = {k: v for k, v in common.items()}
    if plot_ppo(run_dir / "ppo" / "metrics.jsonl", run_dir / "ppo_curves.png"):
        summary["plot"] = str(run_dir / "ppo_curves.png")
    samples = []
    sft_s = [json.loads(l) for l in (ev_dir / "sft_samples.jsonl").read_text().splitlines()]
    ppo_s = [json.loads(l) for l in (ev_dir / "ppo_samples.jsonl").read_text().splitlines()]
    for a, b in list(zip(sft_s, ppo_s))[:E.n_samples_shown]:
        samples.append({"prompt": a["prompt"], "sft": a["response"], "sft_score": a["score"],
                        "ppo": b["response"], "ppo_score": b["score"]})
    summary["samples"] = samples
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _last_user_turn(prompt: str) -> str:
    for marker in ("<|im_start|>user\n", "Human: "):
        if marker in prompt:
            return prompt.rsplit(marker, 1)[1].split("<|im_end|>")[0].strip()
    return prompt[-200:]


def print_summary(s: dict) -> None:
    if "rm_test_accuracy" not in s:
        return
    print("\n================ turborlhf summary ================")
    print(f"reward model: test accuracy {s['rm_test_accuracy']:.3f} on {s['rm_test_pairs']} held-out pairs"
          + (f" (\"the shorter response wins\" scores {s['rm_test_length']['shorter_wins']:.3f} on them)"
             if s.get("rm_test_length", {}).get("shorter_wins") is not None else ""))
    a, b = s["sft_policy"], s["ppo_policy"]
    print(f"SFT policy:   reward {a['reward_mean']:+.3f} ± {a['reward_std']:.3f}, "
          f"length {a['response_length_mean']:.1f} tokens ({a['n']} test prompts)")
    print(f"PPO policy:   reward {b['reward_mean']:+.3f} ± {b['reward_std']:.3f}, "
          f"length {b['response_length_mean']:.1f} tokens, KL to SFT {b['kl_to_reference']:.2f}")
    print(f"PPO − SFT:    {s['ppo_minus_sft_reward_in_sft_std']:+.2f} SFT reward std")
    for i, x in enumerate(s.get("samples", []), 1):
        print(f"\n--- sample {i}: {_last_user_turn(x['prompt'])[:160]!r}")
        print(f"  SFT ({x['sft_score']:+.2f}): {x['sft'][:240]!r}")
        print(f"  PPO ({x['ppo_score']:+.2f}): {x['ppo'][:240]!r}")
    if s.get("plot"):
        print(f"\nplot: {s['plot']}")
    if s.get("stage_seconds"):
        from turborlhf.metrics import format_duration

        total, stages = s.get("total_seconds", 0), sum(s["stage_seconds"].values())
        print("stage times: " + ", ".join(f"{k} {format_duration(v)}" for k, v in s["stage_seconds"].items())
              + (f"; total {format_duration(total)}" if stages <= total + 1 else   # some ran in an earlier invocation
                 f"; {format_duration(stages)} in all, this invocation {format_duration(total)}"))
    print("===================================================")
