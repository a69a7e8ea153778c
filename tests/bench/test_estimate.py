"""pipeline/bench/estimate.py: the run time bench announces before its timed part, from one calibration generation
per method, and the full run's."""

from __future__ import annotations

import pytest

from pipeline.bench.estimate import Estimate, announcement, duration, estimate, seconds_per_generation

CALIBRATED = {("target", 0): 2.0, ("ngram", 1): 1.0, ("ngram", 2): 3.0, ("hf_lookup", 8): 4.0}


def test_the_timed_part_is_each_methods_seconds_times_prompts_and_repeats():
    keys = [("target", 0), ("ngram", 1), ("hf_lookup", 8)]
    result = estimate(keys, CALIBRATED, prompts=4, repeats=3)
    assert result == Estimate(generations=3 * 4 * 3, seconds=(2.0 + 1.0 + 4.0) * 4 * 3)
    assert estimate(keys, CALIBRATED, 4, 3, token_scale=2.0).seconds == pytest.approx(2 * result.seconds)


def test_a_method_not_calibrated_costs_its_methods_median_else_target_only():
    assert seconds_per_generation(("ngram", 8), CALIBRATED) == 2.0  # median of ngram K=1 and K=2
    assert seconds_per_generation(("speculative", 3), CALIBRATED) == 2.0  # target-only's
    assert seconds_per_generation(("ngram", 2), CALIBRATED) == 3.0


@pytest.mark.parametrize("seconds, text", [(45, "45 s"), (204, "3.4 min"), (2400, "40.0 min"), (5760, "1.6 h")])
def test_durations_read_in_the_unit_a_person_would_use(seconds, text):
    assert duration(seconds) == text


def test_the_announcement_names_the_full_runs_flags_and_time():
    text = announcement(Estimate(96, 204.0), Estimate(720, 2880.0), "--num-prompts 6 --max-new-tokens 64",
                        "4 prompts in 4 sets x 8 methods x 3 repeats, 32 new tokens")
    assert text == ("bench: 96 timed generations (4 prompts in 4 sets x 8 methods x 3 repeats, 32 new tokens) will "
                    "take about 3.4 min on this machine (each method timed once on the first prompt); a full run "
                    "(--num-prompts 6 --max-new-tokens 64) would take about 48.0 min")
    assert announcement(Estimate(96, 204.0), None, "", "x").endswith("; this is a full run")
