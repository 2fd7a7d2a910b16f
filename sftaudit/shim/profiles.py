"""How often the shim records what. A profile is a named schedule; keyword options override it.

Per-step records (loss, lr, per-tensor gradient norms, batch statistics) are cheap
and taken at every step in every profile. The profile sets the schedule of the
costly probes. Three staged profiles: ``dev`` records everything, often
(for debugging a run; it costs several percent of step time); ``preprod`` thins the
data-layer evidence (checks 01, 02 and 04 see fewer rows) and probes less often, within
the 3% budget: it is the default. A logits probe (06) of ten forward passes would not
fit there; ours is one batched forward, so preprod keeps it at a low rate. ``prod``
keeps the cheapest set at a lower frequency. Overheads per
profile are measured by ``benchmarks/shim_overhead.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Schedule:
    """Intervals in optimizer steps; 0 switches a probe off."""

    samples_every: int  # full rows (input_ids, labels) as loss-mask evidence
    samples_per_batch: int  # at most this many rows of each micro-batch
    grad_hist_every: int  # per-tensor histograms (also taken at suspicious steps)
    probe_every: int  # next-token distributions on the probe prompts
    probe_top_k: int  # how much of each distribution is kept
    generate_every: int  # sampled generations on the probe prompts
    generations_per_prompt: int
    eval_every: int  # greedy generations on the eval set
    max_new_tokens: int


PROFILES: dict[str, Schedule] = {
    "dev": Schedule(
        samples_every=1,
        samples_per_batch=8,
        grad_hist_every=50,
        probe_every=10,
        probe_top_k=32,
        generate_every=50,
        generations_per_prompt=8,
        eval_every=50,
        max_new_tokens=32,
    ),
    "preprod": Schedule(
        samples_every=50,
        samples_per_batch=2,
        grad_hist_every=200,
        probe_every=50,
        probe_top_k=32,
        generate_every=200,
        generations_per_prompt=8,
        eval_every=200,
        max_new_tokens=32,
    ),
    "prod": Schedule(
        samples_every=500,
        samples_per_batch=1,
        grad_hist_every=1000,
        probe_every=0,
        probe_top_k=32,
        generate_every=0,
        generations_per_prompt=0,
        eval_every=1000,
        max_new_tokens=32,
    ),
}
DEFAULT_PROFILE = "preprod"


def resolve_schedule(profile: str, overrides: dict) -> Schedule:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    known = {f.name for f in fields(Schedule)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown schedule options {sorted(unknown)}; known: {sorted(known)}")
    return replace(PROFILES[profile], **overrides)
