"""Goose inside transformers' own ``model.generate``: ``custom_generate=goose.hf_generate``.

    out = model.generate(**tok(prompt, return_tensors="pt"), custom_generate=goose.hf_generate,
                         max_new_tokens=128, do_sample=True, temperature=0.7, top_p=0.9)

transformers prepares the inputs, config, processors and criteria, then calls :func:`hf_generate` in place of its
loop; Goose walks its trees with them and returns what ``generate`` returns. The decoder is ``pld`` + ``tr`` under
``spine-fit`` (composed once per model) unless the keyword ``goose`` gives a Decoder or ``compose`` keywords.
transformers hands ``custom_generate`` neither its ``streamer`` (taken from ``generate``'s frame) nor its
``tokenizer``: ``stop_strings`` (a parameter here, so that transformers passes it unchecked) use the ``goose=``
Decoder's, the streamer's or the saved one.
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref

import torch

from goose import generation
from goose.compose import compose
from goose.decoding import Decoder
from goose.errors import InvalidInputError

_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: Decoder}
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> tokenizer saved beside it
_lock = threading.Lock()

DEFAULT = {"sources": ["pld", "tr"], "policy": "spine-fit"}


def _decoder_for(model, spec):
    """The decoder ``goose=spec`` names for ``model`` (see the module docstring)."""
    if isinstance(spec, Decoder):
        if spec.model is not model:
            raise InvalidInputError(
                "goose= names a Decoder composed for another model; a decoder verifies with its own model. "
                "Hint: goose.compose(model, tok, ...) with the model you call generate on.")
        return spec
    if spec is None:
        spec = DEFAULT
    if not isinstance(spec, dict):
        raise InvalidInputError(
            f"goose= must be a goose.Decoder or a dict of goose.compose keywords, got {type(spec).__name__}. "
            "Hint: goose={'sources': ['pld', 'tr'], 'policy': 'spine'}")
    key = repr(sorted(spec.items(), key=lambda kv: kv[0]))
    return _once(_once(_decoders, model, dict), key, lambda: compose(model, None, **spec))


def _once(table, key, make):
    """``table[key]``, made by ``make()`` outside the lock where missing (the first one stored wins)."""
    with _lock:
        got = table.get(key)
    if got is None:
        got = make()
        with _lock:
            got = table.setdefault(key, got)
    return got


def _saved_tokenizer(model, stop_strings):
    """The tokenizer saved beside ``model``, or an error saying how to give ``stop_strings`` one."""
    path = getattr(getattr(model, "config", None), "name_or_path", None) or getattr(model, "name_or_path", None)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path) if path else None
    except Exception:  # noqa: BLE001 - any failure means: no tokenizer beside the model
        tok = None
    if tok is None:
        raise InvalidInputError(
            f"stop_strings={stop_strings!r} need the model's tokenizer, and transformers does not hand "
            f"custom_generate the tokenizer= it was given; none was found beside the model ({path!r}). "
            "Hint: pass goose=goose.compose(model, tok) (its tokenizer is used), or "
            "stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, stop_strings)])")
    return tok


def _generate_locals() -> dict | None:
    """The ``streamer`` and ``assistant_model`` of the ``GenerationMixin.generate`` call that called
    :func:`hf_generate`, or None where that frame is not found."""
    f = inspect.currentframe()
    for _ in range(5):  # hf_generate, then generate's own body under its decorators
        f = f.f_back if f is not None else None  # off this frame at once: no reference cycle
        if f is not None and f.f_code.co_name == "generate" and "generation_mode_kwargs" in f.f_locals:
            loc = f.f_locals
            return {"streamer": loc.get("streamer"), "assistant_model": loc.get("assistant_model")}
    return None


def _refuse(generation_config, input_ids, model_kwargs, assistant) -> None:
    """Refuse what Goose's one-sequence loop cannot honour, before any forward."""
    def no(option, value, hint):
        raise InvalidInputError(
            f"goose.hf_generate cannot honour {option}={value!r}: Goose decodes one sequence, one candidate "
            f"at a time, with its own draft sources. Hint: {hint}")

    generation.refuse(generation_config)  # the config first: generate has expanded the batch for beams already
    if input_ids.shape[0] != 1:
        no("batch size", input_ids.shape[0], "call generate once per prompt (or drop custom_generate for batches)")
    if assistant is not None:
        no("assistant_model", type(assistant).__name__, "Goose drafts without a draft model; drop assistant_model")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        no("attention_mask with padding", "zeros in the mask", "pass the unpadded prompt")
    if model_kwargs.get("inputs_embeds") is not None:
        no("inputs_embeds", "a tensor", "pass input_ids: draft sources work on token ids")
    for k in ("past_key_values", "cache"):
        c = model_kwargs.get(k)
        # generate prepares an empty cache of its own; a filled one is the caller's
        if c is not None and getattr(c, "get_seq_length", lambda: 0)() > 0:
            no(k, f"{type(c).__name__} holding {c.get_seq_length()} positions",
               f"drop {k}: Goose builds its own cache from the prompt ids")


def hf_generate(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                synced_gpus: bool = False, streamer=None, goose=None, stop_strings=None, **model_kwargs):
    """transformers' decoding loop, replaced by Goose's: pass as ``model.generate(custom_generate=...)``."""
    caller = _generate_locals()
    if streamer is None and caller is not None:
        streamer = caller["streamer"]
    _refuse(generation_config, input_ids, model_kwargs, caller["assistant_model"] if caller else None)
    if caller is None:
        warnings.warn("goose.hf_generate could not find transformers' generate frame: a streamer passed to generate "
                      "gets the prompt only, and assistant_model cannot be checked", stacklevel=2)
    dec = _decoder_for(model, goose)
    prompt_len = input_ids.shape[1]
    max_length = getattr(generation_config, "max_length", None) or (prompt_len + 20)
    max_new = max(0, int(max_length) - prompt_len)
    if dec.max_positions is not None:
        max_new = min(max_new, dec.max_positions - prompt_len)
    record = bool(getattr(generation_config, "return_dict_in_generate", False) and (
        getattr(generation_config, "output_scores", False) or getattr(generation_config, "output_logits", False)))
    if stop_strings:
        from transformers import StoppingCriteriaList, StopStringCriteria

        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        tok = (getattr(dec, "tokenizer", None) or getattr(streamer, "tokenizer", None)
               or _once(_tokenizers, model, lambda: _saved_tokenizer(model, stop_strings)))
        stopping_criteria = StoppingCriteriaList([*stopping_criteria, StopStringCriteria(tok, list(stop_strings))])
    resolved = generation.from_transformers(generation_config, logits_processor, stopping_criteria)
    out = dec.generate_resolved(dec.prompt_tensor(input_ids[0]), max_new, resolved.stop_ids, resolved, None,
                                streamer, record, stream_prompt=False)  # generate has put the prompt already
    new = torch.tensor([out.token_ids], dtype=torch.long, device=input_ids.device)
    sequences = torch.cat([input_ids, new], dim=-1)
    if not getattr(generation_config, "return_dict_in_generate", False):
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(
        sequences=sequences, scores=out.scores if generation_config.output_scores else None,
        logits=out.logits if generation_config.output_logits else None, attentions=None, hidden_states=None)
