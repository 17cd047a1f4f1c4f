"""pjax.malloc: when the huge-pages tunable is set, and the restart that sets it."""
import os
import subprocess
import sys
import textwrap

import pytest

from pjax import malloc

HUGE = {"GLIBC_TUNABLES": malloc.TUNABLE}


@pytest.fixture
def thp_madvise(tmp_path, monkeypatch):
    """A machine where the tunable applies: glibc >= 2.35, huge pages in madvise mode, Linux."""
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(malloc, "THP_MODE", str(mode))
    monkeypatch.setattr(malloc, "_glibc_at_least", lambda *version: True)
    monkeypatch.setattr(sys, "platform", "linux")
    return mode


def test_set_for_xla_cpu_where_huge_pages_are_madvise(thp_madvise):
    assert malloc.huge_pages_env({"JAX_PLATFORMS": "cpu"}) == HUGE
    assert malloc.huge_pages_env({"JAX_PLATFORMS": "cpu,cuda"}) == HUGE


@pytest.mark.parametrize("environ", [{"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                                     {"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": ""},
                                     {"JAX_PLATFORMS": "cuda"}, {"JAX_PLATFORMS": "tpu,cpu"}],
                         ids=["user_tunables", "user_empty", "cuda", "tpu"])
def test_left_alone_for_the_users_setting_and_accelerators(thp_madvise, environ):
    assert malloc.huge_pages_env(environ) == {}


@pytest.mark.parametrize("mode", ["[always] madvise never", "always madvise [never]"])
def test_left_alone_where_the_kernel_decides(thp_madvise, mode):
    thp_madvise.write_text(mode + "\n")  # 'always': huge pages anyway; 'never': none to have
    assert malloc.huge_pages_env({"JAX_PLATFORMS": "cpu"}) == {}


def test_left_alone_without_glibc_2_35_or_linux(thp_madvise, monkeypatch, tmp_path):
    monkeypatch.setattr(malloc, "_glibc_at_least", lambda *version: False)
    assert malloc.huge_pages_env({"JAX_PLATFORMS": "cpu"}) == {}
    monkeypatch.setattr(malloc, "_glibc_at_least", lambda *version: True)
    monkeypatch.setattr(malloc, "THP_MODE", str(tmp_path / "missing"))
    assert malloc.huge_pages_env({"JAX_PLATFORMS": "cpu"}) == {}
    monkeypatch.setattr(sys, "platform", "darwin")
    assert malloc.huge_pages_env({"JAX_PLATFORMS": "cpu"}) == {}


def test_glibc_version_check_reads_this_libc():
    version = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    if version and version.startswith("glibc "):
        major, minor = (int(v) for v in version.split()[1].split(".")[:2])
        assert malloc._glibc_at_least(major, minor) and not malloc._glibc_at_least(major, minor + 1)
    else:
        assert not malloc._glibc_at_least(2, 35)


def test_restart_runs_the_same_command_once_with_the_tunable(tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from pjax import malloc
        malloc.THP_MODE = {str(mode)!r}
        malloc._glibc_at_least = lambda *version: True
        print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
        malloc.restart_with_huge_pages()
        print("main", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
    """))
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, str(script), "a=1", "--flag"], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    pid = out[0].split()[1]
    if sys.platform.startswith("linux"):
        assert out == [f"start {pid} None ['a=1', '--flag']", f"start {pid} {malloc.TUNABLE} ['a=1', '--flag']",
                       f"main {pid} {malloc.TUNABLE} ['a=1', '--flag']"]
    else:  # nothing to set: no restart
        assert out == [f"start {pid} None ['a=1', '--flag']", f"main {pid} None ['a=1', '--flag']"]
