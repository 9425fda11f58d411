"""The docs say what the code does: the versions they state, the flags they show.

docs/protocol.md's version is the code's `PROTOCOL_VERSION`, its history
steps back one version at a time, and every `colonnade COMMAND ... --flag`
in the README and docs/ is a flag of that command.
"""

import argparse
import re
from pathlib import Path

import pytest

from colonnade.cli.main import build_parser
from colonnade.protocol.keys import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL_MD = ROOT / "docs" / "protocol.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_protocol_md_states_the_codes_protocol_version():
    text = PROTOCOL_MD.read_text()
    title = re.match(r"# The object-store protocol, version (\d+)\n", text)
    assert title, "docs/protocol.md's title names the protocol version"
    assert int(title[1]) == PROTOCOL_VERSION
    # The envelope's example, and the step to this version.
    assert {int(v) for v in re.findall(r'"protocol": (\d+)', text)} == {PROTOCOL_VERSION}
    assert f"What changed from version {PROTOCOL_VERSION - 1}:" in text


def test_protocol_md_tells_every_step_once_newest_first():
    steps = re.findall(r"(?:What changed from|From) version (\d+):", PROTOCOL_MD.read_text())
    assert [int(v) for v in steps] == list(range(PROTOCOL_VERSION - 1, 0, -1))


def test_the_readme_names_the_codes_protocol_version():
    named = re.findall(r"protocol v(\d+)", (ROOT / "README.md").read_text())
    assert named and {int(v) for v in named} == {PROTOCOL_VERSION}


def test_pulse_format_md_states_the_codes_format_version():
    from colonnade.pulse.format import FORMAT_VERSION

    title = re.match(
        r"# PULSE patch format, version (\d+)\n", (ROOT / "docs/pulse-format.md").read_text()
    )
    assert title and int(title[1]) == FORMAT_VERSION


def _commands() -> dict[tuple[str, ...], set[str]]:
    """Every command path (("worker",), ("keys", "new"), ...) and its flags."""
    out: dict[tuple[str, ...], set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        out[path] = {o for a in parser._actions for o in a.option_strings}
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, (*path, name))

    walk(build_parser(), ())
    return out


_INVOCATION = re.compile(r"colonnade ((?:[a-z]+ ?){1,2})([^`\n|#]*)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9.-]*[a-z0-9]")


def _shown_flags(text: str, commands: dict) -> list[tuple[str, str]]:
    """(command, flag) of every `colonnade COMMAND ... --flag` on one line."""
    text = re.sub(r"\\\n\s*", " ", text)  # a shell line continued
    found = []
    for m in _INVOCATION.finditer(text):
        path: tuple[str, ...] = ()
        for word in m[1].split():
            if (*path, word) in commands:
                path = (*path, word)
        if path:
            rest = " ".join([*m[1].split(None, len(path))[len(path) :], m[2]])
            found += [(" ".join(path), f) for f in _FLAG.findall(rest)]
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_flag_the_docs_show_exists(doc):
    commands = _commands()
    shown = _shown_flags(doc.read_text(), commands)
    missing = sorted({(c, f) for c, f in shown if f not in commands[tuple(c.split())]})
    assert missing == []


def test_the_flag_check_sees_a_flag_a_command_lacks():
    """The check above would pass vacuously if it saw no command lines."""
    commands = _commands()
    text = "colonnade worker --store s3://b/r \\\n    --preset smoke   # a worker has no preset"
    assert _shown_flags(text, commands) == [("worker", "--store"), ("worker", "--preset")]
    assert "--preset" not in commands[("worker",)] and "--preset" in commands[("trainer",)]
    readme = _shown_flags((ROOT / "README.md").read_text(), commands)
    assert ("worker", "--join") in readme and ("invite", "--store") in readme
