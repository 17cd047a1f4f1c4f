"""Every `error:` and `warning:` line at most LIMIT characters: a pytest plugin (`tests/conftest.py` loads it).

A mistake's line says the fix first, in a line a terminal shows whole; the explanation that does not fit is in a
guide the line points to (issue 75). While a test runs this records every `ConfigError` built, as the `error:` line
`pjax.cli.fail` would print for it, and every line starting `error: ` or `warning: ` that the test wrote to stdout
or stderr: what pytest captured of the phase (setup, call or teardown), and what the test read back through
`capsys` or `capfd`. A phase that recorded a longer line fails with an AssertionError naming the line and its
length. Output of a process the test started is not seen, nor a line printed with pytest's capture off (`-s`).

A line is measured as a user would see it: a path under pytest's temporary directory
(/tmp/pytest-of-USER/pytest-N[/popen-gwK]/test_name0/...) counts from /tmp, the rest of it as long as a user's own."""
from __future__ import annotations

import re

import pytest

LIMIT = 200
PREFIXES = ("error: ", "warning: ")

_OVER_LONG: list[str] = []  # the lines over LIMIT recorded since the last report

# pytest's base temporary directory, a worker's under pytest-xdist included
_PYTEST_ROOT = re.compile(r"/\S*?/pytest-of-[^/\s]+/pytest-\d+(/popen-gw\d+)?")


def length(line: str) -> int:
    """`line`'s length with pytest's base temporary directory counted as /tmp."""
    return len(_PYTEST_ROOT.sub("/tmp", line))


def over_long(lines: list[str]) -> list[str]:
    """The `error:` or `warning:` lines of `lines` longer than LIMIT."""
    return [line for line in lines if line.startswith(PREFIXES) and length(line) > LIMIT]


def drain() -> list[str]:
    """The over-long lines recorded since the last call, forgotten here."""
    lines, _OVER_LONG[:] = list(_OVER_LONG), []
    return lines


def record_output(text: str) -> None:
    """Record the `error:` and `warning:` lines of some output."""
    _OVER_LONG.extend(over_long(text.splitlines()))


def record_error(message: str) -> None:
    """Record the `error:` line a ConfigError with `message` prints."""
    from pjax.cli import error_line

    _OVER_LONG.extend(over_long([error_line(message)]))


def check(lines: list[str]) -> None:
    """An AssertionError naming each line of `lines` longer than LIMIT (with its length), if any."""
    __tracebackhide__ = True
    lines = list(dict.fromkeys(over_long(lines)))  # one report per distinct line
    if lines:
        said = "\n".join(f"{length(line)} characters: {line}" for line in lines)
        raise AssertionError(f"{len(lines)} error:/warning: line(s) over {LIMIT} characters; say the fix first and "
                             f"point to the guide for the rest (issue 75):\n{said}")


def install() -> None:
    """Wrap, once for this process, the three places the lines pass: ConfigError's constructor, the output pytest
    captures of each phase, and capsys's and capfd's `readouterr`."""
    from mesh.errors import ConfigError

    if getattr(ConfigError.__init__, "records_lines", False):
        return
    init = ConfigError.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if args and isinstance(args[0], str):
            record_error(args[0])

    recording_init.records_lines = True
    ConfigError.__init__ = recording_init

    add_report_section = pytest.Item.add_report_section

    def recording_add_report_section(self, when: str, key: str, content: str) -> None:
        if key in ("stdout", "stderr") and isinstance(content, str):
            record_output(content)
        add_report_section(self, when, key, content)

    pytest.Item.add_report_section = recording_add_report_section

    readouterr = pytest.CaptureFixture.readouterr

    def recording_readouterr(self):
        result = readouterr(self)
        for text in result:
            if isinstance(text, str):  # capsysbinary's and capfdbinary's are bytes
                record_output(text)
        return result

    pytest.CaptureFixture.readouterr = recording_readouterr


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A phase that recorded an over-long line fails with an AssertionError (a phase that failed otherwise keeps
    its own failure, and the lines are added to its report)."""
    __tracebackhide__ = True
    lines = drain()
    if lines:
        try:
            check(lines)
        except AssertionError as e:
            if call.excinfo is None:
                call.excinfo = pytest.ExceptionInfo.from_current()
            else:
                item.add_report_section(call.when, "over-long lines", str(e))
    return (yield)
