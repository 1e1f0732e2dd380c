"""Quiet, informative consoles (issue 20 item 5): warnings that repeat at every step are counted and reported once per
logging interval (``trainer.warnings_every`` steps, an epoch online, a variant of an evaluation), with the totals in
``results.json`` and the trackers, and nothing is written through an open progress bar
(`diffalign.runtime.console`)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest
from conftest import CHILD_ENV, REPO, compose_cfg, smoke_overrides

from diffalign.runtime.console import console_summary, literal, warn_repeated

log = logging.getLogger("test_console")


def test_outside_a_summary_a_repeated_warning_is_logged_at_once(caplog):
    with caplog.at_level(logging.WARNING, logger="test_console"):
        warn_repeated(log, "k", "{count} of {of} things in " + literal("{braces}"), count=2, of=5)
        warn_repeated(log, "k", "{count} of {of} things", count=0, of=5)  # nothing went wrong: nothing said
    assert [r.getMessage() for r in caplog.records] == ["2 of 5 things in {braces}"]


def test_inside_a_summary_calls_are_counted_and_reported_once_per_flush(caplog):
    with caplog.at_level(logging.WARNING, logger="test_console"), console_summary() as counts:
        for count in (1, 0, 3):  # 4 of 30 over 3 calls, 2 of them with something to say
            warn_repeated(log, "sat", "{count} of {of} pairs saturated", count=count, of=10)
        warn_repeated(log, "skip", "{count} of {of} updates skipped", count=0, of=1)  # counted, never said
        assert counts.pending() == {"sat": 4, "skip": 0}
        assert caplog.records == []  # nothing said until the interval ends
        assert counts.flush("steps 1-3") == {"warnings/sat": 4}
        assert counts.flush("steps 4-6") == {}  # a quiet interval says nothing
        warn_repeated(log, "sat", "{count} of {of} pairs saturated", count=2, of=10)
        with console_summary() as inner:  # nested (an evaluation inside a run): the same counts
            assert inner is counts
    # the last interval is reported when the summary closes
    assert [r.getMessage() for r in caplog.records] == ["steps 1-3: 4 of 30 pairs saturated",
                                                        "at the end: 2 of 10 pairs saturated"]
    assert counts.totals["sat"] == {"count": 6, "of": 40, "events": 3, "calls": 4,
                                    "message": "6 of 40 pairs saturated"}
    assert counts.postfix() == {"sat": 6}


def test_a_per_run_kind_is_said_once_with_the_run_s_counts(caplog):
    """A kind counted with per_run=True is held over the interval flushes (the trackers still get each interval's
    count) and said once, by the flush given run_where, with its sums; the per-interval kinds are said as before. A
    run that stops before its last flush says it at the end."""
    with caplog.at_level(logging.WARNING, logger="test_console"), console_summary() as counts:
        for interval, (sat, skip) in enumerate([(1, 0), (0, 0), (3, 1)]):
            warn_repeated(log, "sat", "{count} of {of} pairs saturated", count=sat, of=10, per_run=True)
            warn_repeated(log, "skip", "{count} of {of} updates skipped", count=skip, of=1)
            last = interval == 2
            got = counts.flush(f"steps {interval + 1}", run_where="steps 1-3" if last else None)
            assert got == {f"warnings/{key}": n for key, n in (("sat", sat), ("skip", skip)) if n}
        assert [r.getMessage() for r in caplog.records] == ["steps 3: 1 of 1 updates skipped",
                                                            "steps 1-3: 4 of 30 pairs saturated"]
        assert counts.totals["sat"]["count"] == 4 and counts.postfix() == {"sat": 4, "skip": 1}
    assert len(caplog.records) == 2  # nothing held: nothing more at the end
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test_console"), console_summary() as counts:
        warn_repeated(log, "sat", "{count} of {of} pairs saturated", count=2, of=10, per_run=True)
        assert counts.flush("steps 1") == {"warnings/sat": 2} and caplog.records == []
        warn_repeated(log, "sat", "{count} of {of} pairs saturated", count=1, of=10, per_run=True)
    assert [r.getMessage() for r in caplog.records] == ["at the end: 3 of 20 pairs saturated"]


def test_counts_from_another_thread_are_counted():
    import threading

    with console_summary() as counts:
        threads = [threading.Thread(target=warn_repeated, args=(log, "retries", "{count} retries")) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert counts.pending() == {"retries": 8}


def _all_saturated(monkeypatch):
    """Every Diffusion-DPO pair counts as saturated (z > -inf), so a run's counts are known by hand."""
    import diffalign.objectives.diffusion_dpo as dpo

    monkeypatch.setattr(dpo, "SATURATION_THRESHOLD", float("-inf"))


def test_saturation_in_the_preference_loop_is_one_line_per_run_with_the_counts(tmp_path, monkeypatch, caplog):
    """5 steps of 2 pairs, every pair saturated, warnings_every=2: one line for the run, 10 of 10 pairs over steps
    1-5 (it was one line per interval: the default job printed 9 of them); the trackers still get each interval's
    count at its last step (4, 4, 2), results.json the total of 10 of 10."""
    from diffalign.train.preference import train

    _all_saturated(monkeypatch)
    cfg = compose_cfg(smoke_overrides(tmp_path, steps=5) + ["trainer.warnings_every=2"])
    with caplog.at_level(logging.WARNING, logger="diffalign.objectives.diffusion_dpo"):
        results = train(cfg)
    said = [r.getMessage() for r in caplog.records if r.name == "diffalign.objectives.diffusion_dpo"]
    assert said == [("steps 1-5: Diffusion-DPO: 10 of 10 pairs had z > -inf: already ranked right by a wide margin, "
                     "~0 gradient from them (logsigmoid flat); a few are expected, lower method.beta only if most are")]
    # the per-step metric the objective returns agrees with the summaries
    assert [h["saturated"] for h in results["history_tail"]] == [2.0] * 5
    assert [h.get("warnings/saturated") for h in results["history_tail"]] == [None, 4, None, 4, 2]
    assert results["warnings"]["saturated"]["count"] == 10 and results["warnings"]["saturated"]["of"] == 10
    assert json.loads((tmp_path / "results.json").read_text())["warnings"]["saturated"]["events"] == 5


def test_a_long_prompt_in_an_evaluation_is_one_line_per_variant(tmp_path, caplog):
    """Three prompts longer than the tiny text encoder's 12 tokens: one line for the base variant (each prompt is
    reported the first time the encoder sees it), none for the second variant (the same prompts)."""
    from diffalign.evaluation.evaluate import evaluate_policy
    from diffalign.evaluation.generation import EvalConfig
    from diffalign.models.tiny_random import build_tiny_random_policy
    from diffalign.rewards.brightness import Brightness

    policy = build_tiny_random_policy(seed=0)
    words = ["a", "red", "circle", "left", "of", "a", "green", "square", "and", "a", "blue", "triangle", "above", "a",
             "yellow", "circle"]
    rows = [{"prompt": " ".join(words[: 14 + k])} for k in range(3)] + [{"prompt": "a red circle"}]
    cfg = EvalConfig(prompts="x", seeds=[0], sampler={"name": "ode", "num_inference_steps": 1}, batch_size=4)
    with caplog.at_level(logging.WARNING, logger="diffalign.models.stable_diffusion"):
        evaluate_policy(policy, rows, {"brightness": Brightness()}, cfg, tmp_path, {"base": True, "policy": False},
                        progress=False, log=lambda message: None)
    said = [r.getMessage() for r in caplog.records if r.name == "diffalign.models.stable_diffusion"]
    assert len(said) == 1
    assert said[0] == (f"eval base: 3 prompt(s) longer than 12 tokens: the text encoder reads only the first 12, the "
                       f"rest is ignored; the last: {rows[2]['prompt']!r} has "
                       f"{len(policy.tokenizer(rows[2]['prompt']).input_ids)} tokens")


SATURATED_RUN = """
import sys
import diffalign.objectives.diffusion_dpo as dpo
dpo.SATURATION_THRESHOLD = float("-inf")  # every pair counts as saturated
from diffalign import cli
sys.argv = ["diffalign-train", *sys.argv[1:]]
cli.train()
"""

BAR = re.compile(r"(train|eval|on-policy data):\s+\d+%\|")


@pytest.mark.slow
def test_the_console_of_a_run_has_the_summaries_on_their_own_lines_and_an_unbroken_bar(tmp_path):
    """The CLI as a user runs it (Hydra's logging to standard output, tqdm's bar on standard error, both captured in
    one stream as a terminal shows them): 1 saturation line for the run of 5 steps at warnings_every=2 (a per-run
    kind, said at the last step) and the monitors' lines mid-run, each on a line of its own (the bar is cleared
    before and redrawn after), and the bar's postfix counting the run's saturated pairs."""
    out = subprocess.run(
        [sys.executable, "-c", SATURATED_RUN, f"output_dir={tmp_path / 'run'}", "model=tiny_random",
         "trainer.max_steps=5", "trainer.batch_size=2", "data=shapes_pairs", "data.num_pairs=16",
         "trainer.warnings_every=2", "trainer.log_with=none", "eval.enabled=true", "eval.prompts_per_tag=1",
         "eval.seeds=[0]", "eval.sampler.num_inference_steps=1", "monitor.every=2", "monitor.num_prompts=2",
         "monitor.seeds=[0]", "monitor.sampler.num_inference_steps=1", "monitor.diversity=false"],
        cwd=REPO, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
        check=False)
    assert out.returncode == 0, out.stdout[-3000:]
    segments = [s for s in re.split(r"[\r\n]", out.stdout) if s.strip()]
    summaries = [s for s in segments if "Diffusion-DPO:" in s]
    assert len(summaries) == 1 and "[WARNING] - steps 1-5: Diffusion-DPO: 10 of 10 pairs" in summaries[0], summaries
    for s in segments:  # no log line shares a line with a progress bar
        if "[diffalign]" in s or "WARNING" in s or "INFO" in s:
            assert not BAR.search(s), s
    # every summary line starts a fresh line: the bar was cleared (tqdm.write) right before it
    for match in re.finditer(r"[^\n]*Diffusion-DPO:", out.stdout):
        before = match.group(0).split("[", 1)[0]
        assert not BAR.search(before), before
    assert any(BAR.search(s) and "saturated=10" in s for s in segments)  # the postfix's total
    assert sum("[diffalign] monitor step" in s for s in segments) == 3  # steps 0, 2, 4: also on lines of their own
