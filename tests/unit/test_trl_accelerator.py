"""TRL's script surface on the trainer without training: `trainer.accelerator` (one process, and two gloo processes
that meet through the launcher's rendezvous), and `trainer.push_to_hub` with the hub unreachable: a clear error
naming the cause, the model saved in output_dir as the folder it would upload."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from engine.api.trl_accelerator import Accelerator
from engine.api.trl_hub import HubUploadError, upload_model_folder


def test_a_plain_python_run_is_a_world_of_one(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    acc = Accelerator()
    assert (acc.process_index, acc.num_processes, acc.is_main_process, acc.is_local_main_process) == (0, 1, True, True)
    assert acc.device.type == ("cuda" if torch.cuda.is_available() else "cpu") and acc.distributed_type == "NO"
    acc.print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
    acc.wait_for_everyone()
    with acc.main_process_first():
        pass
    assert acc.gather(torch.tensor(2.0)).tolist() == [2.0]  # a scalar becomes one entry per process
    assert acc.gather({"a": torch.ones(2, 3)})["a"].shape == (2, 3)
    assert acc.gather_for_metrics(["x", "y"]) == ["x", "y"]
    assert acc.reduce(torch.tensor([1.0, 2.0]), "mean").tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match="use_gather_object"):
        acc.gather("text")


def test_a_non_main_rank_does_not_print(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    acc = Accelerator()
    assert (acc.process_index, acc.is_main_process, acc.is_last_process) == (1, False, True)
    acc.print("hidden")
    assert capsys.readouterr().out == ""


def _two_ranks(rank: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    acc = Accelerator()
    acc.wait_for_everyone()
    gathered = acc.gather(torch.tensor([float(rank), 10.0 + rank]))
    objects = acc.gather_for_metrics([f"rank{rank}"])
    total = acc.reduce(torch.tensor(float(rank + 1)))
    acc.wait_for_everyone()
    results.put((rank, gathered.tolist(), objects, float(total), torch.distributed.get_backend()))


def test_two_processes_gather_and_meet_through_the_launchers_rendezvous():
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_two_ranks, args=(rank, port, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    outputs = sorted(results.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    for rank, gathered, objects, total, backend in outputs:
        assert gathered == [0.0, 10.0, 1.0, 11.0]  # rank order, concatenated along dim 0
        assert objects == ["rank0", "rank1"] and total == 3.0
        assert backend == "gloo"  # the group the engine would open on CPU, left open for it to join


def test_push_to_hub_without_the_hub_names_the_cause_and_leaves_the_model_in_output_dir(tmp_path, monkeypatch):
    import datasets

    from engine import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.warns(UserWarning, match="hub_model_id.*trainer.push_to_hub"):  # not during training
        args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                          max_steps=1, hub_model_id="me/tiny-grpo")
    trainer = GRPOTrainer(model="builtin:tiny-qwen2-arith", reward_funcs=lambda completions, **kw: [0.0] * len(
        completions), args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["a", "b"]}))
    assert trainer.hub_model_id == "me/tiny-grpo"
    with pytest.raises(HubUploadError, match=r"'me/tiny-grpo' \(HF_HUB_OFFLINE is set\).*saved in") as err:
        trainer.push_to_hub(dataset_name="arith")
    assert str(tmp_path / "run") in str(err.value)
    folder = tmp_path / "run"  # what it would upload: a Hugging Face checkpoint and its card
    assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    assert any(folder.glob("*.safetensors")) and "arith" in (folder / "README.md").read_text()
    assert GRPOConfig(output_dir=str(tmp_path / "other")).hub_model_id is None
    assert trainer.accelerator.is_main_process and trainer.end() is None  # what TRL's grpo script calls last


def test_upload_refuses_a_folder_without_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no saved model"):
        upload_model_folder(tmp_path, "me/nothing")
