import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "tests" / "assets" / "tokenizer" / "trained" / "tokenizer.json"


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory):
    """A tiny text model directory (HF weights in f32, the test tokenizer), made through the API itself."""
    import moetrain as mt

    d = tmp_path_factory.mktemp("text") / "model"
    mt.Model("tiny", device="cpu", seed=3, tokenizer=str(TOKENIZER)).trainer.export_hf(str(d), dtype="f32")
    return str(d)
