"""Every shell command in README.md runs as written on a fresh clone, once `make run` or `make test`
has made `.venv`.

A reader copies commands from the README into a shell without the virtualenv activated, so a bare
`python -m ...` runs the system's python (which has none of the dependencies) and a bare `sat-train`
is not on the PATH. Nothing is run here (the commands train, serve and benchmark for minutes);
each command is checked against what it names:

* the commands are the lines of the ```bash / ```sh / ```console blocks (`# or: CMD` comments
  included), indented code lines, and inline code spans that start like a command (`make ...`,
  `.venv/bin/...`, `python ...`, `pip ...`, `bash ...`, or a console script with arguments);
* `make` targets exist in the Makefile; programs are `.venv/bin/` ones: python, pip, the console
  scripts of pyproject's [project.scripts] (whose entry points must exist), or what a `pip install`
  earlier in the same line installs; `python -m` modules exist and run as a script; scripts run by
  path, `--config` files and every path under the repository's own folders exist; `pip install`
  extras exist in pyproject;
* the dotted `key=value` overrides of the commands that read the experiment config load with that
  config (`sat_jax.experiment.load_config`), so a renamed key fails here. A `model.hf_path` that
  an earlier README command writes (its `--out`) may be missing.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib
import re
import shlex
import tomllib

import pytest

from sat_jax.experiment import ConfigError, load_config

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
EXTRAS = set(PYPROJECT["project"].get("optional-dependencies", {}))
MAKE_TARGETS = set(re.findall(r"^([\w.-]+):(?!=)", (REPO / "Makefile").read_text(), flags=re.M))
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
# What an inline code span or an indented line starts with when it is a command.
COMMAND = re.compile(
    r"^(make|\.venv/bin/[\w.-]+|python3?|pip3?|bash|" + "|".join(map(re.escape, SCRIPTS)) + r")\s"
)
# Folders of the repository: a path under one of them must exist (runs/ holds outputs).
REPO_DIRS = ("configs", "benchmarks", "notebooks", "tests", "docs", "sat_jax", "train",
             "rollout_server", "rollout_api")  # fmt: skip
# Commands that read the experiment config (--config and dotted overrides).
CONFIG_SCRIPTS = {"sat-serve", "sat-train", "sat-export", "sat-eval"}
CONFIG_MODULES = {
    "train",
    "rollout_server",
    "train.export",
    "train.eval_checkpoint",
    "sat_jax.plan",
}
OVERRIDE = re.compile(r"^[a-z_]\w*(\.\w+)+=")


@dataclasses.dataclass(frozen=True)
class Command:
    line: int  # 1-based line of README.md
    text: str


def readme_commands(text: str) -> list[Command]:
    """The shell commands of a README's text, in order."""
    found: list[tuple[int, int, str]] = []  # (offset, line, command)

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    prose = list(text)  # the text with every fenced block blanked (newlines kept)
    for block in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        for i in range(block.start(), block.end()):
            if prose[i] != "\n":
                prose[i] = " "
        if block.group(1) not in SHELL_BLOCKS:
            continue
        body, start = block.group(2), block.start(2)
        body = re.sub(r"\\\n", "  ", body)  # continuation lines (same length: offsets stay)
        offset = start
        for raw in body.split("\n"):
            line = raw.strip()
            if block.group(1) == "console":
                line = line[2:] if line.startswith("$ ") else ""
            command, *comment = re.split(r"(?:^|\s)#\s*", line, maxsplit=1)
            if command.strip():
                found.append((offset, line_of(offset), command.strip()))
            alternative = re.match(r"or:\s*(.+)", "".join(comment))
            if alternative:
                found.append((offset, line_of(offset), alternative.group(1).strip()))
            offset += len(raw) + 1
    plain = "".join(prose)
    for indented in re.finditer(r"^(?: {4,}|\t)(\S.*)$", plain, flags=re.M):
        if COMMAND.match(indented.group(1) + " "):
            found.append((indented.start(), line_of(indented.start()), indented.group(1).strip()))
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", plain):
        words = " ".join(span.group(1).split())
        if COMMAND.match(words + " ") and len(words.split()) > 1:
            found.append((span.start(), line_of(span.start()), words))
    return [Command(line, command) for _, line, command in sorted(found, key=lambda f: f[0])]


def _module_problem(module: str) -> str | None:
    """Why `python -m module` would not run (None: it would)."""
    try:
        spec = importlib.util.find_spec(module)
    except ImportError as e:
        return f"python -m {module}: {e}"
    if spec is None:
        return f"python -m {module}: no such module"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        return (
            _module_problem(module + ".__main__") if module.split(".")[-1] != "__main__" else None
        )
    source = pathlib.Path(spec.origin or "")
    if source.suffix == ".py" and "__main__" not in source.read_text():
        return f"python -m {module}: the module has no `if __name__ == '__main__'` part"
    return None


def _entry_point_problem(script: str) -> str | None:
    module, _, function = SCRIPTS[script].partition(":")
    try:
        found = hasattr(importlib.import_module(module), function)
    except ImportError as e:
        return f"{script}: entry point {SCRIPTS[script]}: {e}"
    return None if found else f"{script}: entry point {SCRIPTS[script]} does not exist"


def _config_problem(config: str | None, overrides: list[str], made: set[str]) -> str | None:
    try:
        load_config(config, overrides)
    except ConfigError as e:
        missing = re.search(r"hf_path: no config\.json in (\S+)", str(e))
        if missing and missing.group(1) in made:
            return None  # written by an earlier command of the README
        return f"the config does not load: {e}"
    return None


def command_problems(command: str, made: set[str]) -> list[str]:
    """What in `command` names something that does not exist (empty: it runs as written).

    Args:
      command: one shell command line.
      made: paths earlier commands write (their `--out`); this command's are added.
    """
    problems: list[str] = []
    text = re.sub(r"(?:^|\s)\[[^\]]*\.\.\.\]", " ", command)  # `[optional ...]` placeholders
    installed = False  # a `pip install` earlier in the line may install the next program
    for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", text):
        try:
            words = shlex.split(part)
        except ValueError as e:
            problems.append(f"{part!r} is not a shell command: {e}")
            continue
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]  # VAR=value before the program
        if not words:
            continue
        program, args = words[0], words[1:]
        name = program.removeprefix(".venv/bin/")
        if program == "make":
            problems += [f"make {a}: no such Makefile target" for a in args
                         if not a.startswith("-") and "=" not in a and a not in MAKE_TARGETS]  # fmt: skip
            continue
        if program == "bash":
            if not args or not (REPO / args[0]).is_file():
                problems.append(f"bash {' '.join(args[:1])}: no such script")
            continue
        if not program.startswith(".venv/bin/"):
            problems.append(
                f"{program}: the system's, not the project's: write .venv/bin/{program} "
                "(the virtualenv is not activated)"
            )
        elif name not in {"python", "pip", *SCRIPTS} and not installed:
            problems.append(f"{program}: not in .venv/bin (not python, pip or a console script)")
        module = None
        if name in SCRIPTS:
            problems += filter(None, [_entry_point_problem(name)])
        elif name.startswith("python") and args[:1] == ["-m"] and len(args) > 1:
            module, args = args[1], args[2:]
            problems += filter(None, [_module_problem(module)])
        elif name.startswith("python") and args and args[0].endswith(".py"):
            if not (REPO / args[0]).is_file():
                problems.append(f"{args[0]}: no such script")
            args = args[1:]
        elif name.startswith("pip") and args[:1] == ["install"]:
            installed = True
            for arg in args[1:]:
                extras = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
                if extras:
                    problems += [f"pip install {arg}: no extra {e!r} in pyproject.toml"
                                 for e in extras.group(1).split(",") if e not in EXTRAS]  # fmt: skip
        config, overrides = None, []
        for flag, value in zip(["", *args], args, strict=False):
            if flag == "--config":
                config = value
                if not (REPO / value).is_file():
                    problems.append(f"{value}: no such file or directory")
                continue
            if flag == "--out":
                made.add(value)
            if OVERRIDE.match(value):
                overrides.append(value)
            elif value.split("/")[0] in REPO_DIRS and "/" in value:
                if not (REPO / value).exists():
                    problems.append(f"{value}: no such file or directory")
        if config is not None and not (REPO / config).is_file():
            continue  # reported above
        if name in CONFIG_SCRIPTS or module in CONFIG_MODULES:
            if config is not None or overrides:
                path = None if config is None else str(REPO / config)
                problems += filter(None, [_config_problem(path, overrides, made)])
    return problems


COMMANDS = readme_commands(README.read_text())


def test_the_readme_has_commands_to_check():
    # The extraction itself: the quick start and a command of each kind are found.
    texts = [c.text for c in COMMANDS]
    assert {"make run", "make test"} <= set(texts), texts
    for start in (".venv/bin/sat-serve", ".venv/bin/python -m", ".venv/bin/python benchmarks/"):
        assert any(t.startswith(start) for t in texts), (start, texts)


def test_every_readme_command_runs_as_written():
    made: set[str] = set()
    failures = [
        f"README.md:{c.line}: {c.text}\n    {problem}"
        for c in COMMANDS
        for problem in command_problems(c.text, made)
    ]
    assert not failures, "\n".join(failures)


BROKEN = """
Run `python -m sat_jax.plan --preset tiny` or `make nope`.

```bash
.venv/bin/sat-train --config configs/nope.yaml   # or: .venv/bin/python -m train.nope
.venv/bin/sat-serve --config configs/arith_tiny.yaml server.bogus=1
.venv/bin/pip install -e '.[nope]' && .venv/bin/jupyter lab notebooks/
.venv/bin/python benchmarks/nope.py --out runs/x
.venv/bin/sat-nope --help
```

```python
python -m this_is_python_code_not_a_command
```
"""


def test_the_checks_catch_commands_that_would_not_run():
    commands = readme_commands(BROKEN)
    assert [(c.line, c.text) for c in commands] == [
        (2, "python -m sat_jax.plan --preset tiny"),
        (2, "make nope"),
        (5, ".venv/bin/sat-train --config configs/nope.yaml"),
        (5, ".venv/bin/python -m train.nope"),
        (6, ".venv/bin/sat-serve --config configs/arith_tiny.yaml server.bogus=1"),
        (7, ".venv/bin/pip install -e '.[nope]' && .venv/bin/jupyter lab notebooks/"),
        (8, ".venv/bin/python benchmarks/nope.py --out runs/x"),
        (9, ".venv/bin/sat-nope --help"),
    ]
    made: set[str] = set()
    problems = [command_problems(c.text, made) for c in commands]
    assert "the system's, not the project's" in problems[0][0] and len(problems[0]) == 1
    assert problems[1] == ["make nope: no such Makefile target"]
    assert problems[2] == ["configs/nope.yaml: no such file or directory"]
    assert problems[3] == ["python -m train.nope: no such module"]
    assert len(problems[4]) == 1 and "server.bogus: unknown key" in problems[4][0]
    assert problems[5] == ["pip install .[nope]: no extra 'nope' in pyproject.toml"]
    assert problems[6] == ["benchmarks/nope.py: no such script"] and made == {"runs/x"}
    assert problems[7] == [
        ".venv/bin/sat-nope: not in .venv/bin (not python, pip or a console script)"
    ]


@pytest.mark.parametrize(
    "command",
    [
        ".venv/bin/python -m sat_jax.plan --preset qwen3_30b_a3b --mesh fsdp=64",
        ".venv/bin/sat-serve --config configs/arith_tiny.yaml server.port=9000",
        "make test-fast",
        "EPATH_USE_TF=false .venv/bin/python -m train --config configs/arith_tiny.yaml",
    ],
)
def test_commands_that_run_pass(command):
    assert command_problems(command, set()) == []
