"""The rule-based reward both sides of `turborlhf bench grpo` use (from shared/peers/trl_grpo.py):
prefer ~20-word answers, +1 for an apology or refusal word. Cheap on purpose: the benchmark times
the trainers, not the reward."""


def score(text: str) -> float:
    words = len(text.split())
    return -abs(words - 20) / 20 + (1.0 if any(w in text.lower() for w in ("sorry", "cannot", "can't")) else 0.0)


def turborlhf_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """turborlhf's reward-function signature (`rewards: [{kind: function, path: ...:turborlhf_reward}]`)."""
    return [score(r) for r in responses]


def trl_reward(completions, **kwargs) -> list[float]:
    """TRL's reward-function signature (conversational completions are lists of messages)."""
    return [score(c[0]["content"] if isinstance(c, list) else c) for c in completions]
