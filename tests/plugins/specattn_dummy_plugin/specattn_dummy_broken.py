"""A plugin entry point that fails to load: specattn must log it and go on."""

raise RuntimeError("specattn_dummy_broken fails on purpose")
