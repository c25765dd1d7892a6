"""Performance profile of a simulated deployment (YAML, validated with pydantic).

A profile holds every number the simulator uses: step-time models of the prefill and decode
engines, KV capacity, transfer and offload costs, speculative decoding, cold start and the host
memory of each process. Writing one for another model or GPU means copying ``default.yaml`` and
changing numbers; ``load_profile`` names the bad field when one is wrong.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from sla_guard.spec_base import Strict, error_message, load_yaml

PROFILE_DIR = Path(__file__).parent / "profiles"


class PrefillModel(Strict):
    """step time = step_base_s + sum over scheduled chunks of n * (per_token_s + per_token_per_kctx_s * ctx/1000)."""

    step_base_s: float = Field(ge=0)
    per_token_s: float = Field(gt=0)
    per_token_per_kctx_s: float = Field(default=0.0, ge=0, description="attention cost growing with context")
    chunk_tokens: int = Field(ge=16, description="chunked-prefill token budget per step")
    max_num_seqs: int = Field(default=256, ge=1)
    jitter: float = Field(default=0.03, ge=0, lt=1, description="relative std-dev of each step time")


class DecodeModel(Strict):
    """step time = step_base_s + per_seq_s * batch + per_kctx_s * total_context/1000 (spec decode on)."""

    step_base_s: float = Field(gt=0)
    per_seq_s: float = Field(ge=0)
    per_kctx_s: float = Field(default=0.0, ge=0)
    max_num_seqs: int = Field(default=256, ge=1)
    nospec_factor: float = Field(default=1.0, gt=0, le=1, description="step time without drafts / with")
    jitter: float = Field(default=0.03, ge=0, lt=1)


class KVModel(Strict):
    block_tokens: int = Field(ge=1, description="KV block size (tokens)")
    prefill_capacity_tokens: int = Field(ge=1)
    decode_capacity_tokens: int = Field(ge=1)
    bytes_per_token: float = Field(gt=0)
    cpu_offload_bytes: float = Field(default=0.0, ge=0, description="CPU tier per prefill replica; 0 = off")
    restore_s_per_gb: float = Field(default=0.026, ge=0)


class TransferModel(Strict):
    bandwidth_bytes_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)
    post_s: float = Field(default=0.0005, ge=0)
    jitter: float = Field(default=0.1, ge=0, lt=1)
    failure_prob: float = Field(default=0.0, ge=0, le=1)
    bytes_per_descriptor: float = Field(default=4 * 1024 * 1024, gt=0)


class SpecModel(Strict):
    method: str = "mtp"
    num_spec_tokens: int = Field(default=0, ge=0, le=16)
    acceptance_per_pos: list[float] = Field(default_factory=list, description="unconditional rate at each position")

    @model_validator(mode="after")
    def _shape(self) -> SpecModel:
        if len(self.acceptance_per_pos) != self.num_spec_tokens:
            raise ValueError("acceptance_per_pos needs one rate per speculative token")
        prev = 1.0
        for a in self.acceptance_per_pos:
            if not 0 <= a <= prev:
                raise ValueError("acceptance_per_pos must be in [0, 1] and non-increasing")
            prev = a
        return self


class ProcessModel(Strict):
    role: str  # api_server | engine_core | worker
    name: str  # process label, e.g. EngineCore_DP0
    rss_bytes: float = Field(gt=0)
    anon_share: float = Field(default=0.85, gt=0, le=1)
    shmem_bytes: float = Field(default=0.0, ge=0)
    gc_sawtooth_bytes: float = Field(default=0.0, ge=0, description="GC sawtooth amplitude")
    gc_period_s: float = Field(default=60.0, gt=0)
    noise_bytes: float = Field(default=0.0, ge=0, description="std-dev of sample noise")
    warmup_growth_bytes: float = Field(default=0.0, ge=0, description="growth that levels off after start")
    warmup_s: float = Field(default=600.0, gt=0)
    threads: int = 8
    open_fds: int = 64
    frozen_objects: int = 0


class Profile(Strict):
    name: str
    model: str
    gpus_per_replica: int = Field(ge=1)
    gpu_hour_usd: float = Field(default=0.0, ge=0)
    prefill: PrefillModel
    decode: DecodeModel
    kv: KVModel
    transfer: TransferModel
    spec: SpecModel = Field(default_factory=SpecModel)
    cold_start_s: float = Field(default=300.0, ge=0)
    frontend_s: float = Field(default=0.0, ge=0, description="API server + proxy time per hop, outside engine timers")
    router_overhead_s: float = Field(
        default=0.003, ge=0,
        description="the P/D proxy's own time per request before the first token reaches the client (routing, "
                    "rewriting the decode request, relaying the first token), in three equal passes: before the "
                    "prefill leg, between the legs, after the decode leg; the client scope's stage=proxy")
    processes: list[ProcessModel] = Field(default_factory=list)
    max_model_len: int = Field(default=1_000_000, ge=16)


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field and how to fix it."""


def load_profile(name_or_path: str | Path = "default") -> Profile:
    """Load ``name`` from sla_guard/sim/profiles/ or a YAML file path."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILE_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        known = ", ".join(sorted(x.stem for x in PROFILE_DIR.glob("*.yaml")))
        raise ProfileError(f"profile {name_or_path!r} not found; use one of: {known}, or a path to a .yaml file")
    try:
        data = load_yaml(p.read_text())
    except yaml.YAMLError as err:
        raise ProfileError(f"{p} is not valid YAML: {err}") from None
    try:
        return Profile.model_validate(data or {})
    except ValidationError as err:
        lines = [f"invalid profile {p}:"]
        for e in err.errors():
            where = ".".join(str(x) for x in e["loc"]) or "(top level)"
            lines.append(f"  {where}: {error_message(e)} (got {e.get('input')!r:.60})")
        raise ProfileError("\n".join(lines)) from None
