"""What the vLLM proposer can be told: :class:`ProposerOptions`, a ``goose.Options`` model (unknown fields, a
string for a number or a bool, a rate outside [0, 1] are refused with what is allowed).

Given as ``Proposer(vllm_config, options={...})``, or, for the proposer vLLM builds in its worker, as a JSON
object in ``$GOOSE_VLLM_OPTIONS`` (its sources also as ``$GOOSE_VLLM_SOURCES``). docs/options.md lists them.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from goose.interfaces import Options

TIER_FLOORS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)


class ProposerOptions(Options):
    """The vLLM proposer's options (goose.vllm.Proposer)."""

    sources: str | list = Field(
        "pld+suffix+tr", description="the draft sources: a method spec's sources ('pld{max_chain=32}+suffix+tr') or a "
        "list of names / (name, options) pairs; tr is served from the logits vLLM computes")
    prior: float = Field(0.5, ge=0.0, le=1.0, description="acceptance of a source's token before it is measured")
    prior_weight: float = Field(2.0, gt=0.0, description="pseudo-observations behind prior")
    start_reach: float = Field(
        0.3, ge=0.0, le=1.0, description="the reach below which nothing is drafted before the step cost is measured")
    tier_floors: tuple[float, ...] = Field(
        TIER_FLOORS, description="each chain source's acceptance is measured apart per band of the confidence its "
        "proposals report (a chain's band: the first floor its confidence reaches, 0 below them all); (): one rate "
        "per source")
    request_weight: float = Field(
        2.0, gt=0.0, description="expected tokens of prior weight on a request's own acceptance factor (its "
        "accepted tokens over what its drafts were expected to give, toward the recent requests' factor)")
    recent_decay: float = Field(
        0.99, ge=0.0, le=1.0, description="per step, the decay of the recent requests' accepted and expected "
        "tokens, where a new request's factor starts (at most 1; back to 1 where nothing is drafted)")
    min_reach: float | None = Field(
        None, ge=0.0, le=1.0, description="a fixed reach floor instead of the measured step cost (None: measured)")
    rest_window: int = Field(
        32, ge=1, description="the sources rest (nothing drafted) when a window of this many booked steps, of as "
        "many decoding requests, saved less than nothing, measured")
    rest_early: float = Field(
        8.0, gt=0.0, description="a window is judged at once when it has lost this many steps' time (a step of "
        "as many requests without drafts)")
    rest_steps: int = Field(16, ge=1, description="how long a rest lasts, twice as long after each window that again saved nothing")
    rest_max: int = Field(512, ge=1, description="the longest rest, in steps")
    probe_below: float = Field(
        0.3, ge=0.0, description="a step drafts nothing (a probe) when the steps of as many decoding requests "
        "without drafts weigh less than this in the step cost, so that the baseline stays measured")
    ask_every: int = Field(
        8, ge=1, description="where asking the sources has taken more than the plans after it expected to save, "
        "they are asked on one step in this many")
    ask_decay: float = Field(0.9, ge=0.0, le=1.0, description="per step asked, the decay of what asking saved and took")
    may_pay_every: int = Field(
        4, ge=1, description="steps between two workings-out of whether any draft could pay at a batch size")

    @field_validator("tier_floors", mode="before")
    @classmethod
    def _floors_are_confidences(cls, v):
        if isinstance(v, (list, tuple)) and any(isinstance(f, (int, float)) and not 0.0 <= f <= 1.0 for f in v):
            raise ValueError(f"tier_floors must be confidences in [0, 1], got {tuple(v)!r}. Hint: {TIER_FLOORS!r}, "
                             "or () to measure each source as one rate")
        return v
