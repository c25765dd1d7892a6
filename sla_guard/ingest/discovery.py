"""Which engines to scrape: the config's static targets plus a targets file re-read when it
changes (so an operator or a deployment controller adds and removes engines without a restart).

The file is YAML or JSON, either a list of targets like the config's
(``[{url, model, pool, name}]``) or Prometheus ``file_sd`` groups
(``[{targets: ["host:port"], labels: {model, pool}}]``). A file that cannot be read or is
invalid keeps the last good list and counts an error (each round it stays so); it never stops the
guard. ``status()`` shows the count and the reason in ``/v1/status``, and the scraper counts them in
``guard_scrape_errors{target="targets_file",kind="discovery"}``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from exporters.redact import redact_url
from sla_guard.config import DiscoveryError, Target, load_yaml, parse_targets

log = logging.getLogger("sla_guard.ingest.discovery")


class TargetDiscovery:
    """Static targets + a targets file, re-read when its mtime, size or inode changes."""

    def __init__(self, static: list[Target], targets_file: Path | None = None) -> None:
        self.static = list(static)
        self.path = Path(targets_file) if targets_file else None
        self._mtime: tuple[int, int, int] | None = None
        self._from_file: list[Target] = []
        self.errors = 0
        self.last_error: str | None = None
        self._warned: set[tuple[str, str]] = set()  # (url, name) of duplicates already logged

    def targets(self) -> list[Target]:
        if self.path is not None:
            self._refresh()
        seen: dict[str, Target] = {}
        first_of: dict[tuple[str, str | None], str] = {}  # (url, adapter) -> name of its first definition
        for t in [*self.static, *self._from_file]:
            key = t.name or t.url
            if key in seen:
                continue  # first definition of a name wins
            # one engine under two names was scraped twice: its requests counted twice in its pool
            # (or once in each of two pools), passing min_requests on half the evidence. A router's
            # page read with and without an adapter stores different series: both are kept.
            if (first := first_of.setdefault((t.url, t.adapter), key)) != key:
                if (t.url, key) not in self._warned:
                    self._warned.add((t.url, key))
                    url = redact_url(t.url)
                    shown = first if first != t.url else url
                    log.warning("target %s has the URL of target %s (%s): scraped once", t.name or url, shown, url)
                continue
            seen[key] = t
        # an unnamed target is shown as its redacted URL; URLs that differ only in credentials or
        # query values would share that name (and a store group): number the later ones
        out, shown = [], set()
        for t in seen.values():
            if t.name is None and (name := redact_url(t.url)) in shown:
                n = 2
                while f"{name}#{n}" in shown:
                    n += 1
                t = t.model_copy(update={"name": f"{name}#{n}"})
            shown.add(t.name or redact_url(t.url))
            out.append(t)
        return out

    def status(self) -> dict | None:
        """The targets file's health for ``/v1/status``: otherwise a broken file, which keeps the
        last good list, was visible only in the log. None without a targets file."""
        if self.path is None:
            return None
        return {"targets_file": str(self.path), "targets": len(self._from_file), "errors": self.errors,
                "last_error": self.last_error}

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
            # not the mtime alone: a file renamed over it (or copied with cp -p / rsync -t) can carry
            # the old one's mtime, and a coarse-mtime filesystem stamps two edits in a second alike
            mtime = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError as err:
            self._fail(f"cannot stat {self.path}: {err.strerror}")
            return
        if mtime == self._mtime:
            return
        try:
            data = load_yaml(self.path.read_text(encoding="utf-8"))
            self._from_file = parse_targets(data, str(self.path))
            self._mtime = mtime
            self.last_error = None
        except UnicodeDecodeError:
            self._fail(f"{self.path} is not UTF-8 text; write it as YAML or JSON")
        except (OSError, yaml.YAMLError, DiscoveryError) as err:
            self._fail(str(err))

    def _fail(self, msg: str) -> None:
        self.errors += 1
        if msg != self.last_error:
            log.warning("targets file: %s (keeping %d targets from before)", msg, len(self._from_file))
        self.last_error = msg
