"""The copy drill: windows of the task's text, copied once, only the copy learned."""

import pytest

from colonnade.envs import load_environment
from colonnade.train.sft import collate, copy_drill
from colonnade.train.warmstart import (
    DRILL_BATCH,
    DRILL_LR,
    WarmstartConfig,
    _stages,
    total_steps,
)

TEXTS = [
    "The Gallus ostkais gene KVR12 encodes velorin (also called VE-12).",
    "Velorin activity is inhibited by trimeknib, a small molecule.",
    "GX1.",
]


def test_each_exercise_is_a_window_an_end_token_and_the_same_window(tiny):
    _, tok = tiny
    docs = [tok.encode(" " + t, add_special_tokens=False) for t in TEXTS]
    exercises = copy_drill(tok, TEXTS, 200, seed=3)
    assert len(exercises) == 200
    widths = set()
    for ex in exercises:
        width = (len(ex.ids) - 1) // 2
        first, end, second = ex.ids[:width], ex.ids[width], ex.ids[width + 1 :]
        assert end == tok.eos_token_id and first == second
        # Only the copy is learned: the window itself is unpredictable.
        assert ex.learn == (False,) * (width + 1) + (True,) * width
        # A contiguous span of one of the texts, as the tokenizer splits it.
        assert any(list(first) == d[i : i + width] for d in docs for i in range(len(d) - width + 1))
        widths.add(width)
    # 6-20 tokens, shorter only where a whole text is shorter.
    shortest = min(len(d) for d in docs)
    assert shortest < 6 and min(widths) == shortest
    assert max(widths) <= 20 and len(widths) > 5


def test_drill_is_deterministic_under_its_seed(tiny):
    _, tok = tiny
    assert copy_drill(tok, TEXTS, 50, seed=1) == copy_drill(tok, TEXTS, 50, seed=1)
    assert copy_drill(tok, TEXTS, 50, seed=1) != copy_drill(tok, TEXTS, 50, seed=2)


def test_drill_batches_collate_with_labels_on_the_copy_only(tiny):
    _, tok = tiny
    exercises = copy_drill(tok, TEXTS, 8, seed=0)
    _, attn, labels = collate(exercises, tok.pad_token_id)
    for row, ex in enumerate(exercises):
        learned = labels[row] != -100
        assert learned.sum().item() == sum(ex.learn)
        assert attn[row].sum().item() == len(ex.ids)


def test_drill_needs_texts(tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match="no texts"):
        copy_drill(tok, [], 4, seed=0)


def test_drill_steps_default_per_model_and_task_and_count_in_the_total():
    searchqa = WarmstartConfig(model="tiny", env="searchqa").resolved()
    assert searchqa.drill_steps > 0 and searchqa.skill_fraction > 0.5
    assert total_steps(searchqa) == searchqa.drill_steps + searchqa.steps
    # One word out of eight, all in the prompt: smoke needs no drill; nor
    # does a pretrained model, which already copies.
    assert WarmstartConfig(model="tiny", env="smoke").resolved().drill_steps == 0
    assert WarmstartConfig(model="smollm2-135m").resolved().drill_steps == 0
    # What is given wins over the defaults, zero included.
    given = WarmstartConfig(model="tiny", drill_steps=0, steps=7, skill_fraction=0.25)
    assert (given.resolved().drill_steps, given.resolved().steps) == (0, 7)
    assert given.resolved().skill_fraction == 0.25
    with pytest.raises(ValueError, match="drill_steps"):
        WarmstartConfig(drill_steps=-1).resolved()
    with pytest.raises(ValueError, match="skill_fraction"):
        WarmstartConfig(skill_fraction=1.5).resolved()
    # Demos on the env's own train split unless a practice corpus is asked for.
    assert searchqa.practice_seed == -1
    assert WarmstartConfig(practice_seed=2).resolved().practice_seed == 2
    # The mixture's rate: tiny on searchqa a third of the skill's, else the same.
    assert searchqa.mix_lr == pytest.approx(searchqa.lr * 0.3)
    smoke = WarmstartConfig(model="tiny", env="smoke").resolved()
    assert smoke.mix_lr == smoke.lr
    assert WarmstartConfig(env="smoke", mix_lr=1e-5).resolved().mix_lr == 1e-5
    # The drill is part of what the cache key covers.
    a, b = WarmstartConfig(drill_steps=10), WarmstartConfig(drill_steps=20)
    assert a.key("/x/base") != b.key("/x/base")
    # A tool service's address and key are not: the corpus arguments are.
    there = {"n_clusters": 40, "service": "http://a:1", "service_key": "00" * 32}
    moved = {**there, "service": "http://b:2", "service_key": "11" * 32}
    keyed = [WarmstartConfig(env_kwargs=k).key("/x/base") for k in (there, moved)]
    assert keyed[0] == keyed[1] != WarmstartConfig(env_kwargs={"n_clusters": 41}).key("/x/base")


def test_practice_needs_an_env_that_can_practise():
    from colonnade.envs import load_environment
    from colonnade.train.warmstart import _demo_env

    smoke = load_environment("smoke")
    assert _demo_env(WarmstartConfig(env="smoke").resolved(), smoke) is smoke
    with pytest.raises(TypeError, match="practice"):
        _demo_env(WarmstartConfig(env="smoke", practice_seed=1).resolved(), smoke)
    sqa = load_environment("searchqa", n_clusters=20)
    practice = _demo_env(WarmstartConfig(env="searchqa", practice_seed=1).resolved(), sqa)
    assert practice is not sqa and not practice.corpus.names & sqa.corpus.names


def test_stages_run_the_drill_the_skill_then_the_mixture_at_their_rates(tiny):
    _, tok = tiny
    env = load_environment("smoke", n_tasks=20)
    cfg = WarmstartConfig(env="smoke", drill_steps=2, steps=4, skill_fraction=0.5, lr=1e-3,
                          mix_lr=2e-4).resolved()  # fmt: skip
    stages = [(steps, batch, lr, done) for _, steps, batch, lr, done in _stages(cfg, env, env, tok)]
    assert stages == [(2, DRILL_BATCH, DRILL_LR, 0), (2, 8, 1e-3, 2), (2, 8, 2e-4, 4)]
