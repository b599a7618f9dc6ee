"""turborlhf: fast, complete RLHF (SFT, reward models, PPO, DPO-family, KTO, GRPO/RLOO/REINFORCE++,
best-of-n, conditional SFT).

Importing the package is cheap: no torch, Ray, vLLM or model import happens here.
"""
__version__ = "0.1.0"
