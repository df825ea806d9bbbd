"""What one RL step of the policy takes and gives: the samples the driver builds, and how the step's metrics reduce,
first over a rank's micro-batches (train_phases.step_result), then over the ranks (PolicyGroup.train_step).

Light on purpose: the driver imports it, so it loads nothing of the actor's (train_phases.py does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainSample:
    """What the policy needs of one response; the driver builds these from `Sample`s."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_log_probs: list[float]
    ref_log_probs: list[float] | None = None
    # 1 on the tokens the loss counts; 0 on tokens the policy did not choose (a tool's output) and, with
    # --loss.mask_truncated, on every token of a response cut at the length limit. None: every token counts
    response_mask: list[int] | None = None
    # policy versions between the weights that sampled the response and the trainer's at this step (the
    # offpolicy/staleness_<v>/* metrics group by it)
    staleness: int = 0
    # streamed samples: the same per response token (a partial rollout's span two or more values); None: `staleness`
    token_staleness: list[int] | None = None
    # the response's data source where the step mixes several (entropy/<source>/seq_mean); "" otherwise
    data_source: str = ""
    # tool episodes: the policy's turn of each response token (1, 2, ...; 0 on tool tokens), for the per-turn entropy
    # metrics (Sample.token_turns); None: one turn
    token_turns: list[int] | None = None


# reduced over micro-batches and ranks by max, the rest by mean
MAX_METRICS = {"rollout/logprob_diff_max", "offpolicy/weight_max", "train/micro_batch_tokens_max"}
# each rank's value is its share of the mini-batch mean (aggregate's normaliser spans all ranks): summed over ranks
SUMMED_LOSSES = ("loss/policy", "loss/entropy_bonus")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def reduce_micro_batches(metrics: dict[str, list[float]], mini_batches: int, world_size: int) -> dict[str, float]:
    """One rank's metrics of every micro-batch as one value each."""
    result = {k: max(v) if k in MAX_METRICS else mean(v) for k, v in metrics.items()}
    # the loss is a share of the mini-batch mean on each rank: its sum over a mini-batch's micro-batches is this
    # rank's share of that mini-batch's loss, averaged here over the mini-batches
    for key in SUMMED_LOSSES:
        result[key] = sum(metrics.get(key, [])) / mini_batches / world_size
    return result


def merge_ranks(results: list[dict[str, float]]) -> dict[str, float]:
    """Every rank's step result as one: each rank's share of the losses and its tokens summed, the rest by max or
    mean."""
    # every rank's keys: a rank may lack some (a staleness none of its responses has)
    keys = dict.fromkeys(k for r in results for k in r)
    merged = {k: (max if k in MAX_METRICS else mean)([r[k] for r in results if k in r]) for k in keys}
    for key in SUMMED_LOSSES:
        merged[key] = sum(r[key] for r in results)
    merged["train/tokens"] = sum(r["train/tokens"] for r in results)
    return merged
