"""The vLLM proposer's options (:class:`ProposerOptions`, listed in docs/options.md) and its internal tuning."""

from __future__ import annotations

from pydantic import Field, field_validator

from goose.interfaces import Options

TIER_FLOORS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
PRIOR, PRIOR_WEIGHT = 0.5, 2.0  # a source token's acceptance before it is measured, and its pseudo-observations
START_REACH = 0.3  # the reach below which nothing is drafted before the step cost is measured
REQUEST_WEIGHT = 2.0  # expected tokens of prior weight on a request's own acceptance factor
REST_WINDOW = 32  # the sources rest when a window of this many booked steps saved less than nothing
REST_EARLY = 8.0  # a window is judged at once when it has lost this many steps' time
REST_STEPS, REST_MAX = 16, 512  # a rest's length (doubled after each window that again saved nothing), its cap
PROBE_BELOW = 0.3  # a step drafts nothing when steps without drafts weigh less than this in the step cost
ASK_EVERY = 8  # where asking the sources took more than it saved, they are asked on one step in this many
ASK_DECAY = 0.9  # per step asked, the decay of what asking saved and took
MAY_PAY_EVERY = 4  # steps between two workings-out of whether any draft could pay at a batch size


class ProposerOptions(Options):
    """The vLLM proposer's options (goose.vllm.Proposer); a bad value is refused with what is allowed."""

    sources: str | list = Field(
        "pld+suffix+tr", description="the draft sources: a method spec's sources ('pld{max_chain=32}+suffix+tr') or a "
        "list of names / (name, options) pairs; tr is served from the logits vLLM computes",
        json_schema_extra={"why": "which draft sources vLLM's proposer uses"},
    )
    tier_floors: tuple[float, ...] = Field(
        TIER_FLOORS, description="each chain source's acceptance is measured apart per band of the confidence its "
        "proposals report (a chain's band: the first floor its confidence reaches, 0 below them all); (): one rate "
        "per source",
        json_schema_extra={"why": "the confidence bands each source is measured in (): one rate per source"},
    )
    recent_decay: float = Field(
        0.99, ge=0.0, le=1.0, description="per step, the decay of the recent requests' accepted and expected "
        "tokens, where a new request's factor starts (at most 1; back to 1 where nothing is drafted)",
        json_schema_extra={"why": "how fast a new request's starting factor forgets earlier requests"},
    )
    min_reach: float | None = Field(
        None, ge=0.0, le=1.0, description="a fixed reach floor instead of the measured step cost (None: measured)",
        json_schema_extra={"why": "a fixed reach floor instead of the measured step cost (reproducible plans, a "
                           "noisy clock)"},
    )

    @field_validator("tier_floors", mode="before")
    @classmethod
    def _floors_are_confidences(cls, v):
        if isinstance(v, (list, tuple)) and any(isinstance(f, (int, float)) and not 0.0 <= f <= 1.0 for f in v):
            raise ValueError(f"tier_floors must be confidences in [0, 1], got {tuple(v)!r}. Hint: {TIER_FLOORS!r}, "
                             "or () to measure each source as one rate")
        return v
