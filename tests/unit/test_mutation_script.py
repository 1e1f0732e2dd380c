"""``scripts/mutation.py`` (docs/contributing.md#mutation-testing): a re-run of named mutants with ``--keep --only``
must meet the tests as they are now. mutmut keeps in ``mutants/mutmut-stats.json`` which tests run each function and
re-collects it only for tests with new names, so a survivor re-run after its test was extended met the old selection
and was reported as surviving again (issue 35); `prepare` deletes that record for such a re-run and keeps it (and the
results) otherwise."""

from __future__ import annotations

from conftest import REPO, load_script


def _script():
    return load_script("mutation", "mutation_script")


def test_keep_with_only_forgets_which_tests_ran_each_function_and_keeps_the_results(tmp_path, monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "WORK", tmp_path)
    folder = script.prepare("objectives/ddpo", keep=False)
    assert folder == tmp_path / "objectives.ddpo" and (folder / "diffalign").resolve() == REPO / "diffalign"
    config = (folder / "setup.cfg").read_text()
    assert "only_mutate = diffalign/objectives/ddpo.py" in config and "tests/unit/objectives/test_ddpo_config.py" in config
    (folder / "mutants" / "diffalign" / "objectives").mkdir(parents=True)
    stats, meta = folder / "mutants" / "mutmut-stats.json", folder / "mutants" / "diffalign" / "objectives" / "ddpo.py.meta"
    stats.write_text("{}")
    meta.write_text("{}")

    script.prepare("objectives/ddpo", keep=True)  # --keep alone: mutmut re-runs changed functions, with its record
    assert stats.exists() and meta.exists()
    script.prepare("objectives/ddpo", keep=True, only=["*DDPOǁ__init____mutmut_1"])
    assert not stats.exists() and meta.exists()  # the named mutants meet today's tests; the others' results stay
    stats.write_text("{}")
    script.prepare("objectives/ddpo", keep=False, only=["*DDPOǁ__init____mutmut_1"])
    assert not (folder / "mutants").exists()  # without --keep: a fresh run
