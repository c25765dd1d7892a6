"""TEST-ONLY: the shape of vLLM issue 44175 at a known rate, for the object census.

The real bug: ``SingleTypeKVCacheManager.new_block_ids``, a list built with the KV-cache
manager (during ``EngineCore.__init__``, so before ``gc.freeze()``), appended on every block
allocation and never drained. Here ``register()`` (called by vLLM before the engine is built)
patches ``SingleTypeKVCacheManager.__init__`` to give every manager a list
``sla_guard_test_block_ids``, and wraps ``EngineCore.post_step`` (called after every engine step)
to append to the first manager's list so that its length follows ``RATE * (now - first step)``:
a known growth rate in elements per second, as long as the engine keeps stepping. The list
object is created before ``gc.freeze()``; only its elements are new.

Environment: ``SLA_GUARD_TEST_CENSUS_RATE`` (elements per second, default 20),
``SLA_GUARD_TEST_CENSUS_ELEMENT_BYTES`` (each element is a bytes object of that size, default
1024, so the growth also shows in RSS; 0 appends ints like the real block ids) and
``SLA_GUARD_TEST_CENSUS_MARK`` (a file: at the first append we write the gc freeze count, whether
``gc.get_objects()`` still sees the list -- it must not -- and the PID).
"""

from __future__ import annotations

import gc
import os
import sys
import time

ATTR = "sla_guard_test_block_ids"


def register() -> None:
    # Patch the classes wherever we are: a forked EngineCore inherits them patched from the API
    # server, a spawned one calls register() itself. Only EngineCore calls post_step.
    try:
        core = sys.modules.get("vllm.v1.engine.core")
        if core is None:
            import vllm.v1.engine.core as core
        import vllm.v1.core.single_type_kv_cache_manager as stm
    except Exception:
        return
    mgr_cls, eng_cls = stm.SingleTypeKVCacheManager, core.EngineCore
    if getattr(eng_cls.post_step, "_sla_guard_test_census", False):
        return
    rate = float(os.environ.get("SLA_GUARD_TEST_CENSUS_RATE", "20"))
    size = int(os.environ.get("SLA_GUARD_TEST_CENSUS_ELEMENT_BYTES", "1024"))
    mark = os.environ.get("SLA_GUARD_TEST_CENSUS_MARK")
    original_init, original_post_step = mgr_cls.__init__, eng_cls.post_step
    state = {"t0": None}

    def __init__(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        setattr(self, ATTR, [])  # built with the engine: before gc.freeze()

    def post_step(self, model_executed: bool) -> None:
        try:
            if model_executed:
                ids = getattr(self.scheduler.kv_cache_manager.coordinator.single_type_managers[0], ATTR)
                now = time.monotonic()
                if state["t0"] is None:
                    state["t0"] = now
                    if mark:
                        hidden = not any(o is ids for o in gc.get_objects())
                        with open(mark, "w") as fh:
                            fh.write(f"{gc.get_freeze_count()} {int(hidden)} {os.getpid()}\n")
                due = int(rate * (now - state["t0"]))
                for _ in range(min(due - len(ids), 10_000)):
                    ids.append(b"\x01" * size if size > 0 else len(ids) + 1000)
        except Exception:  # a test plugin must not break the engine either
            pass
        return original_post_step(self, model_executed)

    post_step._sla_guard_test_census = True  # type: ignore[attr-defined]
    mgr_cls.__init__ = __init__
    eng_cls.post_step = post_step
