"""Goose: training-free, lossless speculative decoding as a plugin framework.

    import goose
    dec = goose.compose(model, tokenizer, sources=["pld", "tr"], policy="spine")
    out = dec.generate("def fib(n):", max_new_tokens=128)
"""

from goose.compose import compose, greedy
from goose.hf import hf_generate
from goose.decoding import Decoder, GenerationOutput, Stats, StepRecord
from goose.errors import (ComponentError, DecoderBusyError, DraftSourceError, GooseError, InvalidInputError,
                          InvalidTreeError, PluginError, TreePolicyError, UnknownComponentError, UnsupportedModelError,
                          VerifierError)
from goose.hookspecs import hookimpl, hookspec
from goose.interfaces import (DraftContext, DraftSource, DraftState, Options, Proposal, Request, TreePolicy, Verified,
                              Verifier)
from goose.manager import PluginWarning, broken_plugins, get_registry, register_plugin, unregister_plugin
from goose.tree import DraftTree

__version__ = "0.1.0"

__all__ = [
    "compose", "greedy", "hf_generate",
    "Decoder", "GenerationOutput", "Stats", "StepRecord",
    "DraftTree", "DraftSource", "TreePolicy", "Verifier",
    "DraftContext", "DraftState", "Proposal", "Request", "Verified", "Options",
    "hookimpl", "hookspec",
    "get_registry", "register_plugin", "unregister_plugin", "broken_plugins", "PluginWarning",
    "GooseError", "DecoderBusyError", "UnknownComponentError", "PluginError", "InvalidTreeError", "InvalidInputError",
    "ComponentError", "DraftSourceError", "TreePolicyError", "VerifierError", "UnsupportedModelError",
]
