"""What ``model.generate`` would do with these arguments: its generation config, processors, criteria.

:func:`resolve` asks the model's own ``generate``, through a ``custom_generate`` that returns what it prepared
instead of decoding (no forward runs); a model without transformers' ``generate`` gets only the arguments given
(:func:`explicit`). docs/concepts.md explains why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from goose.errors import InvalidInputError
from goose.sampling import Sampling, build_processors

# the generate() arguments Decoder.generate takes (None: unset, resolved as transformers would)
ARGUMENTS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "min_new_tokens")


@dataclass
class Resolved:
    """One call's decoding rule: what the verifier walk applies to every visited row."""

    do_sample: bool
    temperature: float | None
    processors: list = field(default_factory=list)  # applied in order to each visited row
    criteria: object | None = None  # a StoppingCriteriaList beyond max length and eos ids, or None
    stop_ids: set = field(default_factory=set)  # eos ids the criteria stop on
    values: dict = field(default_factory=dict)  # the resolved ARGUMENTS (stats.extra["generation"])
    source: str = "explicit"  # "transformers": resolved by model.generate; "explicit": only what was given

    @property
    def plain_greedy(self) -> bool:
        return not self.do_sample and not self.processors and self.criteria is None


def _capture(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
             streamer=None, **model_kwargs):
    """A ``custom_generate`` that returns what ``generate`` prepared instead of decoding."""
    return generation_config, logits_processor, stopping_criteria


def uses_transformers(model) -> bool:
    """Whether ``model.generate`` is transformers' (its arguments then resolve as it resolves them)."""
    try:
        from transformers import GenerationMixin
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, GenerationMixin) and getattr(model, "generation_config", None) is not None


def resolve(model, ids: torch.Tensor, max_new_tokens: int, given: dict, logits_processor=None,
            stopping_criteria=None) -> Resolved:
    """The processors, criteria and values ``model.generate(ids, max_new_tokens=..., **given)`` would use."""
    kw = dict(given)
    if logits_processor is not None:
        kw["logits_processor"] = logits_processor
    if stopping_criteria is not None:
        kw["stopping_criteria"] = stopping_criteria
    x = ids.view(1, -1)
    try:
        gc, procs, criteria = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                             custom_generate=_capture, **kw)
    except ValueError as exc:  # transformers' own validation (e.g. a processor type it also builds)
        raise InvalidInputError(f"transformers' generate refused these arguments: {exc}") from exc
    refuse(gc)
    return from_transformers(gc, procs, criteria)


def from_transformers(gc, procs, criteria) -> Resolved:
    """The rule of what transformers' ``generate`` prepared: its config, processors and criteria."""
    plain, eos = plain_criteria(criteria)
    values = {k: getattr(gc, k, None) for k in ARGUMENTS}
    sample = bool(getattr(gc, "do_sample", False))
    return Resolved(sample, gc.temperature if sample else None, list(procs), None if plain else criteria,
                    eos, values, "transformers")


def plain_criteria(stopping_criteria) -> tuple[bool, set[int]]:
    """Whether the criteria are only max length and eos ids (the loop's own stops), and those ids."""
    from transformers import EosTokenCriteria, MaxLengthCriteria

    eos: set[int] = set()
    for c in stopping_criteria:
        if isinstance(c, MaxLengthCriteria):
            continue
        if isinstance(c, EosTokenCriteria):
            eos.update(int(t) for t in torch.as_tensor(c.eos_token_id).view(-1).tolist())
            continue
        return False, set()
    return True, eos


def explicit(given: dict, prompt_len: int, eos_ids, logits_processor=None, stopping_criteria=None) -> Resolved:
    """Only the arguments given, for a model without transformers' ``generate``."""
    s = Sampling(**{"do_sample": False, "min_new_tokens": 0, **given})
    procs = list(build_processors(s, prompt_len, sorted(eos_ids)))
    if logits_processor:
        procs.extend(logits_processor)
    criteria = stopping_criteria if stopping_criteria is not None and len(stopping_criteria) else None
    values = {k: getattr(s, k) for k in ARGUMENTS}
    return Resolved(s.do_sample, s.temperature if s.do_sample else None, procs, criteria, set(), values)


def refuse(gc) -> None:
    """Refuse the decoding modes of generation config ``gc`` that Goose's one-sequence loop cannot honour."""
    def no(option, value, hint):
        raise InvalidInputError(
            f"Goose cannot honour {option}={value!r} (given, or set in the model's generation_config): it decodes "
            f"one sequence, one candidate at a time, with its own draft sources. Hint: {hint}")

    if getattr(gc, "num_beams", 1) not in (None, 1):
        no("num_beams", gc.num_beams, "model.generation_config.num_beams = 1 (or pass num_beams=1 to "
           "model.generate), or use model.generate for beam search")
    if getattr(gc, "num_return_sequences", 1) not in (None, 1):
        no("num_return_sequences", gc.num_return_sequences, "model.generation_config.num_return_sequences = 1, "
           "and call generate once per sequence")
    for k in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if getattr(gc, k, None) is not None:
            no(k, getattr(gc, k), f"drop {k}: Goose does its own drafting")
