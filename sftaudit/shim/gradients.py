"""Gradient capture: per-tensor L2 norms at every step, histograms on schedule and at suspicious steps,
non-finite counts, the pre- and post-clip reads.

Every value is over this rank's local pieces of the parameters (`pieces`: DDP, FSDP1/2 and DeepSpeed
differ only there), so nothing here runs a collective. The norms stay on device until the step's one
host transfer (`Recorder._to_host`); only the rare paths (a non-finite norm, a spike's histograms)
read more.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from itertools import repeat
from operator import is_not
from typing import Any

import numpy as np
import torch

from ..core.artifacts import GRAD_HIST_EDGES
from .pieces import Pieces
from .profiles import Schedule
from .sink import Sink

# A step whose global gradient norm exceeds this multiple of its running mean gets histograms
# recorded on the spot, so the evidence of a spike exists even between scheduled histograms.
SPIKE_FACTOR = 10.0


class Gradients:
    """One step's gradient reads (reset by the recorder at each step) and the running mean of the norm."""

    def __init__(self, pieces: Pieces, schedule: Schedule, sink: Sink, norms_at_backward_end: bool):
        self._pieces = pieces
        self._params = pieces.params
        self._every_index = list(range(len(self._params)))  # the usual case: every tensor has a gradient
        self._schedule = schedule
        self._sink = sink
        self.at_backward_end = norms_at_backward_end
        self._ema: float | None = None
        self.reset()

    def reset(self) -> None:
        self.norms: torch.Tensor | None = None
        self._post_norms: torch.Tensor | None = None  # after the loop's clipping (norms_at_backward_end)
        self._read_after_clip = False  # norms_at_backward_end, but this step's were read after clipping
        self._index: list[int] = []
        self._hist: torch.Tensor | None = None
        self._hist_index: list[int] = []

    def read(self, step: int) -> None:
        """The norms as the gradients stand now; with `at_backward_end` and norms read there, these
        are the post-clip ones beside them (when none was read there, they stand in, and the step says so)."""
        if self.at_backward_end and self.norms is not None:
            grads = self._present(self._pieces.grads())
            if _none_missing(grads):
                self._post_norms = torch.stack(torch._foreach_norm(grads)).float()
            return
        self.capture(step)
        self._read_after_clip = self.at_backward_end

    def capture(self, step: int) -> None:
        all_grads = self._pieces.grads()
        index = self._every_index if _none_missing(all_grads) else [i for i, g in enumerate(all_grads) if g is not None]
        if not index:
            return
        grads = all_grads if len(index) == len(all_grads) else [all_grads[i] for i in index]
        norms = torch.stack(torch._foreach_norm(grads))
        self.norms = norms if norms.dtype == torch.float32 else norms.float()
        self._index = index
        every = self._schedule.grad_hist_every
        if every and step % every == 0 and "grad_hists" not in self._sink.disabled:
            self._hist, self._hist_index = histograms(grads), index

    def read_when_backward_ends(self, output: Any, at_end: Callable[[], None]) -> None:
        """When backward reaches this forward's output, queue `at_end` (a guarded `capture`) for the end
        of that backward pass. The callback queues itself once more so that it runs after the final
        callbacks queued during the pass (DDP's reduction, FSDP's), on the gradients the clipping will see."""
        get = output.get if isinstance(output, Mapping) else lambda k: getattr(output, k, None)
        # Whichever of them the loop's objective was computed from (TRL's own loss uses log_probs, not loss).
        tensors = [
            t for t in (get(k) for k in ("loss", "log_probs", "logits")) if torch.is_tensor(t) and t.requires_grad
        ]
        engine = torch.autograd.Variable._execution_engine
        queued = []

        def started(_grad: torch.Tensor) -> None:
            if not queued:  # once per backward pass, whichever output it reaches first
                queued.append(True)
                engine.queue_callback(lambda: engine.queue_callback(at_end))

        for tensor in tensors:
            tensor.register_hook(started)

    def _present(self, all_grads: list) -> list:
        """The gradients at the tensors whose norms were read (all of them, mostly: no copy then)."""
        return all_grads if len(self._index) == len(all_grads) else [all_grads[i] for i in self._index]

    def _per_tensor(self, host: list[float]) -> list[float | None]:
        """Host norms as one value per parameter (None where it had no gradient)."""
        if len(self._index) == len(self._params):
            return host
        out: list[float | None] = [None] * len(self._params)
        for i, v in zip(self._index, host):
            out[i] = v
        return out

    def parts(self) -> list[tuple[str, torch.Tensor]]:
        """The step's device tensors for the one host transfer, in pack order."""
        named = (("norms", self.norms), ("post_norms", self._post_norms), ("hist", self._hist))
        return [(key, t) for key, t in named if t is not None]

    def step_fields(self, values: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        """The step record's gradient fields from the transferred values (``values[("step", key)]``), and
        those only some steps have (post-clip norms, or the source when the norms are post-clip)."""
        norms: list[float | None] = [None] * len(self._params)
        nonfinite, global_norm = {}, None
        if ("step", "norms") in values:
            host_norms = values["step", "norms"].tolist()  # plain floats: a few dozen, numpy would cost more
            norms = self._per_tensor(host_norms)
            global_norm = _l2(host_norms)
            if not math.isfinite(global_norm):  # else every norm is finite
                bad = np.flatnonzero(~np.isfinite(values["step", "norms"]))
                if bad.size:
                    nonfinite = self._count_nonfinite([self._index[j] for j in bad])
        fields = {"grad_norm": global_norm, "grad_norms": norms, "nonfinite_grads": nonfinite}
        extra = {}
        if ("step", "post_norms") in values:
            post = values["step", "post_norms"].tolist()
            extra = {
                "grad_norm_post_clip": _l2(post),
                "grad_norms_post_clip": self._per_tensor(post),
            }
        elif self._read_after_clip:
            extra = {"grad_norm_source": "post_clip"}  # no backward-end read this step: the norms are post-clip
        return fields, extra

    def after_step(self, step: int, values: dict, fields: dict) -> None:
        """After the step's record: its histograms (scheduled, or triggered by a non-finite norm or a
        spike), then the running mean of the global norm."""
        global_norm, nonfinite = fields["grad_norm"], fields["nonfinite_grads"]
        if ("step", "hist") in values:
            self._write_hists(step, self._hist_index, values["step", "hist"], "scheduled")
        elif nonfinite or self._is_spike(global_norm):
            self._write_triggered_hists(step, "nonfinite" if nonfinite else "spike")
        if global_norm is not None and np.isfinite(global_norm):
            self._ema = global_norm if self._ema is None else 0.9 * self._ema + 0.1 * global_norm

    def _is_spike(self, global_norm: float | None) -> bool:
        ema = self._ema
        return global_norm is not None and ema is not None and ema > 0 and global_norm > SPIKE_FACTOR * ema

    def _count_nonfinite(self, bad: list[int]) -> dict[str, int]:
        counts = {}
        grads = self._pieces.step_grads()
        for i in bad:  # rare path: only tensors whose norm is already non-finite
            grad = grads[i]
            if grad is not None:
                counts[self._params[i]["name"]] = int((~torch.isfinite(grad)).sum())
        return counts

    def _write_triggered_hists(self, step: int, reason: str) -> None:
        """Histograms of this step's gradient pieces, taken after the optimizer step: only when the
        pieces still have the norms recorded for the step, or all of them one multiple of those (an
        in-place clip: `clip_grad_norm_`, DeepSpeed's bf16 accumulation buffer), which is undone; else
        (freed, reused, zeroed) an event saying they could not be taken."""
        if "grad_hists" in self._sink.disabled:
            return
        grads = self._pieces.step_grads()
        index = [i for i, g in enumerate(grads) if g is not None]
        pieces = [grads[i] for i in index]
        scale = self._scale_since_recorded(pieces) if self.norms is not None and index == self._index else None
        if scale is None:
            self._sink.write(
                "events",
                {
                    "kind": "grad_hists_not_recorded",
                    "step": step,
                    "time": time.time(),
                    "error": f"{reason} step: its gradients were freed or changed by the "
                    f"optimizer step before the histograms ({self._pieces.framework})",
                },
            )
            return
        if scale != 1.0:
            pieces = torch._foreach_div(pieces, scale)
        self._write_hists(step, index, histograms(pieces).cpu().numpy(), reason)

    def _scale_since_recorded(self, pieces: list[torch.Tensor]) -> float | None:
        """1.0 when the pieces' norms are the recorded ones; c when every piece was multiplied by one
        finite c > 0 since (norms zero before stay zero); None otherwise. A rare path: one more pass
        over the gradients and one more transfer are fine here."""
        now = torch.stack(torch._foreach_norm(pieces)).float()
        if torch.equal(now.nan_to_num(nan=-1.0), self.norms.nan_to_num(nan=-1.0)):  # NaN where it was NaN
            return 1.0
        now, then = now.double().cpu().numpy(), self.norms.double().cpu().numpy()
        moved = np.isfinite(then) & (then > 0)
        if not moved.any() or not np.isfinite(then[~moved]).all() or (now[~moved] != 0).any():
            return None
        ratios = now[moved] / then[moved]
        scale = float(np.median(ratios))
        uniform = np.isfinite(ratios).all() and scale > 0 and np.abs(ratios / scale - 1).max() <= 1e-4
        return scale if uniform else None

    def _write_hists(self, step: int, index: list[int], hist: Any, reason: str) -> None:
        hist = hist.reshape(len(index), -1).astype("int64")
        for i, counts in zip(index, hist):
            self._sink.write(
                "grad_hists",
                {
                    "step": step,
                    "tensor": self._params[i]["name"],
                    "reason": reason,
                    "zeros": int(counts[0]),
                    "nonfinite": int(counts[1]),
                    "counts": counts[2:].tolist(),
                },
            )


def _l2(values: list[float]) -> float:
    """The L2 norm of the per-tensor norms, in float64 (NaN when one is NaN, inf when one is inf)."""
    return math.sqrt(sum(v * v for v in values))


def _none_missing(grads: list) -> bool:
    """No None among them, checked without a Python-level loop (`None in grads` would compare tensors)."""
    return all(map(is_not, grads, repeat(None)))


def histograms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor: [zeros, non-finite, counts of log10|g| in GRAD_HIST_EDGES bins] (zeros and values below
    the first edge in the first bin, above the last in the last). No masked copy of the finite values:
    histc skips NaN, and the infinities, clamped into the last bin, are taken out of it again."""
    lo, hi, bins = GRAD_HIST_EDGES[0], GRAD_HIST_EDGES[-1], len(GRAD_HIST_EDGES) - 1
    rows = []
    for g in grads:
        g = g.detach().float().reshape(-1)
        counts = torch.histc(torch.log10(g.abs()).clamp_(lo, hi - 1e-6), bins=bins, min=lo, max=hi)
        counts[-1] -= torch.isinf(g).sum()
        nonfinite = g.numel() - counts.sum()  # the NaN histc skipped and the infinities taken out
        rows.append(torch.cat([(g == 0).sum().reshape(1).float(), nonfinite.reshape(1), counts]))
    return torch.stack(rows)
