"""The built-in verifier, ``transformers``: a draft tree verified in one forward of a stock Hugging Face causal LM.

The nodes go in as one sequence with position ids ``past_len + depth`` and a 4-D additive mask (each node sees the
cached prefix, its ancestors and itself); the walk follows the target's argmax (or the rule's choice); the accepted
nodes' key/value rows are gathered into contiguous slots and the rest cropped.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from typing import Literal

import torch
from pydantic import Field

from goose.errors import UnsupportedModelError
from goose.hookspecs import hookimpl
from goose.interfaces import Options, Verified, Verifier, text_config
from goose.tree import DraftTree
from goose import sampling
from goose.verifiers import latency
from goose.verifiers import attention, skinny, stream
from goose.verifiers import cache as kv_cache

MASK_HONOURING = ("eager", "sdpa")  # attention implementations that honour an arbitrary 4-D additive mask
# Routes on which the root's predecessor (the token before the anchor) is reported to observers, as the
# reference does on its chain and single-step routes; on tree routes the root has none.
ROOT_PREDECESSOR_ROUTES = frozenset({"single", "path", "bypassed"})


class TreeVerifierOptions(Options):
    linear: Literal["auto", "stock", "skinny", "packed", "stream"] = Field("auto", description=(
        "linear layers of the verifier's passes: 'stock' F.linear; 'skinny' weight @ x.T (2-64 nodes); 'packed' "
        "MKL's GEMM on weights packed once (2-64 nodes; float32 CPU; 1-4x each weight's memory, within "
        "pack_limit_mib) (verifiers/skinny.py); 'stream' a numba kernel that reads each weight once per pass, in "
        "its own layout (1-64 nodes, one-token steps included; float32 CPU; verifiers/stream.py; where the CPU has "
        "AVX-512 its IR block kernel, verifiers/stream_ir.py, $GOOSE_STREAM_KERNEL=loop for numba's loop); 'auto' "
        "the fastest per size, as the cached latency calibration measured (stock where none is cached). The "
        "prompt's prefill always runs stock"),
        json_schema_extra={"why": "'stock' keeps transformers' kernels; a named form forces it (to compare kernels)"},
    )
    pack_limit_mib: int | None = Field(None, ge=0, description=(
        "most MiB the packed weights of linear='packed'/'auto' may take (measured as they are made: about 1-4x the "
        "linear weights); None: a quarter of the memory available when they would be made; 0: never pack (tree "
        "passes then use the fastest other form). stats.extra['verifier']['linear'] reports what they take"),
        json_schema_extra={"why": "memory: what the packed weights may take (0: never pack)"},
    )
    gqa: bool = Field(True, description=(
        "on the CPU with sdpa attention, tree passes let torch's kernel read shared key/value heads in place "
        "instead of transformers copying the cache per layer (verifiers/attention.py; the same logits to the bit)"),
        json_schema_extra={
            "why": "off: transformers' own attention path (to compare, or where a model's attention is patched)"},
    )
    headroom: bool = Field(True, description=(
        "the key/value cache appends each step's rows into a buffer with room to grow, instead of transformers' "
        "DynamicLayer copying the whole cache per layer and step (verifiers/cache.py; the same logits to the bit)"),
        json_schema_extra={"why": "off: transformers' own cache growth, where memory per request is tight"},
    )
    defer_prefill_rows: bool = Field(True, description=(
        "the prefill computes the LM head for its last position only and keeps the final hidden states of the "
        "other positions the sources asked for (keep); their logit rows are computed when the first draft needs "
        "them (prefill_rows), so a generation that ends at its first token never pays for them. Checked once per "
        "model: the deferred last row must match the prefill's own, or the verifier computes the rows in the "
        "prefill from then on"),
        json_schema_extra={"why": "off: compute the prefill's logit rows in the prefill (to compare)"},
    )


class TransformersVerifier(Verifier):
    """Verify a draft tree in one forward of the unmodified model; greedy walk; gather+crop commit.

    With a :class:`~goose.sampling.TokenRule` (``rule``, passed to ``prefill`` and ``verify``) the walk chooses
    each token with the rule (:func:`~goose.sampling.rule_walk`). Its speed protocol offers the linear layers'
    forms (``skinny``, ``packed``, ``stream``) to the calibration and runs each tree size in its fastest.
    """

    name = "transformers"
    Options = TreeVerifierOptions
    supports_rules = True

    def bind(self, model) -> None:
        cfg = getattr(model, "config", None)
        if cfg is None:
            raise UnsupportedModelError(
                f"model {type(model).__name__} has no `.config`; Goose serves Hugging Face causal LMs "
                "(a PreTrainedModel, or any module with the same forward contract and a config).")
        impl = getattr(cfg, "_attn_implementation", None) or "eager"
        if impl not in MASK_HONOURING:
            raise UnsupportedModelError(
                f"attention implementation {impl!r} ignores custom 4-D masks, so a draft tree cannot be "
                f"verified exactly. Supported: {', '.join(MASK_HONOURING)}. Hint: load the model with "
                "attn_implementation='sdpa' (or 'eager').")
        super().bind(model)  # vocab_size, max_positions
        self.window_plan = attention.window_plan(model, text_config(cfg))
        self._sliding = False  # the request's cache has sliding layers (set at the prefill)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._linears = skinny.linears(model) if self.options.linear != "stock" else []
        limit = self.options.pack_limit_mib
        self.packs_allowed = skinny.packed_available(self._linears, limit)
        if self.options.linear == "stream" and not stream.available(self._linears):
            raise UnsupportedModelError(stream.unavailable_reason(self._linears))
        if self.options.linear == "packed" and not self.packs_allowed:
            need = skinny.pack_estimate(self._linears) / 2**20
            room = skinny.pack_limit(limit) / 2**20
            why = (
                "float32 linear layers on the CPU and a torch built with MKL"
                if not skinny.packed_supported(self._linears)
                else f"about {need:,.0f} MiB for the packs, within pack_limit_mib "
                f"({'a quarter of the memory available: ' if limit is None else ''}{room:,.0f} MiB)")
            raise UnsupportedModelError(
                f"verifier option linear='packed' needs {why}; this model or machine has not. Allowed here: "
                "'auto', 'stock', 'skinny'. Hint: leave linear='auto', which uses packed weights only where "
                "they are available and measured faster, or raise pack_limit_mib.")
        self._forms: dict[int, str] | None = None  # tree size -> form, resolved at the first prefill
        self._head_curve = None  # the cached curve whose head timings size the deferred prefill rows
        self._defer_failed = False  # a recomputed deferred row differed: rows are computed in the prefill from then on
        self.deferred_prefill = None
        self.timers: dict = {}
        # transformers' causal LMs compute the LM head for the last k positions only when told
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        p = latency.first_param(model)
        self.device, self.dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
        if not self.dtype.is_floating_point:
            self.dtype = torch.float32
        self.device = input_device(model, self.device)
        self._gqa = impl == "sdpa" and self.device.type == "cpu" and self.options.gqa and attention.available()

    def check_request(self, prompt_len: int, max_new_tokens: int, max_depth: int) -> None:
        plan = self.window_plan
        total = prompt_len + max_new_tokens + max_depth
        if plan.mode == "refuse" and total > plan.window:
            raise UnsupportedModelError(
                f"this model uses sliding-window attention (window {plan.window}), and Goose cannot mask "
                f"that window exactly in a tree pass: {plan.why}. Without it a tree mask would replace the "
                f"window, and prompt + max_new_tokens + draft depth = {total} exceeds it. Allowed: at most "
                f"{plan.window} positions in all. Hint: shorten the prompt or max_new_tokens, or use a model "
                "whose forward takes one attention mask per layer type (Gemma-2/3, Qwen2) or whose layers "
                "are all sliding with one window (Mistral).")

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # older signature
            cache = DynamicCache()
        kv_cache.keep_rows_for_rollback(cache)
        return kv_cache.with_headroom(cache) if self.options.headroom else cache

    def _forward(self, input_ids, attention_mask=None, position_ids=None, keep: int | None = None,
                 form: str | None = None):
        """The model's logits (``[positions, vocab]``), its linear layers in ``form`` (None: stock) and, for a
        tree pass (a mask), grouped heads read in place where enabled; ``keep``: logits of the last positions only."""
        kw = {self._cache_kw: self.cache}
        if keep is not None and self._keep_kw is not None and keep < input_ids.shape[1]:
            kw[self._keep_kw] = keep
        with contextlib.ExitStack() as scope:
            if form and self._linears:
                scope.enter_context(skinny.rerouted(self.model, self._linears, form))
            if attention_mask is not None and self._gqa:
                scope.enter_context(attention.tree_pass())
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, **kw)
        return out.logits[0]

    def _form_for(self, n: int) -> str | None:
        """The form a pass of n nodes runs its linear layers in ("skinny", "packed", "stream"; None: stock)."""
        if not self._linears or not (1 <= n <= skinny.MAX_ROWS):
            return None
        if self.options.linear in skinny.FORMS:
            return self.options.linear if skinny.serves(self.options.linear, n) else None
        return self._forms.get(n)  # resolved at the first prefill

    def _resolve_forms(self) -> None:
        """Each tree size's form, from the cached latency calibration ("auto"); the packed weights are made
        here, at the prefill, so that no tree pass pays for packing."""
        forms: dict[int, str] = {}
        self._head_curve = None
        if self.options.linear == "auto":
            curve = latency.cached_curve(self.model, self)
            if curve is not None and curve.head:
                self._head_curve = curve  # how many rows the deferred prefill rows are run as
            if curve is not None and self._linears:
                usable = set(self.pass_forms())  # a cached curve may list a form this machine cannot run now
                forms.update({k: f for f, ns in curve.forms if f in usable for k in ns})
        if "packed" in forms.values() or self.options.linear == "packed":
            if not skinny.prepack(self._linears, self.options.pack_limit_mib):
                if self.options.linear == "packed":
                    raise UnsupportedModelError(
                        f"the packed weights measured {skinny.pack_estimate(self._linears) / 2**20:,.0f} MiB, over "
                        f"pack_limit_mib ({skinny.pack_limit(self.options.pack_limit_mib) / 2**20:,.0f} MiB); "
                        "they were dropped. Hint: linear='auto', or raise pack_limit_mib.")
                forms = {k: f for k, f in forms.items() if f != "packed"}  # stock at those sizes
        self._forms = forms

    # -- speed protocol (goose.verifiers.latency): the linear layers' forms, each timed by the calibration
    def timing_key(self) -> dict:
        """A curve per kernel setting: stock linears only, grouped heads copied (``gqa=False``), packs beyond the
        memory limit, no stream kernel on this machine; a forced form is calibrated as ``"auto"``."""
        key = {k: v for k, v in super().timing_key().items() if k != "options"}
        if self.options.linear == "stock":
            key["linear"] = "stock"
        else:
            if not self.packs_allowed and skinny.packed_supported(self._linears):
                key["packed"] = False
            if self._linears and not stream.available(self._linears):
                key["stream"] = False
        if not self.options.gqa:
            key["gqa"] = False
        return key

    def pass_forms(self) -> tuple[str, ...]:
        """``skinny``; ``packed`` where MKL's packed GEMM serves within ``pack_limit_mib``; ``stream`` where
        the numba kernel serves (none with ``linear="stock"``)."""
        linears = self._linears
        offered = {"skinny": bool(linears), "packed": self.packs_allowed, "stream": stream.available(linears)}
        return tuple(f for f, ok in offered.items() if ok)

    def form_serves(self, form: str, rows: int) -> bool:
        return skinny.serves(form, rows)

    def forms_kept(self, forms: frozenset[str]) -> None:
        if "packed" not in forms:  # memory no pass will read
            skinny.release_packs(self._linears)
        self._forms = None  # the next prefill reads the new curve: the calibration's own prefills found none

    def time_pass(self, tree: DraftTree, form: str | None = None) -> float:
        """One forward of ``tree`` (a chain) in ``form``, its rows then cropped: the next pass is timed over
        the same cache."""
        n = tree.num_nodes
        mask = tree.attention_mask(self.past_len, dtype=self.dtype, device=self.device) if n > 1 else None
        pos = tree.position_ids(self.past_len, device=self.device)
        ids = torch.tensor([tree.tokens], device=self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self._forward(ids, mask, pos, form=form)
        dt = time.perf_counter() - t0
        self.cache.crop(-n)
        return dt

    def _linear_info(self) -> dict:
        """Which form each pass size's linear layers run in, and the memory the forms take beside the weights
        (the packed weights', measured as they were made; the stream form reads the weights as they are)."""
        forms = self._forms or {}
        in_use = "packed" in forms.values() or self.options.linear == "packed"
        mib = round(skinny.packed_bytes(self._linears) / 2**20, 1) if in_use else 0.0
        streaming = "stream" in forms.values() or self.options.linear == "stream"
        return {
            "option": self.options.linear,
            "packed": mib > 0,
            "packed_mib": mib,
            "pack_limit_mib": round(skinny.pack_limit(self.options.pack_limit_mib) / 2**20),
            "stream": streaming,
            "stream_extra_mib": 0.0,
            "stream_vector_bits": stream.vector_width()["bits"] if streaming else None,
            "stream_kernel": stream.kernel_info().get("kernel") if streaming else None,
            "forms": {str(k): f for k, f in sorted(forms.items())},
        }

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor, keep: int | None = None, rule=None) -> Verified:
        """The prompt in one forward; logits for the last ``keep`` positions only (None: all). With
        ``defer_prefill_rows`` (and a head that can be applied apart, :meth:`_head_parts`) only the last row is
        computed; the others wait for :meth:`prefill_rows`, the record's ``rest``."""
        self.timers = {"mask": 0.0, "forward": 0.0, "walk": 0.0, "commit": 0.0, "prefill_forward": 0.0}
        self.deferred_prefill = None
        self._rule = rule  # for the deferred rows' record
        if self._forms is None:
            self._resolve_forms()
        self.cache = self._new_cache()
        ids = prompt_ids.to(self.device).view(1, -1)
        n = ids.shape[1]
        k = n if keep is None else max(1, min(int(keep), n))
        prev = torch.cat([torch.tensor([-1], device=self.device), ids[0, :-1]])[n - k :]
        parts = self._head_parts() if k > 1 and self.options.defer_prefill_rows else None
        t0 = time.perf_counter()
        pos = torch.arange(n, device=self.device).view(1, -1)
        if parts is None:
            logits = self._forward(ids, position_ids=pos, keep=k)
        else:
            with final_hidden(parts[0], k) as held:
                logits = self._forward(ids, position_ids=pos, keep=1)
            if len(held) == 1:
                self.deferred_prefill = (ids[0, n - k :], prev, held[0], logits[-1].clone())
                k = 1
            else:  # no rows held (the decoder ran more than once): the rows the forward computed, and their tokens
                k = min(k, logits.shape[0])
            prev = prev[-k:]
        if logits.shape[0] > k:  # a model without logits_to_keep computed them all
            logits = logits[-k:]
        self.timers["prefill_forward"] += time.perf_counter() - t0
        self.timers["prefill_logit_rows"] = int(logits.shape[0])
        self.past_len = n
        self._sliding = kv_cache.has_sliding_layers(self.cache)
        if self._sliding:
            self.cache.crop(0)  # sliding layers: back to the last window - 1 positions
        self.before_root = int(ids[0, -1])
        argmax = top1(logits)
        rest = self.prefill_rows if self.deferred_prefill is not None else None
        if rule is None:
            return Verified("prefill", ids[0, n - k :], prev, logits, argmax, bonus=argmax[-1], rest=rest)
        first = rule.choose(logits[-1], ())
        rule.ends((first,))
        return Verified("prefill", ids[0, n - k :], prev, logits, argmax, bonus=first, walk=rule.kind, rest=rest)

    def _head_parts(self):
        """(decoder module, LM head, final logit soft-cap) when the head can be applied to the decoder's output
        apart from the forward; None otherwise, or once a deferred row failed its check on this model."""
        if self._defer_failed:
            return None
        m = self.model
        try:
            dec = m.get_decoder() if hasattr(m, "get_decoder") else None
            head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
        except (AttributeError, NotImplementedError):
            return None
        if not isinstance(dec, torch.nn.Module) or not isinstance(head, torch.nn.Module) or dec is m:
            return None
        return dec, head, getattr(text_config(m.config), "final_logit_softcapping", None)

    @torch.inference_mode()
    def prefill_rows(self) -> Verified | None:
        """The prefill's deferred logit rows (the last ``keep`` prompt positions), computed now; None when none
        are pending, or when the recomputed last row differs from the prefill's own (the head is more than
        ``get_output_embeddings``, e.g. a logit scale: rows are computed in the prefill from then on)."""
        pending, self.deferred_prefill = self.deferred_prefill, None
        if pending is None:
            return None
        tokens, prev, hidden, last = pending
        _, head, cap = self._head_parts() or (None, None, None)
        if head is None:
            return None
        t0 = time.perf_counter()
        k = hidden.shape[0]
        rows = self._head_curve.head_rows(k) if self._head_curve is not None else k
        if rows > k:  # padded to a measured row count that took less (LatencyCurve.head_rows); sliced off
            hidden = torch.cat([hidden, hidden.new_zeros(rows - k, hidden.shape[1])])
        logits = head(hidden.unsqueeze(0))[0, :k]
        if cap:
            logits = torch.tanh(logits / cap) * cap
        logits = logits.to(last.dtype)
        self.timers["prefill_forward"] = self.timers.get("prefill_forward", 0.0) + time.perf_counter() - t0
        tol = 1e-3 + 1e-2 * float(last.abs().max())
        if logits.shape != (len(tokens), last.shape[-1]) or float((logits[-1] - last).abs().max()) > tol:
            self._defer_failed = True
            return None
        self.timers["prefill_logit_rows"] = int(logits.shape[0])
        self.timers["prefill_head_rows"] = rows
        return Verified("prefill", tokens, prev, logits, top1(logits), bonus=None,
                        walk="greedy" if self._rule is None else self._rule.kind)

    @torch.inference_mode()
    def verify(self, tree: DraftTree, rule=None) -> Verified:
        tm = self.timers
        t0 = time.perf_counter()
        past = self.past_len
        ids = torch.tensor([tree.tokens], dtype=torch.long, device=self.device)
        if tree.num_nodes == 1:
            mask, pos = None, torch.tensor([[past]], device=self.device)
        else:
            mask = self.tree_mask(tree, past)
            pos = tree.position_ids(past, device=self.device)
        t1 = time.perf_counter()
        form = self._form_for(tree.num_nodes)
        logits = self._forward(ids, mask, pos, form=form)
        t2 = time.perf_counter()
        if form:
            tm[f"{form}_passes"] = tm.get(f"{form}_passes", 0) + 1
        argmax = top1(logits)
        if rule is None:
            path = walk(tree, argmax)
            accepted, bonus = tuple(tree.tokens[i] for i in path[1:]), argmax[path[-1]]
        else:
            path, accepted, bonus = sampling.rule_walk(tree, logits, rule)
        t3 = time.perf_counter()
        self.commit(past, path, tree.num_nodes)
        self.past_len = past + len(path)
        t4 = time.perf_counter()
        tm["mask"] += t1 - t0
        tm["forward"] += t2 - t1
        tm["walk"] += t3 - t2
        tm["commit"] += t4 - t3
        toks = tree.tokens
        root_pred = self.before_root if tree.route in ROOT_PREDECESSOR_ROUTES else -1
        pred = torch.tensor([root_pred, *(toks[p] for p in tree.parents[1:])], dtype=torch.long)
        # the token before the next anchor: the last accepted node's (the anchor is the bonus)
        self.before_root = toks[path[-1]]
        return Verified("tree", ids[0], pred, logits, argmax, tree, path, accepted, bonus,
                        walk="greedy" if rule is None else rule.kind)

    def tree_mask(self, tree: DraftTree, past: int):
        """The attention mask of a tree pass over ``past`` committed positions: one 4-D additive mask for every
        layer or, once a sliding window can cut into the tree's view, a windowed mask for the sliding layers
        (in a dict keyed by layer type, or alone where every layer is sliding)."""
        plan = self.window_plan
        if plan.mode in ("full", "refuse") or past + max(tree.depths) < plan.window:  # the window cuts nothing
            return tree.attention_mask(past, dtype=self.dtype, device=self.device)
        n = tree.num_nodes
        kv_len, kv_off = self.cache.get_mask_sizes(n, plan.sliding_layer)
        held = int(kv_len) - n
        if int(kv_off) + held != past:
            raise RuntimeError(
                f"the sliding cache layer holds positions {int(kv_off)}..{int(kv_off) + held - 1}, not the last "
                f"ones before {past}: this transformers' DynamicSlidingWindowLayer no longer behaves as Goose's "
                "commit expects (tests/test_sliding_window.py)")
        windowed = attention.sliding_tree_mask(tree, past, plan.window, held, self.dtype, self.device)
        if plan.mode == "single":
            return windowed
        full = tree.attention_mask(past, dtype=self.dtype, device=self.device) if attention.FULL in plan.types else None
        return {t: (windowed if t == attention.SLIDING else full) for t in plan.types}

    def commit(self, past: int, path: tuple[int, ...], num_nodes: int) -> None:
        """Keep the cache rows of the accepted nodes (root first) in contiguous slots, drop the rest. In each
        layer the pass's rows begin after the positions it held: ``past`` in a full layer, at most
        ``window - 1`` in a sliding one."""
        k = len(path)
        if path[-1] != k - 1:  # not a prefix of the layout: gather first
            src: dict = {}  # one index tensor per (device, first row of the pass)
            for layer in _layers(self.cache):
                dev, start = layer.keys.device, kv_cache.pass_rows_start(layer, num_nodes)
                idx = src.get((dev, start))
                if idx is None:
                    idx = src[dev, start] = torch.tensor([start + i for i in path[1:]], device=dev)
                layer.keys[:, :, start + 1 : start + k] = layer.keys.index_select(2, idx)
                layer.values[:, :, start + 1 : start + k] = layer.values.index_select(2, idx)
        remove = num_nodes - k
        if remove > 0 or self._sliding:  # sliding layers then keep their last window - 1 positions
            self.cache.crop(-remove)

    def end(self) -> None:
        self.cache = None
        self.deferred_prefill = None  # rows never asked for (the generation ended at its first token)

    def stats(self) -> dict:
        """Seconds spent per part of verification in the last generation."""
        return {**self.timers, "linear": self._linear_info()}


@contextlib.contextmanager
def final_hidden(decoder: torch.nn.Module, k: int):
    """Within the block, the last ``k`` rows of each output of ``decoder`` (its final hidden states) run by
    **this thread**, appended to the list yielded (threads sharing the model run through the same hook)."""
    held: list[torch.Tensor] = []
    me = threading.get_ident()

    def grab(_module, _args, out):
        if threading.get_ident() != me:
            return
        h = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
        held.append(h[0, -k:].detach().clone())

    handle = decoder.register_forward_hook(grab)
    try:
        yield held
    finally:
        handle.remove()


def input_device(model, default: torch.device) -> torch.device:
    """Where the model takes its input ids: the input embedding's device, or, for a model dispatched by
    accelerate with the embedding offloaded (on ``meta``), the execution device of accelerate's hook on it."""
    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        emb = None
    w = getattr(emb, "weight", None)
    dev = w.device if isinstance(w, torch.Tensor) else default
    if dev.type == "meta":
        for mod in (emb, model):
            hook = getattr(mod, "_hf_hook", None)
            ex = getattr(hook, "execution_device", None)
            if ex is not None and torch.device(ex).type != "meta":
                return torch.device(ex)
        raise UnsupportedModelError(
            f"model {type(model).__name__} has its weights on the 'meta' device and no accelerate hook "
            "that loads them (input embedding on 'meta', no execution device): it cannot run a forward. "
            "Allowed: weights on a real device, or dispatched by accelerate (from_pretrained(device_map=..., "
            "offload_folder=...) or accelerate.dispatch_model). Hint: load the weights, e.g. "
            "from_pretrained(path) or model.to_empty(device='cpu') followed by loading a state dict.")
    return dev


def top1(logits: torch.Tensor) -> tuple[int, ...]:
    """Each row's argmax (first index among equal maxima), as ``max(-1).indices``: the same indices as
    ``argmax`` (ties, NaN and infinities included), and faster on CPU, bfloat16 most of all."""
    return tuple(logits.max(-1).indices.tolist())


def walk(tree: DraftTree, argmax) -> tuple[int, ...]:
    """Greedy walk: from the root, move to the child whose token is the target's argmax."""
    path = [0]
    while True:
        want = argmax[path[-1]]
        child = next((c for c in tree.children[path[-1]] if tree.tokens[c] == want), None)
        if child is None:
            return tuple(path)
        path.append(child)


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        raise UnsupportedModelError(
            f"cache type {type(cache).__name__} exposes no per-layer keys/values; Goose needs a "
            "transformers DynamicCache (transformers >= 5).")
    return layers


@hookimpl(trylast=True)
def goose_register_verifiers(register) -> None:
    register(TransformersVerifier, deprecated=("greedy", "tree"))
