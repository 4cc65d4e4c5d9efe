"""``speculative(model)``: assisted generation and prompt lookup for one hybrid model instance.

transformers refuses speculative ``generate`` for every model it marks stateful (a recurrent state
cannot be cropped back to the accepted prefix). Inside the context, for this model instance only:

* ``model._is_stateful`` reads False (an instance attribute over the class's), which lifts the
  refusal;
* each supported linear-attention module's ``forward`` is an instance attribute that runs the
  layer through :class:`~.layer.LayerRun` (RecoverSSM's ops) while a cache is in use;
* each linear cache layer a forward meets gets a subclass of its class whose ``crop`` commits the
  accepted tokens and whose ``is_croppable`` is True (generate checks it after the first forward).

On exit every layer taken over commits what is pending and writes its state and conv history back
into the cache layer in transformers' layout, the cache layers get their class back, and the
instance attributes are removed: the model and any cache it filled work as before. Full-attention
layers keep transformers' own cache throughout. An assistant model that is itself stateful is
refused (its cache is cropped across several forwards, which this context does not serve).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator, Optional

import torch

from .adapters import ADAPTERS, NOT_YET, Adapter, supported_models
from .layer import LayerRun
from .ple import NGramHistory, PLEConvRun

_RUN = "_recoverssm_run"         # the layer's recurrence and conv (LayerRun)
_PLE = "_recoverssm_ple"         # Qwen4Exp: the per-layer embedding's dilated conv (PLEConvRun)
_NGRAM = "_recoverssm_ngram"     # Qwen4Exp: the per-layer embedding's n-gram ids (NGramHistory)
_PARTS = (_RUN, _PLE, _NGRAM)
PLE_LAYER = "Qwen4ExpTextPLELayer"


class UnsupportedModelError(ValueError):
    """The model has no linear-attention layer that :func:`speculative` serves."""


class _Speculation:
    """What a context knows across forwards: the candidates of the current forward (from
    ``logits_to_keep``) and every cache layer it took over."""

    def __init__(self, backend: Optional[str]):
        self.backend = backend
        self.tail = 0
        self.layers: "weakref.WeakSet" = weakref.WeakSet()

    def before_forward(self, _model, _args, kwargs):
        keep = kwargs.get("logits_to_keep", 0)
        self.tail = max(int(keep) - 1, 0) if isinstance(keep, int) else 0


_CROPPABLE: dict = {}      # cache layer class -> its subclass whose crop commits


def _croppable(cls: type) -> type:
    """A subclass of the cache layer class ``cls`` whose rollback commits (memoized)."""
    sub = _CROPPABLE.get(cls)
    if sub is None:
        def crop(self, tokens_to_remove: int) -> None:
            run, ple, ngram = (self.__dict__.get(part) for part in _PARTS)
            if run is None and ple is None and tokens_to_remove != 0:
                raise RuntimeError(f"crop({tokens_to_remove}) before the layer ran a window")
            if run is not None:
                run.crop(tokens_to_remove)
            if ple is not None:
                ple.crop(tokens_to_remove)
            if ngram is not None:
                ngram.crop(self, tokens_to_remove)

        def reset(self) -> None:
            for part in _PARTS:
                self.__dict__.pop(part, None)
            cls.reset(self)

        sub = type(f"RecoverSSM{cls.__name__}", (cls,), {
            "is_croppable": property(lambda self: True),
            "activate_past_recording": lambda self: None,
            "crop": crop,
            "reset": reset,
            "_recoverssm_base": cls,
        })
        _CROPPABLE[cls] = sub
    return sub



def _take_over(layer) -> None:
    """The cache layer's rollback becomes a commit (its class), and its conv states keep their
    working width (no recording of the past: the layer's own rollback does not run)."""
    if getattr(type(layer), "_recoverssm_base", None) is None:
        layer.__class__ = _croppable(type(layer))
    layer.record_past = False


def _hand_back(layer) -> None:
    """Commit what is pending, write the states and histories back in transformers' layout, give
    the layer its class back."""
    layer.__dict__.pop(_NGRAM, None)
    ple: Optional[PLEConvRun] = layer.__dict__.pop(_PLE, None)
    if ple is not None:
        conv = layer.conv_states[1]
        conv[:1, :, conv.shape[-1] - ple.history:].copy_(ple.history_columns().to(conv.dtype))
    run: LayerRun = layer.__dict__.pop(_RUN, None)
    if run is not None:
        run.commit_pending()
        rec = layer.recurrent_states[0]
        rec[:1].copy_(run.state.transpose(-1, -2).to(rec.dtype))
        conv = layer.conv_states[0]
        hist = run.width - 1
        conv[:1, :, conv.shape[-1] - hist:].copy_(run.conv[:, :, :hist].to(conv.dtype))
    base = getattr(type(layer), "_recoverssm_base", None)
    if base is not None:
        layer.__class__ = base


def _layer_forward(module: torch.nn.Module, adapter: Adapter, spec: _Speculation):
    """The instance ``forward`` of a supported linear-attention module inside the context."""
    original = type(module).forward

    def forward(hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
        if cache is None or hidden_states.shape[0] != 1:
            return original(module, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        layer = cache.layers[module.layer_idx]
        run: Optional[LayerRun] = layer.__dict__.get(_RUN)
        if run is not None:
            return run.run(hidden_states)
        _take_over(layer)

        def own(head: int) -> torch.Tensor:
            mask = attention_mask[:, :head] if attention_mask is not None else None
            return original(module, hidden_states[:, :head], cache=cache, attention_mask=mask, **kwargs)
        return _prefill(spec, layer, _RUN, hidden_states, layer.has_previous_state[0], own,
                        lambda: LayerRun(adapter, module, layer.conv_states[0], layer.recurrent_states[0],
                                         spec.backend))
    return forward


def _prefill(spec: _Speculation, layer, key: str, hidden_states: torch.Tensor, has_state: bool,
             own: Callable[[int], torch.Tensor], make_run: Callable[[], object]) -> torch.Tensor:
    """The prefill of a taken-over cache layer: the module's own path (``own(head)``) for all but
    the candidates at the end, then the run (``make_run()``, from the states that path left),
    kept on the cache layer under ``key``, verifies the candidates."""
    T = hidden_states.shape[1]
    # at least one token through the module's own path where the cache layer has no state yet
    tail = min(spec.tail, T if has_state else T - 1)
    head = T - tail
    outs = [own(head)] if head > 0 else []
    run = make_run()
    layer.__dict__[key] = run
    spec.layers.add(layer)
    if tail > 0:
        outs.append(run.run(hidden_states[:, head:], candidates=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _ple_forwards(module: torch.nn.Module, spec: _Speculation) -> dict:
    """The instance attributes a Qwen4Exp PLE layer gets inside the context: ``_short_conv`` on
    the module, ``forward`` on its n-gram embedding."""
    original_conv = type(module)._short_conv
    embedding = module.ple_embedding
    original_embedding = type(embedding).forward

    def short_conv(hidden_states: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is None or hidden_states.shape[0] != 1:
            return original_conv(module, hidden_states, cache)
        layer = cache.layers[module.layer_idx]
        run: Optional[PLEConvRun] = layer.__dict__.get(_PLE)
        if run is not None:
            return run.run(hidden_states)
        _take_over(layer)
        return _prefill(spec, layer, _PLE, hidden_states, layer.conv_states[1] is not None,
                        lambda head: original_conv(module, hidden_states[:, :head], cache),
                        lambda: PLEConvRun(module, layer.conv_states[1], spec.backend))

    def ngram_forward(input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is None or input_ids.shape[0] != 1:
            return original_embedding(embedding, input_ids, cache)
        layer = cache.layers[embedding.layer_idx]
        _take_over(layer)
        seen = cache.get_conv_state(embedding.layer_idx, state_idx=2)
        previous = (seen.clone() if seen is not None
                    else input_ids.new_full((1, embedding.context_len), embedding.eos_token_id)).long()
        out = original_embedding(embedding, input_ids, cache)
        history = layer.__dict__.setdefault(_NGRAM, NGramHistory(embedding.context_len))
        history.saw(previous, input_ids.long())
        spec.layers.add(layer)
        return out

    return {module: {"_short_conv": short_conv}, embedding: {"forward": ngram_forward}}


def _linear_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Adapter]]:
    """The model's supported linear-attention modules; an error naming what is supported where
    there are none, or where the model has recurrent layers this context does not serve."""
    found, other = [], set()
    for m in model.modules():
        name = type(m).__name__
        if name in ADAPTERS:
            found.append((m, ADAPTERS[name]))
        elif name in NOT_YET:
            other.add(NOT_YET[name])
    if other or not found:
        what = ", ".join(sorted(other)) if other else f"no supported linear-attention layer in {type(model).__name__}"
        raise UnsupportedModelError(f"recoverssm.integrations.transformers.speculative does not serve {what}; "
                                    f"supported: {', '.join(supported_models())}")
    return found


@contextlib.contextmanager
def speculative(model: torch.nn.Module, *, backend: Optional[str] = None) -> Iterator[torch.nn.Module]:
    """Let ``model.generate`` speculate (``assistant_model=``, ``prompt_lookup_num_tokens=``) on a
    hybrid transformers model, exactly: the linear-attention layers verify each window of
    candidates without writing their state and commit the accepted tokens when generate rolls
    its cache back.

    ``model``: a transformers model with Qwen3-Next, Qwen3.5, Qwen4Exp, OLMo-hybrid or Kimi-Linear
    linear-attention layers (``supported_models()``), on the CPU or a GPU, fp32 or bf16. ``backend``: a RecoverSSM
    backend name (default: chosen by the tensors' device). Scoped to this instance and undone on
    exit (see the module docstring)::

        with speculative(model):
            out = model.generate(input_ids, prompt_lookup_num_tokens=4, max_new_tokens=64)
    """
    modules = _linear_modules(model)
    spec = _Speculation(backend)
    saved = {name: model.__dict__[name] for name in ("_is_stateful", "_get_candidate_generator")
             if name in model.__dict__}
    original_candidates = model._get_candidate_generator

    def get_candidate_generator(*args, **kwargs):
        assistant = kwargs.get("assistant_model")
        if assistant is not None and getattr(assistant, "_is_stateful", False):
            raise ValueError(f"speculative(): the assistant model {type(assistant).__name__} is stateful; use a "
                             "model without recurrent layers as the assistant, or prompt lookup")
        return original_candidates(*args, **kwargs)

    patches = {module: {"forward": _layer_forward(module, adapter, spec)} for module, adapter in modules}
    for ple in (m for m in model.modules() if type(m).__name__ == PLE_LAYER):
        patches.update(_ple_forwards(ple, spec))
    hook = model.register_forward_pre_hook(spec.before_forward, with_kwargs=True)
    model.__dict__["_is_stateful"] = False
    model.__dict__["_get_candidate_generator"] = get_candidate_generator
    for module, attrs in patches.items():
        module.__dict__.update(attrs)
    try:
        yield model
    finally:
        hook.remove()
        for module, attrs in patches.items():
            for name in attrs:
                module.__dict__.pop(name, None)
        for name in ("_is_stateful", "_get_candidate_generator"):
            model.__dict__.pop(name, None)
        model.__dict__.update(saved)
        for layer in list(spec.layers):
            _hand_back(layer)
