"""`turborlhf plan --from-data`: the run's own batches, from its data files and tokenizer (no
weights), with the same encoding and deterministic step plan as the trainer, so the plan sizes the
heaviest micro-batch the run will really see (`batches_from_data`)."""
from __future__ import annotations

from typing import Optional

__all__ = ["batches_from_data"]


def _heaviest(cands: list[dict], key) -> Optional[dict]:
    return max(cands, key=key) if cands else None


def batches_from_data(command: str, cfg, tokenizer_path: str) -> Optional[dict]:
    """The heaviest training micro-batch of the run `cfg` describes, from its data files and the
    same encoding and deterministic step plan as the trainer: ``{"rows", "row_len", "resp",
    "note"}`` (PPO: ``{"prompt_len", "note"}``, the longest prompt of the planned steps; the
    responses stay at max_new_tokens). None for commands whose batches depend on generation.
    """
    from turborlhf.engine.run import plan_steps
    from turborlhf.models.load import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    loop = cfg.train

    def micro(plan, mb):
        for step in plan:
            for s0 in range(0, len(step), mb):
                yield step[s0:s0 + mb]

    if command == "sft":
        from turborlhf.data.loaders import load_sft
        from turborlhf.data.tokenize import encode_examples

        rows = load_sft(cfg.data.train_file, tok, **cfg.data.loader_kwargs())
        rows = rows[:cfg.data.max_samples] if cfg.data.max_samples else rows
        enc = encode_examples(tok, rows, cfg.data.max_len)
        plan = plan_steps([len(e["input_ids"]) for e in enc], loop.sequences_per_step,
                          loop.epochs, loop.max_steps, loop.seed)
        cands = [{"rows": len(b), "row_len": max(len(enc[i]["input_ids"]) for i in b),
                  "resp": sum(sum(enc[i]["loss_mask"]) for i in b)} for b in micro(plan, loop.micro_batch_size)]
        unit = "sequences"
    elif command in ("dpo", "kto"):
        if command == "dpo":
            from turborlhf.data.loaders import load_pairs
            from turborlhf.data.tokenize import encode_pair_list

            items = load_pairs(cfg.data.train_file, tok, **cfg.data.loader_kwargs())
            items = items[:cfg.data.max_samples] if cfg.data.max_samples else items
            enc = encode_pair_list(tok, items, cfg.data.max_len)
            seqs = lambda i: [enc[i]["chosen"], enc[i]["rejected"]]
            per_step = loop.pairs_per_step
        else:
            from turborlhf.data.loaders import load_kto
            from turborlhf.data.tokenize import encode_prompt_response

            items = load_kto(cfg.data.train_file, tok, **cfg.data.loader_kwargs())
            items = items[:cfg.data.max_samples] if cfg.data.max_samples else items
            enc = [encode_prompt_response(tok, r["prompt"], r["completion"], cfg.data.max_len) for r in items]
            seqs = lambda i: [enc[i]]
            per_step = loop.examples_per_step
        plan = plan_steps([max(len(x["input_ids"]) for x in seqs(i)) for i in range(len(enc))], per_step, loop.epochs,
                          loop.max_steps, loop.seed)
        cands = []
        for b in micro(plan, loop.micro_batch_size):
            ss = [x for i in b for x in seqs(i)]
            cands.append({"rows": len(ss), "row_len": max(len(x["input_ids"]) for x in ss),
                          "resp": sum(sum(x["loss_mask"]) for x in ss)})
        unit = "sequences"
    elif command == "rm":
        from turborlhf.data.loaders import load_pairs
        from turborlhf.models.forward import pack_shared_prefix
        from turborlhf.rewards.model import encode_pairs
        from turborlhf.trainers.reward_model import plan_pair_steps

        items = load_pairs(cfg.data.train_file, tok, **cfg.data.loader_kwargs())
        items = items[:cfg.data.max_samples] if cfg.data.max_samples else items
        enc = encode_pairs(tok, items, cfg.data.max_len)
        plan = plan_pair_steps(enc, loop)
        cands = []
        for b in micro(plan, loop.micro_batch_size):
            packed = pack_shared_prefix([enc[i]["chosen"] for i in b], [enc[i]["rejected"] for i in b], 0)
            cands.append({"rows": len(b), "row_len": packed.ids_BL.shape[1], "resp": 0})
        unit = "pair rows"
    elif command in ("ppo", "grpo", "rloo"):
        from turborlhf.data.loaders import load_prompts
        from turborlhf.data.tokenize import encode_prompts

        prompts = load_prompts(cfg.data.prompts_file, tok, **cfg.data.loader_kwargs())
        prompts = prompts[:cfg.data.max_samples] if cfg.data.max_samples else prompts
        ids = encode_prompts(tok, prompts, cfg.rollout.max_prompt_len)
        plan = plan_steps([len(p) for p in ids], cfg.algo.prompts_per_step, loop.epochs, loop.max_steps, loop.seed)
        P = max(max(len(ids[i]) for i in step) for step in plan)
        return {"prompt_len": P, "note": f"from the data: longest prompt of the {len(plan)} planned steps {P} tokens"}
    else:
        return None
    best = _heaviest(cands, key=lambda c: c["rows"] * c["row_len"] * 1000 + c["resp"])
    return {**best, "note": f"from the data: heaviest micro-batch of the {len(plan)} planned steps is {best['rows']} "
                            f"{unit} × {best['row_len']} tokens, {best['resp']} response tokens"}
