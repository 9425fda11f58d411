"""The default searchqa warm start of `tiny` lands in the band RL needs.

The band RL needs: held-out pass@1 about 20-35% with search in well under
half of the episodes, while the skill is there: when the base does search, it
mostly answers right (its unsearched answers never are). This is the v0 of
`colonnade run`'s demo, built exactly as the run builds it (minutes on 2
cores), then evaluated at the run's temperature on the int8 engine.
"""

import pytest

from colonnade.engine import SamplingParams, load_engine
from colonnade.envs import load_environment
from colonnade.rollout.evaluate import evaluate
from colonnade.train.warmstart import WarmstartConfig, warmstart

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_default_searchqa_warm_start_is_a_weak_base_with_the_skill(tmp_path, monkeypatch):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path / "cache"))
    path, built = warmstart(WarmstartConfig(model="tiny", env="searchqa"))
    assert built
    env = load_environment("searchqa")
    engine = load_engine(str(path), precision="int8")
    params = SamplingParams(temperature=1.0, max_turn_tokens=64, max_episode_tokens=384)
    fig = evaluate(engine, env, env.tasks("test")[:200], params, batch_size=50)
    # The band with room for sampling noise (n = 200: one standard error ~0.03).
    assert 0.15 <= fig["pass_at_1"] <= 0.40, fig
    assert 0.15 <= fig["search_rate"] <= 0.50, fig
    assert fig["format_ok"] >= 0.9, fig
    # Right answers come from searching: over half of the searches end right.
    assert fig["pass_at_1"] >= 0.5 * fig["search_rate"], fig
