"""Config loading and validation: every bad value is a ValueError naming the value, the rule and a fix; STA's
strategy is checked against a DiT's shape (heads, layers) before any call, and before from_pretrained loads
weights."""
import json

import pytest
import torch

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse import load_attention_config
from fastwan.errors import InvalidArgument


def test_load_from_dict_file_and_string(tmp_path):
    conf = {"tile": [2, 8, 8], "window": [3, 3, 5], "dense_steps": 2,
            "strategy": {"0": {"*": [5, 5, 5]}, "*": {"3": [[3, 3, 3], [1, 3, 5]]}}}
    path = tmp_path / "sta.json"
    path.write_text(json.dumps(conf))
    assert load_attention_config(str(path)) == conf
    assert load_attention_config(path) == conf
    assert load_attention_config(json.dumps(conf)) == conf
    assert load_attention_config(conf) == conf and load_attention_config(None) == {}
    b = create_backend("SLIDING_TILE_ATTN", load_attention_config(str(path)))
    assert b.windows_for(0, 9, heads=2) == ((5, 5, 5),)
    assert b.windows_for(7, 3, heads=2) == ((3, 3, 3), (1, 3, 5))
    assert b.windows_for(7, 4, heads=2) == ((3, 3, 5),)
    assert b.windows_for(None, 3, heads=2) == ((3, 3, 3), (1, 3, 5))


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_attention_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"window": [3, 3, 3],}')
    with pytest.raises(ValueError, match=r"not valid JSON: .* line 1"):
        load_attention_config(str(bad))
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_attention_config(str(lst))
    with pytest.raises(ValueError, match="JSON file path"):
        load_attention_config(42)


@pytest.mark.parametrize(
    "name,conf,match",
    [
        ("SLIDING_TILE_ATTN", {"window": [4, 3, 3]}, r"window=\[4, 3, 3\].*odd.*use 3 or 5"),
        ("SLIDING_TILE_ATTN", {"window": [0, 3, 3]}, r"window=\[0, 3, 3\].*>= 1"),
        ("SLIDING_TILE_ATTN", {"window": [3, 3]}, r"window=\[3, 3\].*three integers"),
        ("SLIDING_TILE_ATTN", {"windows": [3, 3, 3]}, r"unknown config key.*'windows'.*valid keys"),
        ("SLIDING_TILE_ATTN", {"tile": [2, 8]}, r"tile=\[2, 8\]"),
        ("SLIDING_TILE_ATTN", {"dense_steps": -1}, r"dense_steps=-1"),
        ("SLIDING_TILE_ATTN", {"kernel": "triton"}, r"kernel='triton'.*auto, flex, sdpa, fa4"),
        ("SLIDING_TILE_ATTN", {"strategy": {"0": {"1": [3, 2, 3]}}}, r"strategy\['0'\]\['1'\].*odd"),
        ("SLIDING_TILE_ATTN", {"strategy": {"0": {"1": [[3, 3, 3], [3, 3]]}}}, r"head 1.*three integers"),
        ("SLIDING_TILE_ATTN", {"strategy": {"first": {}}}, r"'first' is not a step"),
        ("SLIDING_TILE_ATTN", {"strategy": {"0_1_2": [3, 3, 3], "0": {}}}, r"cannot be mixed"),
        ("SLIDING_TILE_ATTN", {"strategy": [3, 3, 3]}, r"strategy must be a JSON object"),
        ("SLIDING_TILE_ATTN", {"tile": [2, 8, 8], "block_size": 64}, r"block_size=64 is smaller"),
        ("NEIGHBORHOOD_ATTN", {"kernel_size": [3, 0, 3]}, r"kernel_size=\[3, 0, 3\].*-1 for the whole"),
        ("NEIGHBORHOOD_ATTN", {"kernel_size": 3, "stride": [1, 4, 1]}, r"stride\[1\] \(H\) = 4.*stride <= 3"),
        ("NEIGHBORHOOD_ATTN", {"is_causal": [True, False]}, r"is_causal"),
        ("NEIGHBORHOOD_ATTN", {"kernel": "sdpa", "dilaton": 2}, r"'dilaton'"),
        ("VIDEO_SPARSE_ATTN", {"sparsity": 1.0}, r"sparsity=1.0.*\[0, 1\)"),
        ("VIDEO_SPARSE_ATTN", {"sparsity": -0.1}, r"sparsity=-0.1"),
        ("VIDEO_SPARSE_ATTN", {"sparsity": "0.9"}, r"sparsity='0.9'"),
        ("VIDEO_SPARSE_ATTN", {"topk": 3}, r"unknown config key.*'topk'"),
    ],
)
def test_bad_config_raises_before_compute(name, conf, match):
    with pytest.raises(ValueError, match=match):
        create_backend(name, conf)


def test_grid_dependent_errors():
    na = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": [5, 3, 3]})
    with pytest.raises(ValueError, match=r"kernel_size\[0\] \* dilation\[0\] = 5 \* 1 = 5 exceeds the grid size 4 "
                                         r"along T.*kernel_size\[0\] <= 4"):
        na.layout((4, 8, 8), "cpu")
    na = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": [2, 3, 3], "dilation": [3, 1, 1]})
    with pytest.raises(ValueError, match="2 \\* 3 = 6 exceeds"):
        na.layout((5, 8, 8), "cpu")
    na = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": [-1, 3, 3], "stride": [4, 1, 1]})
    with pytest.raises(ValueError, match=r"stride\[0\] = 4 > kernel_size\[0\] = 3"):
        na.layout((3, 8, 8), "cpu")
    sta = create_backend("SLIDING_TILE_ATTN", {"tile": [1, 2, 2], "strategy": {"0": {"0": [[1, 1, 1]] * 3}}})
    layout = sta.layout((2, 4, 4), "cpu")
    q = torch.zeros(1, layout.padded_tokens, 2, 8)
    with pytest.raises(ValueError, match=r"lists 3 per-head windows but the layer has 2 heads"):
        sta(q, q, q, meta=AttentionMetadata(grid=(2, 4, 4), step_index=0, layer_index=0, layout=layout))
    flat = create_backend("SLIDING_TILE_ATTN", {"tile": [1, 2, 2], "strategy": {"0_0_5": [1, 1, 1]}})
    with pytest.raises(ValueError, match=r"names head 5 but the layer has 2 heads"):
        flat(q, q, q, meta=AttentionMetadata(grid=(2, 4, 4), step_index=0, layer_index=0,
                                             layout=flat.layout((2, 4, 4), "cpu")))
    vsa = create_backend("VIDEO_SPARSE_ATTN", {"tile": [1, 2, 2]})
    lay = vsa.layout((2, 4, 4), "cpu")
    q = torch.zeros(1, lay.padded_tokens, 2, 8)
    with pytest.raises(ValueError, match="gate_compress has shape"):
        vsa(q, q, q, meta=AttentionMetadata(grid=(2, 4, 4), layout=lay, extra={"gate_compress": q[:, :5]}))
    with pytest.raises(TypeError, match="no static mask"):
        vsa.dense_mask((2, 4, 4))


@pytest.mark.parametrize("text,kind", [("[1]", "array"), ("3", "number"), ("null", "null"), ('"x"', "string"),
                                       ("true", "boolean")])
def test_inline_json_that_is_not_an_object_is_named_as_such(text, kind, tmp_path, monkeypatch):
    """Inline JSON other than an object is refused as that JSON type, not as a missing file; a file of that name
    is still read as a file."""
    from fastwan.errors import InvalidArgument

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument, match=rf"is a JSON {kind}, not a JSON object"):
        load_attention_config(text, given_by="--config X")
    (tmp_path / text).write_text('{"sparsity": 0.5}')
    assert load_attention_config(text) == {"sparsity": 0.5}


# ---- the strategy against the DiT ---------------------------------------------------------------------------------
CHECK_MODEL = [  # strategy, (heads, layers) that fit, (heads, layers) that do not, message
    ({"5": {"*": [[1, 1, 1]] * 4}}, (4, 2), (3, 2), r"strategy\['5'\]\['\*'\] lists 4 per-head windows.*3 heads"),
    ({"0_1_3": [1, 1, 1]}, (4, 2), (3, 2), r"'0_1_3' names head 3 but the layer has 3 heads"),
    ({"0_1_3": [1, 1, 1]}, (4, 2), (4, 1), r"'0_1_\.\.\.' names layer 1 but the DiT has 1 layers"),
    ({"*": {"7": 3}}, (1, 8), (1, 7), r"strategy \['\*'\]\['7'\] names layer 7 but the DiT has 7 layers"),
]


@pytest.mark.parametrize("strategy,fits,misfits,msg", CHECK_MODEL)
def test_sta_strategy_is_checked_against_the_dit_before_any_call(strategy, fits, misfits, msg):
    """Every entry at once, whatever step it is for (a step-5 entry would otherwise fail at step 5)."""
    b = create_backend("SLIDING_TILE_ATTN", {"strategy": strategy})
    b.check_model(*fits)
    with pytest.raises(InvalidArgument, match=msg):
        b.check_model(*misfits)
    for other in ("NEIGHBORHOOD_ATTN", "VIDEO_SPARSE_ATTN"):
        create_backend(other, {}).check_model(*misfits)  # nothing per head or layer to check


@pytest.mark.parametrize("strategy,msg", [
    ({"00_1_2": 3, "0_1_2": 5}, r"strategy\['0_1_2'\] names the same entry.*'0_1_2'"),
    ({"0": {"1": 3}, "00": {"1": 5}}, r"strategy\['00'\]\['1'\] names the same entry.*\['0'\]\['1'\]"),
    ({"*": {"1": 3, "01": 5}}, r"strategy\['\*'\]\['01'\] names the same entry"),
])
def test_sta_strategy_keys_naming_one_entry_twice_raise(strategy, msg):
    with pytest.raises(InvalidArgument, match=msg):
        create_backend("SLIDING_TILE_ATTN", {"strategy": strategy})


def test_from_pretrained_checks_the_strategy_against_the_dit_before_weights_load(tmp_path, monkeypatch):
    """Five per-head windows for a DiT with fewer heads: refused by from_pretrained, before any weight loads."""
    import fastwan.pipelines.generator as generator
    from fastwan.checkpoint.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "wan2.1", "wan2.1", seed=0)

    def loaded(*a, **k):
        raise AssertionError("weights loaded before the attention config was checked against the DiT")

    monkeypatch.setattr(generator, "load_transformer", loaded)
    conf = {"tile": [1, 2, 2], "strategy": {"*": {"*": [[1, 1, 1]] * 5}}}
    with pytest.raises(InvalidArgument, match="5 per-head windows"):
        generator.VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32,
                                                 attention_backend="SLIDING_TILE_ATTN", attention_config=conf)
