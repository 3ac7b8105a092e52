"""parallel_bench's --layouts grammar: each entry is the processes, CFG split, ring degree and CHORDS cores the
generator is built and called with."""
import pytest

from benchmarks.parallel_bench import Layout, layout


@pytest.mark.parametrize("text,want", [
    ("1", Layout(1)),
    ("sp3", Layout(3)),
    ("sp4r2", Layout(4, ring=2)),
    ("cfg2", Layout(2, cfg=True)),
    ("cfg2xsp2", Layout(4, cfg=True)),
    ("cfg2xsp3r3", Layout(6, cfg=True, ring=3)),
    ("chords4", Layout(4, cores=4)),
    ("chords2xsp2", Layout(4, cores=2)),
    ("chords4@0-12-20-28", Layout(4, cores=4, init=(0, 12, 20, 28))),
])
def test_layout(text, want):
    got = layout(text)
    assert got == want
    assert got.load() == {"num_gpus": want.num_gpus, "cfg_parallel": want.cfg, "ring_degree": want.ring}


def test_chords_request():
    assert layout("sp2").request() == {}
    assert layout("chords3").request() == {"chords_cores": 3}
    assert layout("chords2@0-5").request() == {"chords_cores": 2, "chords_init": [0, 5]}


@pytest.mark.parametrize("text", ["", "2", "sp", "cfg", "cfg3", "cfg2x", "cfg2xsp", "cfg2r2", "xsp2", "sp2x",
                                  "chords", "chords4@0-1", "chords2@", "ring2"])
def test_bad_layout(text):
    with pytest.raises(ValueError, match="--layouts entry"):
        layout(text)
