"""The demo's synthetic mode end to end (the model-backed mode is tested in test_smollm2.py)."""

import json

import torch

from nvfp4_indexer.demo.analysis import local_window, page_mass, selection_recall
from nvfp4_indexer.demo.main import main


def test_demo_random_writes_report(tmp_path):
    rc = main(["--random", "--tokens", "2304", "--layers", "3", "--out", str(tmp_path),
               "--device", "cpu"])
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    layer = data["layers"][0]
    assert layer["rows"] == (2304 - 2048) * 2  # rows with >= 16 history pages, H = 2
    assert layer["decode_match"] is True
    rec = layer["recall"]
    assert rec["oracle"] >= max(rec["nvfp4"], rec["bf16"], rec["local"]) - 1e-9
    assert 0 < rec["nvfp4"] <= 1
    assert (tmp_path / "recall.png").stat().st_size > 1000
    assert "recall nvfp4" in (tmp_path / "report.md").read_text()


def test_recall_helpers():
    probs = torch.zeros(1, 1, 512)
    probs[0, 0, 5] = 0.5  # page 0
    probs[0, 0, 300] = 0.25  # page 2
    probs[0, 0, 400] = 0.25  # page 3
    mass = page_mass(probs, 4)
    assert mass.tolist() == [[[0.5, 0.0, 0.25, 0.25]]]
    sel = torch.tensor([[[0, 3] + [-1] * 14]], dtype=torch.int32)
    assert selection_recall(sel, mass).item() == 0.75
    win = local_window(torch.tensor([3]), 1)
    assert win[0, 0].tolist() == [-1] * 12 + [0, 1, 2, 3]
