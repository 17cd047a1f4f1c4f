"""Which platforms an entry point starts JAX on (pjax/platforms.py): the user's JAX_PLATFORMS as set, else the CPU
where JAX's CUDA plugin is installed and no NVIDIA driver is, so that no plugin traceback precedes pjax's output."""
import pytest

from pjax import platforms


@pytest.mark.parametrize("driver,plugin,expected", [(False, True, "cpu"), (True, True, None), (False, False, None)])
def test_cpu_only_where_the_cuda_plugin_finds_no_driver(monkeypatch, driver, plugin, expected):
    monkeypatch.setattr(platforms, "nvidia_driver", lambda: driver)
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: plugin)
    environ = {"PATH": "/bin"}
    assert platforms.start_platforms(environ) == expected
    assert environ.get("JAX_PLATFORMS") == expected


@pytest.mark.parametrize("chosen", ["cuda", "cpu", "tpu,cpu"])
def test_a_jax_platforms_the_user_sets_is_kept(monkeypatch, chosen):
    monkeypatch.setattr(platforms, "nvidia_driver", lambda: False)
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: True)
    environ = {"JAX_PLATFORMS": chosen}
    assert platforms.start_platforms(environ) is None and environ == {"JAX_PLATFORMS": chosen}

