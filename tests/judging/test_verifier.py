import pytest

from mappa_graph import Action, Episode, TraceStore, VerifierJudge
from mappa_graph.errors import JudgeError


def _episode() -> Episode:
    ep = Episode(reference="42")
    ep.actions = [Action(episode_id=ep.id, node=n, agent=n, output_message={"role": "assistant", "content": c})
                  for n, c in [("planner", "plan"), ("coder", "42"), ("reporter", "boom")]]
    return ep


def test_verifier_gets_action_episode_and_reference() -> None:
    judge = VerifierJudge(lambda a, ep, ref: (1.0 if a.output_text == ref else 0.0, "exact match"), name="exact")
    rewards = judge.score(_episode())
    assert [r.score for r in rewards] == [0.0, 1.0, 0.0]
    assert {r.judge for r in rewards} == {"exact"} and rewards[1].rationale == "exact match"


def test_judge_that_raises_on_one_action_keeps_the_episode_and_says_why(tmp_path) -> None:
    def fragile(action, episode, ref):
        if action.output_text == "boom":
            raise ZeroDivisionError("division by zero")
        return 0.5

    store = TraceStore(tmp_path / "t.db")
    ep = _episode()
    store.add_episode(ep)
    rewards = VerifierJudge(fragile, name="fragile").score(ep)
    store.add_rewards(rewards)
    assert [r.score for r in rewards] == [0.5, 0.5, None]
    reason = rewards[2].unscored_reason
    assert "judge 'fragile' raised ZeroDivisionError" in reason and "node 'reporter'" in reason
    assert store.episode(ep.id) == ep and len(store.rewards(episode_id=ep.id)) == 3
    with pytest.raises(JudgeError, match="raised ZeroDivisionError"):
        VerifierJudge(fragile, name="fragile", strict=True).score(ep)


def test_out_of_range_or_nan_scores_are_unscored_not_clamped() -> None:
    values = iter([1.7, float("nan"), None])
    rewards = VerifierJudge(lambda a, e, r: next(values), name="v").score(_episode())
    assert [r.score for r in rewards] == [None, None, None]
    assert "outside [0.0, 1.0]" in rewards[0].unscored_reason
    assert "not a finite number" in rewards[1].unscored_reason
    assert "abstained" in rewards[2].unscored_reason


def test_non_callable_judge_is_refused() -> None:
    with pytest.raises(TypeError, match="needs a callable"):
        VerifierJudge("not a function")  # type: ignore[arg-type]
