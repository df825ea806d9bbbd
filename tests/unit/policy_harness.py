"""A policy rank's RL step without Ray or DeepSpeed, for the unit tier: `PolicyActor.train_step` and its phases
(actors/train_phases.py) run as they are, on the tiny random model, behind `Engine`, a stand-in for the DeepSpeed
engine that keeps the part of DeepSpeed's contract the step relies on:

- `set_gradient_accumulation_boundary(flag)` decides whether `step()` applies the optimizer (DeepSpeed's
  `is_gradient_accumulation_boundary`, which an explicit flag overrides); off the boundary `step()` only counts a
  micro-step, so a step that never reaches its boundary never moves the weights and `was_step_applied()` stays False;
- at the boundary the gradients are averaged over the data-parallel ranks (gloo all-reduce / world size), clipped to
  `--actor.grad_clip`, and a non-finite norm skips the update;
- `backward(loss, scale_wrt_gas=True)` divides by the accumulation steps as DeepSpeed does (the step passes False).

It also records what a test wants to see: every loss handed to `backward`, the optimizer steps applied, the
forwards with and without grad.

Two ranks run as two processes over gloo on 127.0.0.1 (`run_ranks`), each with its own `Engine`; the samples are
dealt out over the ranks as PolicyGroup.train_step deals them (`shard`), and their metrics merged by its
`merge_ranks`.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors import train_phases
from entropy_openrlhf.actors.group import free_port
from entropy_openrlhf.actors.micro_batches import layout_for
from entropy_openrlhf.actors.policy_actor import PolicyActor
from entropy_openrlhf.actors.step_data import TrainSample
from entropy_openrlhf.actors.train_phases import RankSetup
from entropy_openrlhf.config import Config, from_args
from entropy_openrlhf.rendezvous import init_default_group


class Engine(torch.nn.Module):
    """The DeepSpeed engine's surface that the step uses, around a transformers (or peft) model, with a real AdamW
    (module docstring). `lr` overrides `--actor.lr`: 0 keeps the weights where they are while every optimizer step
    still runs, so that each pass of a step sees the weights it started from."""

    def __init__(self, model: torch.nn.Module, cfg: Config, world_size: int = 1, lr: float | None = None, gas: int = 1):
        super().__init__()
        self.module = model
        self.device = torch.device("cpu")
        self.world_size, self.grad_clip, self.gas = world_size, cfg.actor.grad_clip, gas
        self.params = [p for p in model.parameters() if p.requires_grad]
        a = cfg.actor
        self.optimizer = torch.optim.AdamW(
            self.params, lr=a.lr if lr is None else lr, betas=tuple(a.adam_betas), eps=a.adam_eps,
            weight_decay=a.weight_decay,
        )  # fmt: skip
        self._boundary: bool | None = None
        self._step_applied = False  # DeepSpeed's value before any optimizer step
        self._grad_norm: float | None = None
        self.micro_steps = 0
        self.applied_steps = 0
        self.losses: list[float] = []  # every loss handed to backward, in order
        self.forwards = {"grad": 0, "no_grad": 0}

    def forward(self, **kwargs: Any) -> Any:
        self.forwards["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return self.module(**kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        if scale_wrt_gas:
            loss = loss / self.gas
        self.losses.append(float(loss.detach()))
        loss.backward()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = is_boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is None:
            return (self.micro_steps + 1) % self.gas == 0
        return self._boundary

    def step(self) -> None:
        at_boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not at_boundary:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.world_size > 1:
                dist.all_reduce(p.grad)
                p.grad /= self.world_size
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params]))
        self._grad_norm = float(norm)
        self._step_applied = bool(torch.isfinite(norm))
        if self._step_applied:
            self.optimizer.step()
            self.applied_steps += 1
        self.optimizer.zero_grad(set_to_none=True)

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for the block: the tiny model's matrices are too small to split, and on a machine whose
    cores are busy two threads waiting on each other made a step 30 times slower (8 s against 0.25 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def make_actor(
    cfg: Config,
    model: torch.nn.Module,
    rank: int = 0,
    world_size: int = 1,
    lr: float | None = None,
) -> Any:
    """A PolicyActor whose `train_step` is the actor's own code, on an instance built without Ray or DeepSpeed
    (what its constructor would set, with `Engine` for the DeepSpeed engine)."""
    actor = object.__new__(PolicyActor.__ray_metadata__.modified_class)
    actor.cfg, actor.rank, actor.world_size, actor.version = cfg, rank, world_size, 0
    actor.engine = Engine(model, cfg, world_size, lr=lr)
    actor.phases = train_phases
    # as build_policy_engine decides it: the tiny model has no dropout
    actor.dropout_free = not getattr(model.config, "attention_dropout", 0.0) and not any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
    )
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    actor.setup = RankSetup(cfg, rank, world_size, pad_id)
    return actor


def step_config(*flags: str, loss: str = "ppo", n: int = 8, mini: int = 2, micro: int = 2) -> Config:
    """A config for a step of `n` responses (groups of 4 per prompt) in `mini` mini-batches of micro-batches of
    `micro` sequences, packing off (each micro-batch its own padded batch), then `flags`."""
    return from_args(
        ["--rollout.batch_size", str(n // 4), "--rollout.n_samples_per_prompt", "4", "--train.mini_batches", str(mini),
         "--actor.micro_batch_size", str(micro), "--train.shared_prefix", "off", "--async.max_staleness", "0",
         *flags],
        {"loss.type": loss},
    )  # fmt: skip


def model_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float = 1.0):
    """log p(response token | what precedes it) at `temperature`, one sequence alone, no padding, in fp64: an
    independent reading of the model, sharing no code with forward.py."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def make_samples(
    model: torch.nn.Module, n: int = 8, seed: int = 0, noise: float = 0.3, temperature: float = 1.0
) -> list[TrainSample]:
    """n responses in groups of 4 per prompt, of 3 to 7 tokens, with mixed-sign advantages and rollout log-probs
    off the model's own by up to `noise` nats (so that the rollout's and the trainer's numbers tell apart)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1, 5 + i // 4, 6, 7]
        response = [rng.randrange(3, 300) for _ in range(rng.randint(3, 7))]
        own = model_log_probs(model, prompt, response, temperature)
        out.append(TrainSample(prompt, response, rng.gauss(0.0, 1.0), [x + rng.uniform(-noise, noise) for x in own]))
    return out


def shard(cfg: Config, samples: list[TrainSample], world_size: int) -> list[tuple[list[TrainSample], list[list[int]]]]:
    """Each rank's samples and micro-batch sizes, as PolicyGroup.train_step deals them out."""
    layout = layout_for(
        [len(s.prompt_ids) + len(s.response_ids) for s in samples], [tuple(s.prompt_ids) for s in samples],
        cfg.train.mini_batches, world_size, cfg.actor.micro_batch_size, cfg.train.max_tokens_per_micro_batch,
        keep_groups=cfg.train.shared_prefix != "off",
    )  # fmt: skip
    return [([samples[i] for i in layout.order(r)], layout.sizes(r)) for r in range(world_size)]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------ several ranks (gloo)


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    # one thread per rank: the two ranks share the machine's cores with whatever else runs
    torch.set_num_threads(1)
    init_default_group("gloo", "127.0.0.1", port, rank, world_size, timeout_s=120.0)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` processes that form torch's default group over gloo on
    127.0.0.1; each rank's result, in rank order. `fn` must be a module-level function: the processes fork from
    multiprocessing's fork server, a fresh process (no threads of this one's, no OpenMP pool) that imports `fn`'s
    module once; spawning each rank instead would import torch, transformers and OpenRLHF once per rank (22 s
    against 6 s for two ranks on two busy cores)."""
    # honoured when this process starts the fork server; one already running imports the module per rank instead
    mp.get_context("forkserver").set_forkserver_preload([fn.__module__])
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank_main, args=(world_size, free_port("127.0.0.1"), fn, args, out_dir), nprocs=world_size,
            start_method="forkserver",
        )  # fmt: skip
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
