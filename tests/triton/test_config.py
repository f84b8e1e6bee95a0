"""The Triton launchers' tuning configs (``nvfp4_indexer.triton.config``): validated once at
construction (SPEC 10, 11: Python or numpy integers, never bool; a ValueError naming the field),
frozen, and re-validated by ``dataclasses.replace``. No kernel runs here."""

import dataclasses

import numpy as np
import pytest

from nvfp4_indexer.triton import DecodeConfig, GatherConfig, InsertConfig, PrefillConfig
from nvfp4_indexer.triton import heuristics as hz

# (config, field, a good non-default value, bad values)
FIELDS = [
    (DecodeConfig, "dot", "fp32", ["fp17", 1, True]),
    (DecodeConfig, "dequant", "triton", ["x", True]),
    (DecodeConfig, "num_splits", 4, [True, 0, hz.MAX_SPLITS + 1, 2.0, "2", np.float32(2)]),
    (DecodeConfig, "window", 8, [True, np.bool_(True), 0, 3, -2, 2.0,
                                 2 * hz.MAX_WINDOW_ELEMS // hz.MIN_BLOCK_M]),
    (DecodeConfig, "num_warps", 8, [True, 3, np.int8(3), 4.0]),
    (DecodeConfig, "num_stages", 3, [0, True, 2.5]),
    (DecodeConfig, "programs_per_sm", 8, [0, False]),
    (DecodeConfig, "maxnreg", 255, [23, 256, True]),
    (DecodeConfig, "pdl", True, [1, None, "yes", np.bool_(True)]),
    (DecodeConfig, "page_score_min_pages", 0, [-1, True]),
    (PrefillConfig, "dot", "fp16", ["x", False]),
    (PrefillConfig, "num_splits", 2, [0, True]),
    (PrefillConfig, "window", 4, [3, True, 128]),
    (PrefillConfig, "block_m", 64, [8, True, 512]),
    (PrefillConfig, "num_warps", 8, [16, True]),
    (PrefillConfig, "num_stages", 4, [5, 0, True]),
    (PrefillConfig, "tokens_on_n", False, [1, "true"]),
    (PrefillConfig, "gather", GatherConfig(tok_block=32), [None, {}, DecodeConfig()]),
    (PrefillConfig, "kernel", "triton", ["gluon", "Triton", 1, True, ["wgmma"]]),
    (GatherConfig, "dequant", "triton", ["lut", True]),
    (GatherConfig, "tok_block", 32, [4, True, 256]),
    (GatherConfig, "num_warps", 2, [3, True]),
    (GatherConfig, "page_parts", 2, [16, True]),
    (GatherConfig, "streaming", False, [1, "no"]),
    (InsertConfig, "block_t", 8, [0, 3, 256, True]),
    (InsertConfig, "num_warps", 2, [16, True, 3]),
]


@pytest.mark.parametrize("cls,name,good,bads", FIELDS,
                         ids=[f"{c.__name__}.{n}" for c, n, _, _ in FIELDS])
def test_config_fields(cls, name, good, bads):
    cfg = cls(**{name: good})
    assert getattr(cfg, name) == good and cfg.overrides() == {name: good}
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, name, good)
    for bad in bads:  # at construction and through replace, naming the field
        with pytest.raises(ValueError, match=rf"^{name}: expected .*, got "):
            cls(**{name: bad})
        with pytest.raises(ValueError, match=rf"^{name}: expected "):
            dataclasses.replace(cls(), **{name: bad})


def test_numpy_integers_are_stored_as_int():
    """numpy integers are accepted and normalized (configs are hashed and compared)."""
    cfgs = [DecodeConfig(num_splits=np.int64(4), window=np.int32(8), num_warps=np.int16(8)),
            PrefillConfig(window=np.int64(4), block_m=np.uint8(64), num_stages=np.int64(3)),
            GatherConfig(tok_block=np.int64(32), page_parts=np.int8(2),
                         pages_per_program=np.int32(2)),
            InsertConfig(block_t=np.int64(8), num_warps=np.int32(2))]
    for cfg in cfgs:
        for f in dataclasses.fields(cfg):
            assert not isinstance(getattr(cfg, f.name), np.generic), (cfg, f.name)
    assert cfgs[0] == DecodeConfig(num_splits=4, window=8, num_warps=8)
    assert hash(cfgs[0]) == hash(DecodeConfig(num_splits=4, window=8, num_warps=8))


def test_decode_window_bounded_by_the_launch_rows():
    """The config bounds window by the smallest BLOCK_M; the runner by the launch's."""
    from nvfp4_indexer.triton import decode
    top = hz.MAX_WINDOW_ELEMS // hz.MIN_BLOCK_M
    assert DecodeConfig(window=top).window == top
    with pytest.raises(ValueError, match="window"):  # Q*H = 32 rows: window <= 128
        decode.DecodeRunner(8, 2, 8, 4, "cpu", config=DecodeConfig(window=top), warmup=False)
