"""Each `proves` mark held to the runs its test made: a pytest plugin (`tests/conftest.py` loads it).

Every trainer pjax builds passes `pjax.step._validated`, and every curriculum `Curriculum.for_run`; both are
recorded here as the FEATURES the run exercises (`pjax.compose.exercised`: ZeRO at dp >= 2, a schedule at pp >= 2,
experts split over 2 or more devices, ...). A run made while a fixture is set up belongs to that fixture (and to
each test that requests it, even from its cache); one made in a test's setup or call, to the test (helpers that
cache runs use `cache`, which replays them). A `proves("a+b")` on a `pytest.param` must be exercised by a run of
that case; on a function, by a run of any of its cases (checked after its last one, where none was deselected:
`--dist loadfile` keeps a file's cases in one worker). Otherwise the test fails, naming the pair and what its runs
did exercise, so the matrix (`tests/composition.py`, which reads the marks) shows only pairs a run proved."""
from __future__ import annotations

import contextvars
import functools
from typing import Callable, Iterable

import pytest

from pjax import compose

# Where a run recorded now belongs: a list of a fixture's or a test's runs (None: nobody is listening).
_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("proof_runs", default=None)
_FIXTURE_RUNS: dict[tuple[str, str], list[frozenset[str]]] = {}


def unexercised(claims: Iterable[str], runs: Iterable[frozenset[str]]) -> list[str]:
    """The claimed pairs ('zb_h1+zero3') that no single run exercises both features of."""
    runs = list(runs)
    return [claim for claim in claims if not any(set(claim.split("+")) <= run for run in runs)]


def _record(run_features: frozenset[str]) -> None:
    sink = _SINK.get()
    if sink is not None:
        sink.append(run_features)


def install() -> None:
    """Wrap the two places every run passes, for this process."""
    import pjax.step as step
    from pjax.data.curriculum import Curriculum
    from pjax.validate import Run

    validated = step._validated

    def recording_validated(mesh, cfg, tc, *sections):
        mc = validated(mesh, cfg, tc, *sections)
        _record(compose.exercised(Run(mc, cfg, tc, *sections)))
        return mc

    for_run = Curriculum.for_run.__func__

    def recording_for_run(cls, text, run):
        curriculum = for_run(cls, text, run)
        _record(compose.exercised(run, curriculum))
        return curriculum

    step._validated = recording_validated
    Curriculum.for_run = classmethod(recording_for_run)


def cache(fn: Callable) -> Callable:
    """`functools.cache` for a helper that builds runs: each call, from the cache or not, records the runs the
    first one made, so a test that reuses another's compiled layout still shows what it ran."""
    results: dict = {}

    @functools.wraps(fn)
    def cached(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in results:
            runs: list[frozenset[str]] = []
            token = _SINK.set(runs)
            try:
                value = fn(*args, **kwargs)
            finally:
                _SINK.reset(token)
            results[key] = value, runs
        value, runs = results[key]
        for run in runs:
            _record(run)
        return value
    cached.cache_clear = results.clear
    return cached


def _fixture_key(name: str, param: object) -> tuple[str, str]:
    return name, repr(param)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    runs: list[frozenset[str]] = []
    token = _SINK.set(runs)
    try:
        return (yield)
    finally:
        _SINK.reset(token)
        if runs:
            _FIXTURE_RUNS.setdefault(_fixture_key(fixturedef.argname, getattr(request, "param", None)), []).extend(runs)


def _claims(item) -> tuple[list[str], list[str]]:
    """(the function's claims, its parameter's own): a mark on a parametrized function speaks for all of its cases
    together, one on a `pytest.param` for that case alone."""
    function = [claim for mark in getattr(item.function, "pytestmark", []) if mark.name == "proves"
                for claim in mark.args]
    every = [claim for mark in item.iter_markers("proves") for claim in mark.args]
    return function, [claim for claim in every if claim not in function]


_FUNCTION_RUNS: dict[object, list[frozenset[str]]] = {}
_LAST: dict[object, object] = {}  # function -> its last item in this session's run order
_PARTIAL: set[object] = set()  # functions some of whose cases were deselected: their claims go unchecked


def pytest_deselected(items):
    _PARTIAL.update(getattr(item, "function", None) for item in items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.proof_runs = []
    token = _SINK.set(item.proof_runs)
    try:
        return (yield)
    finally:
        _SINK.reset(token)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    token = _SINK.set(item.proof_runs)
    try:
        result = yield
    finally:
        _SINK.reset(token)
    function, own = _claims(item)
    if not (function or own):
        return result
    params = getattr(getattr(item, "callspec", None), "params", {})
    runs = [*item.proof_runs, *(run for name in item.fixturenames
                                for run in _FIXTURE_RUNS.get(_fixture_key(name, params.get(name)), []))]
    _fail_unless_exercised(own, runs, "this case")
    together = _FUNCTION_RUNS.setdefault(item.function, [])
    together.extend(runs)
    if not _LAST:
        _LAST.update({i.function: i for i in item.session.items if hasattr(i, "function")})
    if _LAST.get(item.function) is item and item.function not in _PARTIAL:
        _fail_unless_exercised(function, together, "this test's cases")
    return result


def _fail_unless_exercised(claims: list[str], runs: list[frozenset[str]], whose: str) -> None:
    missing = unexercised(claims, runs)
    if missing:
        seen = sorted({"+".join(sorted(run)) or "none" for run in runs}) or ["no run recorded"]
        raise AssertionError(f"proves {', '.join(missing)}, but no run of {whose} exercises both features; they "
                             f"exercised: {'; '.join(seen)}")
