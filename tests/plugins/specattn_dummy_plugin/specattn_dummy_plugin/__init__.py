"""A third-party backend pair, registered through the ``specattn.backends`` entry point.

It answers to ``dummy_plugin`` (alias ``dummy``) on every platform and is never chosen by
``auto``; it computes nothing (selection tests only).
"""

from specattn import DraftDecodeBackend, DraftExtendBackend

IMPORT_COUNT = globals().get("IMPORT_COUNT", 0) + 1


class DummyDecode(DraftDecodeBackend, name="dummy_plugin", aliases=("dummy",),
                  kernel_library="none (test plugin)"):
    auto_eligible = False
    tested_on = "CPU (selection only)"

    def init_forward_metadata(self, batch):
        pass

    def forward(self, step, layer, q, k, v):
        raise NotImplementedError("the dummy plugin computes nothing")


class DummyExtend(DraftExtendBackend, name="dummy_plugin", aliases=("dummy",),
                  kernel_library="none (test plugin)"):
    auto_eligible = False
    tested_on = "CPU (selection only)"

    def init_forward_metadata(self, batch):
        pass

    def forward(self, layer, q, k, v):
        raise NotImplementedError("the dummy plugin computes nothing")
