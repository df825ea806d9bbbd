"""The entropy controller's dynamics against a synthetic entropy process, plus its config parsing and validation.

The process: H_{t+1} = H_t + eta * (log(scale_t) - log(s_eq)) + noise. Entropy rises while the scale is above an
equilibrium s_eq the controller does not know and falls below it; seeded noise stands in for batch-to-batch jitter.
"""

import json
import math
import random

import pytest

from entropy_openrlhf.algorithms.entropy_control import (
    EntropyControlConfig,
    EntropyController,
    parse_target,
    validate,
)

LO, HI = 0.3, 0.5
BAND = f"{LO},{HI}"


def controller(**kw) -> EntropyController:
    return EntropyController(EntropyControlConfig(**{"target": BAND, **kw}))


def simulate(ctl: EntropyController, h0: float, s_eq: float, steps: int, seed: int, eta: float = 0.05):
    """Closed loop: measure H, update the scale, let the scale act on the next batch. Returns (entropies, scales)."""
    rng = random.Random(seed)
    h, hs, scales = h0, [], []
    for _ in range(steps):
        hs.append(h)
        scales.append(ctl.update(h))
        h = max(0.0, h + eta * (math.log(ctl.scale) - math.log(s_eq)) + rng.gauss(0.0, 0.005))
    return hs, scales


def first_in_band(hs: list[float]) -> int | None:
    return next((i for i, h in enumerate(hs) if LO <= h <= HI), None)


# --------------------------------------------------------------------------- closed-loop dynamics


@pytest.mark.parametrize("seed", range(5))
def test_below_band_scale_rises_and_entropy_enters(seed):
    # s_eq = 3 > initial scale 1: left alone the entropy keeps falling, so only a rising scale brings it back.
    # Integral action alone (damping 0): every step below the band raises the scale.
    ctl = controller(damping=0.0)
    hs, scales = simulate(ctl, h0=0.1, s_eq=3.0, steps=60, seed=seed)
    entry = first_in_band(hs)
    assert entry is not None, f"entropy never reached the band: {hs[-5:]}"
    assert entry <= 30
    # Every update made while below the band raised the scale, or held it at max_scale.
    before = [1.0, *scales[: entry - 1]]
    assert all(new > old or new == ctl.cfg.max_scale for old, new in zip(before, scales[:entry]))
    assert scales[entry - 1] > 1.0


@pytest.mark.parametrize("h0, s_eq", [(0.1, 3.0), (0.9, 0.3), (0.4, 5.0), (0.4, 0.2)])
def test_damping_keeps_the_entropy_in_the_band_where_integral_action_alone_swings_through_it(h0, s_eq):
    """On this process the knob sets entropy's rate of change, so integral action alone overshoots and swings; the
    damping term (the default) holds it in the band most of the time once settled."""

    def time_in_band(damping: float) -> float:
        shares = []
        for seed in range(5):
            hs, _ = simulate(controller(damping=damping), h0=h0, s_eq=s_eq, steps=300, seed=seed)
            shares.append(sum(LO <= h <= HI for h in hs[100:]) / 200)
        return min(shares)

    damped, undamped = time_in_band(EntropyControlConfig().damping), time_in_band(0.0)
    assert damped >= 0.75, damped
    assert undamped < damped - 0.2, (undamped, damped)


def test_damping_holds_the_scale_while_entropy_already_moves_toward_the_band():
    ctl = controller(damping=2.0)
    ctl.update(0.10)  # below: rises by gain * (0.3 - 0.1) / 0.4 = 0.5 in log space (no trend yet)
    assert ctl.scale == pytest.approx(math.exp(0.5))
    scale = ctl.scale
    # still below, but up by 0.15 nats (0.375 of the centre): the step is 0.125 - 2 * 0.375 < 0, the scale eases
    ctl.update(0.25)
    assert ctl.scale == pytest.approx(scale * math.exp(1.0 * (0.3 - 0.25) / 0.4 - 2.0 * 0.15 / 0.4))
    assert ctl.scale < scale
    ctl.update(0.40)  # inside the band: put, whatever the trend
    assert ctl.scale == pytest.approx(scale * math.exp(0.125 - 0.75))


@pytest.mark.parametrize("seed", range(5))
def test_above_band_scale_falls_and_entropy_enters(seed):
    # s_eq = 0.3 < 1: left alone the entropy keeps surging.
    ctl = controller(damping=0.0)
    hs, scales = simulate(ctl, h0=0.9, s_eq=0.3, steps=60, seed=seed)
    entry = first_in_band(hs)
    assert entry is not None, f"entropy never reached the band: {hs[-5:]}"
    assert entry <= 30
    before = [1.0, *scales[: entry - 1]]
    assert all(new < old or new == ctl.cfg.min_scale for old, new in zip(before, scales[:entry]))
    assert scales[entry - 1] < 1.0


def test_inside_band_scale_stays_exactly_put():
    ctl = controller(initial_scale=1.7)
    rng = random.Random(0)
    for h in [LO, HI, (LO + HI) / 2, *(rng.uniform(LO, HI) for _ in range(200))]:
        assert ctl.update(h) == 1.7
        assert ctl.error == 0.0
    assert ctl.metrics() == {"entropy_ctl/scale": 1.7, "entropy_ctl/error": 0.0}


def test_step_is_proportional_to_error_relative_to_band_centre():
    centre = (LO + HI) / 2
    below = controller(gain=0.8)
    below.update(LO - 0.1)
    assert below.error == pytest.approx(0.1 / centre)
    assert below.scale == pytest.approx(math.exp(0.8 * 0.1 / centre))
    # The same miss in nats above the band moves the scale by the reciprocal factor.
    above = controller(gain=0.8)
    above.update(HI + 0.1)
    assert above.error == pytest.approx(-0.1 / centre)
    assert above.scale == pytest.approx(1 / below.scale)


@pytest.mark.parametrize("stuck, bound", [(0.0, "max_scale"), (5.0, "min_scale")])
def test_scale_saturates_at_its_bound_when_entropy_is_stuck(stuck, bound):
    ctl = controller(min_scale=0.2, max_scale=4.0)
    scales = [ctl.update(stuck) for _ in range(100)]
    assert all(0.2 <= s <= 4.0 for s in scales)
    assert scales[-1] == getattr(ctl.cfg, bound)
    # It leaves the bound as soon as the entropy crosses to the other side of the band.
    ctl.update(5.0 if stuck == 0.0 else 0.0)
    assert 0.2 < ctl.scale < 4.0


def test_per_step_factor_never_exceeds_max_step():
    ctl = controller(gain=50.0, max_step=1.5, min_scale=1e-3, max_scale=1e3)
    rng = random.Random(1)
    previous, ratios = ctl.scale, []
    for _ in range(500):
        scale = ctl.update(rng.uniform(0.0, 3.0))
        ratios.append(scale / previous)
        previous = scale
    assert all(1 / 1.5 - 1e-12 <= r <= 1.5 + 1e-12 for r in ratios)
    # The cap was actually reached both ways, so the bound above is a real test of it.
    assert max(ratios) == pytest.approx(1.5)
    assert min(ratios) == pytest.approx(1 / 1.5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_entropy_leaves_scale_unchanged(bad):
    ctl = controller()
    ctl.update(0.1)
    scale, steps = ctl.scale, ctl.steps
    assert ctl.update(bad) == scale
    assert ctl.scale == scale and ctl.steps == steps
    assert ctl.error == 0.0


def test_state_dict_round_trip_gives_identical_trajectory():
    cfg = EntropyControlConfig(target=BAND, gain=1.3, max_step=1.8)
    rng = random.Random(7)
    entropies = [rng.uniform(0.0, 1.2) for _ in range(80)]
    original = EntropyController(cfg)
    for h in entropies[:30]:
        original.update(h)
    # Through JSON: the state must be plain numbers a checkpoint can hold as is.
    state = json.loads(json.dumps(original.state_dict()))
    assert state == original.state_dict()
    restored = EntropyController(cfg)
    restored.load_state_dict(state)
    assert (restored.scale, restored.error, restored.steps) == (original.scale, original.error, original.steps)
    for h in entropies[30:]:
        assert restored.update(h) == original.update(h)
        assert restored.metrics() == original.metrics()


def test_off_when_target_is_empty():
    ctl = EntropyController(EntropyControlConfig(target="", initial_scale=3.0))
    assert not ctl.enabled
    for h in (0.0, 0.4, 9.0, math.nan):
        assert ctl.update(h) == 1.0
    assert ctl.metrics() == {}
    assert parse_target("") is None and parse_target("  ") is None


# --------------------------------------------------------------------------- parsing and validation


def test_parse_target_accepts_a_band():
    assert parse_target("0.3,0.5") == (0.3, 0.5)
    assert parse_target(" 0.3 , 0.5 ") == (0.3, 0.5)
    assert parse_target("0,0.4") == (0.0, 0.4)
    assert parse_target("0.4,0.4") == (0.4, 0.4)


@pytest.mark.parametrize("text", ["0.3", "0.3,0.5,0.7", "a,b", "0.3;0.5", "nan,1", "0.1,inf", "0.5,0.3", "-0.1,0.3"])
def test_parse_target_errors_name_the_flag(text):
    with pytest.raises(ValueError, match=r"^--entropy\.target: "):
        parse_target(text)


def test_parse_target_refuses_a_band_at_zero():
    with pytest.raises(ValueError, match=r"^--entropy\.target: .*HI must be > 0"):
        parse_target("0,0")


def test_validate_accepts_defaults():
    assert validate(EntropyControlConfig()) == []
    assert validate(EntropyControlConfig(target=BAND)) == []


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"target": "0.5,0.3"}, "target"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": -1.0, "initial_scale": -1.0}, "min_scale"),
        ({"max_scale": math.inf}, "max_scale"),
        ({"min_scale": 2.0, "max_scale": 1.0}, "max_scale"),
        ({"initial_scale": 20.0}, "initial_scale"),
        ({"initial_scale": 0.05}, "initial_scale"),
        ({"gain": 0.0}, "gain"),
        ({"gain": math.nan}, "gain"),
        ({"max_step": 1.0}, "max_step"),
        ({"max_step": 0.5}, "max_step"),
    ],
)
def test_validate_errors_name_the_flag(change, flag):
    errors = validate(EntropyControlConfig(**{"target": BAND, **change}))
    assert errors
    assert all(e.startswith("--entropy.") for e in errors)
    assert any(e.startswith(f"--entropy.{flag}: ") for e in errors), errors


def test_controller_refuses_an_invalid_config():
    with pytest.raises(ValueError, match=r"--entropy\.max_step: "):
        controller(max_step=1.0)
