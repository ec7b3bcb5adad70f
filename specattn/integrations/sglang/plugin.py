"""The SGLang plugin: routes SGLang's draft backend factory to specattn when the user opts in.

SGLang loads it from the entry-point group ``sglang.srt.plugins`` at process start. Without the
opt-in (``settings``: ``SPECATTN_SGLANG=1`` or ``SPECATTN_SGLANG_BACKEND=NAME``) it registers
nothing and SGLang is unchanged. With it, AROUND hooks on
``DraftBackendFactory.create_decode_backend`` / ``create_draft_extend_backend`` build the
specattn backend for the name SGLang resolved (or the forced one), wrap it in SGLang's protocol
(``backends``), set the name stamps SGLang's models dispatch on (the name SGLang's own
factory stamps, so model code takes the same path as with SGLang's backend) and log
specattn's selection explanation once. A name specattn does not know leaves SGLang's own
backend in place (logged).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..._logging import warn_once
from ...config import SpecConfig
from ...errors import BackendUnavailableError, InvalidInputError, UnknownBackendError
from ...factory import DraftBackendFactory
from .adapter import wrap_pools
from .settings import (BACKEND_ENV, ENABLE_ENV, OPTIONS_ENV, Settings, opted_in, read_settings,
                       stray_settings)

__all__ = ["register", "DECODE_TARGET", "EXTEND_TARGET", "sglang_backend_name",
           "build_decode_backend", "build_draft_extend_backend"]

log = logging.getLogger(__name__)

_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory"
DECODE_TARGET = f"{_FACTORY}.create_decode_backend"
EXTEND_TARGET = f"{_FACTORY}.create_draft_extend_backend"

_explained: set[tuple[str, str, str]] = set()


def register() -> None:
    """Entry point (``sglang.srt.plugins``): hook the draft factory if the user opted in.

    The factory is hooked before the other variables are read: SGLang's loader logs an
    exception of a plugin and starts without it, so a bad value raises again from the hooks
    when SGLang builds its draft backends, which stops start-up."""
    stray = stray_settings()
    if stray:
        log.warning("specattn SGLang plugin: %s set but not read (the variables are %s, "
                    "%s and the tree mode and options only with the opt-in)",
                    ", ".join(stray), ENABLE_ENV, BACKEND_ENV)
    if not opted_in():
        log.debug("specattn SGLang plugin loaded, not enabled (set SPECATTN_SGLANG=1)")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(DECODE_TARGET, _around_create_decode_backend, HookType.AROUND)
    HookRegistry.register(EXTEND_TARGET, _around_create_draft_extend_backend, HookType.AROUND)
    settings = read_settings()
    if settings.tree_mode == "path":
        from .tree import SELECT_TOP_K_TARGET, around_select_top_k_tokens

        HookRegistry.register(SELECT_TOP_K_TARGET, around_select_top_k_tokens,
                              HookType.AROUND)
    log.info("specattn serves SGLang's draft attention (%s, tree mode %s%s)",
             f"backend {settings.backend!r}" if settings.backend else "same backend names",
             settings.tree_mode,
             f", options {'; '.join(o.label for o in settings.options)}"
             if settings.options else "")


def sglang_backend_name(factory: Any, kind: str) -> str:
    """The name SGLang's own factory resolves for ``kind`` (``"decode"`` / ``"extend"``):
    the draft runner's override, else the configured decode (or, for extend, prefill unless
    ``speculative_attention_mode == "decode"``) backend."""
    from sglang.srt.runtime_context import attention_backends, get_spec

    prefill, decode = attention_backends()
    use_decode = kind == "decode" or get_spec().speculative_attention_mode == "decode"
    return factory.draft_attn_backend or (decode if use_decode else prefill)


def _draft_runner(model_runner: Any):
    from sglang.srt.runtime_context import get_parallel

    from .backends import check_model_runner

    check_model_runner(model_runner)
    heads = model_runner.model_config.get_num_attention_heads(get_parallel().attn_tp_size)
    return wrap_pools(model_runner, heads)


def _start_layer(model_runner: Any) -> int:
    return int(getattr(model_runner.token_to_kv_pool, "start_layer", 0) or 0)


def _specattn_factory(model_runner: Any, topk: int, num_steps: int, settings: Settings,
                      sglang_name: str) -> DraftBackendFactory:
    runner = _draft_runner(model_runner)
    config = SpecConfig(attention_backend=settings.specattn_name(sglang_name),
                        page_size=runner.page_size, kv_cache_dtype=runner.kv_cache_dtype)
    return DraftBackendFactory(config, runner, topk, num_steps, tree_mode=settings.tree_mode,
                               backend_options=settings.backend_options())


def _explain_once(selection: Any, kind: str, sglang_name: str, settings: Settings) -> None:
    key = (kind, sglang_name, settings.specattn_name(sglang_name))
    if key in _explained:
        return
    _explained.add(key)
    log.info("specattn serves SGLang's draft %s (SGLang backend %r):\n%s", kind, sglang_name,
             selection.explain())


def _stamp(backend: Any, name: str) -> None:
    backend.prefill_attention_backend_str = name
    backend.decode_attention_backend_str = name


def _build(kind: str, model_runner: Any, topk: int, num_steps: int, sglang_name: str,
           settings: Optional[Settings], wrap):
    settings = read_settings() if settings is None else settings
    factory = _specattn_factory(model_runner, topk, num_steps, settings, sglang_name)
    create, explain = ((factory.create_decode_backend, factory.explain_decode_backend)
                       if kind == "decode" else
                       (factory.create_draft_extend_backend,
                        factory.explain_draft_extend_backend))
    try:
        backend = create()
    except (InvalidInputError, BackendUnavailableError) as exc:
        named = _named_by_settings(exc, settings, sglang_name)
        if named is exc:
            raise
        raise named from exc
    if backend is None:
        return None
    _warn_unused_options(settings, type(backend), kind)
    _explain_once(explain(), kind, sglang_name, settings)
    wrapped = wrap(backend, _start_layer(model_runner))
    _check_layers(model_runner, wrapped.adapter.layers)
    stamp = _stamp_name(kind, sglang_name)
    for b in (wrapped, *getattr(wrapped, "attn_backends", ())):
        _stamp(b, stamp)
    return wrapped


def _check_layers(model_runner: Any, layers: Any) -> None:
    """The draft model's attention layers (SGLang's ``RadixAttention`` modules of
    ``model_runner.model``, loaded before SGLang builds the draft backends), converted once
    now: what specattn refuses in a layer (a sliding window, a logit cap other than tanh,
    cross attention) stops start-up here, not at the layer's first forward (without CUDA
    graphs, the first request's). A layer of another shape than the pool's (an MLA model's
    non-absorbed attention) is left to its calls, as ``LayerMap.get`` leaves it."""
    model = getattr(model_runner, "model", None)
    for module in model.modules() if hasattr(model, "modules") else ():
        if all(hasattr(module, a) for a in ("layer_id", "tp_q_head_num", "tp_k_head_num",
                                            "qk_head_dim", "v_head_dim", "scaling")):
            layers.get(module)


def _stamp_name(kind: str, sglang_name: str) -> str:
    """The name SGLang's own factory stamps for ``sglang_name``: that of the backend it
    builds, an alias's or a dispatcher's target (``cutedsl_mla``'s draft extend is
    ``trtllm_mla``, ``nsa`` is ``dsa``, ``hybrid_linear_attn`` the platform's), which
    specattn's names follow; a name specattn does not know stays as SGLang resolved it."""
    from ...selection import resolve_name

    return resolve_name(kind, sglang_name) or sglang_name


def _named_by_settings(exc: Exception, settings: Settings, sglang_name: str) -> Exception:
    """A refusal of the backend the settings chose, saying which setting chose it: an option
    of ``SPECATTN_SGLANG_OPTIONS`` the backend refuses (``plan=dot-mla`` on an MHA model),
    or a backend that cannot serve here, chosen by ``SPECATTN_SGLANG_BACKEND`` or by
    ``SPECATTN_SGLANG=1`` from SGLang's name (unsetting it keeps SGLang's own backend)."""
    argument = getattr(exc, "argument", None)
    option = next((o for o in settings.options if argument in o.keys()), None)
    if option is not None:
        return InvalidInputError(OPTIONS_ENV, f"options the serving backend takes ({exc})",
                                 repr(option.label))
    if isinstance(exc, BackendUnavailableError):
        chooser = (f"{BACKEND_ENV}={settings.backend}" if settings.backend else
                   f"{ENABLE_ENV}=1 (SGLang's backend {sglang_name!r})")
        return BackendUnavailableError(
            f"{chooser} chose specattn's {exc.name!r}, which cannot serve here: "
            f"{exc.summary} (unset {BACKEND_ENV if settings.backend else ENABLE_ENV} to keep "
            f"SGLang's own backend)", exc.name, exc.reasons, summary=exc.summary)
    return exc


def _warn_unused_options(settings: Settings, serving: type, kind: str) -> None:
    """An option for another backend than the one serving ``kind`` is not used: said once
    (a deployment that changes models with the same environment may serve another)."""
    from ...registry import active_registry

    for option in settings.options:
        if serving not in option.classes(active_registry()):
            warn_once(log, f"{OPTIONS_ENV}: {option.label} is not used for SGLang's draft "
                      f"{kind}, which specattn's {serving.name!r} serves")


def build_decode_backend(model_runner: Any, topk: int, num_steps: int, sglang_name: str,
                         settings: Optional[Settings] = None):
    """The SGLang-protocol multi-step draft container over specattn (``None`` for
    ``num_steps <= 1``), stamped with ``sglang_name``."""
    from .backends import SpecattnMultiStepDraftBackend

    return _build("decode", model_runner, topk, num_steps, sglang_name, settings,
                  lambda backend, start: SpecattnMultiStepDraftBackend(
                      model_runner, topk, num_steps, backend, start_layer=start))


def build_draft_extend_backend(model_runner: Any, topk: int, num_steps: int,
                               sglang_name: str, settings: Optional[Settings] = None,
                               fallback: Any = None):
    """The SGLang-protocol draft-extend backend over specattn, stamped with
    ``sglang_name``; ``fallback`` serves what specattn cannot (see ``backends``)."""
    from .backends import SpecattnDraftExtendBackend

    return _build("extend", model_runner, topk, num_steps, sglang_name, settings,
                  lambda backend, start: SpecattnDraftExtendBackend(
                      model_runner, backend, fallback=fallback, start_layer=start))


def _unknown(kind: str, name: str, err: UnknownBackendError) -> None:
    warn_once(log, f"specattn has no draft {kind} backend named {name!r}; SGLang's own "
              f"backend serves it ({err})")


def _around_create_decode_backend(original, factory: Any):
    settings = read_settings()  # first: a bad value stops start-up whatever serves
    if factory.speculative_num_steps <= 1 or factory.qsa_profile is not None:
        return original(factory)
    name = sglang_backend_name(factory, "decode")
    try:
        return build_decode_backend(factory.draft_model_runner, factory.topk,
                                    factory.speculative_num_steps, name, settings)
    except UnknownBackendError as err:
        _unknown("decode", settings.specattn_name(name), err)
        return original(factory)


def _around_create_draft_extend_backend(original, factory: Any):
    settings = read_settings()
    if factory.qsa_profile is not None:
        return original(factory)
    name = sglang_backend_name(factory, "extend")
    runner = factory.draft_model_runner
    # An MLA model's prefill may take the non-absorbed path: keep SGLang's backend for it.
    fallback = original(factory) if runner.use_mla_backend else None
    try:
        built = build_draft_extend_backend(runner, factory.topk,
                                           factory.speculative_num_steps, name, settings,
                                           fallback=fallback)
    except UnknownBackendError as err:
        _unknown("extend", settings.specattn_name(name), err)
        built = None
    # specattn has no draft extend for the name (``flashmla``'s, as the original factory):
    # SGLang's own backend serves it, as an unknown name's does.
    return built if built is not None else (fallback if fallback is not None
                                            else original(factory))
