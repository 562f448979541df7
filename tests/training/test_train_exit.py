"""A multi-process run's processes leave at the end of `finishing.end_run`, once everything is saved and before the
run's objects are freed (their C++ destructors can hang, pytorch/pytorch#190489); a caller of `main` keeps its process."""

import traceback

import pytest
import torch
from test_train_text_to_image import train_args

import diffusers_lmlp.train
from diffusers_lmlp.training import finishing


class Left(BaseException):
    """Raised by the stand-in for `leave_finished_process`, which would end this test's process."""


@pytest.mark.parametrize("exit_when_done", [True, False])
def test_the_process_leaves_after_saving_only_when_asked(workspace, monkeypatch, exit_when_done):
    output = workspace / f"leaves-{exit_when_done}"
    seen = {}

    def leave():
        seen["saved"] = sorted(path.name for path in output.iterdir())
        raise Left

    monkeypatch.setattr(finishing, "leave_finished_process", leave)
    threads = torch.get_num_threads()
    argv = [*train_args(workspace, output), "--max_train_steps", "1", "--num_threads", "1"]
    try:
        if not exit_when_done:
            diffusers_lmlp.train.main(argv)
            assert seen == {} and (output / "model_index.json").is_file()
            return
        with pytest.raises(Left) as left:
            diffusers_lmlp.train.main(argv, exit_when_done=True)
    finally:
        torch.set_num_threads(threads)
    assert {"model_index.json", "training_summary.json", "transformer", "README.md"} <= set(seen["saved"])
    # Left from inside end_run, with run_training's frame (the model, optimizer and data iterators) still alive.
    frames = [frame.name for frame in traceback.extract_tb(left.value.__traceback__)]
    assert frames[-3:-1] == ["run_training", "end_run"]


@pytest.mark.parametrize("world_size, leaves", [(None, False), ("1", False), ("2", True)])
def test_the_command_leaves_in_each_process_of_a_multi_process_run(world_size, leaves, monkeypatch):
    calls = []
    monkeypatch.setattr(
        diffusers_lmlp.train, "main", lambda argv=None, exit_when_done=False: calls.append(exit_when_done)
    )
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    diffusers_lmlp.train.cli()
    assert calls == [leaves]
