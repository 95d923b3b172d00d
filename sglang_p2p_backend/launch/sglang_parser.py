"""Checks rendered server commands with SGLang's own argument parser, the p2pnccl plugin loaded through
SGLang's plugin loader, exactly as `python -m sglang.launch_server` would see them.

Beyond what argparse rejects, it also rejects flags that only parse as an abbreviation of a longer one
(argparse's allow_abbrev: `--tp` silently becomes `--tp-size`, and an abbreviation that is unique today
turns ambiguous when a release adds a flag, as `--cuda-graph-bs` did in 0.5.23) and flags the release
marks deprecated, so a rendered command keeps working on the next release.
"""

from __future__ import annotations

import argparse
import functools
from typing import Iterable

from .config import ConfigError
from .release import RENAMED, installed_release
from .render import TRANSFER_BACKEND, Command


class _ParseError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit the process
        raise _ParseError(message)


class PluginNotLoadedError(RuntimeError):
    pass


class SGLangArgChecker:
    """SGLang's `sglang serve` parser (the one prepare_server_args builds) with every plugin loaded."""

    def __init__(self) -> None:
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import ServerArgs

        load_plugins()
        parser = _RaisingParser(prog="sglang serve")
        ServerArgs.add_cli_args(parser)
        self.parser = parser
        self.release = installed_release() or "unknown"
        backend = parser._option_string_actions["--disaggregation-transfer-backend"]
        if TRANSFER_BACKEND not in (backend.choices or ()):
            raise PluginNotLoadedError(
                f"SGLang {self.release}'s plugin loader did not register `{TRANSFER_BACKEND}`: install this "
                f"project into the environment (pip install -e .) and, if SGLANG_PLUGINS is set, add {TRANSFER_BACKEND} to it"
            )

    def _option_problems(self, cmd: Command) -> list[str]:
        options = self.parser._option_string_actions
        problems = []
        for token in cmd.args:
            if not token.startswith("--"):
                continue
            flag = token.split("=", 1)[0]
            name = flag[2:]
            action = options.get(flag)
            if action is None:
                longer = sorted(o for o in options if o.startswith(flag))
                if name in RENAMED:
                    fix = f"it was renamed: use {RENAMED[name]}"
                elif longer:
                    fix = f"it only abbreviates {', '.join(longer[:3])}: write the full flag name"
                else:
                    fix = "remove it from the config's args or correct its spelling"
                problems.append(f"{cmd.label}: unknown flag `{flag}` for SGLang {self.release}: {fix}")
            elif type(action).__name__.startswith("Deprecated"):
                fix = RENAMED.get(name, "its replacement (see `sglang serve --help`)")
                problems.append(f"{cmd.label}: `{flag}` is deprecated in SGLang {self.release}: use {fix}")
        return problems

    def problems(self, cmd: Command) -> list[str]:
        found = self._option_problems(cmd)
        if found:  # argparse would repeat them less precisely ("unrecognized arguments")
            return found
        try:
            self.parser.parse_args(list(cmd.args))
        except _ParseError as exc:
            found.append(f"{cmd.label}: SGLang {self.release} rejects the command: {exc}")
        return found

    def check(self, commands: Iterable[Command], source: str) -> None:
        found = [p for c in commands for p in self.problems(c)]
        if found:
            raise ConfigError(source, found)


@functools.cache
def checker() -> SGLangArgChecker:
    """One parser per process: building it imports SGLang (seconds), parsing with it takes microseconds."""
    return SGLangArgChecker()
