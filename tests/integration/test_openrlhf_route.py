"""The OpenRLHF route in OpenRLHF's own code (docs/guides/openrlhf.md).

1. One real `ActorPPOTrainer.training_step` of OpenRLHF 0.11.2 on CPU, DeepSpeed included, with the adapter
   installed: the loss it reports and the gradients DeepSpeed accumulates equal our loss function's on log-probs
   computed here from a fresh copy of the model, over two micro-batches (gradient accumulation), padded and with
   OpenRLHF's sample packing. What had to be stood in for, because OpenRLHF assumes CUDA, is listed in
   `cpu_trainer` (docs/guides/openrlhf.md, "What runs on CPU").
2. The Ray worker setup hook: `main()` runs a stand-in for train_ppo_ray (this module as __main__, since the real
   one needs GPUs for vLLM and the policy) which starts Ray as OpenRLHF does and places OpenRLHF's real
   `PolicyModelActor`s with OpenRLHF's own `RayActorGroup`; in each, `ppo_actor.PolicyLoss` is the adapter and the
   trainer class builds it. Also under `ray job submit`, on the e2e tier's Ray head
   (tests/e2e/test_ray_job_submit.py::test_the_openrlhf_route_s_setup_hook_under_ray_job_submit).
Each runs in a child process: DeepSpeed and torch.distributed state, and a Ray of its own, stay out of pytest's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

ROOT = Path(__file__).parents[2]
RESULT = "RESULT_JSON "  # the child's answer: the last stdout line with this prefix


def run_child(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run `cmd` from the repo root; its answer is the JSON on its last stdout line starting with RESULT."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len(RESULT) :])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ================================================================ 1. the real training_step on CPU


def openrlhf_args(argv: list[str]) -> SimpleNamespace:
    """train_ppo_ray's own parser and defaults for `argv`: its parser is built under `if __name__ == "__main__"`, so
    run the module and stop it at parse_args (nothing after that runs)."""
    import runpy

    from openrlhf.utils.config import hierarchize

    class Parsed(Exception):
        pass

    real_parse = argparse.ArgumentParser.parse_args
    parsed = {}

    def parse_args(self, args=None, namespace=None):
        parsed["ns"] = real_parse(self, argv, namespace)
        raise Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), contextlib.suppress(Parsed):
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    args = hierarchize(parsed["ns"])
    # the two derived settings train_ppo_ray fills in right after parsing, which the trainer reads
    if args.actor.eps_clip_low_high is None:
        args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)
    if len(args.algo.advantage.is_correction_threshold) == 1:
        args.algo.advantage.is_correction_threshold.insert(0, 0.0)
    return args


def _pad_input(hidden, indices, batch: int, seqlen: int):
    """flash_attn.bert_padding.pad_input: rows of the packed tokens back to their (batch, seqlen) places."""
    out = hidden.new_zeros((batch * seqlen, *hidden.shape[1:]))
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])


def _unpad_input(hidden, attention_mask):
    """flash_attn.bert_padding.unpad_input: the attended tokens of a (batch, seqlen, ...) tensor, their flat indices,
    the cumulative lengths, the longest length and the lengths."""
    import torch

    lengths = attention_mask.sum(-1, dtype=torch.int32)
    indices = attention_mask.flatten().nonzero().flatten()
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return hidden.reshape(-1, *hidden.shape[2:])[indices], indices, cu_seqlens, int(lengths.max()), lengths


def cpu_trainer(args: SimpleNamespace, model_dir: str, packing: bool):
    """OpenRLHF's strategy, Actor, DeepSpeed engine and ActorPPOTrainer, built by their own code on CPU. Stood in
    for, and nothing else (docs/guides/openrlhf.md lists the lines):
    - the process group: initialised with gloo here and LOCAL_RANK set only after setup_distributed, which sets
      that CUDA device when it is set (utils/deepspeed/deepspeed.py:97), while deepspeed.initialize needs it;
    - setup_distributed's device mesh is built on "cpu" instead of "cuda" (deepspeed.py:105);
    - fp32: the Actor wraps a model loaded here, since given a path it loads bf16 or fp16 only (utils/utils.py,
      convert_to_torch_dtype), and DeepSpeed's bf16 is switched off (--ds.param_dtype offers bf16 and fp16 only);
      bf16 on CPU is slow without AMX (docs/guides/cpu.md) and would blur the comparison;
    - the DeepSpeed optimizer is torch's AdamW ("torch_adam": true) instead of FusedAdam, a C++ build on CPU;
    - ActorPPOTrainer.__init__ ends with a barrier plus torch.cuda.synchronize() (utils/distributed_util.py:10);
      the barrier is kept; its replay buffer asks torch.cuda.current_device() for the device it would move samples
      to (trainer/ppo_utils/replay_buffer.py:40), which training_step never uses: answered 0 while it is built;
    - with packing, flash-attn's unpad/pad helpers (CUDA wheels only) are replaced by the same index arithmetic in
      torch, and the model runs SDPA, which transformers gives a block-diagonal mask for packed position ids.
    """
    import openrlhf.models.ring_attn_utils as ring
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import torch
    import torch.distributed as dist
    from openrlhf.models import Actor
    from openrlhf.utils import get_strategy
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    os.environ.pop("LOCAL_RANK", None)  # read by setup_distributed, which would set that CUDA device
    if not dist.is_initialized():  # one group for every scenario of the child process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    strategy = get_strategy(args)
    cpu_mesh = lambda _device, *a, **k: init_device_mesh("cpu", *a, **k)  # noqa: E731
    with mock.patch("openrlhf.utils.deepspeed.deepspeed.init_device_mesh", cpu_mesh):
        strategy.setup_distributed()
    os.environ["LOCAL_RANK"] = "0"  # deepspeed.initialize wants it (else it looks for MPI); CPU device 0

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False  # as Actor sets it when it loads the model itself (models/actor.py:210)
    actor = Actor(model, temperature=args.rollout.temperature)
    actor.packing_samples = packing  # likewise
    if packing:
        ring.unpad_input, ring.pad_input = _unpad_input, _pad_input
        ring.index_first_axis = lambda x, idx: x[idx]

    real_config = strategy.get_ds_train_config

    def ds_config(*a, **k):
        config = real_config(*a, **k)
        if "optimizer" in config:
            config["optimizer"]["params"]["torch_adam"] = True
        config["bf16"]["enabled"] = False  # --ds.param_dtype offers bf16 and fp16 only
        return config

    strategy.get_ds_train_config = ds_config
    actor_cfg = dict(
        optim=args.actor.optim, muon=vars(args.actor.muon), adam=vars(args.actor.adam),
        lr_scheduler=args.actor.lr_scheduler, lr_warmup_ratio=args.actor.lr_warmup_ratio,
        min_lr_ratio=args.actor.min_lr_ratio, max_norm=args.actor.max_norm, scheduler_steps=10,
    )  # fmt: skip
    actor, optim, scheduler = strategy.prepare((actor, actor_cfg))
    with (
        mock.patch.object(ppo_actor, "torch_dist_barrier_and_cuda_sync", dist.barrier),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),  # only named by the unused replay buffer
    ):
        trainer = ppo_actor.ActorPPOTrainer(
            strategy, actor, ema_model=None, actor_optim=optim, actor_scheduler=scheduler,
            micro_train_batch_size=args.train.micro_batch_size, tokenizer=None, eps_clip=args.actor.eps_clip,
            vllm_engines=None,
        )  # fmt: skip
    return trainer, strategy


SAMPLES = [  # (prompt length, response length, advantage): lengths differ, so the micro-batches are padded
    (5, 7, 1.0),
    (3, 4, -0.5),
    (6, 9, 0.8),
    (4, 3, -1.2),
]


def reference_log_probs(model, sequences, attention_mask):
    """Per-token log-probs of the next token, (B, T-1), from a plain forward of a fresh model copy."""
    import torch

    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(sequences, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, sequences[:, 1:, None]).squeeze(-1), logits[:, :-1]


def experiences(model, packing: bool, seed: int):
    """Two micro-batches of two samples, as OpenRLHF's replay buffer holds samples (1-D per-token tensors; the action
    mask on the response span of the shifted grid, as its samples generator marks it) and as its collate_fn batches
    them (make_experience_batch: right-padded with zeros)."""
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch

    g = torch.Generator().manual_seed(seed)
    items = []
    for prompt, response, adv in SAMPLES:
        n = prompt + response
        seq = torch.randint(3, model.config.vocab_size, (n,), generator=g)
        attn = torch.ones(n, dtype=torch.long)
        action = torch.zeros(n, dtype=torch.long)
        action[prompt:] = 1
        action = action[1:]
        with torch.no_grad():
            lp = reference_log_probs(model, seq[None], attn[None])[0][0]
        # the policy the optimizer steps start from, and vLLM's, both a little off the current weights: KL-Cov's
        # |logp - old| then has a gradient, and the IS gate something to filter
        old = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * action
        rollout = (old + 0.3 * torch.randn(lp.shape, generator=g)) * action
        items.append(
            Experience(
                sequences=seq, attention_mask=attn, action_mask=action, action_log_probs=old,
                rollout_log_probs=rollout, advantages=adv * action.float(), response_length=torch.tensor(response),
                total_length=torch.tensor(float(n)), info={"reward": adv},
            )
        )  # fmt: skip
    return [make_experience_batch(items[i : i + 2], packing) for i in (0, 2)]


def run_scenario(spec: dict, model_dir: str, seed: int) -> dict:
    """Build the trainer with the objective installed, run training_step on two micro-batches (one optimizer step),
    and compute the reference; returns the numbers the test compares."""
    import deepspeed
    import torch
    from openrlhf.utils.loss_utils import iter_grad_accum_global_norm
    from transformers import AutoModelForCausalLM

    from entropy_openrlhf.algorithms.objectives import LossContext, TokenBatch, get_objective, select_tokens
    from entropy_openrlhf.integrations import openrlhf as route

    name, params, packing = spec["objective"], spec["params"], spec["packing"]
    cls = route.install(name, **params)
    args = openrlhf_args(spec["argv"])
    trainer, strategy = cpu_trainer(args, model_dir, packing)
    assert type(trainer.actor_loss_fn) is cls, type(trainer.actor_loss_fn)  # the trainer built the adapter itself

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batches = experiences(reference, packing, seed=seed)
    params_by_name = dict(trainer.actor.model.module.named_parameters())

    grads = {}
    real_backward = strategy.backward

    def backward(loss, model, optimizer, **kw):
        real_backward(loss, model, optimizer, **kw)
        if model.model.is_gradient_accumulation_boundary():  # read before the optimizer step consumes them
            grads.update({n: deepspeed.utils.safe_get_full_grad(p).clone() for n, p in params_by_name.items()})

    strategy.backward = backward
    statuses, shapes = [], []
    # as ppo_train feeds training_step: each micro-batch with the normalisers of its optimizer step
    for step, (experience, info) in enumerate(
        iter_grad_accum_global_norm(batches, strategy, strategy.accumulated_gradient, lambda e: e.action_mask)
    ):
        statuses.append(trainer.training_step(experience, kl_ctl=0.0, step=step, loss_batch_info=info))
        shapes.append(list(trainer.actor_loss_fn.last_shape))

    # The reference: our objective on log-probs of the fresh model copy, per micro-batch with the step's token count
    # divided by the accumulation steps (OpenRLHF's normaliser), its gradient divided by them as DeepSpeed divides
    # it: for a token mean, one mean over the whole step. IS weights by hand: OpenRLHF's token 'mask' gate.
    gas = strategy.accumulated_gradient
    total_tokens = float(sum(b.action_mask.sum() for b in batches))
    obj = get_objective(name)
    config, loss_cfg = route.build_settings(name, params)
    correction = args.algo.advantage
    ref_losses = []
    for b in batches:
        lp, logits = reference_log_probs(reference, b.sequences, b.attention_mask)
        weights = None
        if correction.is_correction_level != "off":
            assert (correction.is_correction_level, correction.is_correction_mode) == ("token", "mask")
            low, high = correction.is_correction_threshold
            w = torch.exp(b.action_log_probs - b.rollout_log_probs)
            weights = torch.where((w >= low) & (w <= high), w, torch.zeros_like(w))
        entropy = None
        if obj.needs_entropy:
            entropy = (torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)).detach()
        batch = TokenBatch(lp, b.action_log_probs, b.advantages, b.action_mask, entropy=entropy, is_weights=weights)
        ctx = LossContext(
            clip_low=args.actor.eps_clip_low_high[0], clip_high=args.actor.eps_clip_low_high[1],
            tokens=total_tokens / gas, dp_size=1,
        )  # fmt: skip
        ctx.selected, _ = select_tokens(name, config, loss_cfg, batch, ctx)
        out = obj.loss(batch, config, ctx)
        ref_losses.append(out.loss.item())
        (out.loss / gas).backward()

    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    route.uninstall()
    return {
        "accumulated_gradient": gas,
        "loss_trainer": [s["metrics"]["policy_loss"].item() for s in statuses],
        "loss_reference": ref_losses,
        "grad_max_diff": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()),
        "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
        "shapes": shapes,
        "batch_shapes": [list(b.action_mask.shape) for b in batches],
        "status_keys": sorted(set().union(*(s["metrics"] for s in statuses))),
        "metric_weights": {k: w for s in statuses for k, w in s["weights"].items() if k.startswith(("loss/", "cov/"))},
        "selected_frac": [s["metrics"][f"loss/{spec['frac_key']}"].item() for s in statuses],
        "is_filter_ratio": [s["metrics"][k].item() for s in statuses for k in ["is_filter_ratio"] if k in s["metrics"]],
    }


def trainer_step_child() -> None:
    """Child process: every scenario in one process (the imports are most of the time), numbers on stdout."""
    import torch.distributed as dist

    from entropy_openrlhf.compat import ensure_flash_attn_importable

    ensure_flash_attn_importable()
    payload = json.loads(sys.argv[1])
    try:
        results = {key: run_scenario(spec, payload["model"], payload["seed"]) for key, spec in SCENARIOS.items()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(RESULT + json.dumps(results), flush=True)


STEP_FLAGS = ["--train.micro_batch_size", "2", "--train.batch_size", "4", "--ds.zero_stage", "2"]
# fmt: off
SCENARIOS = {
    # KL-Cov with OpenRLHF's token-level IS correction (mask), padded micro-batches
    "kl_cov-is-padded": dict(
        objective="kl_cov", params={"ratio": 0.1}, packing=False, frac_key="kl_cov_frac",
        argv=[*STEP_FLAGS, "--algo.advantage.is_correction_level", "token",
              "--algo.advantage.is_correction_threshold", "0.7", "1.4"],
    ),
    # an objective that reads the token entropy, which the adapter captures from the actor's forward
    "high_entropy-padded": dict(
        objective="high_entropy", params={"top_frac": 0.3}, packing=False, frac_key="entropy_selected_frac",
        argv=STEP_FLAGS,
    ),
    # KL-Cov with --ds.packing_samples (OpenRLHF's GPU default)
    "kl_cov-packed": dict(
        objective="kl_cov", params={"ratio": 0.1}, packing=True, frac_key="kl_cov_frac",
        argv=[*STEP_FLAGS, "--ds.packing_samples"],
    ),
}
# fmt: on


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory) -> dict:
    from entropy_openrlhf.models.tiny import make_tiny_model

    model = str(make_tiny_model(tmp_path_factory.mktemp("openrlhf_route_model")))
    code = "from tests.integration.test_openrlhf_route import trainer_step_child; trainer_step_child()"
    # 7 min measured with the machine's load average near 28 on 2 cores: the limit only catches a hang
    return run_child([sys.executable, "-c", code, json.dumps({"model": model, "seed": 11})], timeout=1500)


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_openrlhfs_training_step_on_cpu_equals_our_loss(scenario, trainer_results):
    r = trainer_results[scenario]
    assert r["accumulated_gradient"] == 2  # two micro-batches per optimizer step: accumulation is exercised
    assert r["loss_trainer"] == pytest.approx(r["loss_reference"], rel=1e-4, abs=1e-6)
    assert r["grad_scale"] > 0 and r["grad_max_diff"] <= 1e-4 * r["grad_scale"], r
    # the loss gets (B, T-1) tensors, packed or not: OpenRLHF 0.11.2 re-pads the packed forward's log-probs
    assert r["shapes"] == r["batch_shapes"]
    assert all(0 < f < 1 for f in r["selected_frac"]), r["selected_frac"]
    # our metrics reach the status dict that ppo_train reduces, token-weighted as OpenRLHF's own 0-d metrics
    assert r["metric_weights"] and set(r["metric_weights"].values()) == {"token"}
    assert {"policy_loss", "ppo_clip_ratio", "ppo_kl", "cov/mean"} <= set(r["status_keys"])
    if "-is-" in scenario:
        assert {"vllm_kl", "is_filter_ratio"} <= set(r["status_keys"])
        assert any(0 < f < 1 for f in r["is_filter_ratio"]), r["is_filter_ratio"]


# ================================================================ 2. the setup hook in OpenRLHF's policy actors

# The CLI run with this module in train_ppo_ray's place: `python -m tests.integration.test_openrlhf_route route
# <our flags> <stand-in flags>` calls main(), which runs this module again as __main__ with the flags left over.
ROUTE = [sys.executable, "-m", "tests.integration.test_openrlhf_route", "route"]
OBJECTIVE_FLAGS = ["--objective", "kl_cov", "--objective.ratio", "0.05", "--objective.coef", "0.5"]


def probe_policy_actor(actor) -> dict:
    """Runs inside a PolicyModelActor (Ray's __ray_call__): what its process would build and call."""
    import dataclasses
    import inspect

    import ray
    import torch

    from entropy_openrlhf.algorithms.losses import kl_cov_loss
    from entropy_openrlhf.integrations.openrlhf_adapter import ObjectivePolicyLoss

    ppo_actor = sys.modules["openrlhf.trainer.ray.ppo_actor"]
    cls = ppo_actor.PolicyLoss
    # the trainer class the actor's init_model_from_pretrained builds, and the PolicyLoss that class's __init__ sees
    init_model = inspect.unwrap(type(actor).init_model_from_pretrained)  # Ray may wrap actor methods
    trainer_cls = init_model.__globals__.get("ActorPPOTrainer")
    builds = trainer_cls.__init__.__globals__["PolicyLoss"] if trainer_cls else None
    g = torch.Generator().manual_seed(0)
    lp, old, adv = torch.randn(3, 3, 8, generator=g)
    mask = torch.ones(3, 8)
    info = {"dp_size": 2, "batch_num_tokens": torch.tensor(40.0), "global_batch_size": torch.tensor(5.0)}
    got = cls(clip_eps_low=0.2, clip_eps_high=0.28)(lp, old, adv, action_mask=mask, **info)[0]
    want = kl_cov_loss(lp, old, adv, mask, ratio=0.05, coef=0.5, normalizer=40.0, dp_size=2).loss
    return {
        "rank": int(os.environ["RANK"]),
        "pid": os.getpid(),
        "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
        "is_adapter": isinstance(cls, type) and issubclass(cls, ObjectivePolicyLoss),
        "objective": getattr(cls, "objective", None),
        "params": dataclasses.asdict(cls.params) if hasattr(cls, "params") else None,
        "trainer_builds_it": builds is cls and trainer_cls is ppo_actor.ActorPPOTrainer,
        "init_model_module": init_model.__module__,
        "training_step_wrapped": hasattr(ppo_actor.ActorPPOTrainer.training_step, "__entropy_openrlhf_wrapped__"),
        "loss": got.item(),
        "loss_expected": want.item(),
    }


def probe_plain_worker() -> dict:
    """Runs in a plain task of the same job (as a vLLM engine's process would be): the hook left it light."""
    return {
        "pid": os.getpid(),
        "ppo_actor_imported": "openrlhf.trainer.ray.ppo_actor" in sys.modules,
        "deepspeed_imported": "deepspeed" in sys.modules,
        "waiting_for_ppo_actor": any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path),
    }


def stand_in_train_ppo_ray(argv: list[str]) -> None:
    """What train_ppo_ray does up to its policy actors, without the GPUs: Ray started by OpenRLHF's own call
    (cli/train_ppo_ray.py:24), OpenRLHF's PolicyModelActors placed by OpenRLHF's RayActorGroup, in a placement
    group of (logical) GPU bundles as train_ppo_ray makes them; then each actor is probed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=0, help="logical GPUs of a local cluster; 0: no placement group")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    local = not os.environ.get("RAY_ADDRESS")  # a `ray job submit` driver joins the job's cluster
    openrlhf_env = {"env_vars": {"NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
    cluster = dict(num_cpus=2, num_gpus=a.gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                   object_store_memory=100_000_000) if local else {}  # fmt: skip
    ray.init(runtime_env=openrlhf_env, **cluster)
    try:
        from openrlhf.trainer.ray.launcher import RayActorGroup
        from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

        if a.gpus:
            pg = placement_group([{"GPU": 1, "CPU": 1}] * a.gpus, strategy="PACK")
            if not pg.wait(a.timeout):
                remove_placement_group(pg)
                raise TimeoutError(f"the policy actors' placement group was not placed within {a.timeout:.0f} s")
            group = RayActorGroup(1, a.gpus, PolicyModelActor, pg=pg, num_gpus_per_actor=0.5)
        else:
            group = RayActorGroup(1, 1, PolicyModelActor, pg=None, num_gpus_per_actor=0)
        refs = [h.__ray_call__.remote(probe_policy_actor) for h in group._actor_handlers]
        refs.append(ray.remote(num_cpus=0)(probe_plain_worker).remote())
        try:
            *actors, plain = ray.get(refs, timeout=a.timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the PolicyModelActor probes did not answer within {a.timeout:.0f} s") from None
        print(RESULT + json.dumps({"actors": actors, "plain": plain}), flush=True)
    finally:
        ray.shutdown()


def check_probes(r: dict, ranks: int) -> None:
    actors = r["actors"]
    assert sorted(x["rank"] for x in actors) == list(range(ranks)) and len({x["pid"] for x in actors}) == ranks
    for x in actors:
        assert x["is_adapter"] and x["objective"] == "kl_cov", x
        assert x["params"] == {"ratio": 0.05, "coef": 0.5, "ppo_clip": False, "within": ""}, x
        assert x["trainer_builds_it"] and x["training_step_wrapped"], x
        assert x["loss"] == pytest.approx(x["loss_expected"], rel=1e-6), x
    plain = r["plain"]
    assert plain["pid"] not in {x["pid"] for x in actors}
    assert plain["waiting_for_ppo_actor"] and not plain["ppo_actor_imported"] and not plain["deepspeed_imported"]


@pytest.mark.timeout(900)
def test_setup_hook_installs_the_objective_in_openrlhfs_policy_actors():
    r = run_child([*ROUTE, *OBJECTIVE_FLAGS, "--gpus", "2", "--timeout", "600"], timeout=840)
    check_probes(r, ranks=2)
    assert sorted(i for x in r["actors"] for i in x["gpu_ids"]) == ["0", "1"]  # one bundle each, as placed


if __name__ == "__main__":
    if sys.argv[1:2] == ["route"]:  # the command line, with this module standing in for train_ppo_ray
        from entropy_openrlhf.integrations.openrlhf_cli import main

        sys.exit(main(sys.argv[2:], train_module="tests.integration.test_openrlhf_route"))
    stand_in_train_ppo_ray(sys.argv[1:])  # run by main() in train_ppo_ray's place
