"""The generated code is what its generator writes: ``scripts/gen_hot_steps.py`` regenerates the hot steps of
``cbpause.core.loop.LoopSteps`` and the file must not differ (as trio checks its generated wrappers)."""

import pytest

from cbpause.core import loop

from .conftest import ROOT, load_script

pytestmark = pytest.mark.layer("core")


def test_the_hot_steps_are_generated_and_unedited():
    gen = load_script("gen_hot_steps")
    text = (ROOT / "src" / "cbpause" / "core" / "loop.py").read_text()
    assert gen.generate(text) == text, "loop.py's hot steps were edited by hand: run python scripts/gen_hot_steps.py"


def test_a_hand_edit_of_the_region_is_caught():
    gen = load_script("gen_hot_steps")
    text = (ROOT / "src" / "cbpause" / "core" / "loop.py").read_text()
    edited = text.replace("self._step(t.idle, t.can_idle)", "self._step(t.idle, t.can_end_step)")
    assert edited != text and gen.generate(edited) == text


def test_every_hot_step_replays_its_own_memo_and_falls_back_to_its_guard():
    gen = load_script("gen_hot_steps")
    assert set(loop.LoopSteps._MEMO_WIDTHS) == {h.name for h in gen.HOT}
    for h in gen.HOT:
        assert callable(getattr(loop.LoopSteps, h.name))
        if h.slow:
            assert callable(getattr(loop.LoopSteps, f"_{h.name}_slow"))
