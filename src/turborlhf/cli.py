"""Command line: ``turborlhf <command> ...``.

Training commands take ``--config FILE.yaml`` plus dotted overrides in either form
``--optim.lr 1e-5`` or ``optim.lr=1e-5``; ``turborlhf <command> --help`` lists every field.
Heavy modules (torch, transformers, Ray, vLLM) are imported only inside the chosen command.

Bad input (a `turborlhf.errors.UserError`: config field, data file, model directory, reward
function) is one line ``error: ...`` and exit code 2; ``--debug`` anywhere on the command line
shows the full traceback instead. A training run stopped by SIGINT/SIGTERM exits with 130/143
after saving a resumable checkpoint (`turborlhf.engine.lifecycle`).
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Callable, Optional

# command → (module, function, config class name in turborlhf.config or None, one-line help)
TRAIN_COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "sft": ("turborlhf.trainers.sft", "train", "SFTConfig", "supervised fine-tuning on response tokens"),
    "rm": ("turborlhf.trainers.reward_model", "train", "RMConfig", "pairwise (Bradley-Terry) reward model"),
    "ppo": ("turborlhf.trainers.ppo", "train", "PPOConfig", "PPO with actor, critic, reward and reference models"),
    "dpo": ("turborlhf.trainers.dpo", "train", "DPOConfig", "DPO / IPO / cDPO / reference-free preference optimisation"),
    "kto": ("turborlhf.trainers.kto", "train", "KTOConfig", "KTO on unpaired desirable/undesirable examples"),
    "rejection-sampling": ("turborlhf.trainers.rejection_sampling", "train", "RejectionSamplingConfig",
                           "best-of-n sampling scored by a reward model, then SFT on the best, for N rounds"),
    "conditional-sft": ("turborlhf.trainers.conditional_sft", "train", "ConditionalSFTConfig",
                        "reward-conditioned SFT (score tags in the prompt, generate with the best tag)"),
    "pipeline": ("turborlhf.pipeline", "run", "PipelineConfig", "prepare data → SFT → RM → PPO → evaluation"),
    "grpo": ("turborlhf.trainers.ppo", "train", "GRPOConfig", "`ppo` with the GRPO preset (group-normalised "
             "advantages, no critic, k3 KL loss)"),
    "rloo": ("turborlhf.trainers.ppo", "train", "RLOOConfig", "`ppo` with the RLOO preset (leave-one-out "
             "baseline, no critic, KL in the reward)"),
}

OTHER_COMMANDS: dict[str, str] = {
    "fetch-model": "download and convert a named model into the cache",
    "prepare-data": "convert a dataset (hh-rlhf, gsm8k, reasoning-gym) into training files",
    "eval-rm": "reward-model accuracy on preference pairs",
    "eval-policy": "generate for prompts and score with a reward model",
    "eval-dpo": "implicit-reward accuracy and margin of a DPO policy on preference pairs",
    "eval-math": "GSM8K accuracy and #### format rate of a policy (greedy, fast rollout engine)",
    "serve-rm": "serve a reward model over HTTP with request batching",
    "plan": "estimate memory per role and device for a config before launch (reads no weights)",
    "bench": "time ppo/dpo/rm/grpo/generate against a peer (TRL, HF generate) side by side",
    "generate": "batch inference: responses for a prompts file, written as JSONL",
    "chat": "interactive multi-turn chat with a model (reads stdin)",
    "export": "a checkpoint (LoRA merged) as a plain HF directory; --push-to-hub REPO",
}


_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")   # the start of a ``key.sub=value`` token


def _split_overrides(rest: list[str], cls=None) -> list[str]:
    """``['--a.b', '3', 'c.d=4', '--e=5', '--f']`` → ``['a.b=3', 'c.d=4', 'e=5', 'f=true']``: a
    flag with no value means true, for a true/false field of config class `cls` only (else a
    ConfigError naming the field; without `cls` it stays a bare key, which `load_config` refuses)."""
    out, i = [], 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("--"):
            key = tok[2:]
            if "=" in key:
                out.append(key)
            elif i + 1 < len(rest) and not rest[i + 1].startswith("--") and not (
                    _OVERRIDE.match(rest[i + 1]) and _may_be_bare(cls, key)):   # "--log.run_name lr=1e-5": a value
                out.append(f"{key}={rest[i + 1]}")
                i += 1
            else:
                out.append(f"{key}=true" if cls is not None and _bare_flag(cls, key) else key)
        elif "=" in tok:
            out.append(tok)
        else:
            from turborlhf.config import ConfigError    # a bad input: exit code 2

            raise ConfigError(f"unexpected argument '{tok}' (overrides look like key.sub=value)")
        i += 1
    return out


def _may_be_bare(cls, key: str) -> bool:
    """Whether ``--key`` may stand alone (a true/false field of `cls`, or no `cls` to tell): then a
    ``k=v`` token after it is the next override, not its value."""
    from turborlhf.config import ConfigError

    try:
        return cls is None or _bare_flag(cls, key)
    except ConfigError:
        return False


def _bare_flag(cls, key: str) -> bool:
    """True if `key` names a true/false field of config class `cls`; otherwise ConfigError naming it."""
    from turborlhf.config import Cfg, ConfigError, _cfg_class, _scalar_kinds

    node = cls
    for part in key.split("."):
        if not (isinstance(node, type) and issubclass(node, Cfg)):   # inside a free-form mapping
            raise ConfigError(f"{key}: no value given (write --{key} VALUE or {key}=VALUE)")
        if part not in node.model_fields:
            raise ConfigError(f"{key}: unknown field ('{part}' is not a field of {node.__name__})")
        node = _cfg_class(node.model_fields[part].annotation) or node.model_fields[part].annotation
    if _scalar_kinds(node) - {type(None)} != {bool}:
        raise ConfigError(f"{key}: no value given (write --{key} VALUE or {key}=VALUE); "
                          "only true/false fields may be given as a bare flag")
    return True


def _run_train_command(name: str, argv: list[str]) -> int:
    from turborlhf import config as C

    module, func, cls_name, help_text = TRAIN_COMMANDS[name]
    cls = getattr(C, cls_name)
    p = argparse.ArgumentParser(prog=f"turborlhf {name}", description=f"{help_text}. {cls.__doc__ or ''}",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="config fields (override with --field value or field=value):\n"
                                       + "\n".join(C.config_help(cls)))
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in output_dir; refused if the config changed "
                        "(other than output_dir, log.*, distributed.*, train.threads, train.save_every, "
                        "train.keep_checkpoints, train.eval_every)")
    p.add_argument("--resume-changed", action="store_true",
                   help="like --resume, but continue with a changed config (the changes are printed)")
    args, rest = p.parse_known_args(argv)
    try:
        cfg = C.load_config(cls, args.config, _split_overrides(rest, cls))
    except C.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fn: Callable = getattr(importlib.import_module(module), func)
    from turborlhf.distributed.group import WorkerError
    from turborlhf.engine.malloc import keep_freed_memory
    from turborlhf.engine.lifecycle import RunInterrupted, allow_config_change

    keep_freed_memory()           # no page faults for tensors freed and allocated again every step

    try:
        with allow_config_change(args.resume_changed):
            fn(cfg, resume=args.resume or args.resume_changed)
    except WorkerError as e:      # a role worker died, hung or failed: the message names it
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RunInterrupted as e:   # SIGINT/SIGTERM: a resumable checkpoint was kept
        print(f"stopped: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _fetch_model(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="turborlhf fetch-model", description=OTHER_COMMANDS["fetch-model"])
    p.add_argument("name", help="zoo name, e.g. smollm2-135m-instruct")
    p.add_argument("--force", action="store_true", help="download and convert again")
    a = p.parse_args(argv)
    from turborlhf.models.zoo import fetch_model

    print(fetch_model(a.name, force=a.force))
    return 0


def _prepare_data(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="turborlhf prepare-data", description=OTHER_COMMANDS["prepare-data"])
    p.add_argument("dataset", choices=["hh-rlhf", "gsm8k", "reasoning-gym"], help="dataset format")
    p.add_argument("--input", help="hh-rlhf and gsm8k: a .jsonl/.jsonl.gz, .parquet, .arrow, .csv or .json file; "
                   "hh-rlhf also a hub id (Anthropic/hh-rlhf)")
    p.add_argument("--output-dir", required=True, help="where the converted files go")
    p.add_argument("--tokenizer", default="smollm2-135m-instruct", help="tokenizer whose chat template renders dialogues")
    p.add_argument("--test-fraction", type=float, default=0.1, help="share of prompts held out (stable hash split)")
    p.add_argument("--strict", action="store_true", help="any malformed line is an error")
    p.add_argument("--task", help="reasoning-gym: task name (e.g. basic_arithmetic)")
    p.add_argument("--n", type=int, default=1000, help="reasoning-gym: problems to generate")
    p.add_argument("--seed", type=int, default=0, help="reasoning-gym: generator seed")
    a = p.parse_args(argv)
    if a.dataset in ("gsm8k", "reasoning-gym"):
        from turborlhf.data.gsm8k import prepare_gsm8k, summarize
        from turborlhf.data.reasoning_gym import prepare_reasoning_gym

        if a.dataset == "gsm8k" and not a.input:
            p.error("gsm8k needs --input (e.g. data/gsm8k/train.jsonl.gz)")
        if a.dataset == "reasoning-gym" and not a.task:
            p.error("reasoning-gym needs --task NAME")
        try:
            report = (prepare_gsm8k(a.input, a.output_dir, a.strict) if a.dataset == "gsm8k"
                      else prepare_reasoning_gym(a.task, a.n, a.seed, a.output_dir))
        except (ValueError, OSError, ImportError) as e:      # DataError is a ValueError
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(summarize(report))
        return 0
    if not a.input:
        p.error("hh-rlhf needs --input")
    from turborlhf.data.hh_rlhf import run_prepare_data
    from turborlhf.models.zoo import resolve_model_path

    try:
        a.tokenizer = resolve_model_path(a.tokenizer)
        run_prepare_data(a)
    except (ValueError, OSError) as e:        # a bad --test-fraction, an --output-dir that is a file
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _eval(name: str, argv: list[str]) -> int:
    from turborlhf import evaluate

    return evaluate.main(name, argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    from turborlhf.engine.malloc import prefer_huge_pages
    from turborlhf.errors import RunError, UserError
    from turborlhf.metrics import console_logging

    prefer_huge_pages()   # before torch allocates: 2 MiB pages for its large blocks (fewer page faults)

    console_logging()     # progress and status messages; results and errors below are printed

    try:
        return _dispatch(argv)
    except UserError as e:        # bad input: the message names the field, file or path
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:         # a step that would be wrong (NaN, failed sync, drift): the last checkpoint is good
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        import errno

        if debug or e.errno not in (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EDQUOT,
                                    errno.EISDIR, errno.ENOTDIR, errno.EEXIST):
            raise
        # a run directory that is read-only, full or not ours: the path and the reason, not a traceback;
        # checkpoints are written whole or not at all, so the last one is intact
        print(f"error: {e.filename or 'a file'}: {e.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:     # a second SIGINT/SIGTERM, or one outside a training loop
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        lines = ["usage: turborlhf <command> [options]", "", "commands:"]
        for k, v in TRAIN_COMMANDS.items():
            lines.append(f"  {k:<14} {v[3]}")
        for k, v in OTHER_COMMANDS.items():
            lines.append(f"  {k:<14} {v}")
        lines += ["", "`turborlhf <command> --help` shows the command's options and config fields.",
                  "--debug (anywhere) shows the full traceback of an error instead of its one-line message."]
        print("\n".join(lines))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from turborlhf import __version__

        print(__version__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in TRAIN_COMMANDS:
        return _run_train_command(cmd, rest)
    if cmd == "fetch-model":
        return _fetch_model(rest)
    if cmd == "prepare-data":
        return _prepare_data(rest)
    if cmd in ("eval-rm", "eval-policy"):
        return _eval(cmd, rest)
    if cmd == "eval-math":
        from turborlhf.eval_math import main as eval_math_main

        return eval_math_main(rest)
    if cmd == "eval-dpo":
        from turborlhf.trainers.dpo import eval_dpo_main

        return eval_dpo_main(rest)
    if cmd == "plan":
        from turborlhf.plan import main as plan_main

        return plan_main(rest)
    if cmd == "serve-rm":
        from turborlhf.rewards.server import main as serve_main

        return serve_main(rest)
    if cmd == "bench":
        from turborlhf.bench.cli import main as bench_main

        return bench_main(rest)
    if cmd in ("generate", "chat", "export"):
        from turborlhf.commands import main as commands_main

        return commands_main(cmd, rest)
    print(f"error: unknown command '{cmd}' (see turborlhf --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
