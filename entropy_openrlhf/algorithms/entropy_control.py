"""Closed-loop entropy control: keep `entropy/seq_mean` inside a band `--entropy.target LO,HI` by moving two knobs
once per RL step: the active objective's own strength (a scale on KL-Cov's coefficient or ratio, Clip-Cov's ratio,
high_entropy's top fraction) and the coefficient of an entropy bonus `-alpha * H` added to the loss.

Why two knobs. Measured on the built-in task (study/notebook.md, 'Entropy control'), the objective's own knob held
the band from above but could not lift entropy back once it fell below: KL-Cov's coefficient slows a fall, it has no
term that pushes entropy up, and PPO, CISPO and GSPO have no knob at all. The bonus's gradient raises every token's
entropy directly, so below the band it is the push that works; above the band a bonus only adds to the surge. Both
knobs read the same control signal: below the band the bonus rises (from its base `--loss.entropy_coef`, up to
`max_bonus`) and the scale rises too, as before; above it the bonus falls back to its base and the scale falls,
weakening the objective's push. Inside the band both may relax toward their base, so a knob raised for one
dip does not stay raised for the rest of the run (`bonus_relax`, `scale_relax`; the scale's is off by default: a
scale usually holds the band because it sits away from its base). An objective with no knob is driven by the bonus
alone.

Why multiplicative for the scale, additive for the bonus. The objectives' knobs span orders of magnitude, so the
scale moves by factors (steps in log space). The bonus starts from 0, where no factor moves it, and its useful range
is one order of magnitude at most: it moves by the same signal times `max_bonus`, so a signal of 0.1 moves the bonus
by a tenth of its largest value and the scale by about 10 %.

The control signal. With c the band's centre, H the batch's entropy and H_f its filtered value (below), the error
is e = (LO - H)/c below the band, (HI - H)/c above, 0 inside: the distance to the nearest edge relative to the
centre, so a miss in nats moves the knobs alike on either side and LO = 0 divides by nothing. Outside the band the
signal is u = gain * e - damping * (H_f - H_f,previous)/c, capped at +-log(max_step): log(scale) += u and
bonus += u * max_bonus, each kept within its bounds.
The gain term integrates the error, so a slow drift of what the knobs must be is followed, not left as an offset.
The damping term is there because the knobs set how fast entropy moves more than where it sits: with integral
action alone entropy swings through the band and back (in the band 20-40 % of the time on the unit tests' synthetic
process); subtracting the trend stops a knob growing while entropy already moves toward the band.

Why a filter, and where. The damping term reads a difference of two noisy batch means. With 16 samples a step the
measured entropy jumped by up to 0.3 nats between steps (study/notebook.md) and damping read the jumps as recovery,
giving back what the gain had built. `smoothing` makes the trend the change of an exponential average over steps,
H_f = smoothing * H_f + (1 - smoothing) * H: it still follows a steady drift, while a batch's noise reaches it only
(1 - smoothing) times as large. The error keeps reading the batch's own entropy: filtering it too delays the
integral action, and on the unit tests' noisy process that made the entropy swing (in the band 30-60 % of the time
against 80 % and more); the integral sums the error, which averages its noise already. This is the derivative
filter of a textbook PID controller.

What the bounds guard against. `max_step` caps the per-step factor, so one odd batch cannot swing the objective
by orders of magnitude; [min_scale, max_scale] and [base, max_bonus] cap the authority, so a knob with no effect
saturates at a bound instead of winding up without limit, and comes back as soon as the error changes sign.

Limits. It reacts at least one batch late (more with asynchronous rollouts and with smoothing), so a large gain
overshoots. It cannot hold entropy where the objective at its bounds and the largest bonus cannot reach. A large
bonus can make entropy explode (the reason verl and OpenRLHF default to 0): `max_bonus` bounds it, and the bonus
returns to its base as soon as entropy is above the band.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FLAG = "--entropy"


@dataclass
class EntropyControlConfig:
    target: str = field(
        default="",
        metadata={
            "help": "LO,HI in the units of entropy/seq_mean (nats): rescale the entropy objective's knob each step "
            "to keep the measured entropy inside the band; empty = off"
        },
    )
    min_scale: float = field(
        default=0.1, metadata={"help": "smallest multiplier of the objective's knob (the weakest push allowed)"}
    )
    max_scale: float = field(
        default=10.0, metadata={"help": "largest multiplier of the objective's knob (the strongest push allowed)"}
    )
    # gain 1: a miss by x (relative to the band's centre) moves the scale by a factor e^x per step, e.g. 10 % off
    # -> ~1.1x, entropy collapsed to 0 below a band [c/2, 3c/2] -> e^0.5 = 1.65x. Crossing the whole default range
    # (100x) takes ~9 steps at a 50 % miss and ~46 at 10 %: the time scale on which entropy itself moves in RL runs,
    # so the controller neither lags the drift by hundreds of steps nor outruns its own one-batch delay.
    gain: float = field(
        default=1.0,
        metadata={
            "help": "log-scale change per step per unit of relative error (distance to the nearest band edge over "
            "the band's centre): 1 = a 10 % miss moves the scale ~10 % per step; lower it for stale asynchronous "
            "rollouts"
        },
    )
    # 2.0: at gain 1 the cap only binds beyond a 69 % miss (ln 2), i.e. it limits gross outliers, not normal control.
    max_step: float = field(
        default=2.0,
        metadata={"help": "largest factor (> 1) by which the scale may grow or shrink in one step"},
    )
    # damping 2: a change of entropy of 10 % of the centre per step cancels a 20 % miss, so the scale stops growing
    # while the entropy is already moving toward the band fast enough to reach it in a few steps.
    damping: float = field(
        default=2.0,
        metadata={
            "help": "outside the band, the log-scale step also subtracts this times the last change of entropy "
            "(relative to the band's centre): it stops the scale growing while entropy already moves toward the "
            "band, so it does not swing through it; 0 = integral control only"
        },
    )
    initial_scale: float = field(
        default=1.0,
        metadata={
            "help": "scale at the first step and the base it relaxes to (1 = the objective's knob as configured)"
        },
    )
    # 0.01: ten times verl's former fixed default (1e-3; now 0, as OpenRLHF's). The controller holds it only while
    # entropy is low, and a coefficient much larger can make an LLM's entropy explode within a few steps.
    max_bonus: float = field(
        default=0.01,
        metadata={
            "help": "largest entropy-bonus coefficient the controller may set below the band (the bonus starts at "
            "--loss.entropy_coef, its base); 0 = no bonus, the objective's knob only"
        },
    )
    # 0.5: a batch's noise reaches the trend halved. On the unit tests' noisy two-knob process (measurement noise of
    # 0.1 nats, jumps of 0.3 between steps) the knobs travelled a quarter less than unfiltered for the same time in
    # the band; 0.7 cut their travel further but held the band less (69-79 % against 78-86 % of the steps).
    smoothing: float = field(
        default=0.5,
        metadata={
            "help": "in [0, 1): the damping term reads the change of an exponential average of the entropy over "
            "steps, H_f = smoothing * H_f + (1 - smoothing) * H, so small-batch noise is not read as a trend; 0 = "
            "the raw step-to-step change"
        },
    )
    # 0.1: a bonus raised for one dip is back within half of it after 7 steps in the upper half of the band. On the
    # unit tests' two-knob processes it raised the time in the band from 72-80 % (no relaxation) to 78-89 %.
    bonus_relax: float = field(
        default=0.1,
        metadata={
            "help": "in [0, 1): inside the upper half of the band, the share of its distance to its base "
            "(--loss.entropy_coef) the bonus gives back per step; 0 = it stays put"
        },
    )
    # 0: the objective's knob usually has to stay away from its configured value to hold the band (that is why it
    # moved), so giving it back lets entropy out again: on the unit tests' processes 0.05 cut the time in the band
    # of a surge held by a weakened objective from 89 % to 70 %, and of the scale-only process from 85-88 % to 79-82 %.
    scale_relax: float = field(
        default=0.0,
        metadata={
            "help": "in [0, 1): inside the band, on the half away from the edge it defends, the share of its "
            "log-distance to initial_scale the scale gives back per step; 0 = a dead band, it stays put"
        },
    )


def parse_target(text: str) -> tuple[float, float] | None:
    """`"LO,HI"` -> (LO, HI); empty -> None (control off). Raises ValueError naming `--entropy.target`."""
    text = text.strip()
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 2 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{FLAG}.target: {text!r} must be two numbers LO,HI (nats of entropy/seq_mean), e.g. 0.3,0.5")
    lo, hi = values
    if lo < 0 or hi < 0:
        raise ValueError(f"{FLAG}.target: {text!r}: entropy is never negative, LO and HI must be >= 0")
    if lo > hi:
        raise ValueError(f"{FLAG}.target: {text!r}: LO {lo} is above HI {hi}")
    if hi == 0:
        # The error is relative to the band's centre, which must be > 0; a band at 0 asks for a deterministic policy.
        raise ValueError(f"{FLAG}.target: {text!r}: HI must be > 0")
    return lo, hi


def validate(cfg: EntropyControlConfig) -> list[str]:
    """Every problem with `cfg`, each message starting with its flag; empty when `cfg` can be used."""
    errors: list[str] = []

    def need(ok: bool, name: str, why: str) -> None:
        if not ok:
            errors.append(f"{FLAG}.{name}: {why}")

    try:
        parse_target(cfg.target)
    except ValueError as e:
        errors.append(str(e))
    # Comparisons with NaN are False, so the `need(x > 0 ...)` checks refuse NaN; isfinite refuses inf as well.
    for name in ("min_scale", "max_scale", "initial_scale"):
        value = getattr(cfg, name)
        need(math.isfinite(value), name, f"{value} must be a finite number")
    need(cfg.min_scale > 0, "min_scale", f"{cfg.min_scale} must be > 0 (the scale multiplies the knob)")
    need(
        cfg.min_scale <= cfg.initial_scale <= cfg.max_scale,
        "initial_scale",
        f"{cfg.initial_scale} must lie in [min_scale, max_scale] = [{cfg.min_scale}, {cfg.max_scale}]",
    )
    need(cfg.min_scale <= cfg.max_scale, "max_scale", f"{cfg.max_scale} is below min_scale {cfg.min_scale}")
    need(math.isfinite(cfg.gain) and cfg.gain > 0, "gain", f"{cfg.gain} must be a finite number > 0")
    need(math.isfinite(cfg.max_step) and cfg.max_step > 1, "max_step", f"{cfg.max_step} must be a finite factor > 1")
    need(math.isfinite(cfg.damping) and cfg.damping >= 0, "damping", f"{cfg.damping} must be a finite number >= 0")
    need(
        math.isfinite(cfg.max_bonus) and cfg.max_bonus >= 0,
        "max_bonus",
        f"{cfg.max_bonus} must be a finite number >= 0",
    )
    need(0 <= cfg.smoothing < 1, "smoothing", f"{cfg.smoothing} must be in [0, 1) (0 = read the raw entropy)")
    for name in ("bonus_relax", "scale_relax"):
        value = getattr(cfg, name)
        need(0 <= value < 1, name, f"{value} must be in [0, 1) (0 = no relaxation inside the band)")
    return errors


# What the controller reads from a step's metrics (PolicyActor.train_step logs it). Read through `observe`, which
# refuses a step without it: a renamed or misspelled metric must stop the run, not freeze the controller.
MEASURE = "entropy/seq_mean"
# relaxation stops at this share of max_bonus above the base: the bonus is then exactly its base, so a bonus of 0 is
# 0 again and the entropy's gradient is no longer computed
BONUS_SNAP = 0.01


class EntropyController:
    """The two knobs of entropy control, moved once per step by the measured entropy of the last batch.

    `scale` multiplies the objective's knob; `bonus` is the entropy bonus's coefficient. With an empty target the
    controller is off: `scale` stays 1.0, `bonus` stays `base_bonus` (the fixed --loss.entropy_coef) and
    `metrics()` is empty. `has_knob=False` (ppo, cispo, gspo) keeps the scale at 1 and drives the bonus alone.
    """

    def __init__(self, cfg: EntropyControlConfig, base_bonus: float = 0.0, has_knob: bool = True) -> None:
        errors = validate(cfg)
        if not (math.isfinite(base_bonus) and base_bonus >= 0):
            errors.append(f"--loss.entropy_coef: {base_bonus} must be a finite number >= 0")
        if errors:
            raise ValueError("; ".join(errors))
        self.cfg = cfg
        self.band = parse_target(cfg.target)
        self.has_knob = has_knob
        self.base_bonus = float(base_bonus)
        # the bonus's range; empty (no bonus control) when max_bonus does not exceed the base
        self.max_bonus = max(cfg.max_bonus, self.base_bonus)
        self.base_scale = cfg.initial_scale if self.band is not None and has_knob else 1.0
        self._scale = self.base_scale
        self._bonus = self.base_bonus
        self._error = 0.0
        self.steps = 0
        self._last_entropy: float | None = None  # the filtered entropy so far: the filter's state, for the trend
        self._trend = 0.0  # the last change of the filtered entropy, relative to the band's centre

    @property
    def enabled(self) -> bool:
        return self.band is not None

    @property
    def scale(self) -> float:
        """The multiplier to apply to the objective's knob for the next step."""
        return self._scale

    @property
    def bonus(self) -> float:
        """The entropy bonus's coefficient for the next step (--loss.entropy_coef when control is off)."""
        return self._bonus

    @property
    def error(self) -> float:
        """Last relative error: > 0 below the band (the knobs rose), < 0 above (they fell), 0 inside or skipped."""
        return self._error

    @property
    def last_entropy(self) -> float | None:
        """The filtered entropy after the last update (None before the first), whose change the damping reads."""
        return self._last_entropy

    def relative_error(self, entropy: float) -> float:
        """Signed distance to the nearest band edge over the band's centre; 0 inside the band.

        Relative to the centre, not to the edge: the same miss in nats moves the knobs by the same amount on either
        side, and a band starting at LO = 0 does not divide by zero.
        """
        if self.band is None:
            return 0.0
        lo, hi = self.band
        centre = (lo + hi) / 2
        if entropy < lo:
            return (lo - entropy) / centre
        if entropy > hi:
            return (hi - entropy) / centre
        return 0.0

    def observe(self, metrics: dict[str, float]) -> float:
        """Feed a step's metrics (the policy's train metrics); reads MEASURE from them and returns the new scale.
        A step without it is a KeyError naming the metric: a controller that silently stopped reading would leave
        the knobs frozen for the rest of the run."""
        if self.band is None:
            return self._scale
        if MEASURE not in metrics:
            near = sorted(k for k in metrics if k.startswith("entropy"))
            raise KeyError(
                f"the entropy controller (--entropy.target) reads {MEASURE!r}, which this step's metrics lack "
                f"(entropy metrics present: {near or 'none'})"
            )
        return self.update(metrics[MEASURE])

    def update(self, entropy: float) -> float:
        """Feed the last batch's `entropy/seq_mean`; returns the new scale (the bonus is `self.bonus`)."""
        entropy = float(entropy)
        if self.band is None:
            return self._scale
        if not math.isfinite(entropy):
            # No measurement (e.g. an empty batch): hold both knobs and the filter rather than act on garbage.
            self._error = 0.0
            return self._scale
        self.steps += 1
        lo, hi = self.band
        previous = self._last_entropy
        s = self.cfg.smoothing
        filtered = entropy if previous is None else s * previous + (1 - s) * entropy
        self._last_entropy = filtered
        self._trend = 0.0 if previous is None else (filtered - previous) / ((lo + hi) / 2)
        self._error = self.relative_error(entropy)  # the batch's own entropy: see "Why a filter, and where"
        if self._error == 0.0:
            self._relax(upper_half=filtered > (lo + hi) / 2)
            return self._scale
        limit = math.log(self.cfg.max_step)
        signal = min(max(self.cfg.gain * self._error - self.cfg.damping * self._trend, -limit), limit)
        if self.has_knob:
            self._scale = min(max(self._scale * math.exp(signal), self.cfg.min_scale), self.cfg.max_scale)
        if self._error < 0:
            # Above the band the bonus only falls: damping may ease the scale's fall while entropy already drops,
            # but a bonus switched on above the band would push the wrong way (and cost its gradient).
            signal = min(signal, 0.0)
        self._bonus = min(max(self._bonus + signal * self.max_bonus, self.base_bonus), self.max_bonus)
        return self._scale

    def _relax(self, upper_half: bool) -> None:
        """Inside the band, each knob gives back its share of the distance to its base, but only in the half of the
        band away from the edge it was raised to defend (the bonus and a raised scale defend the lower edge, a
        lowered scale the upper one). Relaxing everywhere in the band lets entropy drift back to that edge and
        hover on it: on the unit tests' noise-free process, a bonus relaxed in the whole band held the band 62-66 %
        of the time, relaxed in the upper half only 86 %. A share of 0 leaves a knob exactly where it is (no
        exp(log(x)) round trip that could nudge the float)."""
        raised = self._scale > self.base_scale
        if self.has_knob and self.cfg.scale_relax > 0 and upper_half == raised:
            self._scale = self.base_scale * (self._scale / self.base_scale) ** (1.0 - self.cfg.scale_relax)
        if self.cfg.bonus_relax > 0 and upper_half:
            excess = (self._bonus - self.base_bonus) * (1.0 - self.cfg.bonus_relax)
            self._bonus = self.base_bonus + excess if excess > BONUS_SNAP * self.max_bonus else self.base_bonus

    def metrics(self) -> dict[str, float]:
        if self.band is None:
            return {}
        return {
            "entropy_ctl/scale": self._scale,
            "entropy_ctl/bonus": self._bonus,
            "entropy_ctl/error": self._error,
            "entropy_ctl/trend": self._trend,
        }

    def state_dict(self) -> dict[str, float | int | None]:
        return {
            "scale": self._scale,
            "bonus": self._bonus,
            "error": self._error,
            "trend": self._trend,
            "steps": self.steps,
            "last_entropy": self._last_entropy,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; the controller then continues exactly as the saved one would have.

        A scale or bonus outside the current bounds (bounds changed on resume) is clipped into them. When control is
        off the knobs stay at their base whatever was saved. States saved before the bonus existed have none: the
        bonus resumes at its base.
        """
        missing = {"scale", "error", "steps"} - state.keys()
        if missing:
            raise ValueError(f"entropy controller state lacks {sorted(missing)}")
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"entropy controller state has scale {scale}; expected a finite number > 0")
        bonus = float(state.get("bonus", self.base_bonus))
        if not (math.isfinite(bonus) and bonus >= 0):
            raise ValueError(f"entropy controller state has bonus {bonus}; expected a finite number >= 0")
        self.steps = int(state["steps"])
        self._error = float(state["error"])
        self._trend = float(state.get("trend", 0.0))  # a logged value only; absent before the filter existed
        last = state.get("last_entropy")  # absent in states saved before damping existed
        self._last_entropy = None if last is None else float(last)
        if self.band is not None:
            if self.has_knob:
                self._scale = min(max(scale, self.cfg.min_scale), self.cfg.max_scale)
            self._bonus = min(max(bonus, self.base_bonus), self.max_bonus)
