"""Detectors for silent failures: host-memory leaks (``leak``) and slow drifts of rates and
latency (``drift``). Pure math lives in those modules; ``evaluators`` binds them to the guard's
MetricsView, ``findings`` keeps their results, ``alertmanager`` pushes them out."""
