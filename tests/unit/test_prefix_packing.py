"""Shared-prefix packing: the layout, the choice, and exactness against the plain per-row forward.

Exactness runs on a tiny random Llama in fp64: per-token log-probs and entropies of the packed layout equal the plain
layout's, and so do the parameter gradients, to fp32 rounding relative to their size (the model's RMSNorm computes
in fp32 whatever the dtype, and the two layouts sum a shared prompt's gradient in different orders).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from entropy_openrlhf.actors.forward import forward_log_probs, make_seq_batch, use_shared_prefix
from entropy_openrlhf.actors.prefix_packing import choose_packing, estimated_cost, group_runs, pack
from entropy_openrlhf.models.tiny import make_tiny_model

# three groups (4, 1 and 2 responses) of different prompt lengths, responses of different lengths, one of 1 token
PROMPTS = [[1, 5, 6, 7, 8]] * 4 + [[1, 9, 9]] + [[1, 4, 4, 4, 4, 4, 4]] * 2
RESPONSES = [[20, 30, 40], [50, 60], [70, 80, 90, 100, 110], [21, 31], [5, 6, 7, 8], [11], [12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_rows_hold_each_prompt_once_then_its_responses():
    packed = pack(PROMPTS, RESPONSES, pad_id=0)
    assert group_runs(PROMPTS) == [[0, 1, 2, 3], [4], [5, 6]]
    assert [(r.prompt_len, r.starts, r.lengths) for r in packed.rows] == [
        (5, [5, 8, 10, 15], [3, 2, 5, 2]), (3, [3], [4]), (7, [7, 8], [1, 6]),
    ]  # fmt: skip
    assert packed.input_ids[0].tolist() == [1, 5, 6, 7, 8, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 21, 31]
    # positions restart at the prompt's length for every response
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 5, 6, 7, 8, 9, 5, 6]
    assert packed.position_ids[1, :7].tolist() == [0, 1, 2, 3, 4, 5, 6] and packed.input_ids[1, 7:].eq(0).all()
    # every response's first token is predicted at its prompt's last position, the others at the token before
    first_response = list(zip(packed.source_row[:3].tolist(), packed.source_pos[:3].tolist()))
    second_response = list(zip(packed.source_row[3:5].tolist(), packed.source_pos[3:5].tolist()))
    assert first_response == [(0, 4), (0, 5), (0, 6)] and second_response == [(0, 4), (0, 8)]
    assert len(packed.source_row) == sum(len(r) for r in RESPONSES)


def test_groups_of_one_are_the_plain_batch():
    plain = pack(PROMPTS, RESPONSES, pad_id=0, share=False)
    assert len(plain.rows) == len(PROMPTS) and all(len(r.lengths) == 1 for r in plain.rows)
    assert plain.input_ids[0, :8].tolist() == PROMPTS[0] + RESPONSES[0]


def test_auto_packs_long_prompts_and_keeps_rows_without_a_shared_prompt():
    demo_prompts = [list(range(1, 361))] * 4
    demo_responses = [list(range(400, 428))] * 4
    assert len(choose_packing("auto", demo_prompts, demo_responses, 0, 576, 1536).rows) == 1
    distinct = [[1, i] for i in range(4)]
    assert len(choose_packing("auto", distinct, demo_responses, 0, 576, 1536).rows) == 4  # nothing to share
    assert len(choose_packing("off", demo_prompts, demo_responses, 0, 576, 1536).rows) == 4
    assert len(choose_packing("on", distinct, demo_responses, 0, 576, 1536).rows) == 4
    shared, plain = pack(demo_prompts, demo_responses, 0), pack(demo_prompts, demo_responses, 0, share=False)
    assert estimated_cost(plain, 576, 1536) / estimated_cost(shared, 576, 1536) > 3  # 95% of tokens were prompt
    with pytest.raises(ValueError, match="auto | on | off"):
        choose_packing("always", demo_prompts, demo_responses, 0, 576, 1536)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_forward_and_backward_equal_the_plain_ones(tiny, checkpointing):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64)
    if checkpointing:  # the GPU presets' setting: the layout must reach the recomputed layers too
        model.gradient_checkpointing_enable()
        model.train()
    adv = torch.linspace(-1.0, 1.0, len(PROMPTS))[:, None]

    def run(batch):
        lp, ent = forward_log_probs(model, batch, with_entropy=True)
        loss = ((lp * adv + lp.exp()) * batch.mask).sum()  # a loss that weighs every token differently
        loss.backward()
        return lp.detach() * batch.mask, ent * batch.mask, grads(model)

    plain_lp, plain_ent, plain_grads = run(make_seq_batch(PROMPTS, RESPONSES, 0))
    assert use_shared_prefix(model, "on")
    packed_batch = make_seq_batch(PROMPTS, RESPONSES, 0, shared_prefix="on", model_config=model.config)
    assert len(packed_batch.packed.rows) == 3
    lp, ent, packed_grads = run(packed_batch)
    assert torch.equal(lp, plain_lp)
    assert torch.equal(ent, plain_ent)
    for name, g in plain_grads.items():
        scale = float(g.abs().max()) or 1.0
        assert float((packed_grads[name] - g).abs().max()) <= 1e-6 * scale, name
    assert any(float(g.abs().max()) > 0 for g in plain_grads.values())


def test_a_group_split_across_micro_batches_repeats_its_prompt(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64)
    with torch.no_grad():
        whole, _ = forward_log_probs(model, make_seq_batch(PROMPTS, RESPONSES, 0))
        use_shared_prefix(model, "on")
        parts = []
        for lo, hi in ((0, 2), (2, 7)):  # the first group's 4 responses split 2 + 2
            b = make_seq_batch(PROMPTS[lo:hi], RESPONSES[lo:hi], 0, shared_prefix="on", model_config=model.config)
            lp, _ = forward_log_probs(model, b)
            parts += [lp[i][b.mask[i].bool()] for i in range(hi - lo)]
    plain = make_seq_batch(PROMPTS, RESPONSES, 0)
    for i, got in enumerate(parts):
        assert torch.equal(got, whole[i][plain.mask[i].bool()]), i


def test_a_model_switched_to_packing_refuses_a_batch_without_a_layout(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    use_shared_prefix(model, "auto")
    with pytest.raises(RuntimeError, match="needs the packed layout"):
        forward_log_probs(model, make_seq_batch(PROMPTS, RESPONSES, 0))


def gqa_model(tmp_path, **overrides) -> str:
    """A random Llama with grouped-query attention: 4 query heads reading 2 key/value heads (SmolLM2 and Qwen2.5 are
    GQA; the tiny model's single head never exercises the repeat of keys and values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, **overrides,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    return str(tmp_path)


def test_grouped_query_attention_packs_exactly(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(gqa_model(tmp_path), dtype=torch.float64)
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads
    adv = torch.linspace(-1.0, 1.0, len(PROMPTS))[:, None]

    def run(batch):
        lp, _ = forward_log_probs(model, batch)
        ((lp * adv) * batch.mask).sum().backward()
        return lp.detach() * batch.mask, grads(model)

    plain_lp, plain_grads = run(make_seq_batch(PROMPTS, RESPONSES, 0))  # transformers' own attention
    use_shared_prefix(model, "on")
    lp, packed_grads = run(make_seq_batch(PROMPTS, RESPONSES, 0, shared_prefix="on", model_config=model.config))
    # the key/value heads each query head reads decide every log-prob: a wrong pairing moves them by far more than
    # rounding (fp64 here, and the two layouts sum in different orders, hence a tolerance rather than equality)
    assert float((lp - plain_lp).abs().max()) < 1e-10
    for name, g in plain_grads.items():
        assert float((packed_grads[name] - g).abs().max()) <= 1e-6 * (float(g.abs().max()) or 1.0), name


def _call_split(training: bool = False, dropout: float = 0.0, **kwargs):
    from entropy_openrlhf.actors.prefix_packing import split_attention

    packed = pack(PROMPTS[:2], RESPONSES[:2], pad_id=0)
    G, L = packed.input_ids.shape
    module = torch.nn.Module().train(training)
    gen = torch.Generator().manual_seed(0)  # the same inputs on every call, so outputs can be compared
    q, kv = torch.randn(G, 2, L, 8, generator=gen), torch.randn(G, 1, L, 8, generator=gen)
    return split_attention(module, q, kv, kv, None, dropout=dropout, prefix_layout=packed.rows, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"softcap": 50.0}, "soft-capping"),
        ({"s_aux": torch.zeros(2)}, "sinks"),
        ({"sliding_window": 6}, "sliding window of 6 tokens"),  # the first prompt (5) + its longest response (5)
        ({"training": True, "dropout": 0.1}, "dropout"),
    ],
)
def test_split_attention_refuses_what_it_does_not_compute(kwargs, message):
    with pytest.raises(NotImplementedError, match=message) as error:
        _call_split(**kwargs)
    assert "--train.shared_prefix off" in str(error.value)


def test_split_attention_accepts_settings_that_change_nothing():
    # what transformers passes for a model without these features, a window as wide as the longest sequence (10),
    # and dropout outside training (some attention modules pass their rate whatever the mode)
    baseline, _ = _call_split()
    for kwargs in ({"softcap": None, "sliding_window": None, "s_aux": None}, {"sliding_window": 10}, {"dropout": 0.1}):
        out, _ = _call_split(**kwargs)
        assert torch.equal(out, baseline), kwargs


def test_a_sliding_window_model_is_refused_through_its_forward(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    use_shared_prefix(model, "on")
    with pytest.raises(NotImplementedError, match="sliding window of 4 tokens"):
        forward_log_probs(model, make_seq_batch(PROMPTS, RESPONSES, 0, shared_prefix="on", model_config=config))


@pytest.mark.parametrize("head_chunk", [0, 2])
def test_response_masks_and_stand_ins_reach_the_packed_forward(tiny, head_chunk):
    """A step's response masks (--loss.mask_truncated, a rollout's masked tool tokens) and a token budget's stand-in
    micro-batch narrow the loss mask after packing: the packed forwards must read only the cells left, and give the
    plain layout's values there (the default --train.shared_prefix auto packs every micro-batch)."""
    from types import SimpleNamespace

    from entropy_openrlhf.actors.chunked_head import use_chunked_head
    from entropy_openrlhf.actors.step_data import TrainSample
    from entropy_openrlhf.actors.train_phases import RankSetup, _stand_in, prepare_step
    from entropy_openrlhf.config import from_args

    masks = [[1, 0, 1], None, [0, 0, 0, 0, 0], [0, 1], None, [1], [1, 1, 0, 0, 1, 1]]
    samples = [TrainSample(p, r, 1.0, [-0.5] * len(r), response_mask=m) for p, r, m in zip(PROMPTS, RESPONSES, masks)]
    grids = {}
    for mode in ("off", "on"):
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64)
        use_chunked_head(model, head_chunk)
        use_shared_prefix(model, mode)
        engine = SimpleNamespace(device=torch.device("cpu"), module=model)
        flags = ["--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", str(len(samples)),
                 "--train.mini_batches", "1", "--actor.micro_batch_size", str(len(samples)),
                 "--train.shared_prefix", mode]  # fmt: skip
        setup = RankSetup(from_args(flags), 0, 1, pad_id=0)
        (batch,) = prepare_step(setup, engine, samples, step=0, strength_scale=1.0, entropy_coef=None).batches
        assert (batch.packed is not None and len(batch.packed.rows) == 3) == (mode == "on")
        lp, ent = forward_log_probs(model, batch, with_entropy=True)
        grids[mode] = (lp * batch.mask, ent * batch.mask, batch.mask)
        # a rank with no sequence in a micro-batch runs a stand-in, all masked: its forward must still run
        (empty,) = prepare_step(setup, engine, [_stand_in(0)], step=0, strength_scale=1.0, entropy_coef=None).batches
        assert float(empty.mask.sum()) == 0
        stand_in_lp, _ = forward_log_probs(model, empty, with_entropy=True)
        assert float((stand_in_lp.detach() * empty.mask).abs().sum()) == 0
    (plain_lp, plain_ent, plain_mask), (lp, ent, mask) = grids["off"], grids["on"]
    assert torch.equal(mask, plain_mask) and int(mask.sum()) == 14  # 23 response tokens, 9 masked
    assert torch.allclose(lp, plain_lp, atol=1e-12) and torch.allclose(ent, plain_ent, atol=1e-12)
    assert float(lp.abs().sum()) > 0
