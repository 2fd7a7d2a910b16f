"""The Trainer state source: a ``trainer_state.json`` read into its history, plan and other fields."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftaudit.errors import InputError
from sftaudit.imports.logs import all_normalised, normalised
from sftaudit.imports.sources.trainer_state import TrainerState, decoded_entries

from . import EXAMPLE_STEPS, example_loss


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run: steps 1..10 logged with their loss and learning rate, as the Trainer saves it."""
    folder.mkdir(parents=True, exist_ok=True)
    history = [{"epoch": s / 10, "learning_rate": 1e-4, "loss": example_loss(s), "step": s} for s in EXAMPLE_STEPS]
    state = {"global_step": 10, "max_steps": 10, "logging_steps": 1, "save_steps": 5, "log_history": history}
    path = folder / "trainer_state.json"
    path.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [path]


def test_a_state_gives_its_history_plan_and_other_fields(tmp_path):
    (path,) = write_example(tmp_path)
    log = TrainerState().read([path], tmp_path)
    assert [e["step"] for e in log.segments[0]] == list(EXAMPLE_STEPS)
    assert log.plan == {"max_steps": 10, "logging_steps": 1, "save_steps": 5}
    assert log.fields["global_step"] == 10 and "log_history" not in log.fields
    assert log.files == ["trainer_state.json"] and log.records == 10


def test_entries_whose_step_is_no_integer_are_left_out(tmp_path):
    path = tmp_path / "trainer_state.json"
    history = [{"loss": 1.0, "step": s} for s in (1, 2.5, "3", None, True)] + [{"loss": 1.0}, 7]
    path.write_text(json.dumps({"global_step": 1, "log_history": history}), encoding="utf-8")
    assert [e["step"] for e in TrainerState().read([path], tmp_path).segments[0]] == [1]


@pytest.mark.parametrize(
    "text",
    ['{"global_step": 3, "log_history": {"step": 1}}', '{"global_step": 3, "log_his', "[1, 2]", "\x00\x01"],
)
def test_what_is_no_state_is_refused_in_one_line(tmp_path, text):
    path = tmp_path / "trainer_state.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match="trainer_state.json: not a"):
        TrainerState().read([path], tmp_path)


def test_detected_by_its_own_keys(tmp_path):
    (path,) = write_example(tmp_path / "run")
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 100}), encoding="utf-8")
    assert TrainerState().detect(path) and not TrainerState().detect(other)


def _state_file(path: Path, history: list[dict], **fields) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"global_step": len(history), "max_steps": 100, "log_history": history, **fields}
    path.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def test_a_stream_read_equals_the_whole_file_read(tmp_path, monkeypatch):
    """Read a chunk at a time (a tiny chunk here: every entry, number and field cut across chunks), NaN and
    Infinity as the Trainer writes them: the same as json.load gives."""
    import sftaudit.imports.sources.trainer_state as module

    monkeypatch.setattr(module, "CHUNK_BYTES", 7)
    history = [{"loss": float("nan") if s == 3 else 1.0 / s, "step": s, "grad_norm": float("inf")} for s in range(1, 9)]
    path = _state_file(tmp_path / "trainer_state.json", history, best_metric=12345.678, stateful_callbacks={"a": [1]})
    log = TrainerState().read([path], tmp_path)
    assert (
        json.dumps(log.segments[0], sort_keys=True) == json.dumps(history, sort_keys=True)
        and log.fields["best_metric"] == 12345.678
    )
    assert log.fields["stateful_callbacks"] == {"a": [1]} and log.plan["max_steps"] == 100


def test_older_states_are_taken_from_the_largest_where_they_repeat_it(tmp_path, monkeypatch):
    import sftaudit.imports.sources.trainer_state as module

    history = [{"loss": 2.0 - s / 100, "step": s} for s in range(1, 41)]
    newest = _state_file(tmp_path / "trainer_state.json", history)
    older = _state_file(tmp_path / "checkpoint-20" / "trainer_state.json", history[:20], global_step=20)
    empty = _state_file(tmp_path / "checkpoint-0" / "trainer_state.json", [], global_step=0)
    branch = history[:10] + [{"loss": 9.0, "step": s} for s in range(11, 16)]  # a branch a resume abandoned
    other = _state_file(tmp_path / "checkpoint-15" / "trainer_state.json", branch, global_step=15)
    decoded = []
    monkeypatch.setattr(module, "normalised", lambda e: decoded.append(e["step"]) or dict(e))
    monkeypatch.setattr(module, "all_normalised", lambda entries: False)  # every entry through `normalised`
    logs = TrainerState().read_all([older, empty, other, newest], tmp_path)
    assert [len(log.segments[0]) for log in logs] == [20, 0, 15, 40]
    assert logs[0].segments[0][19] is logs[3].segments[0][19]  # the same entry, never decoded twice
    assert logs[0].fields["global_step"] == 20 and logs[1].fields["global_step"] == 0
    assert [e["loss"] for e in logs[2].segments[0][10:]] == [9.0] * 5
    assert sorted(decoded) == sorted(list(range(1, 41)) + list(range(1, 16)))  # the branch alone read again


@pytest.mark.parametrize("chunk", [1 << 12, 1 << 23])
@pytest.mark.parametrize("meeting_in_a_key", [False, True])
def test_older_states_are_taken_from_a_batch_of_the_largest(tmp_path, monkeypatch, chunk, meeting_in_a_key):
    """A per-step log decoded a batch at a time: an older state whose log ends within a batch takes the batch's first
    entries, the same objects (their ends found in the file, where the older log ends); a key holding the text where
    entries meet leaves the batch's ends unknown, and an older state ending within it is read in full, to the same
    values."""
    import sftaudit.imports.sources.trainer_state as module

    monkeypatch.setattr(module, "CHUNK_BYTES", chunk)
    history = [{"loss": 2.0 - s / 1000, "step": s} for s in range(1, 301)]
    if meeting_in_a_key:
        history[150] = {"loss}, {x": 1.0, "step": 151}
    newest = _state_file(tmp_path / "trainer_state.json", history)
    cuts = (1, 37, 150, 151, 299)
    olders = [_state_file(tmp_path / f"checkpoint-{n}" / "trainer_state.json", history[:n]) for n in cuts]
    logs = TrainerState().read_all([*olders, newest], tmp_path)
    for n, log in zip(cuts, logs):
        assert json.dumps(log.segments[0]) == json.dumps(history[:n]) and log.records == n
    copied = [log.segments[0][-1] is logs[-1].segments[0][n - 1] for n, log in zip(cuts, logs)]
    if not meeting_in_a_key:
        assert copied == [True] * 5
    elif chunk == 1 << 23:  # the whole log one batch but its last entry: a state ending within it is read in full
        assert copied == [False, False, False, False, True]
    else:  # the batches before the one holding the key
        assert copied[:4] == [True, True, False, False]


@pytest.mark.parametrize("chunk", [300, 1 << 23])
@pytest.mark.parametrize(
    "odd",
    [
        [{"loss": 1.0, "note": "}, {", "step": 21}, {"loss": 1.0, "note": "}\n,\t{", "step": 21}],
        [5, {"loss": 1.0, "step": "21"}],
        [{"nested": {"a": [{"b": 1}, {"c": 2}]}, "step": 21}],
    ],
    ids=["text-of-a-meeting", "no-object", "nested"],
)
def test_entries_decoded_together_are_those_decoded_one_by_one(tmp_path, monkeypatch, chunk, odd):
    """Entries whose text holds where one entry meets the next (``}, {``), an entry that is no object, one whose
    step is text, a nested one, in one chunk or cut across many: the history, the records and the entries an older
    state takes from the largest are what decoding one entry at a time gives."""
    import sftaudit.imports.sources.trainer_state as module

    monkeypatch.setattr(module, "CHUNK_BYTES", chunk)
    history = [{"loss": 1 / s, "step": s} for s in range(1, 60)]
    history[20:20] = odd
    newest = _state_file(tmp_path / "trainer_state.json", history)
    older = _state_file(tmp_path / "checkpoint-30" / "trainer_state.json", history[:40], global_step=30)
    logs = TrainerState().read_all([older, newest], tmp_path)
    kept = [normalised(e) for e in history if type(e) is dict and type(e["step"]) is int]
    assert json.dumps(logs[1].segments[0]) == json.dumps(kept) and logs[1].records == len(history)
    older_kept = [normalised(e) for e in history[:40] if type(e) is dict and type(e["step"]) is int]
    assert logs[0].segments[0] == older_kept and logs[0].records == 40
    assert logs[0].segments[0][-1] is logs[1].segments[0][len(older_kept) - 1]  # taken from the largest: the
    # largest one's entry ends were right


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"log_history": [{"step": 1}] "x": 1}', "no comma between fields"),
        ('{"log_history": [{"step": 1} {"step": 2}]}', "no comma between log entries"),
        ('{"log_history": [{"step": 1}]} trailing', "more after the state's end"),
        ('{"log_history": [' + "[" * 100_000 + "]" * 100_000 + "]}", "nested too deeply"),
    ],
)
def test_a_damaged_state_is_refused_with_what_is_wrong(tmp_path, text, said):
    path = tmp_path / "trainer_state.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=said):
        TrainerState().read([path], tmp_path)


def test_a_value_too_large_to_be_a_state_field_is_refused(tmp_path, monkeypatch):
    import sftaudit.imports.sources.trainer_state as module

    monkeypatch.setattr(module, "MAX_VALUE_BYTES", 1000)
    monkeypatch.setattr(module, "CHUNK_BYTES", 100)
    path = tmp_path / "trainer_state.json"
    path.write_text('{"log_history": [], "x": "' + "y" * 5000 + '"}', encoding="utf-8")
    with pytest.raises(InputError, match="a value of more than"):
        TrainerState().read([path], tmp_path)


def test_a_batch_of_entries_is_kept_as_decoded_only_where_normalising_keeps_each_one():
    clean = [{"loss": 1.0, "step": 1}, {"epoch": 0.1, "loss": float("nan"), "step": 2}]
    assert all_normalised(clean) and [normalised(e) for e in clean] == clean
    odd = [
        {"lr": 1e-4, "step": 3},  # another logger's name
        {"eval/loss": 1.0, "step": 3},
        {"loss": "1.0", "step": 3},  # a number as text
        {"loss": 1, "step": 3},  # an integer
        {"loss": True, "step": 3},
        {"rewards": {"chosen": 1.0}, "step": 3},  # a nested group
        {"loss": 1.0, "step": 2**63},  # past 64 bits
        {"loss": 1.0, "step": 3.0},
        {"loss": 1.0},  # no step
    ]
    for entry in odd:
        assert not all_normalised([*clean, entry]), entry


_JSON_LEAVES = (
    st.floats()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.lists(st.sampled_from(["a", "NaN", "Infinity", "-", '"', "\\", "\ud800", "é", " "]), max_size=4).map("".join)
    | st.booleans()
    | st.none()
)
_JSON_VALUES = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["loss", "step", "NaN", "x"]), inner),
    max_leaves=8,
)


def _as_quoted(value):
    """A value as the fast path reads it: a non-finite float as the text spelling it, an integer past 64 bits as
    the float it rounds to."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    if type(value) is int and not -(2**63) <= value < 2**64:
        return float(value)
    if isinstance(value, list):
        return [_as_quoted(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_quoted(v) for k, v in value.items()}
    return value


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_JSON_VALUES | st.dictionaries(st.sampled_from(["loss", "step", "eval_loss"]), _JSON_LEAVES), max_size=6)
)
def test_entries_decoded_fast_are_the_standard_decoders_with_non_finite_numbers_as_text(entries):
    """orjson where it can: the standard decoder's values, a bare ``NaN``/``Infinity`` as the text spelling it
    (which `normalised` reads as that number), an integer past 64 bits as its float; the standard decoder's own
    where orjson cannot (a ``NaN`` inside a string, a lone surrogate, a number too large for a double)."""
    text = ",".join(json.dumps(e) for e in entries)
    standard = json.loads("[" + text + "]")
    assert json.dumps(decoded_entries(text, json.JSONDecoder())) in {
        json.dumps(standard),
        json.dumps([_as_quoted(e) for e in standard]),
    }


def test_a_non_finite_loss_is_decoded_fast_as_the_text_spelling_it():
    text = '{"loss": NaN, "step": 1}, {"grad_norm": -Infinity, "note": "fine", "step": 2}'
    assert decoded_entries(text, json.JSONDecoder()) == [
        {"loss": "NaN", "step": 1},
        {"grad_norm": "-Infinity", "note": "fine", "step": 2},
    ]
