"""PPO must actually optimise its reward: on a tiny random model with a rule-based reward (the
fraction of 'e' characters in the response), the mean reward of the last rollouts must clearly exceed
that of the first ones. A sign error in the advantage, the ratio or the value target, or a critic
that never learns (critic_lr far below the actor's: the GAE advantages then drown in value noise),
makes this fail; the metrics-only end-to-end tests would not notice."""
from __future__ import annotations

import pytest

from tests.e2e.helpers import REPO, metrics, run_cli

RULE = "def target_char(prompts, responses):\n    return [sum(c == 'e' for c in r) / max(1, len(r)) for r in responses]\n"


@pytest.mark.parametrize("estimator, extra", [
    ("gae", ["algo.prompts_per_step=16", "algo.critic_lr=1e-3"]),
    ("grpo", ["algo.prompts_per_step=4", "algo.n_samples_per_prompt=4"]),
])
def test_reward_rises_on_a_toy_rule(estimator, extra, tiny_model, tiny_data, tmp_path):
    rule = tmp_path / "rules.py"
    rule.write_text(RULE)
    out = tmp_path / estimator
    args = ["ppo", "--config", REPO / "configs/tiny/ppo.yaml", f"actor.name_or_path={tiny_model}", "reward_model=null",
            f"rewards=[{{kind: function, path: {rule}:target_char, weight: 1.0}}]",
            f"data.prompts_file={tiny_data / 'train_prompts.jsonl'}", f"output_dir={out}", "train.max_steps=25",
            "train.save_every=0", "rollout.max_new_tokens=16", "optim.lr=1e-3", "algo.kl_coef=0",
            "algo.missing_eos_penalty=null", "log.tensorboard=false", f"algo.advantage_estimator={estimator}", *extra]
    if estimator == "gae":
        args.append(f"critic.name_or_path={tiny_model}")      # a fresh value head on the tiny LM
    run_cli(*args)
    r = [row["rollout/reward_mean"] for row in metrics(out) if "rollout/reward_mean" in row]
    first, last = sum(r[:5]) / 5, sum(r[-5:]) / 5
    assert last > 1.3 * first, (estimator, [round(x, 3) for x in r])
