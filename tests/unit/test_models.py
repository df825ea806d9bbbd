"""model_folder: what the benchmarks' --model values resolve to."""

import json

from entropy_openrlhf.models.builtin import model_folder


def test_tiny_is_written_into_the_scratch_folder(tmp_path):
    folder = model_folder("tiny", tmp_path)
    assert folder == str(tmp_path / "tiny_model")
    config = json.loads((tmp_path / "tiny_model" / "config.json").read_text())
    assert config["model_type"]  # a real HF config, loadable by transformers


def test_any_other_name_is_taken_as_a_folder_unchanged(tmp_path):
    assert model_folder("/models/qwen2.5-7b", tmp_path) == "/models/qwen2.5-7b"
    assert not any(tmp_path.iterdir())  # nothing made for it
