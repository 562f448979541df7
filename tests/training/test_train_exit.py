"""Each process of a multi-process run leaves once all is saved (pytorch/pytorch#190489); a caller of `main` stays."""

import traceback
from unittest.mock import Mock

import pytest
import torch
from test_train_text_to_image import train_args, train_here

import diffusers_lmlp.train
from diffusers_lmlp.training import finishing


def test_the_process_leaves_after_saving_only_when_asked(workspace, monkeypatch):
    saved = []

    def leave():
        saved.append({path.name for path in (workspace / "leaves").iterdir()})
        raise KeyboardInterrupt  # where `leave_finished_process` would end this test's process

    monkeypatch.setattr(finishing, "leave_finished_process", leave)
    train_here(workspace, "stays", "--max_train_steps", "1")  # without exit_when_done
    assert saved == [] and (workspace / "stays" / "model_index.json").is_file()
    threads = torch.get_num_threads()
    argv = [*train_args(workspace, "leaves"), "--max_train_steps", "1", "--num_threads", "1"]
    with pytest.raises(KeyboardInterrupt) as left:
        diffusers_lmlp.train.main(argv, exit_when_done=True)
    torch.set_num_threads(threads)
    assert {"model_index.json", "training_summary.json", "transformer", "README.md"} <= saved[0]
    # Left from inside end_run, with run_training's frame (the model, optimizer and data iterators) still alive.
    frames = [frame.name for frame in traceback.extract_tb(left.value.__traceback__)]
    assert frames[-3:-1] == ["run_training", "end_run"]


@pytest.mark.parametrize("world_size, leaves", [(None, False), ("1", False), ("2", True)])
def test_the_command_leaves_in_each_process_of_a_multi_process_run(world_size, leaves, monkeypatch):
    monkeypatch.setattr(diffusers_lmlp.train, "main", main := Mock())
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world_size:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    diffusers_lmlp.train.cli()
    main.assert_called_once_with(exit_when_done=leaves)
