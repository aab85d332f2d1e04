"""Which model folders `keybatch up` can serve, and building the small one on first run.

The build runs as a child process (`keybatch model build`), so the supervisor never
imports torch. Only the small model is built unasked: it takes a few minutes on two
cores; the large one is left to `keybatch model build --name kb-large`.
"""

from __future__ import annotations

import subprocess
import sys

from control.settings import Settings

AUTO_BUILD_SUFFIX = "-small"


def is_built(settings: Settings, model: str) -> bool:
    return (settings.model_path(model) / "config.json").exists()


def ensure_models(settings: Settings, wanted: list[str]) -> list[str]:
    """The models to serve: those asked for (default: all configured) whose folders
    exist, after building a missing small one. Prints what it skips and why."""
    models = wanted or list(settings.models)
    unknown = [m for m in models if m not in settings.models]
    if unknown:
        return models  # the plan check names them
    for model in models:
        if not is_built(settings, model) and model.endswith(AUTO_BUILD_SUFFIX):
            print(f"keybatch up: building {model} (first run; a few minutes on two cores)", flush=True)
            cmd = [sys.executable, "-m", "control", "model", "build", "--name", model]
            if subprocess.call(cmd) != 0:
                print(f"keybatch up: building {model} failed", file=sys.stderr)
    served = [m for m in models if is_built(settings, m)]
    for model in models:
        if model not in served:
            print(
                f"keybatch up: {model} is not built ({settings.model_path(model)}); "
                f"serving without it (`keybatch model build --name {model}` adds it)",
                file=sys.stderr,
            )
    if not served:
        print("keybatch up: no model to serve (or `--backend fixed` for the simulated one)", file=sys.stderr)
    return served
