"""specattn inside SGLang: a plugin and SGLang-protocol draft backends (``docs/sglang.md``).

- ``plugin.register``: the ``sglang.srt.plugins`` entry point; routes SGLang's draft backend
  factory to specattn when ``SPECATTN_SGLANG=1`` (or ``SPECATTN_SGLANG_BACKEND=NAME``) is set.
- ``backends``: ``SpecattnMultiStepDraftBackend`` (draft decode) and
  ``SpecattnDraftExtendBackend`` (draft extend) over any specattn backend (imports SGLang).
- ``adapter``: the SGLang-free mapping of pools, batches and layers onto specattn.
- ``settings`` / ``tree``: the opt-in variables and ``path`` tree mode.

Importing this package imports neither SGLang nor the backends.
"""
