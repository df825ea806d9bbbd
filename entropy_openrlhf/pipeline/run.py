"""A run of a pipeline, once main.py has parsed its flags: every check of the input (`prepare`), then Ray, the
actor groups, training, and the clean-up however the run ends (`run`).

Everything that can be wrong with the input (flags, model folder, dataset rows, the verifier) is checked before
any actor starts, and reported as one line naming the flag, file, row or field.

main.py imports this module only after the flags are parsed, so that `--help` and a mistyped flag answer without
what it imports (main.py's docstring).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import ray
from transformers import AutoTokenizer

from entropy_openrlhf.actors.reward import verifier_items
from entropy_openrlhf.cluster import init_ray, joins_cluster, resolve_output_dir
from entropy_openrlhf.cluster_fit import check_nodes, cluster_snapshot, fit_cluster
from entropy_openrlhf.config import Config, ConfigError, validate
from entropy_openrlhf.data.arith_task import write_builtin_task
from entropy_openrlhf.data.dataset import DatasetError, load_prompts, validate_dataset
from entropy_openrlhf.data.tool_task import write_tool_task
from entropy_openrlhf.models.smollm2 import MODEL_NAME, ensure_smollm2
from entropy_openrlhf.models.tiny import make_tiny_model
from entropy_openrlhf.pipeline.checkpoints import latest_checkpoint, resume_point
from entropy_openrlhf.pipeline.faults import NodeLostError
from entropy_openrlhf.pipeline.tracking import Tracker, summarize
from entropy_openrlhf.pipeline.trainer import Trainer
from entropy_openrlhf.samples import PromptItem, Sample
from entropy_openrlhf.tools.sandbox import SandboxUnavailableError, check_sandbox
from rewards import Verifier, VerifierLoadError, load_verifier, probe

T = TypeVar("T")


def resolve_model(cfg: Config, shared: bool = False) -> str:
    """The model folder. The built-in ones are made on the spot: `tiny` under the output folder, SmolLM2 in a cache
    on this machine, or with `shared` (a multi-node cluster) under the output folder, which every node mounts."""
    name = cfg.model.pretrain
    if name == "tiny":
        folder = Path(cfg.train.output_dir) / "tiny_model"
        if not (folder / "config.json").exists():
            make_tiny_model(folder, seed=cfg.train.seed)
        return str(folder)
    if not name:
        return ensure_smollm2(str(Path(cfg.train.output_dir) / "models" / MODEL_NAME) if shared else None)
    if not Path(name).is_dir():
        raise ConfigError(f"--pretrain {name}: no such folder (models are not downloaded at run time)")
    if not (Path(name) / "config.json").exists():
        raise ConfigError(f"--pretrain {name}: the folder holds no HF model (no config.json)")
    return name


def resolve_data(cfg: Config, need_train: bool = True) -> tuple[str, list[str]]:
    """Paths of the training prompts and of the test sets (`--data.test` takes several, separated by commas). The
    built-in task is written to the output folder when training data is needed but not given, or when neither is."""
    train = cfg.data.train
    tests = [p.strip() for p in cfg.data.test.split(",") if p.strip()]
    if not train and (need_train or not tests):
        out, task = Path(cfg.train.output_dir) / "data", cfg.data.builtin_task
        if task == "auto":  # a tool rollout gets the prompt that shows its call format
            task = "arith_tools" if cfg.uses_tools else "arith"
        if task == "arith":
            train, builtin_test = write_builtin_task(out, seed=cfg.train.seed, levels=cfg.data.levels())
        else:
            train, builtin_test = write_tool_task(
                out, seed=cfg.train.seed, levels=cfg.data.levels(), prefill=task == "arith_tools_prefilled"
            )
        if tests and (cfg.data.input_key, cfg.data.label_key) != ("prompt", "label"):
            raise ConfigError(
                f"--data.test given without --data.train: training would use the built-in task, whose rows have the "
                f"fields prompt and label, while --data.input_key {cfg.data.input_key} / --data.label_key "
                f"{cfg.data.label_key} name the test set's; give --data.train too (the keys apply to both)"
            )
        tests = tests or [str(builtin_test)]
        cfg.data.input_key, cfg.data.label_key = "prompt", "label"
    # --eval.every with --data.train and no test set is refused before this (config/validation.py)
    for path in [train, *tests] if need_train else tests:
        validate_dataset(path, input_key=cfg.data.input_key, label_key=cfg.data.label_key)
    return str(train), tests


def check_tools_sandbox(cfg: Config) -> str | None:
    """A run whose rollout function runs tool calls fails closed: a ConfigError saying why when the sandbox cannot
    start on this machine; with --tools.sandbox none, the loud warning it prints (and returns, for the run's log)."""
    if not cfg.uses_tools:
        return None
    try:
        warning = check_sandbox(cfg.tools.sandbox)
    except SandboxUnavailableError as e:
        raise ConfigError(str(e)) from None
    if warning:
        print(f"[entropy-openrlhf] WARNING: {warning}", file=sys.stderr, flush=True)
    return warning


def prepare(cfg: Config, need_train: bool = True, shared_model: bool = False):
    """All checks and input loading; no actor starts here. `eval.max_samples` applies to each test set. Without
    `need_train` (scripts/evaluate.py) no training prompts are loaded, and given test sets keep the user's keys.
    `shared_model`: write a built-in model where every node of a multi-node cluster can read it."""
    validate(cfg)
    check_tools_sandbox(cfg)
    verifier = load_verifier(cfg.reward.verifier)  # a verifier that does not load fails now, not in a worker
    try:  # the built-in model and task, the W&B run and the checkpoints go there
        Path(cfg.train.output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--train.output_dir {cfg.train.output_dir}: cannot make the folder: {e.strerror}") from None
    model_path = resolve_model(cfg, shared=shared_model)
    train_path, test_paths = resolve_data(cfg, need_train)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:  # what transformers raises for a folder without a usable tokenizer
        raise ConfigError(f"--pretrain {model_path}: its tokenizer does not load: {str(e).splitlines()[0]}") from None
    kw = dict(
        tokenizer=tokenizer,
        input_key=cfg.data.input_key,
        label_key=cfg.data.label_key,
        apply_chat_template=cfg.data.apply_chat_template,
        system_prompt=cfg.data.system_prompt or None,
    )
    train_items = []
    if need_train:
        train_items = load_prompts(train_path, max_samples=cfg.data.max_samples or None, **kw)
        check_prompt_lengths(train_path, train_items, tokenizer, cfg)
        if cfg.train.resume and resume_point(cfg, len(train_items)) is None:  # one it cannot continue fails here
            print(f"[entropy-openrlhf] --train.resume: no complete checkpoint in {cfg.train.output_dir}/checkpoints: "
                  "this run starts at step 0", flush=True)  # fmt: skip
        earlier = None if cfg.train.resume else latest_checkpoint(Path(cfg.train.output_dir) / "checkpoints")
        if earlier is not None:
            # a fresh run there would save between the earlier run's checkpoints, rotation would keep the newest
            # steps of both, and a later resume could continue the earlier run
            raise ConfigError(
                f"--train.output_dir {cfg.train.output_dir} holds checkpoints of an earlier run (newest: "
                f"{earlier.name}): --train.resume true continues it; to start afresh, give another "
                f"--train.output_dir or remove {earlier.parent}"
            )
    test_items = []
    for path in test_paths:
        items = load_prompts(path, max_samples=cfg.eval.max_samples or None, **kw)
        check_prompt_lengths(path, items, tokenizer, cfg)
        test_items += items
    first_path = train_path if train_items else (test_paths[0] if test_paths else "")
    probe_verifier(verifier, cfg, first_path, (train_items or test_items)[:1], tokenizer)
    return model_path, train_items, test_items


def probe_verifier(verifier: Verifier, cfg: Config, path: str, first: list[PromptItem], tokenizer) -> None:
    """The verifier tried on the first row, its own label given as the response, before any actor starts. A result
    of the wrong shape (a dict without its reward, an OpenRLHF file's short list) would fail every sample of the
    run: refused, naming the row. Any other error may be this response's own (a label is rarely in the answer
    format a verifier parses): said in one line, since one that every response raises scores every sample 0. An
    OpenRLHF file gets its query as a run builds it (verifier_items): the prompt and the label's tokens, ended by the
    end-of-turn token, decoded with their special tokens."""
    if not first:
        return
    item = first[0]
    # the label as a response that stopped at the end-of-turn token, made into the verifier's item as a run makes it
    response_ids = tokenizer(str(item.label), add_special_tokens=False)["input_ids"]
    response_ids += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sample = Sample(
        prompt_index=item.index, prompt=item.prompt,
        prompt_token_ids=tokenizer(item.prompt, add_special_tokens=False)["input_ids"], response=str(item.label),
        response_token_ids=response_ids, rollout_log_probs=[0.0] * len(response_ids), label=item.label,
        policy_version=0, finish_reason="stop", data_source=item.data_source, metadata=dict(item.metadata),
    )  # fmt: skip
    [tried] = verifier_items([sample], tokenizer if verifier.batched else None)
    problem, every_sample = probe(verifier, tried, cfg.reward.timeout_s)
    where = f"verifier {cfg.reward.verifier!r} on the first row of {path}, given its label as the response"
    if every_sample:
        raise VerifierLoadError(f"{where}: {problem}; every sample would fail so (docs/guides/verifiers.md)")
    if problem:
        print(f"[entropy-openrlhf] note: {where}: {problem}. A response that raises scores 0 (reward/errors); if "
              "real responses raise too, check the verifier (docs/guides/verifiers.md, 'Try a verifier')",
              flush=True)  # fmt: skip


def check_prompt_lengths(path: str, items: list, tokenizer, cfg: Config) -> None:
    """A prompt the engine would reject must fail now, naming its row, not minutes later inside vLLM."""
    limit = cfg.rollout.max_model_len - cfg.rollout.max_new_tokens
    if limit <= 0:
        raise ConfigError(
            f"--rollout.max_new_tokens {cfg.rollout.max_new_tokens} leaves no room for a prompt in "
            f"--rollout.max_model_len {cfg.rollout.max_model_len}"
        )
    # the engine tokenizes the templated text the same way: no special tokens added
    lengths = [len(ids) for ids in tokenizer([it.prompt for it in items], add_special_tokens=False)["input_ids"]]
    for item, n in zip(items, lengths):
        if n > limit:
            raise ConfigError(
                f"{path}: row {item.index}: the prompt is {n} tokens, more than --rollout.max_model_len "
                f"{cfg.rollout.max_model_len} minus --rollout.max_new_tokens {cfg.rollout.max_new_tokens}; "
                "raise max_model_len or shorten the prompt"
            )


class StopRequested(BaseException):
    """SIGTERM in the driver: what `ray job stop`, SLURM and Kubernetes send before they SIGKILL. A BaseException,
    like KeyboardInterrupt, so no `except Exception` on the way swallows it."""


def _stop_on_sigterm(signum: int, frame) -> None:
    # Once stopping, further SIGTERMs are ignored: the driver is already doing what they ask (the sender's SIGKILL,
    # after its grace period, remains the backstop).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise StopRequested(signal.Signals(signum).name)


def signal_behind(error: BaseException) -> StopRequested | KeyboardInterrupt | None:
    """The StopRequested or KeyboardInterrupt that `error` was raised from, directly or further back, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (StopRequested, KeyboardInterrupt)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _stopped_by(signal_error: StopRequested | KeyboardInterrupt, trainer: Trainer) -> tuple[int, str]:
    """The exit code and the first words of the stop's last line."""
    name = "SIGTERM" if isinstance(signal_error, StopRequested) else "SIGINT"
    when = f"during step {trainer.step_in_progress}" if hasattr(trainer, "step_in_progress") else "at start-up"
    code = 143 if isinstance(signal_error, StopRequested) else 130  # 128 + the signal's number, as a shell reports it
    return code, f"[entropy-openrlhf] stopped by {name} {when}"


def resume_command(pipeline: str, argv: list[str]) -> str:
    """The command that continues this run: the same flags, with `--train.resume true`."""
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else f"pipelines/{pipeline}.py"
    args, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--train.resume="):
            skip = False
            continue
        if arg == "--train.resume":
            skip = True  # and its value
            continue
        args.append(arg)
    command = shlex.join(["python", script, *args, "--train.resume", "true"])
    # a submitted job (Ray's job supervisor gives its driver the job's config in this variable): submit it again
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ or os.environ.get("RAY_JOB_ID"):
        command = f"ray job submit <your options> -- {command}"
    return command


def resume_note(cfg: Config, pipeline: str, argv: list[str]) -> str:
    """Where a resume continues from, and the command."""
    ckpt = latest_checkpoint(Path(cfg.train.output_dir) / "checkpoints")
    if ckpt is None:
        where = "no complete checkpoint was saved (see --train.save_every): a resume starts again at step 0"
    else:
        done = int(ckpt.name.removeprefix("step"))
        where = f"newest complete checkpoint: {ckpt} ({done} step{'s' if done != 1 else ''} done)"
    return f"{where}. Resume with:\n  {resume_command(pipeline, argv)}"


def _cleanup_step(what: str, step: Callable[[], T], stopping: str) -> T | None:
    """One step of the driver's clean-up. When the run is being stopped, a failure is reported in one line and the
    clean-up goes on, so that the stop's own message still comes; otherwise it is raised as usual."""
    try:
        return step()
    except Exception as e:
        if not stopping:
            raise
        print(f"warning: {what}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None


def run(cfg: Config, pipeline: str, argv: list[str]) -> int:
    """The run that `argv` (already parsed into `cfg`) asks for, from the input checks to the clean-up; its exit
    code: 0 done, 2 bad input (one line on stderr, before any actor starts), 1 a lost node, 130 / 143 stopped by
    SIGINT / SIGTERM (each with the command that resumes it)."""
    if not cfg.logger.run_name:
        cfg.logger.run_name = f"{pipeline}-{time.strftime('%Y%m%d-%H%M%S')}"
    # Relative to the job's working directory, which on a cluster is a private copy on each node: made absolute
    # here, and checked below to be the same folder on every node that writes to it.
    joining, started = joins_cluster(), False
    try:
        try:
            cfg.train.output_dir = resolve_output_dir(cfg.train.output_dir, os.getcwd(), cfg.logger.run_name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        print(f"[entropy-openrlhf] output folder: {cfg.train.output_dir}", flush=True)
        if joining:  # connecting starts no actor; the node count decides where a built-in model is written
            init_ray()
        multi_node = joining and sum(1 for n in ray.nodes() if n.get("Alive")) > 1
        model_path, train_items, test_items = prepare(cfg, shared_model=multi_node)
        started = init_ray(cfg.ray.num_cpus)
        note = fit_cluster(cfg, *cluster_snapshot())
        if note:
            print(f"[entropy-openrlhf] {note}", flush=True)
        check_nodes(cfg, model_path)
        # last, before any actor: a logger that cannot start (an MLflow server not answering, say) is bad input
        tracker = Tracker(cfg.logger.wandb_project, cfg.logger.run_name, cfg.flatten(), cfg.train.output_dir,
                          backends=cfg.logger.backends)  # fmt: skip
    except (ConfigError, DatasetError, VerifierLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        if started:
            ray.shutdown()
        return 2

    print(
        f"[entropy-openrlhf] {pipeline}: model {model_path}, {len(train_items)} train / {len(test_items)} test "
        f"prompts; {tracker.where()}",
        flush=True,
    )
    trainer = Trainer(cfg, model_path, train_items, test_items)
    # After init_ray: ray.init installs its own SIGTERM handler (sys.exit), which stops without saying how to resume.
    # From here a SIGTERM raises StopRequested in this thread, wherever it waits, and the groups are shut down below
    # (before, it ends the driver, which has no actor yet).
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, _stop_on_sigterm) if on_main_thread else None
    code, stopped = 0, ""
    try:
        trainer.start_groups(local=started)
        start_step = trainer.resume() if cfg.train.resume else 0
        history = trainer.run(tracker, start_step=start_step)
        final = Path(cfg.train.output_dir) / "final"
        # weights, config, tokenizer and generation config
        deadline = {"timeout_s": cfg.train.save_timeout_s, "what": "--train.save_timeout_s"}
        trainer.policy.call_all("save_hf", str(final), **deadline)
        if history:  # empty when resuming a run whose last checkpoint is its final step
            print(f"[entropy-openrlhf] first step mean reward: {history[0].get('reward/mean', float('nan')):.4f}")
        print("[entropy-openrlhf] summary\n" + summarize(history, trainer.startup_seconds), flush=True)
        print(f"[entropy-openrlhf] final model: {final}; {tracker.where()}", flush=True)
    except NodeLostError as e:
        code, stopped = 1, f"error: {e}"
    except (StopRequested, KeyboardInterrupt) as e:
        code, stopped = _stopped_by(e, trainer)
    except SystemError as e:
        # a signal handled while the driver waits inside one of Ray's Cython calls (CoreWorker.wait, seen when a
        # SIGTERM reached an evaluation) comes out as a SystemError raised from our StopRequested: the same stop
        signal_error = signal_behind(e)
        if signal_error is None:
            raise
        code, stopped = _stopped_by(signal_error, trainer)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a SIGTERM now would cut the clean-up short
        t0 = time.monotonic()
        trainer.shutdown_groups()
        discarded = _cleanup_step("removing an unfinished save", trainer.discard_unfinished_save, stopped)
        # `ray job stop` and SLURM signal the driver's children too: W&B's service process may be gone already
        _cleanup_step("finishing the loggers", tracker.finish, stopped)
        if started:
            ray.shutdown()
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)
    if stopped:  # the last lines the user sees: what stopped the run, what is kept, how to go on
        cleanup = f"Actors shut down in {time.monotonic() - t0:.0f} s"
        if discarded is not None:
            cleanup += f"; the save it was in ({discarded.name}) was removed unfinished"
        print(f"{stopped}. {cleanup}; {resume_note(cfg, pipeline, argv)}", file=sys.stderr, flush=True)
        if code == 1:
            print("(resume once the node is back, or once the cluster again has the resources those actors asked for)",
                  file=sys.stderr, flush=True)  # fmt: skip
    return code
