"""pjax/observe/profiling.py on its own: which steps a run traces, and a trace cut short still written.
(The end-to-end check, a training run's trace and unchanged losses, is in test_train.py.)"""
import jax.numpy as jnp
import pytest

from mesh.errors import ConfigError
from pjax.observe.profiling import StepProfiler, check_profile_steps


def profiler(tmp_path, profile_steps, first_step):
    notes, warnings = [], []
    return StepProfiler(profile_steps, str(tmp_path), first_step, notes.append, warnings.append), notes, warnings


def test_a_trace_past_the_last_step_is_a_config_error_and_one_up_to_it_is_not():
    check_profile_steps(None, 4)
    check_profile_steps((3, 2), 4)
    with pytest.raises(ConfigError, match=r"^log.profile_steps=\[3, 3\] traces steps 3 to 5, past train.steps=4"):
        check_profile_steps((3, 3), 4)


def test_a_resumed_run_traces_the_steps_it_runs_and_warns_about_the_rest(tmp_path):
    partly, _, warnings = profiler(tmp_path, (2, 4), first_step=4)
    assert (partly._first, partly._last) == (4, 5)
    assert warnings == ["warning: log.profile_steps=[2, 4]: steps 2 to 3 ran before this run resumed at step 4; "
                        "tracing steps 4 to 5."]
    none, notes, warnings = profiler(tmp_path, (2, 1), first_step=6)
    assert warnings == ["warning: log.profile_steps=[2, 1]: step 2 ran before this run resumed at step 6; tracing none."]
    for step in range(6, 9):
        none.start_if_due(step, None)
        none.stop_if_due(step, None)
    none.close()
    assert notes == [] and not (tmp_path / "profile").exists()


def test_a_run_stopped_inside_the_traced_steps_still_writes_its_trace(tmp_path):
    cut, notes, warnings = profiler(tmp_path, (1, 5), first_step=1)
    x = jnp.ones(4)
    cut.start_if_due(1, x)
    cut.stop_if_due(1, x + 1)
    cut.start_if_due(2, x)
    cut.stop_if_due(2, x + 2)
    cut.close()  # as the loop's `finally` does on a signal or an error at step 2
    [trace] = (tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb")
    assert warnings == [] and notes == [f"profile of steps 1 to 2: {trace.parent} (tensorboard --logdir "
                                        f"{tmp_path / 'profile'}; or its perfetto_trace.json.gz in ui.perfetto.dev)"]
    cut.close()  # nothing left to stop
    assert len(notes) == 1
