"""`diffalign.runtime.faults.resume_hint`: the "continue with ..." of every stop message names the run's folder, and
the words after "continue with", pasted into a shell after ``diffalign-train``, give Hydra that folder back."""

from __future__ import annotations

import shlex

import pytest
from conftest import compose_cfg

from diffalign.runtime.faults import resume_hint


@pytest.mark.parametrize("folder", ["runs/train-2026-12-04_12-00-00", "/tmp/my runs/x", "/tmp/it's", "/tmp/a,b=[c]"])
def test_the_hint_pasted_into_a_shell_resumes_that_folder(folder):
    hint = resume_hint(folder)
    assert hint.startswith("continue with ") and hint.endswith(" resume=latest")
    overrides = shlex.split(hint.removeprefix("continue with "))  # what the shell hands diffalign-train
    assert len(overrides) == 2
    cfg = compose_cfg(overrides)
    assert cfg.output_dir == folder and cfg.resume == "latest"


def test_a_plain_folder_is_written_as_it_is():
    assert resume_hint("runs/x") == "continue with output_dir=runs/x resume=latest"
