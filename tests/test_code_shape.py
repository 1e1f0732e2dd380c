"""The shape the method contract promises (issue 18, "Done when"): the two training loops name no method, and no
function in the package exceeds 120 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

PACKAGE = Path(__file__).resolve().parents[1] / "diffalign"
MAX_FUNCTION_LINES = 120
LOOPS = ("train/online.py", "train/preference.py")


def method_names() -> set[str]:
    """Every method's names as words, lower-cased: the method options (``configs/method/*.yaml``, split at ``_``; the
    generic words diffusion, flow, tiny and guard only joined: the loops use ``diffalign.rewards.guard``), their
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


def test_safetensors_files_are_written_only_through_save_safetensors():
    """safetensors writes 0600 whatever the umask; `diffalign.models.base.save_safetensors` restores the umask's mode
    (tests/test_file_modes.py). A direct ``save_file`` elsewhere would bring private run files back."""
    direct = [f"{path.relative_to(PACKAGE.parent)}:{number}" for path in sorted(PACKAGE.rglob("*.py"))
              if path.name != "base.py" or path.parent.name != "models"
              for number, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"\bsave_file\(", line) and not line.lstrip().startswith(("#", '"', "f\""))]
    assert not direct, direct
