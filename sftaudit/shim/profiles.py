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

A profile's probe intervals suit long runs. Given the run's planned length (`max_steps`), the probes,
generations and evals a profile switches on run at least `PROBES_PER_RUN` times over it: an 80-step run
under preprod probes every 10 steps, not never (an interval given as a keyword option stands as given).
The recorder also runs them at the run's last planned step and at each checkpoint save.
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


# Enough points over a run for the checks that read them (LOOP-08's rolling window of 5 evals, LOOP-06's
# block of 4 probes before the one it judges, LOOP-07's 3 generation steps in a row), few enough that a
# short run's probes stay a small share of it.
PROBES_PER_RUN = 8
PROBE_INTERVALS = ("probe_every", "generate_every", "eval_every")


def resolve_schedule(profile: str, overrides: dict, max_steps: int | None = None) -> Schedule:
    """The profile's schedule with the keyword overrides; with the planned length, each probe interval the
    profile sets (not one given) shortened so the probe runs at least PROBES_PER_RUN times."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    known = {f.name for f in fields(Schedule)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown schedule options {sorted(unknown)}; known: {sorted(known)}")
    schedule = replace(PROFILES[profile], **overrides)
    if not max_steps or max_steps <= 0:
        return schedule
    most = max(1, int(max_steps) // PROBES_PER_RUN)
    shorter = {
        name: min(getattr(schedule, name), most)
        for name in PROBE_INTERVALS
        if name not in overrides and getattr(schedule, name) > 0
    }
    return replace(schedule, **shorter)
