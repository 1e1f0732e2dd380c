"""The shape of the package (issues 18 and 30): the two training loops name no method, no function exceeds 120 lines,
at most 12 modules sit directly under diffalign/ (the rest in sub-packages by role), and the import layers stated in
pyproject.toml ([tool.importlinter]) hold."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffalign"
MAX_FUNCTION_LINES = 120
MAX_TOP_LEVEL_MODULES = 12
LOOPS = ("train/online.py", "train/preference.py")


def method_names() -> set[str]:
    """Every method's names as words, lower-cased: the method options (``configs/method/*.yaml``, split at ``_``; the
    generic words diffusion, flow, tiny and guard only joined: the loops use a `NonFiniteGuard`), their
    objective classes and the families they belong to."""
    names = {"grpo", "dancegrpo", "dpo"}
    for option in (PACKAGE / "configs" / "method").glob("*.yaml"):
        names |= {part for part in option.stem.split("_") if part not in ("diffusion", "flow", "tiny", "guard")}
        names.add(option.stem.replace("_", ""))
        target = yaml.safe_load(option.read_text()).get("defaults", [""])[0]
        names.add(target.rsplit("/", 1)[-1].split("@")[0].replace("_", ""))
    return names


def test_the_method_names_cover_every_method():
    assert {"dpo", "seppo", "ddspo", "dgpo", "vipo", "ddpo", "grpo", "nft", "sft", "diffusionnft"} <= method_names()


def test_the_training_loops_contain_no_method_names():
    names = method_names()
    for loop in LOOPS:
        for number, line in enumerate((PACKAGE / loop).read_text().splitlines(), 1):
            words = set(re.split(r"[^a-z0-9]+", line.lower()))
            assert not words & names, f"{loop}:{number} names {sorted(words & names)}: {line.strip()}"


def long_functions(source: str, filename: str = "<source>") -> list[str]:
    """``"<file>:<line> <name> (<n> lines)"`` for every function (methods and nested ones too) longer than 120 lines,
    counted from its ``def`` line to its last line."""
    long = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{filename}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_no_function_in_the_package_exceeds_120_lines():
    long = [hit for path in sorted(PACKAGE.rglob("*.py"))
            for hit in long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not long, long


def test_the_walk_finds_a_long_method_in_a_class():
    body = "".join(f"        x{i} = {i}\n" for i in range(119))
    source = f"class A:\n    @property\n    def f(self):\n{body}        return 0\n"  # def + 119 + return: 121
    assert long_functions(source) == ["<source>:3 f (121 lines)"]
    assert long_functions(source.replace("        x0 = 0\n", "")) == []  # 120 lines is allowed


def test_at_most_12_modules_sit_directly_under_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert {"__init__.py", "methods.py", "types.py", "advantages.py", "cli.py"} <= set(top)  # the contract, the CLI


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the contracts of ``root/pyproject.toml``, analysing ``root/diffalign`` (not an installed
    copy)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache", "--no-logo"]
    return subprocess.run(command, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout, result.stdout


def test_the_import_contracts_catch_an_upward_import_and_a_cycle(tmp_path):
    """A copy of the package where the method contract imports the CLI breaks both contracts: an import from the bottom
    layer to the top one, and a cycle between sub-packages (the CLI imports the contract)."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(PACKAGE, tmp_path / "diffalign", ignore=shutil.ignore_patterns("assets", "configs", "__pycache__"))
    types = tmp_path / "diffalign" / "types.py"
    types.write_text(types.read_text() + "\nimport diffalign.cli  # noqa: E402,F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 2 broken" in result.stdout, result.stdout
    assert "diffalign.types -> diffalign.cli" in result.stdout, result.stdout


def test_safetensors_files_are_written_only_through_save_safetensors():
    """safetensors writes 0600 whatever the umask; `diffalign.runtime.files.save_safetensors` restores the umask's mode
    (tests/integration/test_file_modes.py). A direct ``save_file`` elsewhere would bring private run files back."""
    direct = [f"{path.relative_to(PACKAGE.parent)}:{number}" for path in sorted(PACKAGE.rglob("*.py"))
              if path.name != "files.py" or path.parent.name != "runtime"
              for number, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"\bsave_file\(", line) and not line.lstrip().startswith(("#", '"', "f\""))]
    assert not direct, direct
