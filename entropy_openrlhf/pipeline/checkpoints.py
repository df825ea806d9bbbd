"""Checkpoints: writing one atomically, finding the newest complete one, resuming from it, and rotating old ones.

A checkpoint is checkpoints/step<N>: the DeepSpeed state of every policy rank (weights, optimizer, RNG), an HF export
of the weights, trainer_state.json (step, prompt-stream position, the entropy controller; in a streaming run the
prompts drawn but not yet trained, `open_prompts`) and, in an asynchronous run (`--rollout.mode batch`),
pending.pkl: the batches for steps N .. N + max_staleness - 1, which the save takes from the producer (waiting for
those it still generates), and the evaluations not yet logged. Folders are renamed into place only when complete, so
whatever stops a run mid-save, resume sees complete checkpoints only.

Why the pending batches are saved: one version behind, the run trains step N on a batch that version N - 1's
weights generated while step N - 1 trained, and the checkpoint holds version N. Generated again after a resume,
that batch would come from version N (staleness 0, other samples): another run. Regenerating it exactly would need
version N - 1's weights too (a second copy of the model), and vLLM on GPUs does not repeat a generation bit for bit;
the batch itself is small beside the checkpoint (about 30 bytes per response token: a 7B DAPO batch of 2048
responses of 8k tokens is under 0.5 GB, against some 120 GB of weights and optimizer state). From step
N + max_staleness on, the batches come from version N or later, which the resumed run generates as the unbroken one
did: the same weights, the same prompt-stream position and so the same per-prompt seeds.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections import deque
from pathlib import Path
from typing import Any

from entropy_openrlhf.config import Config, ConfigError
from entropy_openrlhf.ray_waits import wait_dead


class Checkpointing:
    """Saving and resuming the trainer (a mixin of Trainer). It reads the trainer's config, policy group, weight
    sync, prompt stream, training prompts and entropy controller."""

    cfg: Config
    policy: Any
    sync: Any
    stream: Any
    train_items: list
    entropy_ctl: Any
    carried: deque  # batches taken from the producer ahead of their step: the step loop trains them first
    streamer: Any  # the streaming producer (`--rollout.mode stream|partial`), None in batch mode
    reopen: list  # the open prompts of the checkpoint resumed from, for the streaming producer to roll out first
    eval_results: list
    _eval_lock: Any

    def save(self, version: int, stream_after: tuple[int, int], producer: Any = None) -> Path:
        """Write checkpoints/step<N>: the DeepSpeed state (weights, optimizer, each rank's RNG), an HF export, the
        trainer state (step, prompt-stream position, the entropy controller) and, given the `producer` thread, the
        pending batches and evaluations (take_pending). It is written as .tmp-step<N> and renamed when complete, so a
        run killed mid-save leaves only a temporary folder, which resume ignores."""
        root = Path(self.cfg.train.output_dir) / "checkpoints"
        final, tmp, old = (root / f"{prefix}step{version}" for prefix in ("", ".tmp-", ".old-"))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.unfinished_save = tmp  # until the rename: a run stopped meanwhile removes it (discard_unfinished_save)
        deadline = {"timeout_s": self.cfg.train.save_timeout_s, "what": "--train.save_timeout_s"}
        self.policy.call_all("save_checkpoint", str(tmp / "deepspeed"), "state", **deadline)
        self.policy.call_all("save_hf", str(tmp / "hf"), **deadline)  # a complete HF folder: weights, config, tokenizer
        # after the policy's files: meanwhile the producer finishes the batch it generates
        pending, evaluations = self.take_pending(producer, version) if producer is not None else ([], [])
        open_prompts = None
        if getattr(self, "streamer", None) is not None:  # its position has drawn past the open prompts
            stream_after, open_prompts = self.streamer.open_prompts(version)
        if pending or evaluations:
            with open(tmp / PENDING_FILE, "wb") as f:
                pickle.dump({"batches": pending, "evaluations": evaluations}, f, protocol=pickle.HIGHEST_PROTOCOL)
        state = {
            "step": version,
            "stream_epoch": stream_after[0],
            "stream_offset": stream_after[1],
            "seed": self.cfg.train.seed,
            "train_prompts": len(self.train_items),
            "optimizer_steps_per_step": self.cfg.train.optimizer_steps_per_step,
            "shuffle": self.cfg.data.shuffle,
            "lr_schedule": schedule_settings(self.cfg),
            "entropy_ctl": self.entropy_ctl.state_dict(),
            "pending_batches": len(pending),  # in pending.pkl; the stream position above is the one before them
        }
        if open_prompts is not None:  # streaming: drawn, not trained; [epoch, position in the training prompts]
            state["open_prompts"] = [list(p) for p in open_prompts]
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        if final.exists():  # the same step saved again (a resumed run): move the complete copy aside, then replace
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        self.unfinished_save = None
        shutil.rmtree(old, ignore_errors=True)
        rotate_checkpoints(root, self.cfg.train.keep_checkpoints)
        return final

    def take_pending(self, producer: Any, version: int) -> tuple[list, list]:
        """At the save after `version` steps, `--rollout.mode batch`: the batches for steps version ..
        version + max_staleness - 1 (those the producer generates with weights older than `version`), taken from the
        producer's queue into `carried`, where the step loop takes them from; and the evaluations finished but not yet
        logged of versions before `version` (a resumed run evaluates only from `version` on). Taking the batches
        early changes nothing in this run: the producer's next batch waits for weights `version` or newer, which it
        would under the queue's bound too. A producer's failure met here stays in `carried`, to be raised at its
        step, and the checkpoint holds the batches before it."""
        cfg = self.cfg
        if cfg.rollout.mode != "batch":  # the streaming producer's buffer is not saved (its groups are regenerated)
            return [], []
        end = min(version + cfg.async_.max_staleness, cfg.train.num_steps)
        step = version + len(self.carried)  # a save before may have taken some already
        while step < end and not (self.carried and isinstance(self.carried[-1], BaseException)):
            self.carried.append(self._next_batch(producer, step))
            step += 1
        batches = []
        for item in self.carried:
            if isinstance(item, BaseException):
                break
            batches.append(item)
        with self._eval_lock:
            evaluations = [(v, result) for v, result in self.eval_results if v < version]
        return batches, evaluations

    def discard_unfinished_save(self, timeout_s: float = 30.0) -> Path | None:
        """After the groups are shut down: remove the folder of a save the run stopped in (SIGTERM, a lost node,
        an error), so no half-written checkpoint is left. The policy ranks may still be writing into it when the
        driver stops, so it first waits (at most `timeout_s`) until they are gone. Returns the folder removed."""
        tmp = getattr(self, "unfinished_save", None)
        if tmp is None or not tmp.exists():
            return None
        left = wait_dead(self.policy.actors, timeout_s) if getattr(self, "policy", None) is not None else 0
        if left:
            print(f"[entropy-openrlhf] {left} policy rank(s) still answer {timeout_s:.0f} s after the kill; removing "
                  f"{tmp} anyway", flush=True)  # fmt: skip
        # renamed first (one atomic step), then deleted, as rotate_checkpoints does
        doomed = tmp.with_name(".del-" + tmp.name.removeprefix(".tmp-"))
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(tmp, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        self.unfinished_save = None
        return tmp

    def resume(self) -> int:
        """Load the newest complete checkpoint: weights, optimizer and RNG state on every policy rank, the pending
        batches and evaluations, and the prompt-stream position. Returns the step to continue from (0 when there is
        none). Every other random draw (vLLM's per-prompt seeds, Clip-Cov's choice) is derived from the seed and the
        step or stream position, so the resumed steps repeat what the lost ones did."""
        found = resume_point(self.cfg, len(self.train_items))
        if found is None:  # the driver said so before the actors started
            return 0
        ckpt, state = found
        deadline = {"timeout_s": self.cfg.train.save_timeout_s, "what": "--train.save_timeout_s"}
        self.policy.call_all("load_checkpoint", str(ckpt / "deepspeed"), "state", **deadline)
        step = int(state["step"])
        position = state["stream_epoch"], state["stream_offset"]
        if (ckpt / PENDING_FILE).is_file():  # absent when nothing was pending, and in older checkpoints
            pending = pickle.loads((ckpt / PENDING_FILE).read_bytes())
            with self._eval_lock:  # the unbroken run logged them with step `step`
                self.eval_results.extend(pending["evaluations"])
            kept = trainable(pending["batches"], step, self.cfg)
            self.carried.extend(kept)
            position = kept[-1].stream_after if kept else position
            if len(kept) < len(pending["batches"]):
                print(f"[entropy-openrlhf] {len(pending['batches']) - len(kept)} of the checkpoint's "
                      f"{len(pending['batches'])} pending batches are generated again from its weights (this run's "
                      "--rollout.mode or --async.max_staleness does not take them)", flush=True)  # fmt: skip
        open_prompts = [tuple(p) for p in state.get("open_prompts", [])]
        if open_prompts and self.cfg.rollout.mode == "batch":
            print(f"[entropy-openrlhf] the checkpoint's {len(open_prompts)} prompts in flight or buffered at the save "
                  "(a streaming run's) are not rolled out again: --rollout.mode batch continues from the stream's "
                  "position", flush=True)  # fmt: skip
        elif open_prompts:
            self.reopen = open_prompts
            print(f"[entropy-openrlhf] {len(open_prompts)} prompts in flight or buffered at the save are rolled out "
                  "again first, from the checkpoint's weights", flush=True)  # fmt: skip
        self.stream.epoch, self.stream.offset = position
        self.stream._order = self.stream._make_order()
        if "entropy_ctl" in state:  # absent in checkpoints written before the controller existed
            self.entropy_ctl.load_state_dict(state["entropy_ctl"])
        self.sync.publish(step)  # the engines start from the initial model: the checkpoint's weights, before batch 0
        print(f"[entropy-openrlhf] resumed from {ckpt} at step {step}", flush=True)
        return step


PENDING_FILE = "pending.pkl"


def trainable(batches: list, step: int, cfg: Config) -> list:
    """The leading pending batches (for steps `step`, `step` + 1, ...) this run can train as they are: in
    `--rollout.mode batch`, each generated by weights within --async.max_staleness of its step."""
    if cfg.rollout.mode != "batch":
        return []
    kept = []
    for k, batch in enumerate(batches):
        oldest = min(s.policy_version for group in batch.groups for s in group)
        if oldest < step + k - cfg.async_.max_staleness:
            break
        kept.append(batch)
    return kept


CHECKPOINT_NAME = re.compile(r"step(\d+)")


def resume_point(cfg: Config, train_prompts: int) -> tuple[Path, dict] | None:
    """The newest complete checkpoint under output_dir and its trainer state, or None when there is none. Raises
    ConfigError when it was written with another seed or prompt count: its prompt-stream position would point
    elsewhere. The driver calls it before any actor starts, and `Trainer.resume` again when it loads."""
    ckpt = latest_checkpoint(Path(cfg.train.output_dir) / "checkpoints")
    if ckpt is None:
        return None
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--train.resume: {ckpt / 'trainer_state.json'} does not read ({e}); move that checkpoint aside to "
            "resume from the one before"
        ) from None
    for key, flag, now in (
        ("seed", "--train.seed", cfg.train.seed),
        ("train_prompts", "--data.train / --data.max_samples (prompt count)", train_prompts),
        ("shuffle", "--data.shuffle", cfg.data.shuffle),
    ):
        if key in state and state[key] != now:
            raise ConfigError(
                f"--train.resume: {ckpt} was written with {flag} {state[key]}, this run has {now}; "
                "its prompt-stream position would not match"
            )
    # DeepSpeed restores the scheduler's count of optimizer steps: with other steps per RL step, a warmup or a
    # decay would end early or late (a constant rate does not care)
    per_step = cfg.train.optimizer_steps_per_step
    shaped = cfg.actor.lr_scheduler != "constant" or cfg.actor.lr_warmup_steps > 0
    if shaped and state.get("optimizer_steps_per_step", per_step) != per_step:
        raise ConfigError(
            f"--train.resume: {ckpt} was written with {state['optimizer_steps_per_step']} optimizer steps per RL step "
            f"(--train.mini_batches x --train.ppo_epochs), this run has {per_step}; the learning-rate schedule "
            f"(--actor.lr_scheduler {cfg.actor.lr_scheduler}, --actor.lr_warmup_steps {cfg.actor.lr_warmup_steps}) "
            "counts optimizer steps, so its position would not match"
        )
    # DeepSpeed restores the scheduler's step count but not its shape: the same count on another schedule (a longer
    # run, another warm-up or floor) lands elsewhere on it, and the rate jumps
    saved = state.get("lr_schedule")  # absent in checkpoints written before it was saved
    if shaped and saved is not None:
        changed = [f"{name} {saved.get(name)} -> {now}" for name, now in schedule_settings(cfg).items()
                   if saved.get(name) != now]  # fmt: skip
        if changed:
            raise ConfigError(
                f"--train.resume: {ckpt} was written on another learning-rate schedule ({'; '.join(changed)}); the "
                "restored step count would land elsewhere on this one and the rate would jump. Resume with the "
                "checkpoint's settings, or use a constant rate"
            )
    return ckpt, state


def schedule_settings(cfg: Config) -> dict[str, str | int | float]:
    """What fixes the learning rate at each optimizer step, by the flags that set it (saved with a checkpoint)."""
    return {
        "--actor.lr_scheduler": cfg.actor.lr_scheduler,
        "--actor.lr_warmup_steps": cfg.actor.lr_warmup_steps,
        "--actor.min_lr_ratio": cfg.actor.min_lr_ratio,
        "optimizer steps in the run (--train.num_steps x mini_batches x ppo_epochs)": cfg.train.total_optimizer_steps,
    }


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step. Only step<N> folders holding trainer_state.json count:
    .tmp-step<N> (a save cut short) and .old-step<N> (a copy being replaced) never do."""
    if not root.is_dir():
        return None
    done = []
    for path in root.iterdir():
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and (path / "trainer_state.json").is_file():
            done.append((int(match.group(1)), path))
    return max(done)[1] if done else None


def rotate_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints (0 = keep all); return what was deleted. Each is first
    renamed to .del-step<N> (one atomic step, after which resume no longer sees it) and then removed, so a run
    killed in the middle leaves a folder resume ignores, never a half-deleted checkpoint it would pick."""
    for leftover in root.glob(".del-step*"):  # from a run killed while deleting
        shutil.rmtree(leftover, ignore_errors=True)
    if keep <= 0 or not root.is_dir():
        return []
    done = sorted(
        (int(m.group(1)), path)
        for path in root.iterdir()
        if (m := CHECKPOINT_NAME.fullmatch(path.name)) and (path / "trainer_state.json").is_file()
    )
    deleted = []
    for _, path in done[:-keep]:
        doomed = root / f".del-{path.name}"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(path)
    return deleted
