"""The examples run end to end on small shapes."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.cpu_only  # on a GPU, run the example at its real size instead
def test_training_example_lowers_the_loss(capsys):
  spec = importlib.util.spec_from_file_location("train_sparse_mla",
                                                ROOT / "examples" / "train_sparse_mla.py")
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  assert example.main(["--small", "--steps", "6"]) == 0  # 0: the last loss is below the first
  assert "median step" in capsys.readouterr().out
