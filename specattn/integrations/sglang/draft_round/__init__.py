"""SGLang's own EAGLE draft round, stock and through the specattn plugin (imports SGLang).

Everything here is SGLang 0.5.23's: the mock model runner and pools of its attention test kit
(``sglang.test.kits.attention_unittest``: ``MHATokenToKVPool`` / ``MLATokenToKVPool``, a real
``RadixAttention`` layer), ``DraftBackendFactory`` (with the plugin's hooks applied through
SGLang's ``HookRegistry``, or without), the real ``EagleDraftWorker.draft_forward`` (the kit's
worker harness) and ``EAGLEDraftCudaGraphRunner`` (capture, then ``execute``: its host
preparation and the graph replay). What this module adds: long prefixes written straight into
the pools (random KV; the kit fills them token by token), SGLang's per-branch draft slots for
page size > 1, a draft model whose LM head is float32 (the kit's, with logits that near-ties
flip less) and whose MLA KV store gets a contiguous ``out_cache_loc`` (``_contiguous_kv_store``),
records of every step's attention input and output, logits and KV, and the comparisons:

- ``compare``: two runs of the same round (draft tokens; each step's attention output, the
  KV it wrote and the logits, relative to the reference's largest magnitude). A request whose
  tokens differ passes only where the logits that chose them agree within the tolerance (a
  rounding-level near-tie; counted); its later steps are not compared.
- ``check_tree``: a run against a float32 attention computed from the recorded queries and
  the pools, for ``lane`` (each lane's own slots) or ``path`` (each token's ancestors, from the
  parents the plugin recorded), with the rows where the two differ counted; ``UPSTREAM``:
  SGLang backends that read something else, checked against a model of what they read.

On a CPU (tests) the graph runner is driven with an eager stand-in for its CUDA-graph backend
(``EagerGraphBackend``: capture runs the body once, replay runs it again), so everything but
the capture itself runs there.

One module per job: ``fixture`` (the case, SGLang's kit fixture, the prefixes), ``runs`` (the
draft model with records, the factory with or without the plugin, eager and graph rounds),
``checks`` (the comparisons), ``timing`` (rounds and steps timed, stock against the plugin).
"""

from .checks import (UPSTREAM, Verdict, check_tree, compare, kv_reads, perturbed, rel_err,
                     tree_reference, tree_verdict, upstream_check)
from .fixture import (Fixture, RoundCase, build_fixture, draft_positions, eagle_draft_batch,
                      install_stubs)
from .runs import (SPECATTN_ENV_KEYS, DraftModel, EagerGraphBackend, Record, capture_graph,
                   capture_graph_recorded, execute_tree, make_container, run_eager, run_graph,
                   sglang_hooks)
from .timing import served_by, time_graph_round, time_pair, time_steps

__all__ = ["RoundCase", "Fixture", "Record", "Verdict", "build_fixture", "sglang_hooks",
           "make_container", "run_eager", "capture_graph", "capture_graph_recorded",
           "run_graph", "execute_tree", "compare", "check_tree", "tree_reference",
           "time_graph_round", "time_steps", "time_pair", "served_by", "install_stubs",
           "SPECATTN_ENV_KEYS", "draft_positions", "DraftModel", "EagerGraphBackend",
           "rel_err", "kv_reads", "tree_verdict", "UPSTREAM", "upstream_check", "perturbed",
           "eagle_draft_batch"]
