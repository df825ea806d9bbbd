"""What the reward group hands a verifier for each sample (actors/reward.py, verifier_items), on a real tokenizer:
an OpenRLHF reward file's query keeps the special tokens, as OpenRLHF decodes it; the response text does not."""

import pytest
from transformers import AutoTokenizer

from entropy_openrlhf.actors.reward import verifier_items
from entropy_openrlhf.models.tiny import make_tiny_model
from entropy_openrlhf.samples import Sample


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def sample(tokenizer, prompt: str, response: str, stopped: bool) -> Sample:
    """A sample as the engine makes one: its response text without special tokens, its token ids ending with the
    end-of-turn token when it stopped there."""
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if stopped:
        response_ids.append(tokenizer.eos_token_id)
    return Sample(
        prompt_index=0, prompt=prompt, prompt_token_ids=tokenizer(prompt, add_special_tokens=False)["input_ids"],
        response=response, response_token_ids=response_ids, rollout_log_probs=[-0.1] * len(response_ids),
        label="5", policy_version=0, finish_reason="stop" if stopped else "length", data_source="gsm8k",
        metadata={"level": 2},
    )  # fmt: skip


def test_the_openrlhf_query_is_the_whole_sequence_with_its_special_tokens(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    stopped, cut = sample(tokenizer, prompt, "The answer is \\boxed{5}.", True), sample(tokenizer, prompt, "Tom", False)
    (response, label, given_prompt, metadata, query), (_, _, _, _, cut_query) = verifier_items(
        [stopped, cut], tokenizer
    )
    assert (response, label, given_prompt) == ("The answer is \\boxed{5}.", "5", prompt)
    assert metadata == {"level": 2, "data_source": "gsm8k", "response_tokens": len(stopped.response_token_ids),
                        "finish_reason": "stop"}  # fmt: skip
    # the chat template's tokens, and the end-of-turn token the response stopped at, none of them in the response
    assert (
        query
        == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\nThe answer is \\boxed{5}.<|im_end|>"
    )
    assert cut_query == prompt + "Tom"  # cut at the token limit: no end-of-turn token
    # without a tokenizer (every other verifier): the four fields only
    assert [len(i) for i in verifier_items([stopped, cut])] == [4, 4]
