"""Discrete-event simulation of a prefill/decode-disaggregated vLLM deployment.

It emits the metric contract through the same ``EngineRecorder`` code path as the real hooks,
replays real traces, injects faults on a schedule and powers ``sla-guard demo`` / ``replay``.
See docs/simulator.md.
"""
