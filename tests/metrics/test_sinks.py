"""report_to: tensorboard, wandb (offline) and trackio receive every logged metric under its catalogue name, in the
project and under the run name the config gives."""

import json
import shutil
import sys
import types
import uuid

from tandem.config import AsyncGRPOConfig
from tandem.metrics.sinks import make_sinks


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under `folder`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_text(folder, tag: str) -> str:
    """The last text logged under `tag` in the event files under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    return events.Tensors(f"{tag}/text_summary")[-1].tensor_proto.string_val[0].decode()


def test_report_to_all_sends_every_metric_and_the_completions_table_to_tensorboard_wandb_and_trackio(
    tmp_path, monkeypatch
):
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setenv("WANDB_SILENT", "true")
    project = f"tandem-test-{uuid.uuid4().hex[:8]}"
    config = AsyncGRPOConfig(project=project, run_name="first", report_to="all").to_dict()
    sinks = make_sinks(config["report_to"], tmp_path, config)  # all three are installed with the test extra
    assert [type(s).__name__ for s in sinks] == ["JsonlSink", "TensorboardSink", "WandbSink", "TrackioSink"]
    try:
        for step in (1, 2):
            for sink in sinks:
                sink.log(step, {"reward": 0.25 * step, "perf/step_s": 1.5})
        for sink in sinks:  # log_completions: the window's completions as a table
            sink.log_table(2, [[2, "What is 1 + 1?", "2 | two", 1.0]])
        assert sinks[2].run.project == project and sinks[2].run.name == "first"
    finally:
        for sink in sinks:
            sink.close()
    assert tensorboard_scalars(tmp_path / "runs") == {
        "reward": [(1, 0.25), (2, 0.5)],
        "perf/step_s": [(1, 1.5), (2, 1.5)],
    }
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")), "wandb wrote its offline run in output_dir"
    assert json.loads((tmp_path / "completions.jsonl").read_text()) == {
        "step": 2,
        "prompt": "What is 1 + 1?",
        "completion": "2 | two",
        "reward": 1.0,
    }
    assert "| 2 | What is 1 + 1? | 2 \\| two | 1.0 |" in tensorboard_text(tmp_path / "runs", "completions")
    try:
        logs = SQLiteStorage.get_logs(project, "first")
        assert [(row["step"], row["reward"], row["perf/step_s"]) for row in logs if "reward" in row] == [
            (1, 0.25, 1.5),
            (2, 0.5, 1.5),
        ]
        assert [row["step"] for row in logs if "completions" in row] == [2], "the completions table"
    finally:
        SQLiteStorage.get_project_db_path(project).unlink(missing_ok=True)
        shutil.rmtree(SQLiteStorage.get_project_db_path(project).with_suffix(""), ignore_errors=True)


def test_a_hosted_trackio_run_goes_to_its_space_and_bucket_and_is_frozen_when_it_ends(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw)),
        log=lambda *a, **kw: None,
        finish=lambda: calls.append(("finish", {})),
        freeze=lambda **kw: calls.append(("freeze", kw)),
    )
    monkeypatch.setitem(sys.modules, "trackio", fake)
    config = AsyncGRPOConfig(
        project="p",
        run_name="r",
        trackio_space_id="me/dash",
        trackio_bucket_id="me/bucket",
        trackio_static_space_id="me/static",
    ).to_dict()
    (sink,) = make_sinks("trackio", tmp_path, config)[1:]
    sink.close()
    (_, init), finish, (_, freeze) = calls
    assert (init["project"], init["name"], init["space_id"], init["bucket_id"]) == ("p", "r", "me/dash", "me/bucket")
    assert freeze == {"space_id": "me/dash", "project": "p", "new_space_id": "me/static"} and finish[0] == "finish"

    calls.clear()
    (sink,) = make_sinks("trackio", tmp_path, {**config, "trackio_static_space_id": False})[1:]
    sink.close()
    assert [name for name, _ in calls] == ["init", "finish"], "trackio_static_space_id=False: no static Space"


def test_report_to_all_takes_only_the_integrations_that_are_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "tandem.metrics.sinks.INTEGRATIONS", {"tensorboard": "tensorboard", "wandb": "no_such_module_here"}
    )
    sinks = make_sinks("all", tmp_path, AsyncGRPOConfig().to_dict())
    try:
        assert [type(s).__name__ for s in sinks] == ["JsonlSink", "TensorboardSink"]
    finally:
        for sink in sinks:
            sink.close()
