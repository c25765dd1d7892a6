"""The pydantic base of every YAML-facing model: the guard's config, the detectors' and the
advisor's sections, the simulator's profiles. One definition, so the rules cannot drift apart."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown keys are errors (a mistyped key in YAML must not be silently ignored) and a
    validated model is frozen (what was checked is what runs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
