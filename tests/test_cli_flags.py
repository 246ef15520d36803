"""The flags bench, chat, serve and tune share are one group (cli/_common.py SHARED_FLAGS): each flag's default and
help are written once, and every command shows the group's."""

from __future__ import annotations

import click
import pytest
import typer

from specq.cli import bench, chat, serve, tune
from specq.cli._common import SHARED_FLAGS
from specq.cli.main import app

COMMANDS = {"bench": bench, "chat": chat, "serve": serve, "tune": tune}
# flags a command declares itself, with a meaning of its own (not the group's)
OWN = {"chat": {"draft"}, "serve": {"draft", "temp", "seed"}, "tune": {"ctx", "draft_max", "temp"}}


def params(name: str) -> dict[str, click.Parameter]:
    cmd = typer.main.get_command(app).commands[name]
    return {p.name: p for p in cmd.params}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_shows_the_groups_default_and_help(name):
    shown, taken = params(name), COMMANDS[name].main.shared_flags
    assert len(taken) >= 11  # the group is the command's: placement and the drafter at the least
    for flag in taken:
        annotation, default = SHARED_FLAGS[flag]
        option = annotation.__metadata__[0]
        assert shown[flag].default == default, (name, flag)
        assert shown[flag].help == option.help, (name, flag)
    own = {flag for flag in shown if flag in SHARED_FLAGS} - set(taken)
    assert own == OWN.get(name, set())


def test_the_shared_defaults_are_the_same_in_every_command():
    seen: dict[str, set] = {}
    for name in COMMANDS:
        shown = params(name)
        for flag in COMMANDS[name].main.shared_flags:
            seen.setdefault(flag, set()).add(repr(shown[flag].default))
    assert all(len(v) == 1 for v in seen.values()), seen
    assert {"ctx", "drafter", "ngram_min", "threads", "flash_attn"} <= set(seen)
