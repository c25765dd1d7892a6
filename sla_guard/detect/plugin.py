"""`sla-guard serve` extension: adds the detectors to the guard, starts the Alertmanager
publisher when one is configured, and returns the ``/v1/findings`` router."""

from __future__ import annotations

from sla_guard.detect.alertmanager import AlertPublisher
from sla_guard.detect.evaluators import build_evaluators, parse_detectors, router
from sla_guard.detect.findings import FindingsBook


def extend(config, guard, token=None) -> list:
    cfg = parse_detectors(config.detectors)
    book = FindingsBook(guard.metrics)
    if hasattr(guard, "add_state"):
        guard.add_state("findings", book)  # open findings survive a restart (sla_guard.state)
    for ev in build_evaluators(book, cfg):
        guard.add_evaluator(ev)
    publisher = AlertPublisher.from_settings(book, config.alertmanager, guard.metrics)
    if publisher is not None:
        publisher.start()
    guard.findings = book  # for status pages and tests
    return [router(book)]
