"""Serving-engine integrations (optional).

Each subpackage speaks one engine's attention-backend protocol over specattn's public API.
Nothing here is imported by ``import specattn``; an integration imports its engine only
when it is used.

- ``specattn.integrations.sglang``: SGLang's draft attention (plugin + backends).
"""
