"""The generated code is what its generator writes: ``scripts/gen_hot_steps.py`` regenerates the hot steps of
``cbpause.core.loop.LoopSteps`` and the drop-in's Observe in ``cbpause.core.dropin``, and neither file may differ
(as trio checks its generated wrappers)."""

import pytest

from cbpause.core import dropin, loop

from .conftest import load_script

pytestmark = pytest.mark.layer("core")


def test_the_hot_steps_are_generated_and_unedited():
    gen = load_script("gen_hot_steps")
    for path, (hot, inherited) in gen.FILES.items():
        text = path.read_text()
        assert gen.generate(text, hot, inherited) == text, f"{path.name}'s hot steps were edited by hand: run " \
            "python scripts/gen_hot_steps.py"


def test_a_hand_edit_of_the_region_is_caught():
    gen = load_script("gen_hot_steps")
    text = gen.LOOP.read_text()
    edited = text.replace("self._step(t.idle, t.can_idle)", "self._step(t.idle, t.can_end_step)")
    assert edited != text and gen.generate(edited) == text
    text = gen.DROPIN.read_text()
    edited = text.replace("self._memo_observe_dropin = (*memo[4:], *memo[:4])", "pass")
    assert edited != text and gen.generate(edited, gen.DROPIN_HOT, "RankProtocol") == text


def test_every_hot_step_replays_its_own_memo_and_falls_back_to_its_guard():
    gen = load_script("gen_hot_steps")
    assert set(loop.LoopSteps._MEMO_WIDTHS) == {h.name for h in gen.HOT}
    assert set(dropin.PauseProtocol._MEMO_WIDTHS) == {h.name for h in gen.HOT + gen.DROPIN_HOT}
    for cls, hot in ((loop.LoopSteps, gen.HOT), (dropin.PauseProtocol, gen.DROPIN_HOT)):
        for h in hot:
            assert callable(getattr(cls, h.name))
            if h.slow:
                assert callable(getattr(cls, f"_{h.name}_slow"))
