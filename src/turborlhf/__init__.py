"""turborlhf: fast, complete RLHF (SFT, reward models, PPO, DPO-family, KTO, GRPO/RLOO/REINFORCE++,
best-of-n, conditional SFT).

Importing the package is cheap: no torch, Ray, vLLM or model import happens here. The trainer
objects (`turborlhf.api`: ``SFTTrainer``, ``RewardTrainer``, ``DPOTrainer``, ``KTOTrainer``,
``PPOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``) are imported on first use.
"""
__version__ = "0.1.0"

_API = ("SFTTrainer", "RewardTrainer", "DPOTrainer", "KTOTrainer", "PPOTrainer", "GRPOTrainer", "RLOOTrainer",
        "TrainResult", "TrainerState")
_CONFIGS = ("SFTConfig", "RMConfig", "DPOConfig", "KTOConfig", "PPOConfig", "GRPOConfig", "RLOOConfig")

__all__ = ["__version__", *_API, *_CONFIGS, "TrainerCallback"]


def __getattr__(name: str):
    if name in _API:
        from turborlhf import api

        return getattr(api, name)
    if name in _CONFIGS:
        from turborlhf import config

        return getattr(config, name)
    if name == "TrainerCallback":
        from turborlhf.metrics import TrainerCallback

        return TrainerCallback
    raise AttributeError(f"module 'turborlhf' has no attribute {name!r}")
