"""The fields of the ``rollout`` section (engine, sampling, precision, weight-sync check), kept in
their own file to keep config.py short; `turborlhf.config.RolloutCfg` inherits them, so they are
``rollout.<name>`` like every other field. Imports neither torch nor transformers."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["RolloutFields", "SYNC_TOLERANCE"]

# `rollout.sync_tolerance` by engine dtype (nats): the canary statistic of a correct push, measured on
# SmolLM2-135M with FastEngine, times a margin (benchmarks/sync_tolerance.py, docs/rollout.md)
SYNC_TOLERANCE = {"fp32": 1e-3, "bf16": 0.025}


class RolloutFields(BaseModel):
    """Rollout engine and sampling settings (`turborlhf.rollout.make_engine`, docs/rollout.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)

    engine: Literal["auto", "hf", "fast", "vllm"] = Field(
        "auto", description="rollout engine: auto = the embedded fast engine on the CPU, HF generate on a GPU "
                            "(vllm: set it explicitly)")
    max_new_tokens: int = Field(64, ge=1, description="maximum generated tokens per response")
    min_new_tokens: int = Field(0, ge=0, description="EOS/stop tokens are suppressed before this many tokens")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="top-k sampling; 0 = off")
    max_prompt_len: int = Field(256, ge=1, description="prompts are cut from the left to this many tokens")
    batch_size: int = Field(32, ge=1, description="sequences generated together")
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="weights precision inside the engine; auto = bf16 where the engine's device computes it "
                            "natively (README: Hardware), else fp32; on a CPU whose FastEngine fp32 decode linears "
                            "on bf16 weights measure faster than its bf16 ones, fp32 (with weight_dtype auto: bf16)")
    weight_dtype: Literal["auto", "same", "bf16"] = Field(
        "auto", description="storage of the engine's weights: same = at rollout.dtype (the trainer's exact policy in "
                            "fp32); bf16 = rounded to bf16 with fp32 arithmetic when rollout.dtype is fp32 (FastEngine: "
                            "half the bytes per decode step, the weights a bf16 engine samples with); auto = bf16 where "
                            "FastEngine computes in fp32 with its kernel linears, else same (docs/rollout.md)")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="where the engine generates; auto = CUDA for vllm, else the device the policy trains on "
                            "(FastEngine runs on the CPU only, so on a GPU auto takes HFEngine there)")
    vllm_gpu_memory_utilization: Optional[float] = Field(
        None, gt=0, le=1, description="share of its GPU that vLLM takes for weights and KV cache (vLLM's "
        "gpu_memory_utilization, OpenRLHF's --vllm_gpu_memory_utilization); default: 0.9 (vLLM's) where the rollout "
        "engine has its GPU to itself (Ray, not colocated), 0.5 (verl's) where the trainer's models share it (the "
        "local backend, distributed.colocate_all_models); vLLM's CPU build reads it as a share of host memory, so there "
        "the default is divided among the node's engines (distributed.rollout.devices_per_node)")
    verify_sync: bool = Field(True, description="after each weight push, check the engine's log-probs on a fixed "
                                                "canary batch against the trainer's (rollout/sync.py)")
    sync_tolerance: Optional[float] = Field(
        None, gt=0, description="max |difference| of the mean per-token log-prob (nats) between engine and trainer, "
                                "averaged over the canary rows; default (None) = by rollout.dtype, measured noise x "
                                "margin: " + ", ".join(f"{k} {v:g}" for k, v in SYNC_TOLERANCE.items())
                                + " (docs/rollout.md)")

    @model_validator(mode="after")
    def _check_new_tokens(self):
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} must be <= max_new_tokens={self.max_new_tokens}")
        return self

    @model_validator(mode="after")
    def _check_weight_dtype(self):
        from turborlhf.engine.hardware import weight_dtype_conflict   # (imports no torch)
        why = weight_dtype_conflict(self.weight_dtype, self.dtype, self.engine, self.device)
        if why:
            raise ValueError(why)
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_sync_tolerance(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sync_tolerance") is None:
            # dtype auto: filled by turborlhf.engine.run.resolve_hardware once the dtype is chosen
            data = {**data, "sync_tolerance": SYNC_TOLERANCE.get(str(data.get("dtype", "auto")))}
        return data
