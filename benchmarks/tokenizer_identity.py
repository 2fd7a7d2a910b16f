"""How long `tokenizer_identity` takes on released tokenizers: the reference way (json.loads of the whole spec,
json.dumps of each part, as every earlier version computed it) against sftaudit's, in one process, interleaved,
with the digests compared part by part (they must be equal, byte for byte). sftaudit's is timed on a spec it
has not seen (its digests by spec emptied first) and again on the same one (a checkpoint's unchanged tokenizer).

The tokenizers are built from the files the test extras ship (tests/corpus.py: Llama 3.1's 128,256 tokens,
Qwen2.5's 151,665, Mistral v0.3's and Phi-3.5's SentencePiece 32k; never a model hub) and the fixture
tokenizer (2,048). Loading them imports transformers, as in a preflight or a training process: the cycle
collector's cost grows with what the process holds: `--torch` imports torch first, as the shim's training
process holds it (it fingerprints the tokenizer at start and at each checkpoint).

    .venv/bin/python benchmarks/tokenizer_identity.py [--families llama3 qwen2 mistral phi3 fixture] [--repeat 7]
        [--torch]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sftaudit.core.tokenizer import _SPEC_DIGESTS, tokenizer_identity  # noqa: E402
from tests.test_tokenizer_identity import reference_identity  # noqa: E402 - the reference way, declared once


def load(family: str):
    if family == "fixture":
        from sftaudit.fixtures import build_tokenizer

        return build_tokenizer()
    from tests.corpus import real_tokenizer, tokenizer_cache

    return real_tokenizer(family, tokenizer_cache())


def timed(compute, tokenizer) -> tuple[float, dict[str, str]]:
    start = time.perf_counter()
    identity = compute(tokenizer)
    return time.perf_counter() - start, identity


def spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} s [{min(times):.3f}-{max(times):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["llama3", "qwen2", "mistral", "phi3", "fixture"])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--torch", action="store_true", help="import torch first (a training process's heap)")
    args = parser.parse_args()
    if args.torch:
        import torch  # noqa: F401 - its objects are what the cycle collector walks
    load_before = os.getloadavg()[0]
    print(
        f"tokenizer_identity, medians [min-max] of {args.repeat} interleaved runs, {os.cpu_count()} CPUs, "
        f"{'torch imported' if args.torch else 'no torch'}"
    )
    for family in args.families:
        tokenizer = load(family)
        spec_size = len(tokenizer.backend_tokenizer.to_str())
        reference, first, again = [], [], []
        for _ in range(args.repeat):
            seconds, expected = timed(reference_identity, tokenizer)
            reference.append(seconds)
            _SPEC_DIGESTS.clear()
            for times in (first, again):
                seconds, identity = timed(tokenizer_identity, tokenizer)
                times.append(seconds)
                if identity != expected:
                    raise SystemExit(f"{family}: digests differ: {identity} != {expected}")
        ratio = statistics.median(reference) / statistics.median(first)
        print(
            f"  {family}: {len(tokenizer):,} tokens, {spec_size / 1e6:.1f} MB spec: reference {spread(reference)}, "
            f"sftaudit {spread(first)} ({ratio:.1f}x), the same spec again {spread(again)}; digests equal"
        )
    print(f"  load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
