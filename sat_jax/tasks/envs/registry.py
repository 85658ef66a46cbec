"""`task.env`: a shipped environment's name, or a user's class as `module:Class`.

`load_environment` resolves the name to a class and checks, without running it, that it has the
environment interface (base.py), so a bad `task.env` fails when the config loads with one line
naming the key's value and what is wrong, not at the first episode.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping, Sequence

from sat_jax.tasks.envs.base import Environment, SingleTurn
from sat_jax.tasks.envs.calculator import Calculator
from sat_jax.tasks.envs.feedback import Feedback

SHIPPED: dict[str, type[Environment]] = {
    "single_turn": SingleTurn,
    "feedback": Feedback,
    "calculator": Calculator,
}
_SPEC_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def check_env_name(spec: str) -> None:
    """Checks the form of a `task.env` value without importing anything.

    Raises:
      ValueError: `spec` is neither "", a shipped name, nor `module:Class`.
    """
    if spec and spec not in SHIPPED and not _SPEC_RE.fullmatch(spec):
        raise ValueError(
            f"env {spec!r} is neither a shipped environment ({', '.join(SHIPPED)}) nor a "
            "user class written module:Class (e.g. my_pkg.envs:MyEnv)"
        )


def load_environment(spec: str) -> type[Environment]:
    """The environment class `spec` names.

    Args:
      spec: "" or "single_turn" (one answer, today's behaviour), "feedback", "calculator", or
        `module:Class` (an importable module and a class in it; `Class` may be dotted).

    Returns:
      The class; the rollout server makes one instance per episode with `cls(env_config)`.

    Raises:
      ValueError: one line starting with "env", for an unknown name, a module that cannot be
        imported, a missing attribute, or something that is not an environment class.
    """
    check_env_name(spec)
    if not spec:
        return SingleTurn
    if spec in SHIPPED:
        return SHIPPED[spec]
    module_name, _, attr_path = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"env {spec!r}: no module named {e.name!r} (is it on PYTHONPATH?)"
            ) from None
        raise ValueError(f"env {spec!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:
        raise ValueError(
            f"env {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}"
        ) from e
    obj = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"env {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    check_environment_class(obj, spec)
    return obj


def check_environment_class(cls: object, spec: str) -> None:
    """Checks that `cls` is a class with the environment interface.

    Raises:
      ValueError: naming what is missing (not a class, no `reset`/`step`, a constructor that
        does not take the config, `tools` that are not a list of JSON-schema mappings).
    """
    if not isinstance(cls, type):
        raise ValueError(f"env {spec!r} is a {type(cls).__name__}, not a class")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(
            f"env {spec!r}: {cls.__name__} does not implement the environment interface "
            f"(no {' or '.join(missing)}; see sat_jax.tasks.envs.Environment)"
        )
    if getattr(cls, "step", None) is Environment.step:
        raise ValueError(f"env {spec!r}: {cls.__name__} does not override step")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        signature = None  # some C-level classes have none; the first episode will tell
    if signature is not None:
        try:
            signature.bind(None)  # stands in for the EnvConfig
        except TypeError as e:
            raise ValueError(
                f"env {spec!r}: {cls.__name__}(cfg) must take the EnvConfig as its one "
                f"argument ({e})"
            ) from None
    tools = getattr(cls, "tools", ())
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise ValueError(f"env {spec!r}: {cls.__name__}.tools must be a list of JSON schemas")
    if not all(isinstance(t, Mapping) for t in tools):
        raise ValueError(f"env {spec!r}: {cls.__name__}.tools must hold mappings (JSON schemas)")
