"""Every option, positional and sub-command of `loraplex` explains itself in `--help`, and list
commands' tables line up under their headers."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from loraplex.cli.main import COMMANDS, build_parser
from loraplex.cli.table import format_table, print_rows


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    """(path, action) for every argument of every parser, and (path, subparsers action) for each command group."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield path, action
            for name, child in action.choices.items():
                yield from _walk(child, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_and_positional_has_help():
    missing = [f"{' '.join(path)} {'/'.join(a.option_strings) or a.dest}"
               for path, a in _walk(build_parser(), ("loraplex",))
               if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
    assert missing == []


def test_every_subcommand_has_its_own_help():
    groups = [(path, a) for path, a in _walk(build_parser(), ("loraplex",))
              if isinstance(a, argparse._SubParsersAction)]
    assert len(groups) > 10  # the walk reaches the nested groups (db, tenants, keys, bench, ...)
    for path, group in groups:
        helps = {choice.dest: (choice.help or "").strip() for choice in group._choices_actions}
        assert set(helps) == set(group.choices), path
        assert all(helps.values()), (path, helps)
        assert len(set(helps.values())) == len(helps), (path, helps)  # no copy-pasted help (tenants enable/disable)
    tenants = next(g for p, g in groups if p == ("loraplex", "tenants"))
    enable = next(c.help for c in tenants._choices_actions if c.dest == "enable")
    assert "disabled tenant" in enable and "work again" in enable


def test_a_command_line_builds_only_its_own_sub_command_and_imports_only_what_it_needs():
    """Each module declares the command COMMANDS names it for; a command line naming one imports that module
    only (a short database command does not import torch or the benchmarks); any other builds them all."""
    def commands(parser):
        return list(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)

    assert commands(build_parser()) == list(COMMANDS)
    assert commands(build_parser(["--help"])) == commands(build_parser(["tenant", "list"])) == list(COMMANDS)
    for name in COMMANDS:
        assert commands(build_parser([name, "--help"])) == [name]
    probe = ("import sys; from loraplex.cli.main import build_parser; build_parser(['tenants', 'list']); "
             "print(sorted(m for m in ('torch', 'loraplex.cli.bench_cmd', 'loraplex.cli.serve', 'httpx') "
             "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_tables_align_under_their_headers():
    rows = [{"name": "acme", "tier": None, "count": 12}, {"name": "a-much-longer-name", "tier": "gold", "count": 3}]
    header, *lines = format_table(("name", "tier", "count"), rows).splitlines()
    assert header.split() == ["NAME", "TIER", "COUNT"]
    for column in ("TIER", "COUNT"):
        at = header.index(column)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in lines), (column, lines)
    assert lines[0].split() == ["acme", "-", "12"]
    assert format_table(("name",), []) == "NAME"  # an empty list still says what it would list


def test_json_output_is_one_array_of_objects(capsys):
    rows = [{"name": "acme", "tier": None, "extra": "not a column"}]
    print_rows(argparse.Namespace(json=True), ("name", "tier"), rows)
    assert json.loads(capsys.readouterr().out) == [{"name": "acme", "tier": None}]
