"""Asynchronous (k-step-off-policy) rollouts for `turborlhf ppo`: ``rollout.max_staleness: k`` ≥ 1.

While the actor trains on step n, the rollout engines already generate the rollouts of step n+k
(one-step-off-policy for k = 1), with the weights pushed at the end of step n-1. The trainer waits
for that generation only before its next weight push (the engines are busy until then), so
generation time hides behind experience + update time. Peers: verl's ``one_step_off_policy``
recipe, OpenRLHF ``--async_train``, slime's async mode; the correction is decoupled PPO (Hilton et
al. 2022, "Batch size-invariance for policy optimization", Eq. 4): the engine's own log-probs are
the behaviour policy μ, the trainer's log-probs at the current weights are the proximal policy
π_old that the PPO clip is centred on, and the TIS/MIS weight ``π_old/μ`` (``algo.rollout_is``,
`turborlhf.algo.rollout_correction`) corrects for the staleness and the engine/trainer mismatch
at once. ``max_staleness > 0`` therefore requires ``algo.rollout_is`` (a config error otherwise).

Timeline for k = 1 (θ_n = actor weights after n updates; B_n = the rollouts trained at step n)::

    step 0: generate B_0 with θ_0 (no overlap yet) | launch B_1 (θ_0) | train on B_0 → θ_1 | wait B_1, push θ_1
    step 1:                                          launch B_2 (θ_1) | train on B_1 → θ_2 | wait B_2, push θ_2

so ``rollout/staleness`` (actor updates between the weights that generated a batch and the
weights that train on it) is 0 at step 0 and k from step k on. ``max_staleness: 0`` never builds
this pipeline: the synchronous trainer runs unchanged.

Guarantees kept:
- every push is still verified on the canary batch (the push happens only once the engines are
  idle; engines are never put to sleep while a generation is pending: ``distributed.rollout_sleep``
  is refused with ``max_staleness > 0``);
- every wait has a timeout: waiting for a pending batch longer than ``distributed.timeout_s``
  stops the run with `RolloutTimeoutError` (a `WorkerTimeoutError`) naming the step;
- a generation that fails (an engine or a reward function raising) or times out stops the run
  after the step trained meanwhile, which is checkpointed first, whatever ``train.save_every`` is
  (without that batch, which ``--resume`` generates again); after a failure that step's weights
  are pushed too, after a timeout not (an engine may still be busy with the batch);
- a stop signal (SIGINT/SIGTERM) does not wait for a pending generation: a batch already
  generated goes into the checkpoint, one still running is abandoned (no push; ``--resume``
  generates it again, with the checkpoint's weights), so the save fits a scheduler's grace period;
- a checkpoint after step n holds the generated-but-untrained batches of steps n+1 … n+k (prompts,
  responses, finished flags, engine log-probs, scores when already scored, metrics, the policy
  version that generated them, generation time), so ``--resume`` trains on exactly those instead
  of regenerating them with newer weights: a stopped and resumed run equals an uninterrupted one
  (unless a signal abandoned a generation, above).
  A batch that cannot be used (a resume with another ``max_staleness``) is named when dropped.

Threads: on the local backend the background generation runs in a thread of this process (torch
releases the GIL in its kernels, so generation and training overlap on spare cores); on Ray it
waits on the rollout workers. The roles the background thread calls (rollout; reward with dynamic
sampling) are serialised by a lock on the local backend, so no role object is entered by two
threads at once. Generation is seeded per (step, work item, sampling round), so which thread or
engine generates a batch changes nothing. Seeded engines sample with generators of their own
(FastEngine's, HFEngine's `_Sampler`), never reseeding or rewinding torch's process-wide ones,
which the trainer's draws (dropout) use on the other thread.

Not done: a pending generation is not interrupted by a weight push (verl's partial rollouts), and
there is one pending batch at a time, so k > 1 adds staleness but no further overlap.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import asdict, dataclass
from typing import Any, Optional

from turborlhf.config import config_to_dict
from turborlhf.distributed.group import LocalGroup, WorkerTimeoutError
from turborlhf.engine.lifecycle import stop_requested
import turborlhf.trainers.ppo.rlvr as rlvr

logger = logging.getLogger(__name__)

__all__ = ["RolloutBatch", "SyncRollouts", "RolloutPipeline", "RolloutTimeoutError", "GenerationCancelled",
           "actor_version", "rollout_pipeline"]


class RolloutTimeoutError(WorkerTimeoutError):
    """The trainer waited longer than ``distributed.timeout_s`` for a pending rollout batch."""


class GenerationCancelled(BaseException):
    """Raised inside a background generation's thread to stop it (`RolloutPipeline.close`). A
    BaseException, so that no ``except Exception`` on its way (a role group's error wrapping) keeps
    the thread going."""


def _raise_in_thread(thread: threading.Thread, exc: type) -> None:
    """Raise `exc` in `thread` at its next Python instruction (CPython's asynchronous exception;
    a call in C code under way, a torch operation, finishes first)."""
    import ctypes

    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))


def actor_version(step: int, critic_warmup_steps: int) -> int:
    """Actor updates done before step `step` (0-based): the policy version the actor holds then
    (no actor update during the critic warm-up)."""
    return max(0, step - critic_warmup_steps)


@dataclass
class RolloutBatch:
    """A generated, not yet trained rollout batch.

    step: the PPO step (0-based) that trains on it; rollouts: `rlvr.Rollouts` (rows of
    prompts, responses, finished flags, engine log-probs, scores if already scored, metrics);
    version: `actor_version` of the weights that generated it; seconds: generation wall time."""

    step: int
    rollouts: rlvr.Rollouts
    version: int
    seconds: float


class SyncRollouts:
    """``rollout.max_staleness: 0``, the synchronous trainer: `take` generates the step's rollouts
    now (then puts the engines to sleep where ``distributed.rollout_sleep`` frees their memory for
    the update); nothing is pending, saved or measured beyond that. Same interface as
    `RolloutPipeline`, so the PPO step has one path."""

    def __init__(self, cfg, cluster, tok, prompt_ids: list[list[int]], plan: list[list[int]],
                 columns: Optional[list[dict]]) -> None:
        self.cfg, self.cluster, self.tok, self.prompt_ids, self.plan, self.columns = (cfg, cluster, tok, prompt_ids,
                                                                                      plan, columns)

    def take(self, step: int) -> RolloutBatch:
        t0 = time.perf_counter()
        ro = rlvr.collect_rollouts(self.cluster, self.cfg, self.tok, self.prompt_ids, self.plan[step], step,
                                   self.columns)
        seconds = time.perf_counter() - t0
        self.cluster["rollout"].run_alive("sleep")
        return RolloutBatch(step, ro, actor_version(step, self.cfg.algo.critic_warmup_steps), seconds)

    failed: Optional[Exception] = None     # never: a generation's error is raised by `take` itself

    def wait(self) -> None:
        """Nothing is ever pending."""

    def can_push(self) -> bool:
        """The engines are idle after `take`."""
        return True

    def pushed(self, step: int) -> None:
        """The engines' weights are the actor's after every push."""

    def metrics(self, batch: RolloutBatch) -> dict:
        return {}

    def state(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        """Nothing to give back."""


class _Serialized:
    """A local role group whose calls hold a lock: the background generation thread and the
    trainer never enter the same role object at once (reward scoring inside dynamic sampling)."""

    _CALLS = ("run", "run_alive", "run_each", "submit", "submit_each", "ref0", "map_dynamic")

    def __init__(self, group: LocalGroup) -> None:
        self.group, self.lock = group, threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.group, name)
        if name not in self._CALLS:
            return attr

        def locked(*args, **kwargs):
            with self.lock:
                return attr(*args, **kwargs)
        return locked


class RolloutPipeline:
    """Generates the rollouts of future steps in the background (see the module docstring).

    Args:
        cfg: the `PPOConfig` (``rollout.max_staleness`` = k ≥ 1).
        cluster: the run's roles (`turborlhf.trainers.ppo.driver.build_roles`).
        tok, prompt_ids, plan, columns: as `rlvr.collect_rollouts` takes
            them (``plan[step]``: the step's prompt indices).
        start: the first step this process trains (the resumed step, or 0).
        saved: `state()` of the checkpoint resumed from, or None.

    Use: ``take(step)`` at the start of each step, ``wait()`` at the end of each (before its weight
    push) and before each checkpoint, then push only if ``can_push()``; ``failed`` set: checkpoint
    the step, then raise it; ``pushed(step)`` after a push, ``state()`` into the checkpoint (under
    ``STATE_KEY``), ``close()``.
    """

    STATE_KEY = "async_rollouts"      # the key of the pipeline's state in trainer_state.pt
    POLL_S = 0.2                      # how often a wait looks for a stop signal (seconds)
    CANCEL_WAIT_S = 10.0              # how long `close` waits for a cancelled generation to stop (seconds)

    def __init__(self, cfg, cluster, tok, prompt_ids: list[list[int]], plan: list[list[int]],
                 columns: Optional[list[dict]], start: int, saved: Optional[dict] = None) -> None:
        self.cfg, self.cluster, self.tok, self.prompt_ids, self.plan, self.columns = (cfg, cluster, tok, prompt_ids,
                                                                                      plan, columns)
        self.k = cfg.rollout.max_staleness
        self.warmup = cfg.algo.critic_warmup_steps
        self.timeout_s = cfg.distributed.timeout_s
        self.engine_version = actor_version(start, self.warmup)     # the engines hold the start weights
        self.ready: dict[int, RolloutBatch] = {}
        self.pending: Optional[tuple[int, Future]] = None
        self.failed: Optional[Exception] = None     # a generation's error or timeout: the run stops
        self.abandoned: Optional[int] = None        # the step of a batch left generating (engines maybe busy)
        self.waited = 0.0
        self._threads: list[tuple[threading.Thread, Future]] = []     # the background generations
        self._locked: dict[str, Any] = {}
        if cluster.backend == "local":      # the background thread calls these roles
            for role in ("rollout", "reward"):
                self._locked[role] = cluster.groups[role]
                cluster.groups[role] = _Serialized(cluster.groups[role])
        if saved:
            self._restore(saved, start)

    # -- resume ---------------------------------------------------------------------------------
    def _settings(self, step: int) -> str:
        """Digest of what a batch of `step` was made with: its prompts, the group size and every
        algo, rollout (but max_staleness), reward and data setting. A batch saved under other
        settings (``--resume-changed``) is generated again: trained as it was, a changed group size
        regrouped its samples (or crashed on a shape), changed rewards kept the old scores."""
        import hashlib
        import json

        c = config_to_dict(self.cfg)
        c["rollout"].pop("max_staleness", None)
        used = {k: c.get(k) for k in ("algo", "rollout", "rewards", "reward_model", "data")}
        return hashlib.sha256(json.dumps([used, self.plan[step]], sort_keys=True, default=str).encode()).hexdigest()

    def _restore(self, saved: dict, start: int) -> None:
        keep = range(start, min(start + self.k, len(self.plan)))
        dropped, changed = [], []
        for b in saved["batches"]:
            if b["step"] not in keep:
                dropped.append(b["step"])
            elif b.get("settings") not in (None, self._settings(b["step"])):
                changed.append(b["step"])
            else:
                self.ready[b["step"]] = RolloutBatch(b["step"], rlvr.Rollouts(**b["rollouts"]), b["version"],
                                                     b["seconds"])
        if dropped:
            logger.info(f"[ppo] --resume: dropping the saved rollouts of step(s) {', '.join(str(s + 1) for s in dropped)} "
                        f"(rollout.max_staleness={self.k} does not train them next); they are generated again")
        if changed:
            steps = ", ".join(str(s + 1) for s in changed)
            logger.warning(f"[ppo] --resume: dropping the saved rollouts of step(s) {steps}: generated under other "
                           "settings (--resume-changed); they are generated again")
        if self.ready:
            logger.info(f"[ppo] --resume: training on the saved rollouts of step(s) "
                        f"{', '.join(str(s + 1) for s in sorted(self.ready))} (not generated again)")

    def state(self) -> dict:
        """Picklable state for the checkpoint: every generated, untrained batch (call `wait` first)."""
        if self.pending is not None:
            raise RuntimeError("RolloutPipeline.state: a generation is pending; call wait() first")
        return {"max_staleness": self.k, "engine_version": self.engine_version,
                "batches": [{"step": b.step, "rollouts": asdict(b.rollouts), "version": b.version,
                             "seconds": b.seconds, "settings": self._settings(b.step)}
                            for b in sorted(self.ready.values(), key=lambda b: b.step)]}

    # -- generation -----------------------------------------------------------------------------
    def _generate(self, step: int, version: int) -> RolloutBatch:
        t0 = time.perf_counter()
        ro = rlvr.collect_rollouts(self.cluster, self.cfg, self.tok, self.prompt_ids, self.plan[step], step,
                                   self.columns)
        return RolloutBatch(step, ro, version, time.perf_counter() - t0)

    def _launch(self, step: int) -> None:
        fut: Future = Future()
        version = self.engine_version

        def work() -> None:
            try:
                batch = self._generate(step, version)
            except BaseException as e:      # handed to the trainer by wait()
                fut.set_exception(e)
                return
            fut.set_result(batch)

        thread = threading.Thread(target=work, name=f"rollouts-step-{step + 1}", daemon=True)
        thread.start()
        self._threads = [(t, f) for t, f in self._threads if t.is_alive()] + [(thread, fut)]
        self.pending = (step, fut)

    def wait(self) -> None:
        """Wait for the pending batch (if any) and keep it; never raises for the generation.

        The run is to stop after the step trained meanwhile, once that step is checkpointed, when
        this sets ``failed``: the generation's error (e.g. a `WorkerError`; the engines are idle, so
        the step's weights are still pushed), or after ``distributed.timeout_s`` seconds a
        `RolloutTimeoutError`, or a generation's own `WorkerTimeoutError` (an engine may still be
        busy: no push, `can_push` is False). Raised here, they lost that step's checkpoint, and with
        ``train.save_every`` every step since the previous one. On a stop signal (SIGINT/SIGTERM,
        looked for every `POLL_S` seconds) a batch not generated yet is abandoned, not waited for:
        the signal's checkpoint goes without it (``--resume`` generates it again) and `can_push` is
        False."""
        if self.pending is None:
            return
        step, fut = self.pending
        t0 = time.perf_counter()
        try:
            while not fut.done():
                left = self.timeout_s - (time.perf_counter() - t0)
                signum = stop_requested()
                if signum is not None:
                    self.pending, self.abandoned = None, step
                    logger.warning(f"[ppo] {signal.Signals(signum).name}: not waiting for the rollouts of step "
                                   f"{step + 1} (generated in the background); the checkpoint goes without them, "
                                   "--resume generates them again")
                    return
                if left <= 0:
                    self.pending, self.abandoned = None, step
                    self.failed = RolloutTimeoutError(
                        f"the rollouts of step {step + 1} (generated in the background, "
                        f"rollout.max_staleness={self.k}) were not ready within {self.timeout_s:g} s "
                        "(distributed.timeout_s)", "rollout", None, "generate")
                    return
                futures_wait([fut], timeout=min(left, self.POLL_S))
            batch = fut.result()
        except WorkerTimeoutError as e:      # an engine may still be busy (Ray's item timeout on a shared process)
            self.pending, self.abandoned, self.failed = None, step, e
            return
        except Exception as e:
            self.pending, self.failed = None, e
            logger.warning(f"[ppo] the rollouts of step {step + 1} (generated in the background) failed: "
                           f"{type(e).__name__}: {e}; the run stops after this step (pushed and saved first)")
            return
        finally:
            self.waited += time.perf_counter() - t0
        self.pending = None
        self.ready[step] = batch

    def can_push(self) -> bool:
        """Whether the engines may take new weights: not after `wait` abandoned a generation (timed
        out, or a stop signal) that may still be running on them."""
        return self.abandoned is None

    def take(self, step: int) -> RolloutBatch:
        """The rollouts of `step` (generated now only at the start, or after a resume without saved
        ones), after launching the generation of step ``step + k`` with the engines' current weights.
        Raises the error of a generation that failed or timed out since the last step (`wait`), and
        RuntimeError after an abandoned one (the engines may be busy)."""
        self.waited = 0.0
        self.wait()
        if self.failed is not None:
            failed, self.failed = self.failed, None
            raise failed
        if self.abandoned is not None:
            raise RuntimeError(f"RolloutPipeline.take: the generation of step {self.abandoned + 1} was abandoned "
                               "(a stop signal); stop the run")
        for s in range(step, min(step + self.k, len(self.plan))):
            if s not in self.ready:
                self.ready[s] = self._generate(s, self.engine_version)
        batch = self.ready.pop(step)
        if step + self.k < len(self.plan):
            self._launch(step + self.k)
        return batch

    def pushed(self, step: int) -> None:
        """The actor's weights after step `step` (0-based) are in the engines."""
        self.engine_version = actor_version(step + 1, self.warmup)

    def metrics(self, batch: RolloutBatch) -> dict:
        """``rollout/staleness`` (actor updates between the weights that generated `batch` and those
        that train on it) and ``timing/rollout_wait`` (seconds this step waited for pending rollouts)."""
        return {"rollout/staleness": float(actor_version(batch.step, self.warmup) - batch.version),
                "timing/rollout_wait": self.waited}

    def close(self) -> None:
        """Stop a generation still running (pending, or abandoned by `wait`), then give the roles back
        their unlocked groups. `GenerationCancelled` is raised in its thread at its next Python
        instruction (after the torch operation under way) and the thread is waited for up to
        `CANCEL_WAIT_S` seconds, so the roles are not shut down under it and the interpreter does not
        exit while it runs inside torch (an abort, exit code 134, instead of the run's own code). A
        thread blocked longer in one call is left to run (a daemon); on Ray its calls end with their
        own timeouts or the cluster's shutdown."""
        live = [(t, f) for t, f in self._threads if t.is_alive()]
        for t, f in live:
            if not f.done():            # a thread whose generation has ended is left to return
                _raise_in_thread(t, GenerationCancelled)
        deadline = time.monotonic() + self.CANCEL_WAIT_S
        for t, _ in live:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads = [(t, f) for t, f in live if t.is_alive()]
        for role, group in self._locked.items():
            self.cluster.groups[role] = group
        self._locked.clear()
        self.pending = None


def rollout_pipeline(cfg, cluster, tok, prompt_ids: list[list[int]], plan: list[list[int]],
                     columns: Optional[list[dict]], start: int, state: dict) -> "RolloutPipeline | SyncRollouts":
    """Where the run's rollouts come from: a `RolloutPipeline` with ``rollout.max_staleness > 0``
    (given the checkpoint's trainer `state`, ``{}`` for a fresh run, it trains on the saved
    rollouts), else `SyncRollouts`; on a resume to ``max_staleness: 0`` it names the saved rollouts
    it drops (they are generated again)."""
    saved = state.get(RolloutPipeline.STATE_KEY)
    if cfg.rollout.max_staleness:
        return RolloutPipeline(cfg, cluster, tok, prompt_ids, plan, columns, start, saved)
    if saved and saved["batches"]:
        logger.info("[ppo] --resume: rollout.max_staleness=0: dropping the saved rollouts of step(s) "
                    f"{', '.join(str(b['step'] + 1) for b in saved['batches'])}; they are generated again")
    return SyncRollouts(cfg, cluster, tok, prompt_ids, plan, columns)
