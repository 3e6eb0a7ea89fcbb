"""The compiled decoding engines kept per model (`decoding_engine`), so that a compiled step and its graphs serve
every later call of similar sizes, and `release_engines` to free them."""

from __future__ import annotations

import weakref
from collections import OrderedDict

from ..model.transformer import FreeTransformer
from . import step_runner
from .engine import DecodeEngine
from .sampling import declared_filters

# A compiled engine's cache holds the positions asked for rounded up to this many (so that calls of similar
# lengths share one engine and its graphs), and at most max_seq_len.
CACHE_ROUNDING = 64
# Compiled engines kept per model (each holds a KV cache and, on a GPU, its graphs' memory pool).
ENGINES_PER_MODEL = 4

# the compiled engines kept per model (`decoding_engine`), most recently used last: model -> OrderedDict(key ->
# engine). Weak in the model: a model's engines go with it.
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoding_engine(
    model: FreeTransformer, slots: int, positions: int, *, compile: bool = False, inductor: bool | None = None
) -> DecodeEngine:
    """An engine of `slots` rows whose cache holds at least `positions` positions. Eager: a new one, its cache
    exactly that long. Compiled: the model's kept engine for these slots and the positions rounded up to
    CACHE_ROUNDING (made on first use, so that its compiled step and graphs serve every later call); the least
    recently used beyond ENGINES_PER_MODEL is dropped. Kept engines are keyed by the parameters' storage too,
    so a model moved to another device or dtype gets a new one (weights updated in place are seen by a graph),
    and by the declared sampling filters, so a filter registered later is applied.

    A kept engine (its KV cache, compiled step and, on a GPU, its graphs' memory pool) lives until it is the
    least recently used past ENGINES_PER_MODEL, its model is deleted (an engine refers to its model weakly, so
    it never keeps the model alive), or `release_engines(model)`; then its memory is freed as soon as no call
    still decodes with it (on a GPU, `torch.cuda.empty_cache()` gives it back to the driver)."""
    if not compile:
        return DecodeEngine(model, slots, capacity=positions)
    capacity = min(model.config.max_seq_len, -(-positions // CACHE_ROUNDING) * CACHE_ROUNDING)
    if inductor is None:
        inductor = model.rope_cos.device.type in step_runner.INDUCTOR_DEVICES
    key = (slots, capacity, inductor, tuple(p.data_ptr() for p in model.parameters()), declared_filters())
    engines = _engines.setdefault(model, OrderedDict())
    if key not in engines:
        engines[key] = DecodeEngine(model, slots, capacity=capacity, compile=True, inductor=inductor)
        while len(engines) > ENGINES_PER_MODEL:
            engines.popitem(last=False)
    engines.move_to_end(key)
    engine = engines[key]
    if engine.rows:
        raise RuntimeError("the kept decoding engine is in use (one generate(compile=True) call at a time per model)")
    return engine


def release_engines(model: FreeTransformer) -> None:
    """Drop the compiled engines kept for `model` (`decoding_engine`), so that their KV caches, compiled steps
    and graphs' memory can be freed; the next compiled call makes (and compiles) a new one."""
    _engines.pop(model, None)
