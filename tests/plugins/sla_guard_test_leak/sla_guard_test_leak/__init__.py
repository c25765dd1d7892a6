"""TEST-ONLY: a deliberate host-memory leak inside vLLM's EngineCore, shaped like the real one
(vLLM issue 44175: a list that grew on every scheduler step and was never drained).

vLLM calls ``register()`` first thing in ``EngineCore.__init__`` (before ``gc.freeze()``).
It wraps ``EngineCore.post_step``, which the busy loop calls after every engine step, so the
list below grows only while the engine does work, and only after start-up, i.e. after
``gc.freeze()``: the list object itself was created at import, so it sits in the frozen
permanent generation and ``gc.get_objects()``/tracemalloc snapshots taken the usual way miss it.
The leak is visible only as RSS, which is what the detector watches.

Environment: ``SLA_GUARD_TEST_LEAK_BYTES_PER_STEP`` (default 32768) and
``SLA_GUARD_TEST_LEAK_MARK`` (a file; on the first leaked step we write the gc freeze count
there, so the test can check the growth happened after gc.freeze()).
"""

from __future__ import annotations

import gc
import os
import sys

_LEAK: list[bytes] = []  # created before gc.freeze(); grows after it


def register() -> None:
    # Patch the class wherever we are: a forked EngineCore inherits the patched class from the
    # API server (where vLLM's "plugins loaded" flag is then already set), a spawned one calls
    # register() itself. Only EngineCore ever calls post_step, so elsewhere this is inert.
    mod = sys.modules.get("vllm.v1.engine.core")
    if mod is None:
        try:
            import vllm.v1.engine.core as mod
        except Exception:
            return
    cls = mod.EngineCore
    if getattr(cls.post_step, "_sla_guard_test_leak", False):
        return
    original = cls.post_step
    per_step = int(os.environ.get("SLA_GUARD_TEST_LEAK_BYTES_PER_STEP", "32768"))
    mark = os.environ.get("SLA_GUARD_TEST_LEAK_MARK")

    def post_step(self, model_executed: bool) -> None:
        try:
            if model_executed:
                _LEAK.append(b"\x01" * per_step)  # bytes are written: pages are touched
                if len(_LEAK) == 1 and mark:
                    with open(mark, "w") as fh:
                        fh.write(f"{gc.get_freeze_count()} {os.getpid()}\n")
        except Exception:  # a test plugin must not break the engine either
            pass
        return original(self, model_executed)

    post_step._sla_guard_test_leak = True  # type: ignore[attr-defined]
    cls.post_step = post_step
