"""Old home of the exposition parser, now ``sla_guard.exposition`` (the store imports it, and
the store sits below the ingest package). Kept for scripts that still import it from here."""

from sla_guard.exposition import (
    ExpositionError,
    Sample,
    labels_of,
    parse_exposition,
    parse_raw,
    split_series_text,
)

__all__ = ["ExpositionError", "Sample", "labels_of", "parse_exposition", "parse_raw", "split_series_text"]
